"""bitsandbytes weight quantization: LLM.int8 (``int8``) and 4-bit NormalFloat (``nf4``).

LLM.int8 (Dettmers et al. 2022, arXiv:2208.07339) stores each weight row as int8 with an absmax
scale; at run time each activation row (token) is cast to fp16 and quantized to int8 with its own
absmax, the product runs int8 → int32, and *outlier columns* — input features where any row of the
input has ``|x| >= llm_int8_threshold`` — are left out of the int8 product and added back in the
activation dtype against the dequantized weight columns. NF4 (QLoRA, Dettmers et al. 2023,
arXiv:2305.14314) stores 4-bit NormalFloat codes with one absmax per block of 64 weights, so
``group_size`` is ignored. transformers keeps the output head in float.

CPU backend of bitsandbytes 0.50.2 (from its source; checked on the embedded SmolLM2-135M):

- ``int8``: the full LLM.int8 path, outlier decomposition included. The int8 GEMM is
  ``torch._int_mm`` when torch reports AVX-512, else an fp32 matmul of the int8 values. The per-call
  activation quantization is plain torch ops, so a decode step costs ~1.9× fp32 on 2 cores.
- ``nf4``: with AVX-512-BF16, each layer's first eval forward repacks its weight for a fused kernel
  that always computes in bf16 (inputs and scales cast to bf16, whatever ``compute_dtype`` says);
  without it, the weight is dequantized to ``compute_dtype`` and multiplied by ``F.linear``.
- ``compute_dtype`` is the dtype of the activations and the unquantized modules (embeddings, norms,
  attention, head). bf16 was within ±7% of fp32 in speed for both kinds (2 cores, AVX-512-BF16), so
  the default is fp32: better numerics, and no dependence on bf16 hardware.

Batch invariance: a k-token verify forward must give what k decode steps give, or greedy
speculative decoding is not token-identical to the one-token baseline. Two things broke that here,
and both are fixed at load time:

1. LLM.int8 picks its outlier columns over the whole input, so one token's outlier moves the
   others' products (top-1 differed at 18/240 positions on SmolLM2, |Δlogit| up to 6.9).
   :func:`use_rowwise_int8` runs each row through bitsandbytes on its own: the outlier columns
   of a row come from that row alone, which for one row is standard LLM.int8 unchanged, so a row of
   a k-row call is bit-identical to the one-row call (the 1-token baseline). A loop, not a
   vectorized decomposition: it reuses bitsandbytes' own kernels, hence is exact by construction.
2. Rounding activations to int8 (or to bf16 inside the nf4 kernel) turns the ~1e-7 differences
   between the fp32 attention kernels for 1 and k queries into whole quantization steps (nf4:
   |Δlogit| up to 0.8). The runners' attention computes each verify row as the decode step's own call
   (:mod:`spectoolkit.runtime.attention`, ``chosen`` and ``invariant`` row modes).

With attention row-wise and threshold 0, 5-token windows already matched 1-token steps to 4e-5 at
all 240 positions (3 chat prompts × 80 greedy tokens). At threshold 0 the int8 linears are left
stock: per-row activation scales and an exact int32 product make their rows independent already.
The cost is k small calls instead of one per verify forward (and per prefill token).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from spectoolkit.checkpoints import Checkpoint
from spectoolkit.errors import SpecToolkitError, first_line
from spectoolkit.kernels.kernel_choice import MAX_CHUNKED_ROWS
from spectoolkit.kernels.layer_wrapper import LayerWrapper, leaf_linears, replace_module

BNB_KINDS = ("int8", "nf4")
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class BnbConfig:
    """One bitsandbytes scheme: ``int8`` (LLM.int8) or ``nf4`` (4-bit NormalFloat, blocks of 64)."""

    kind: str  # "int8" | "nf4"
    compute_dtype: str = "fp32"  # activations + unquantized modules; on CPU as fast as bf16, more accurate
    llm_int8_threshold: float = 6.0  # |activation| at which a column is an outlier (int8 only; 0 = none)

    def __post_init__(self) -> None:
        if self.kind not in BNB_KINDS:
            raise SpecToolkitError(f"bitsandbytes kind '{self.kind}' is not one of {', '.join(BNB_KINDS)}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise SpecToolkitError(
                f"bitsandbytes compute_dtype '{self.compute_dtype}' is not one of {', '.join(COMPUTE_DTYPES)}"
            )
        if not self.llm_int8_threshold >= 0.0:
            raise SpecToolkitError(
                f"llm_int8_threshold must be >= 0 (0 disables outliers), got {self.llm_int8_threshold}"
            )

    @property
    def dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.compute_dtype]

    def to_transformers(self):
        """The equivalent ``transformers.BitsAndBytesConfig``."""
        from transformers import BitsAndBytesConfig

        if self.kind == "int8":
            return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=self.llm_int8_threshold)
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=self.dtype,
            bnb_4bit_use_double_quant=False,  # the fused CPU kernel un-nests scales on its first forward anyway
        )


def load_quantized(checkpoint: Checkpoint, precision: str, device: torch.device, group_size: int) -> torch.nn.Module:
    """Load ``checkpoint`` with bitsandbytes ``precision`` (``int8`` | ``nf4``) onto ``device``, in eval mode.

    ``group_size`` is ignored: bitsandbytes fixes its own blocking (per row for int8, 64 for nf4).
    """
    del group_size
    return load_bnb(checkpoint, BnbConfig(kind=precision), device)


def load_bnb(checkpoint: Checkpoint, config: BnbConfig, device: torch.device) -> torch.nn.Module:
    """Load ``checkpoint`` (resolved once: :func:`spectoolkit.checkpoints.resolve_checkpoint`) quantized as
    ``config``."""
    from transformers import AutoModelForCausalLM

    _import_bitsandbytes()
    location = checkpoint.location
    try:
        model = AutoModelForCausalLM.from_pretrained(
            location,
            dtype=config.dtype,
            quantization_config=config.to_transformers(),
            device_map={"": device},
        )
    except (ImportError, RuntimeError) as exc:  # missing accelerate, no bitsandbytes backend for the device
        if isinstance(exc, RuntimeError) and "bitsandbytes" not in str(exc):
            raise
        raise SpecToolkitError(
            f"bitsandbytes cannot quantize on {device}: {first_line(exc)} "
            "(install the pinned versions with `make install`, or pick another precision, e.g. rtn-int8)"
        ) from None
    except (OSError, ValueError) as exc:
        raise SpecToolkitError(f"cannot load model '{location}' for {config.kind}: {first_line(exc)}") from None
    model.eval()
    if config.kind == "int8" and config.llm_int8_threshold > 0:
        use_rowwise_int8(model)
    return model


def use_rowwise_int8(model: torch.nn.Module) -> int:
    """Hold every ``Linear8bitLt`` of ``model`` in a :class:`RowwiseLinear8bitLt` (idempotent).

    The bitsandbytes layers keep their weights, state and class; returns how many were wrapped.
    """
    import bitsandbytes as bnb

    count = 0
    for name, module in leaf_linears(model):
        if isinstance(module, bnb.nn.Linear8bitLt):
            replace_module(model, name, RowwiseLinear8bitLt(module))
            count += 1
    return count


class RowwiseLinear8bitLt(LayerWrapper):
    """LLM.int8 with outlier columns chosen per input row: each input row is one standard call of the
    bitsandbytes ``Linear8bitLt`` it holds (child ``layer``), so rows never share outlier columns."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, x.shape[-1])  # [n, in]
        row_forward = self.layer.forward
        if rows.shape[0] == 1 or rows.shape[0] > MAX_CHUNKED_ROWS:  # decode step, or a prefill
            return row_forward(x)
        out = torch.cat([row_forward(row) for row in rows.split(1)])  # [n, out]
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _import_bitsandbytes() -> None:
    """Import bitsandbytes with its two needless warnings silenced.

    Each of these loggers has exactly one call: "MatMul8bitLt: inputs will be cast ... to float16"
    on every int8 forward of every layer (LLM.int8 always quantizes activations from fp16), and, at
    import, a suggestion to install the Hub-downloaded ``kernels`` package for a faster nf4 CPU GEMM
    (the bundled kernel is used instead). A level, not a filter: no log record is built per call.
    """
    for name in ("bitsandbytes.autograd._functions", "bitsandbytes.backends.cpu.ops"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise SpecToolkitError(
            f"precision int8/nf4 needs bitsandbytes ({first_line(exc)}): run `make install` "
            "(or `pip install bitsandbytes`), or pick another precision, e.g. rtn-int8"
        ) from None
