"""A loaded bitsandbytes NF4 layer's weights in our kernel's nf4 terms, so :mod:`spectoolkit.quant.packing` can pack it.

bitsandbytes holds an NF4 ``Linear4bit`` weight (before the layer's first forward, which on CPUs with
AVX-512-BF16 repacks it for bitsandbytes' fused kernel) as ``uint8 [N*K/2, 1]``: the row-major weight
[N, K] flattened, two codes a byte, the first in the high nibble. ``quant_state.absmax`` holds one scale per
block of ``blocksize`` consecutive values (fp32, or int8 codes with their own blockwise state when
nested). The weight is ``w = NF4[u] * absmax[block]``, which is exactly our nf4 kind
(:func:`~spectoolkit.kernels.cpu_linear.pack_nf4`) when a block never straddles two rows (blocksize
divides K): the group is the block. LLM.int8 (``int8``) quantizes the activations too, per call, so its
bits cannot become a weight-only layer: it keeps bitsandbytes' kernel.
"""

from __future__ import annotations

import torch
from torch import nn


def is_nf4_layer(layer: nn.Module) -> bool:
    """Whether ``layer`` is a bitsandbytes ``Linear4bit`` (by class, without importing bitsandbytes)."""
    return type(layer).__name__ == "Linear4bit" and type(layer).__module__.startswith("bitsandbytes")


def unpackable(layer: nn.Module) -> str | None:
    """Why a ``Linear4bit``'s codes cannot become our nf4 panels (None: they can)."""
    weight = layer.weight
    state = getattr(weight, "quant_state", None)
    rows, columns = layer.out_features, layer.in_features
    if state is None:
        return "bitsandbytes 4-bit weight not quantized yet"
    if state.quant_type != "nf4":
        return f"bitsandbytes {state.quant_type} (only nf4 maps onto our kernel)"
    repacked = getattr(state, "packing_format_for_cpu", False)
    if repacked or weight.dtype != torch.uint8 or weight.numel() * 2 != rows * columns:
        return "bitsandbytes weight not in its [N*K/2] layout (already repacked by a forward?)"
    if columns % state.blocksize or state.blocksize % 2:
        return f"bitsandbytes blocksize {state.blocksize} does not split K={columns} evenly"
    if not weight.is_cpu:
        return "not on the CPU"
    return None


def nf4_codes(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(codes u uint8 [N, K], absmax fp32 [N, K / blocksize], blocksize) of a layer :func:`unpackable` accepts,
    with ``NF4[u] * absmax`` = bitsandbytes' weight (module docstring)."""
    state = layer.weight.quant_state
    rows, columns = layer.out_features, layer.in_features
    data = layer.weight.data.reshape(-1)
    codes = torch.stack([data >> 4, data & 15], dim=1).reshape(rows, columns)  # first value in the high nibble
    absmax = state.absmax
    if state.nested:  # int8 codes of the absmax, dequantized as bitsandbytes does
        import bitsandbytes.functional as bnb_functional

        absmax = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    return codes.contiguous(), absmax.float().reshape(rows, columns // state.blocksize), state.blocksize
