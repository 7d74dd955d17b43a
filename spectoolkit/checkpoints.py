"""Where a model comes from, resolved once: a config's model spec -> the :class:`Checkpoint` a run loads.

``spec=None`` (or ``embedded``) means the embedded SmolLM2-135M-Instruct (see :mod:`spectoolkit.embedded`). A GGUF
file, or a model ``make pair`` assembles, is converted once to an HF directory in the cache
(:func:`spectoolkit.pair.gguf_checkpoint`), and the checkpoint remembers the file (llama.cpp and ``+target=gguf``
read it). A hub id is looked up in the local HF cache first; without network, a missing model is a clear
:class:`SpecToolkitError`, never a traceback. Low in the layers: the run's door
(:mod:`spectoolkit.wiring.resolve`), the loaders below it and the compat check all take what this resolves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from spectoolkit.embedded import embedded_dir, gguf_source
from spectoolkit.errors import SpecToolkitError, first_line
from spectoolkit.pair import gguf_checkpoint
from spectoolkit.path_checks import WEIGHT_SUFFIXES, is_hub_id


@dataclass(frozen=True)
class Checkpoint:
    """A model spec resolved once (:func:`resolve_checkpoint`): what the config names, where it loads from, and the
    GGUF file behind it. Loaders, back-ends and caches take this and never resolve the spec again."""

    spec: str | None  # as configured: a directory, hub id, .gguf file, `make pair` name; None = the embedded model
    location: str  # a loadable local directory or cached hub id (:func:`resolve_path`)
    gguf: Path | None = None  # the GGUF file it was converted from (embedded, pair, .gguf), None: not GGUF-backed

    def directory(self) -> Path:
        """The local directory it loads from: itself, or a hub id's cached snapshot (one error when not cached)."""
        if Path(self.location).is_dir():
            return Path(self.location)
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(self.location, local_files_only=True))
        except (OSError, ValueError) as exc:  # LocalEntryNotFoundError, HFValidationError
            raise SpecToolkitError(
                f"model '{self.location}' is not in the local Hugging Face cache ({type(exc).__name__}): "
                "pass a local checkpoint directory instead"
            ) from None

    def gguf_file(self, setting: str = "model.target_path") -> Path:
        """The GGUF file behind it, for a peer that runs the file itself (llama.cpp); one error when it has none."""
        if self.gguf is None:
            raise SpecToolkitError(
                f"{setting}={self.spec} is not a GGUF checkpoint, and llama.cpp runs GGUF files: give a .gguf file, "
                "a `make pair` model name, or leave it unset (the embedded model)"
            )
        return self.gguf


def resolve_checkpoint(spec: str | None) -> Checkpoint:
    """``spec`` resolved to the :class:`Checkpoint` a run loads (a GGUF file converted once, a hub id checked)."""
    location = resolve_path(spec)
    local = Path(location)
    return Checkpoint(spec, location, gguf_source(local) if local.is_dir() else None)


def checkpoint_of(model: Checkpoint | str | None) -> Checkpoint:
    """``model`` as a resolved checkpoint: itself, or a spec resolved here (a library caller's door, as
    ``load_model(None, ...)`` from plain Python)."""
    return model if isinstance(model, Checkpoint) else resolve_checkpoint(model)


def resolve_path(path: str | None) -> str:
    """A loadable location: the embedded directory for ``None``, the converted directory of a GGUF file or of a
    ``make pair`` model, else the directory or hub id."""
    if path is None or path == "embedded":
        return str(embedded_dir())
    converted = gguf_checkpoint(path)
    if converted is not None:
        return str(converted)
    local = Path(path).expanduser()
    if local.is_file():
        raise SpecToolkitError(f"model path '{path}' is a file: give a model directory, a .gguf file or a hub id")
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


def checkpoint_identity(source: Path) -> dict:
    """What identifies checkpoint directory ``source`` in a cache key: its path and its weight files' sizes and
    modification times (a re-converted or re-downloaded checkpoint is another one)."""
    weights = [
        (f.name, f.stat().st_size, f.stat().st_mtime_ns)
        for f in sorted(source.iterdir())
        if f.name.endswith(WEIGHT_SUFFIXES)
    ]
    return {"source": str(source.resolve()), "weights": weights}
