"""The quantization backend chooser: precision name -> the backend module that loads it.

Backends are imported only when used (bitsandbytes and GPTQModel are heavy, optional dependencies),
and only from here, never from the package ``__init__``: the backends import leaves of this package
(:mod:`spectoolkit.quant.rtn_kernels`, ...), which runs that ``__init__``.
"""

from __future__ import annotations

from importlib import import_module

import torch

from spectoolkit.checkpoints import Checkpoint

_BACKEND_MODULES = {
    "int8": "bnb", "nf4": "bnb", "int4": "gptq", "rtn-int8": "rtn", "rtn-int4": "rtn", "gguf": "gguf_native",
}  # fmt: skip


HEAD_QUANTIZING = ("rtn-int8", "rtn-int4")  # backends that can quantize (or cut) the output projection too


def load_quantized(
    checkpoint: Checkpoint, precision: str, device, group_size: int, quantize_head: bool = False,
    head_rows: torch.Tensor | None = None,
) -> torch.nn.Module:  # fmt: skip
    """Load ``checkpoint`` (resolved once: the backends never resolve a spec) quantized
    to ``precision`` with its backend (imported only when used); ``quantize_head`` quantizes ``lm_head`` too,
    ``head_rows`` (target ids) keeps only those rows of it (RTN backends only: the caller checks)."""
    module = import_module(f"spectoolkit.quant.{_BACKEND_MODULES[precision]}")
    if quantize_head or head_rows is not None:
        return module.load_quantized(checkpoint, precision, device, group_size, quantize_lm_head=quantize_head,
                                     head_rows=head_rows)  # fmt: skip
    return module.load_quantized(checkpoint, precision, device, group_size)
