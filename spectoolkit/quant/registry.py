"""The quantization backend chooser: precision name -> the backend module that loads it.

Backends are imported only when used (bitsandbytes and GPTQModel are heavy, optional dependencies),
and only from here, never from the package ``__init__``: the backends import leaves of this package
(:mod:`spectoolkit.quant.rtn_kernels`, ...), which runs that ``__init__``.
"""

from __future__ import annotations

from importlib import import_module

import torch

_BACKEND_MODULES = {
    "int8": "bnb", "nf4": "bnb", "int4": "gptq", "rtn-int8": "rtn", "rtn-int4": "rtn", "gguf": "gguf_native",
}  # fmt: skip


HEAD_QUANTIZING = ("rtn-int8", "rtn-int4")  # backends that can quantize the output projection too


def load_quantized(path: str, precision: str, device, group_size: int, quantize_head: bool = False) -> torch.nn.Module:
    """Load ``path`` quantized to ``precision`` with its backend (imported only when used); ``quantize_head``
    quantizes ``lm_head`` too (RTN backends only: the caller checks)."""
    module = import_module(f"spectoolkit.quant.{_BACKEND_MODULES[precision]}")
    if quantize_head:
        return module.load_quantized(path, precision, device, group_size, quantize_lm_head=True)
    return module.load_quantized(path, precision, device, group_size)
