"""Load causal LMs and tokenizers from a local directory, a hub id, or the embedded default.

``path=None`` means the embedded SmolLM2-135M-Instruct (see :mod:`spectoolkit.embedded`). A hub id
is looked up in the local HF cache first; without network, a missing model is a clear
:class:`SpecToolkitError`, never a traceback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from spectoolkit.errors import SpecToolkitError
from spectoolkit.models.attention import use_packed_attention
from spectoolkit.models.fast_linear import use_gemm_linears

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    """A causal LM ready for inference, with what the engine needs to know about it."""

    model: torch.nn.Module
    path: str
    precision: str
    vocab_size: int  # rows of the output embedding (may exceed len(tokenizer): tail padding)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def weight_bytes(self) -> int:
        """Bytes of parameters and buffers (tied weights counted once), plus bitsandbytes scales."""
        seen: set[int] = set()
        total = 0
        for tensor in list(self.model.parameters()) + list(self.model.buffers()):
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel() * tensor.element_size()
        if self.precision in ("int8", "nf4"):  # bitsandbytes keeps its scales outside params/buffers
            from spectoolkit.quant.bnb import scale_bytes

            total += scale_bytes(self.model)
        return total


def resolve_path(path: str | None) -> str:
    """A loadable location: the embedded directory for ``None``, else the directory or hub id."""
    if path is None or path == "embedded":
        from spectoolkit.embedded import embedded_dir

        return str(embedded_dir())
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise SpecToolkitError(f"model directory '{path}' has no config.json: point it at an HF checkpoint")
        return str(local)
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
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
        message = f"'{repo_id}' is not cached here and the hub cannot be reached ({_first_line(exc)}): {fix}"
        raise SpecToolkitError(message) from None


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when available; ``cuda`` without a GPU is a user error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecToolkitError("device=cuda but no CUDA device is available: use device=cpu or device=auto")
    return torch.device(device)


def load_tokenizer(path: str | None):
    """The tokenizer of ``path`` (see :func:`resolve_path`)."""
    from transformers import AutoTokenizer

    location = resolve_path(path)
    try:
        return AutoTokenizer.from_pretrained(location)
    except (OSError, ValueError) as exc:
        raise SpecToolkitError(f"cannot load the tokenizer of '{location}': {_first_line(exc)}") from None


def load_model(
    path: str | None, precision: str, device: torch.device, fast_linear: bool = True, group_size: int = 64
) -> LoadedModel:
    """Load ``path`` at ``precision`` onto ``device``, in eval mode.

    Float precisions (fp32/bf16/fp16) load directly; quantized ones (int8, nf4, int4, rtn-int8,
    rtn-int4) go through their backend in :mod:`spectoolkit.quant` (``group_size`` for the
    group-wise ones). Attention runs through :mod:`spectoolkit.models.attention` (no KV copy per
    verify forward; a backend's row-wise choice, as bitsandbytes makes, is kept); ``fast_linear``
    enables the fp32 CPU GEMM path of :mod:`spectoolkit.models.fast_linear`.
    """
    from spectoolkit.quant import QUANT_PRECISIONS, load_quantized

    if precision not in DTYPES and precision not in QUANT_PRECISIONS:
        raise SpecToolkitError(f"precision '{precision}' is not one of {', '.join((*DTYPES, *QUANT_PRECISIONS))}")
    location = resolve_path(path)
    if precision in QUANT_PRECISIONS:
        model = load_quantized(location, precision, device, group_size)
    else:
        model = load_float_model(location, precision, device, fast_linear)
    use_packed_attention(model)
    return LoadedModel(model, location, precision, model.get_output_embeddings().out_features)


def load_float_model(location: str, precision: str, device: torch.device, fast_linear: bool = True):
    """The HF causal LM at ``location`` in fp32/bf16/fp16 on ``device`` (eval), fp32 CPU GEMM path optional."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(location, dtype=DTYPES[precision])
    except (OSError, ValueError) as exc:
        raise SpecToolkitError(
            f"cannot load model '{location}': {_first_line(exc)} "
            "(offline: pass a local directory with model.target_path=DIR / model.draft_path=DIR)"
        ) from None
    model.to(device).eval()
    if fast_linear and device.type == "cpu" and precision == "fp32":
        use_gemm_linears(model)
    return model


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
