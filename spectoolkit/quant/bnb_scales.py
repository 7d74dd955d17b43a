"""Bytes of the bitsandbytes scales, which live outside a model's parameters and buffers.

Byte accounting apart from :mod:`spectoolkit.quant.bnb`, so the model loader
(:meth:`spectoolkit.wiring.loading.LoadedModel.weight_bytes`) counts them without importing the
backend it chooses. bitsandbytes itself is imported only when counting.
"""

from __future__ import annotations

import torch


def scale_bytes(model: torch.nn.Module) -> int:
    """Bytes of the bitsandbytes scales, which live outside parameters and buffers.

    int8: one fp32 absmax per weight row (``SCB``); nf4: one absmax per block of 64 (fp32 as loaded,
    bf16 once the CPU kernel has repacked the layer on its first forward). Add this to a
    parameters + buffers count for the true footprint.
    """
    import bitsandbytes as bnb

    total = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear8bitLt):
            scales = [module.state.SCB if module.state.SCB is not None else module.weight.SCB]
        elif isinstance(module, bnb.nn.Linear4bit):
            state = module.weight.quant_state
            scales = [state.absmax, state.state2.absmax] if state.nested else [state.absmax]
        else:
            continue
        total += sum(t.numel() * t.element_size() for t in scales if t is not None)
    return total
