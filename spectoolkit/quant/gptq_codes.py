"""A loaded GPTQModel layer's weights in our kernel's int4 terms, so :mod:`spectoolkit.quant.packing` can pack it.

GPTQModel holds a loaded layer as (its "v2" convention, before the layer's first forward, which converts it to
the CPU kernel's own layout):

- ``qweight`` int32 [K/8, N]: the code q (0..15) of input column k = 8r + s and output column n sits in
  bits 4s..4s+3 of word (r, n);
- ``qzeros`` int32 [G, N/8]: the zero point z of group g and output column n = 8c + s, same nibble order
  (a v1 checkpoint stores z - 1 on disk; GPTQModel adds the 1 back at load);
- ``scales`` [G, N] in the model's dtype, and ``g_idx`` int32 [K], each input column's group.

The weight is ``w[n, k] = scale[g, n] * (q[k, n] - z[g, n])`` with g = g_idx[k]. Our int4 weight is
``(u - 8) * scale + zero``, so u = q and zero = (8 - z) * scale: a 4-bit integer times a bf16/fp16 scale,
exact in fp32, hence the packed layer multiplies by exactly GPTQ's weights. The bits allow it for 4 bits
with groups of consecutive columns (g_idx = k // group, i.e. no act-order permutation), the group even and
dividing K; anything else keeps GPTQModel's kernel, and :func:`unpackable` says why.

At groups of 32, 64, 128 :func:`to_records` keeps the layer's own size instead (issue 55): the codes and 4-bit zero
points packed, the scale as the layer holds it (bf16: GPTQModel converts the file's fp16 on the CPU), from which the
kernel computes exactly the scale and zero above.
"""

from __future__ import annotations

import torch
from torch import nn

from spectoolkit.kernels import formats
from spectoolkit.kernels.cpu_linear import PackedWeight, pack_records

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble s of a word at bits 4s..4s+3


def is_gptq_layer(layer: nn.Module) -> bool:
    """Whether ``layer`` is one of GPTQModel's GPTQ linears (any kernel), by class name: no GPTQModel import."""
    classes = type(layer).__mro__
    return any(cls.__name__ == "GPTQQuantLinear" and cls.__module__.startswith("gptqmodel") for cls in classes)


def unpackable(layer: nn.Module) -> str | None:
    """Why a GPTQ layer's codes cannot become our int4 panels (None: they can)."""
    rows, columns, group = layer.out_features, layer.in_features, _group(layer)
    qweight, qzeros = getattr(layer, "qweight", None), getattr(layer, "qzeros", None)
    if layer.bits != 4:
        return f"gptq {layer.bits}-bit"
    if group % 2 or columns % group:
        return f"gptq group size {group} does not split K={columns} evenly"
    if qweight is None or qweight.dtype != torch.int32 or tuple(qweight.shape) != (columns // 8, rows) or columns % 8:
        return "gptq weights not in the int32 [K/8, N] layout (already converted by a forward?)"
    if qzeros is None or qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (columns // group, -(-rows // 8)):
        return "gptq zeros not in the int32 [G, N/8] layout"
    if not qweight.is_cpu:
        return "not on the CPU"
    g_idx = getattr(layer, "g_idx", None)
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(columns) // group):
        return "gptq act-order (g_idx permutes the input columns)"
    return None


def int4_codes(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(codes u uint8 [N, K], scales fp32 [N, G], zeros fp32 [N, G], group) of a layer :func:`unpackable`
    accepts, with ``(u - 8) * scale + zero`` = GPTQ's weight exactly (module docstring)."""
    codes, zeros = _codes(layer)
    scales = layer.scales.float().t()  # [N, G]
    return codes, scales.contiguous(), ((8 - zeros) * scales).contiguous(), _group(layer)


def to_records(layer: nn.Module) -> PackedWeight | None:
    """A layer :func:`unpackable` accepts at its own size (``gptq-int4-g128``, ...), the same weight as
    :func:`int4_codes`'; None where its group has no format or its scales are not bf16 values (it stays wide)."""
    name = formats.own_size("gptq-int4", _group(layer))
    scales = layer.scales.t().contiguous()  # [N, G]
    if name is None or not torch.equal(scales.bfloat16().float(), scales.float()):
        return None
    codes, zeros = _codes(layer)
    return pack_records(name, codes, {"s": scales.bfloat16(), "zq": zeros.to(torch.uint8)})


def _codes(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes q uint8 [N, K], zero points z int32 [N, G], both in 0..15) of a layer :func:`unpackable` accepts."""
    rows, columns = layer.out_features, layer.in_features
    codes = (layer.qweight[:, None, :] >> _SHIFTS[None, :, None]) & 15  # [K/8, 8, N]
    codes = codes.reshape(columns, rows).t()  # [N, K]
    zeros = (layer.qzeros[:, :, None] >> _SHIFTS[None, None, :]) & 15  # [G, N/8, 8]
    zeros = zeros.reshape(zeros.shape[0], -1)[:, :rows].t()  # [N, G], z in 0..15
    return codes.to(torch.uint8).contiguous(), zeros.contiguous()


def _group(layer: nn.Module) -> int:
    """Input columns per scale: the layer's group size, K for per channel (-1)."""
    return layer.in_features if layer.group_size == -1 else layer.group_size
