"""Where a model comes from and where it runs: checkpoint locations and devices, checked up front.

``path=None`` means the embedded SmolLM2-135M-Instruct (see :mod:`spectoolkit.embedded`). A GGUF file, or a
model ``make pair`` assembles, is converted once to an HF directory in the cache (:func:`spectoolkit.pair.
gguf_checkpoint`). A hub id is looked up in the local HF cache first; without network, a missing model is a clear
:class:`SpecToolkitError`, never a traceback. A leaf: the quantization backends import it without
importing the loader that chooses them (:mod:`spectoolkit.wiring.loading`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from spectoolkit.embedded import GGUF_SUFFIX, embedded_dir, gguf_path, gguf_source
from spectoolkit.errors import SpecToolkitError, first_line
from spectoolkit.pair import PAIR_MODELS, gguf_checkpoint, pair_gguf
from spectoolkit.path_checks import WEIGHT_SUFFIXES, is_hub_id


@dataclass(frozen=True)
class Checkpoint:
    """A model spec resolved once (:func:`resolve_checkpoint`): what the config names, and where it loads from."""

    spec: str | None  # as configured: a directory, hub id, .gguf file, `make pair` name; None = the embedded model
    location: str  # a loadable local directory or cached hub id (:func:`resolve_path`)


def resolve_checkpoint(spec: str | None) -> Checkpoint:
    """``spec`` resolved to the :class:`Checkpoint` a run loads (a GGUF file converted once, a hub id checked)."""
    return Checkpoint(spec, resolve_path(spec))


def location_of(model: Checkpoint | str | None) -> str:
    """Where ``model`` loads from: a resolved checkpoint's location as it is, a spec resolved here."""
    return model.location if isinstance(model, Checkpoint) else resolve_path(model)


def resolve_path(path: str | None) -> str:
    """A loadable location: the embedded directory for ``None``, the converted directory of a GGUF file or of a
    ``make pair`` model, else the directory or hub id."""
    if path is None or path == "embedded":
        return str(embedded_dir())
    converted = gguf_checkpoint(path)
    if converted is not None:
        return str(converted)
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise SpecToolkitError(
                f"model directory '{path}' has no config.json: point it at an HF checkpoint or a .gguf file"
            )
        return str(local)
    if not is_hub_id(path):
        raise SpecToolkitError(f"model path '{path}' does not exist: give a local HF directory or a hub id")
    check_hub_model(path)
    return path  # a hub id such as "org/name"


def gguf_file(path: str | None, setting: str = "model.target_path") -> Path:
    """The GGUF file of checkpoint ``path`` (None: the embedded model's; a ``make pair`` name; a ``.gguf`` file; a
    directory converted from one), for a peer that runs the file itself (llama.cpp); one error when it has none."""
    if path is None or path == "embedded":
        return gguf_path()
    if path in PAIR_MODELS:
        return pair_gguf(path)
    local = Path(path).expanduser()
    if local.name.endswith(GGUF_SUFFIX) and local.is_file():
        return local.resolve()
    source = gguf_source(local) if local.is_dir() else None
    if source is None:
        raise SpecToolkitError(
            f"{setting}={path} is not a GGUF checkpoint, and llama.cpp runs GGUF files: give a .gguf file, a "
            "`make pair` model name, or leave it unset (the embedded model)"
        )
    return source


def check_hub_model(repo_id: str) -> None:
    """Fail fast, with what to do, when hub model ``repo_id`` is neither cached nor downloadable here.

    A cached checkpoint (the Hugging Face cache, ``HF_HOME``) loads as is. Otherwise one quick access
    check runs instead of transformers' minute of retries: no network, a gated repo without access,
    or a wrong id each get one message saying how to get the weights.
    """
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json"), str):
        return
    fix = (f"download it where the hub is reachable (`hf download {repo_id}`, then copy the Hugging Face "
           "cache or the folder) or point model.target_path / model.draft_path at a local directory")  # fmt: skip
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise SpecToolkitError(f"'{repo_id}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: {fix}")
    try:
        huggingface_hub.auth_check(repo_id)
    except GatedRepoError:
        raise SpecToolkitError(
            f"'{repo_id}' is gated and this machine's Hugging Face token has no access: accept its license on "
            f"huggingface.co, run `hf auth login`, or {fix}"
        ) from None
    except RepositoryNotFoundError:
        message = f"'{repo_id}' is not a model on the Hugging Face hub (or is private): check the id"
        raise SpecToolkitError(message) from None
    except Exception as exc:  # network failures surface as the HTTP client's own exception types
        message = f"'{repo_id}' is not cached here and the hub cannot be reached ({first_line(exc)}): {fix}"
        raise SpecToolkitError(message) from None


def local_dir(path: Checkpoint | str | None) -> Path:
    """The local directory of ``path``: itself, the embedded model, or a hub id's cached snapshot."""
    location = location_of(path)
    if Path(location).is_dir():
        return Path(location)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(location, local_files_only=True))
    except (OSError, ValueError) as exc:  # LocalEntryNotFoundError, HFValidationError
        raise SpecToolkitError(
            f"model '{location}' is not in the local Hugging Face cache ({type(exc).__name__}): "
            "pass a local checkpoint directory instead"
        ) from None


def checkpoint_identity(source: Path) -> dict:
    """What identifies checkpoint directory ``source`` in a cache key: its path and its weight files' sizes and
    modification times (a re-converted or re-downloaded checkpoint is another one)."""
    weights = [
        (f.name, f.stat().st_size, f.stat().st_mtime_ns)
        for f in sorted(source.iterdir())
        if f.name.endswith(WEIGHT_SUFFIXES)
    ]
    return {"source": str(source.resolve()), "weights": weights}


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when available; ``cuda`` without a GPU is a user error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecToolkitError("device=cuda but no CUDA device is available: use device=cpu or device=auto")
    return torch.device(device)
