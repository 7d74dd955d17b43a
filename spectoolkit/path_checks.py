"""Every path a user can give is checked before any work starts: one clear error naming the key.

Each path-valued key (:data:`PATH_KEYS`) has a :class:`PathKind`: a file, a directory (and the files it must
hold), or a directory the run creates; and the fix the message ends with. A missing path, an empty value, an
empty file, a file where a directory belongs (or the reverse), a directory without what its loader reads: one
:class:`~spectoolkit.errors.SpecToolkitError` that names the key, its value, what is wrong and what it must hold.

What each kind holds is what its loader reads:

- a model (``model.target_path`` / ``model.draft_path``; :mod:`spectoolkit.checkpoints`): ``embedded`` or
  null, a local HF checkpoint directory (config.json and ``*.safetensors`` / ``*.bin`` weights), a hub id
  (``org/name`` that is no local path: :func:`is_hub_id`), which the loader finds in the Hugging Face cache or
  on the hub when it loads, a GGUF file (:data:`MODEL_FILE_SUFFIXES`; it must start with the GGUF magic; whether
  transformers converts its architecture is told when it is converted), or a model ``make pair`` assembles
  (:data:`spectoolkit.pair.PAIR_MODELS`; refused until it is assembled);
- our EAGLE-3 head (``draft.eagle_path``; ``Eagle3Head.load``): config.json with the shape
  ``python -m spectoolkit.train_draft`` writes, and model.safetensors; a head vLLM loads (``backend.eagle_path``,
  or ``draft.eagle_path`` when vLLM drafts): config.json and weights, as any checkpoint;
- a JSONL file (``workload.path``, ``train.jsonl_path``): readable, with at least one non-blank line (each
  line's content is the workload loader's to judge: a bad line is one failed request, not a failed run);
- the vLLM environment (``backend.vllm_env``): a directory with an executable bin/python;
- the llama.cpp build (``backend.llamacpp_dir``): a directory with an executable bin/llama-server;
- a directory the run writes (``output_dir``, ``train.out``): a directory, or a path whose nearest existing
  parent is a writable directory (it is created);
- a report directory (``python -m spectoolkit.report DIR``): an existing, non-empty directory (whether it holds
  a run or a sweep is :func:`spectoolkit.bench.sweep.report.report_path_for`'s to tell).

Which keys a run checks: those that have an effect in it (:func:`spectoolkit.config_checks.dead_keys`), so a
default such as ``backend.vllm_env=.venv-vllm`` is not looked at by a local run. Callers: ``python -m
spectoolkit`` and ``python -m spectoolkit.serve`` (:func:`spectoolkit.__main__.checked`), ``python -m
spectoolkit.train_draft``, the lm-eval model (its model_args) and ``python -m spectoolkit.report``. The loaders
keep their own checks for library callers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from spectoolkit.config import RunConfig
from spectoolkit.config_checks import Entry, dead_keys
from spectoolkit.embedded import GGUF_SUFFIX
from spectoolkit.errors import SpecToolkitError
from spectoolkit.pair import PAIR_MODELS, not_assembled

Expects = Literal["file", "dir", "new_dir"]  # an existing file, an existing directory, a directory made if missing
WEIGHT_SUFFIXES = (".safetensors", ".bin")  # checkpoint weight files (sharded ones too)
MODEL_FILE_SUFFIXES: tuple[str, ...] = (GGUF_SUFFIX,)  # model locations that are one file (pair.gguf_checkpoint)
GGUF_MAGIC = b"GGUF"  # the first bytes of every GGUF file
LLAMA_SERVER = "bin/llama-server"  # what `make llama-cpp` builds into backend.llamacpp_dir
HEAD_FILES = ("config.json", "model.safetensors")  # what Eagle3Head.save writes (CONFIG_FILE, WEIGHTS_FILE)
READ_CHUNK = 1 << 16  # bytes read at a time while looking for a non-blank line


@dataclass(frozen=True)
class PathKind:
    """What a path-valued key must hold.

    ``fix``: the end of the message, what to give instead. ``needs``: files a directory must hold (relative
    paths); ``content``: a further problem of an existing path, or None. ``words``: values that are no path
    (``embedded``); ``hub_ids``: a missing ``org/name`` is a hub id, resolved when loaded; ``files``: suffixes
    of files accepted where a directory is expected, and ``file_content`` their problem, or None; ``word_problem``:
    why a word cannot be used yet, or None.
    """

    expects: Expects
    fix: str
    needs: tuple[str, ...] = ()
    content: Callable[[Path], str | None] | None = None
    words: tuple[str, ...] = ()
    hub_ids: bool = False
    files: tuple[str, ...] = ()
    file_content: Callable[[Path], str | None] | None = None
    word_problem: Callable[[str], str | None] | None = None


def is_hub_id(value: str) -> bool:
    """``org/name``: not a local path (no leading ``.``, ``/`` or ``~``, exactly one ``/``): a hub model id."""
    return not value.startswith((".", "/", "~")) and value.count("/") == 1


def _weights(directory: Path) -> str | None:
    if any(path.name.endswith(WEIGHT_SUFFIXES) for path in directory.iterdir() if path.is_file()):
        return None
    return f"has no weights ({' or '.join('*' + suffix for suffix in WEIGHT_SUFFIXES)})"


def _our_head(directory: Path) -> str | None:
    """A head :meth:`Eagle3Head.load` reads: config.json carries the shape train_draft writes."""
    try:
        config = json.loads((directory / HEAD_FILES[0]).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"has a {HEAD_FILES[0]} that cannot be read ({type(exc).__name__})"
    section = config.get("spectoolkit") if isinstance(config, dict) else None
    if not isinstance(section, dict) or not isinstance(section.get("shape"), dict):
        return f"has a {HEAD_FILES[0]} that python -m spectoolkit.train_draft did not write (no spectoolkit.shape)"
    return None


def _gguf(path: Path) -> str | None:
    try:
        with path.open("rb") as file:
            head = file.read(len(GGUF_MAGIC))
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    return None if head == GGUF_MAGIC else "is not a GGUF file (it does not start with GGUF)"


def _executable(venv: Path) -> str | None:
    return None if os.access(venv / "bin" / "python", os.X_OK) else "has a bin/python that is not executable"


def _server(build: Path) -> str | None:
    return None if os.access(build / LLAMA_SERVER, os.X_OK) else f"has a {LLAMA_SERVER} that is not executable"


_HEAD_FOR_VLLM = "an EAGLE head checkpoint vLLM loads (config.json and *.safetensors or *.bin weights), e.g. the"
_TRAIN_DRAFT = "directory python -m spectoolkit.train_draft prints"

MODEL = PathKind(
    "dir",
    "give a local HF checkpoint directory (config.json and *.safetensors or *.bin weights), a .gguf file, a hub id "
    f"(org/name), embedded, or a model `make pair` assembles ({', '.join(PAIR_MODELS)})",
    needs=("config.json",), content=_weights, words=("embedded", *PAIR_MODELS), hub_ids=True,
    files=MODEL_FILE_SUFFIXES, file_content=_gguf, word_problem=not_assembled,
)  # fmt: skip
EAGLE_HEAD = PathKind(
    "dir",
    f"point it at a trained EAGLE-3 head, the {_TRAIN_DRAFT} (config.json and model.safetensors), or leave it "
    "null to train the default head",
    needs=HEAD_FILES, content=_our_head,
)  # fmt: skip
VLLM_HEAD = PathKind("dir", f"point it at {_HEAD_FOR_VLLM} {_TRAIN_DRAFT}", needs=("config.json",),
                     content=_weights, hub_ids=True)  # fmt: skip
WORKLOAD_JSONL = PathKind(
    "file", 'give a JSONL file with one prompt per line: {"id": ..., "task_type": ..., "prompt": ...}'
)
TRAIN_JSONL = PathKind(
    "file",
    'give a JSONL file with one training prompt per line: {"id": ..., "task_type": ..., "prompt": ..., '
    '"reference": ... (optional)}',
)
VLLM_ENV = PathKind("dir", "run `make vllm`, or point it at a virtual environment with vLLM installed (bin/python)",
                    needs=("bin/python",), content=_executable)  # fmt: skip
LLAMACPP_DIR = PathKind("dir", f"run `make llama-cpp`, or point it at a directory with {LLAMA_SERVER}",
                        needs=(LLAMA_SERVER,), content=_server)  # fmt: skip
OUTPUT_DIR = PathKind("new_dir", "give a directory for the run's results (created if missing)")
HEAD_COPY = PathKind("new_dir", "give a directory to copy the trained head to (created if missing)")
REPORT_DIR = PathKind("dir", "point it at a run directory with summary.json or a sweep directory")

# Every path-valued key of RunConfig and of the train/ group (spectoolkit.training.job.TrainConfig).
PATH_KEYS: dict[str, PathKind] = {
    "model.target_path": MODEL,
    "model.draft_path": MODEL,
    "draft.eagle_path": EAGLE_HEAD,
    "workload.path": WORKLOAD_JSONL,
    "backend.eagle_path": VLLM_HEAD,
    "backend.vllm_env": VLLM_ENV,
    "backend.llamacpp_dir": LLAMACPP_DIR,
    "output_dir": OUTPUT_DIR,
    "train.jsonl_path": TRAIN_JSONL,
    "train.out": HEAD_COPY,
}


def path_problem(value: str, kind: PathKind) -> str | None:
    """What is wrong with ``value`` as a ``kind`` ("does not exist", "is a file, not a directory", ...), or None."""
    if not value.strip():
        return "is empty"
    if value in kind.words:
        return kind.word_problem(value) if kind.word_problem is not None else None
    path = Path(value).expanduser()
    if kind.expects == "new_dir":
        return _new_dir_problem(path)
    if not path.exists():
        return None if kind.hub_ids and is_hub_id(value) else "does not exist"
    if kind.expects == "file":
        return "is a directory, not a file" if path.is_dir() else _file_problem(path)
    if not path.is_dir():
        if not path.name.endswith(kind.files):
            return "is a file, not a directory"
        return kind.file_content(path) if kind.file_content is not None else None
    return _directory_problem(path, kind)


def _directory_problem(path: Path, kind: PathKind) -> str | None:
    try:
        empty = next(path.iterdir(), None) is None
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if empty:
        return "is an empty directory"
    missing = [name for name in kind.needs if not (path / name).is_file()]
    if missing:
        return f"has no {' and no '.join(missing)}"
    return kind.content(path) if kind.content is not None else None


def _file_problem(path: Path) -> str | None:
    """A readable file with at least one non-blank line."""
    try:
        with path.open("rb") as file:
            for chunk in iter(lambda: file.read(READ_CHUNK), b""):
                if chunk.strip():
                    return None
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    return "is empty"


def _new_dir_problem(path: Path) -> str | None:
    """A directory, or creatable: its nearest existing parent is a directory this process may write."""
    if path.exists():
        return None if path.is_dir() else "is a file, not a directory"
    parent = next(p for p in path.absolute().parents if p.exists())  # the root always exists
    if not parent.is_dir():
        return f"cannot be created: {parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    return None


def check_path(key: str, value: str | Path | None, kind: PathKind) -> None:
    """Raise one SpecToolkitError naming ``key`` when ``value`` is not a ``kind``; None (unset) passes."""
    if value is None:
        return
    problem = path_problem(str(value), kind)
    if problem is not None:
        raise SpecToolkitError(f"{key}={str(value)!r} {problem}: {kind.fix}")


def check_paths(values: Mapping[str, str | None], names: Mapping[str, str] | None = None) -> None:
    """Check each ``key: value`` of ``values`` as its :data:`PATH_KEYS` kind; ``names``: how a key is spelled to
    the user where not as the config key (lm-eval's model_args)."""
    for key, value in values.items():
        check_path((names or {}).get(key, key), value, PATH_KEYS[key])


def run_paths(cfg: RunConfig, entry: Entry = "run") -> dict[str, str | None]:
    """The path-valued keys of ``cfg`` that have an effect in ``entry``, with their values."""
    values = {
        "model.target_path": cfg.model.target_path,
        "model.draft_path": cfg.model.draft_path,
        "draft.eagle_path": cfg.draft.eagle_path,
        "workload.path": cfg.workload.path,
        "backend.eagle_path": cfg.backend.eagle_path,
        "backend.vllm_env": cfg.backend.vllm_env,
        "backend.llamacpp_dir": cfg.backend.llamacpp_dir,
        "output_dir": cfg.output_dir,
    }
    return {key: value for key, value in values.items() if not dead_keys(cfg, [key], entry)}


def check_run_paths(cfg: RunConfig, entry: Entry = "run", names: Mapping[str, str] | None = None) -> None:
    """Check every path of ``cfg`` that ``entry`` reads (:func:`run_paths`); raise for the first bad one."""
    values = run_paths(cfg, entry)
    vllm = "backend.eagle_path" in values  # the run's drafting is vLLM's: it loads draft.eagle_path as any head
    for key, value in values.items():
        kind = VLLM_HEAD if vllm and key == "draft.eagle_path" else PATH_KEYS[key]
        check_path((names or {}).get(key, key), value, kind)
