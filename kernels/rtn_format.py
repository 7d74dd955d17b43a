"""The canonical RTN weight format: config, group-wise quantization and int4 packing.

The contract :mod:`spectoolkit.quant.rtn` (its linears and CPU kernels) and the Triton kernel
:mod:`spectoolkit.kernels.quant_matmul` (its layout, reference and benchmark weights) share, in a leaf
module both import. It sits beside the kernel that reads it: :mod:`spectoolkit.quant` loads checkpoints
through :mod:`spectoolkit.models`, which runs kernels, so the format the kernel reads sits below both.

``nn.Linear`` weight W [N, K] = [out_features, in_features] is split along K into groups of ``g``
consecutive columns (``group_size``; ``-1`` means one group per row, i.e. per output channel); G = K / g
groups per row.

- int4, asymmetric: ``qweight`` uint8 [N, K/2]: byte (n, j) holds the code of column 2j in its
  low nibble and of column 2j+1 in its high nibble; codes u are unsigned in [0, 15].
  ``scales`` and ``zeros`` bf16 [N, G]. Dequantization, in fp32:
  ``w[n, k] = (u[n, k] - 8) * scales[n, k // g] + zeros[n, k // g]`` — ``zeros`` is the float value
  of code 8 (torch tinygemm's convention, so its CPU kernel runs the canonical weights unchanged).
  RTN: with lo = min(0, min w), hi = max(0, max w) over the group (0 is always in range, which keeps
  |zero| <= 8·scale so the bf16 rounding of ``zeros`` stays far below a quantization step),
  ``scale = bf16((hi - lo) / 15)``, ``zero = bf16(lo + 8·scale)``,
  ``u = clamp(round((w - zero) / scale) + 8, 0, 15)`` using the stored (rounded) scale and zero.
- int8, symmetric: ``qweight`` int8 [N, K] (row-major), codes in [-127, 127]; ``scales`` bf16
  [N, G]; ``zeros`` is None; ``w = q * scale``; ``scale = bf16(max |w| / 127)``,
  ``q = clamp(round(w / scale), -127, 127)``.

Both give ``|w - dequantized w| <= scale / 2`` element-wise. Scales are bf16 (what the fast CPU
kernels and the usual GPU activation dtype take); the products ``code × scale`` are exact in fp32, so
every kernel sees bit-identical weights. An all-zero group gets the smallest normal scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectoolkit.errors import SpecToolkitError

_TINY = torch.finfo(torch.bfloat16).tiny  # scale of an all-zero group


@dataclass(frozen=True)
class RtnConfig:
    """RTN settings: ``bits`` 8 or 4; ``group_size`` input columns per scale (-1: per output channel)."""

    bits: int
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise SpecToolkitError(f"RTN bits must be 4 or 8, got {self.bits!r}")
        if not isinstance(self.group_size, int) or not (self.group_size == -1 or self.group_size >= 2):
            raise SpecToolkitError(f"RTN group_size must be -1 (per channel) or >= 2, got {self.group_size!r}")
        if self.bits == 4 and self.group_size != -1 and self.group_size % 2:
            raise SpecToolkitError(f"RTN int4 group_size must be even (two codes per byte), got {self.group_size}")

    def layer_group_size(self, in_features: int) -> int | None:
        """The group size for a layer with ``in_features`` columns, or None if it does not fit."""
        group = in_features if self.group_size == -1 else self.group_size
        if in_features % group or (self.bits == 4 and in_features % 2):
            return None
        return group


@dataclass
class QuantizedWeight:
    """The canonical quantized weight (module docstring); N = out_features, K = in_features, G = K / g."""

    qweight: torch.Tensor  # int4: uint8 [N, K/2], two codes per byte (low nibble = even column); int8: int8 [N, K]
    scales: torch.Tensor  # bf16 [N, G]
    zeros: torch.Tensor | None  # int4: bf16 [N, G], the value of code 8; int8: None (symmetric)
    group_size: int  # g, columns per group (K for per-channel)
    bits: int  # 4 or 8

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the float weight."""
        return self.qweight.shape[0], self.qweight.shape[1] * (2 if self.bits == 4 else 1)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in [0, 15] -> uint8 [N, K/2]: column 2j in the low nibble, 2j+1 in the high one."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> codes uint8 [N, K] (inverse of :func:`pack_int4`)."""
    return torch.stack([qweight & 15, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1)


def quantize_weight(weight: torch.Tensor, cfg: RtnConfig) -> QuantizedWeight:
    """weight [N, K] (any float dtype) -> canonical :class:`QuantizedWeight` (RTN, module docstring)."""
    num_rows, num_cols = weight.shape
    group = cfg.layer_group_size(num_cols)
    if group is None:
        raise SpecToolkitError(f"RTN group_size {cfg.group_size} does not fit a weight with {num_cols} columns")
    groups = weight.detach().float().reshape(num_rows, num_cols // group, group)  # [N, G, g]
    if cfg.bits == 8:
        scales = (groups.abs().amax(-1) / 127).clamp(min=_TINY).to(torch.bfloat16)  # [N, G]
        codes = torch.round(groups / scales.float()[..., None]).clamp(-127, 127)
        return QuantizedWeight(codes.to(torch.int8).reshape(num_rows, num_cols), scales, None, group, 8)
    low = groups.amin(-1).clamp(max=0)  # [N, G]
    high = groups.amax(-1).clamp(min=0)
    scales = ((high - low) / 15).clamp(min=_TINY).to(torch.bfloat16)
    zeros = (low + 8 * scales.float()).to(torch.bfloat16)
    codes = torch.round((groups - zeros.float()[..., None]) / scales.float()[..., None]) + 8
    codes = codes.clamp(0, 15).reshape(num_rows, num_cols)
    return QuantizedWeight(pack_int4(codes), scales, zeros, group, 4)


def dequantize_weight(q: QuantizedWeight) -> torch.Tensor:
    """Canonical weight -> fp32 [N, K] (the exact weights every kernel computes with)."""
    num_rows, num_cols = q.shape
    scales = q.scales.float()[..., None]  # [N, G, 1]
    if q.bits == 8:
        codes = q.qweight.float().reshape(num_rows, -1, q.group_size)  # [N, G, g]
        return (codes * scales).reshape(num_rows, num_cols)
    codes = unpack_int4(q.qweight).float().reshape(num_rows, -1, q.group_size) - 8
    return (codes * scales + q.zeros.float()[..., None]).reshape(num_rows, num_cols)
