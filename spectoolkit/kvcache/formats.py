"""Per-token KV quantization formats: the plain-torch reference a Triton attention kernel must match.

Each format quantizes states [..., D] (``...`` = B, H_kv, n) row by row: one row is one (token, kv-head)
and its codes depend on that row alone, so writing tokens in any chunking gives bit-identical storage
and a rollback never has to re-quantize kept history (DESIGN §2). All arithmetic is fp32.

Stored fields per format, as the paged pool (:mod:`spectoolkit.runtime.paged_kv`) lays them out per layer
and kind: [H_kv, slots, width] (shown below with the reference's own leading batch dimension, [B, H_kv, cap, ·],
``cap`` = slots):

- ``fp8``: ``data`` float8_e4m3fn [B, H_kv, cap, D], ``scale`` fp32 [B, H_kv, cap, 1].
  ``scale = absmax(row) / 448``; ``data = saturate_e4m3(x / scale)`` (round to nearest even);
  ``x ≈ data.float() * scale``.
- ``int8``: ``data`` int8 [B, H_kv, cap, D], ``scale`` fp32 [B, H_kv, cap, 1], symmetric.
  ``scale = absmax(row) / 127``; ``data = clamp(round_half_even(x / scale), -127, 127)``;
  ``x ≈ data * scale``.
- ``int4``: ``data`` uint8 [B, H_kv, cap, D/2], ``scale`` and ``zero`` fp32 [B, H_kv, cap, D/G], asymmetric
  per group of G = gcd(32, D) consecutive elements (G = 32 for every usual head_dim: 64, 96, 128, 256;
  smaller only for tiny test models). Group g covers elements [g*G, (g+1)*G) of the row.
  ``zero = min(group)`` (the value code 0 decodes to, a float offset, not an integer zero-point),
  ``scale = (max(group) - min(group)) / 15``, ``code = clamp(round_half_even((x - zero) / scale), 0, 15)``,
  ``x ≈ code * scale + zero``. Packing: byte j holds element 2j in its low nibble and element 2j+1 in
  its high nibble (``byte = code[2j] | code[2j+1] << 4``).

A row (or group) of zeros, or a constant group, gets ``scale == 0`` and decodes exactly.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from spectoolkit.errors import SpecToolkitError

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127
INT4_MAX = 15
INT4_GROUP = 32


def _safe(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` with zeros replaced by 1 so an all-zero row divides to codes 0, not NaN."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


# ---- the three formats as functions ------------------------------------------------------------


def quantize_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """states [..., D] -> (data float8_e4m3fn [..., D], scale fp32 [..., 1])."""
    rows = states.float()
    scale = rows.abs().amax(dim=-1, keepdim=True) / FP8_MAX  # [..., 1]
    data = (rows / _safe(scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return data, scale


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """data float8_e4m3fn [..., D], scale fp32 [..., 1] -> [..., D] in ``dtype``."""
    return (data.float() * scale).to(dtype)


def quantize_int8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """states [..., D] -> (data int8 [..., D], scale fp32 [..., 1])."""
    rows = states.float()
    scale = rows.abs().amax(dim=-1, keepdim=True) / INT8_MAX  # [..., 1]
    data = torch.round(rows / _safe(scale)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return data, scale


def dequantize_int8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """data int8 [..., D], scale fp32 [..., 1] -> [..., D] in ``dtype``."""
    return (data.float() * scale).to(dtype)


def int4_group_size(head_dim: int) -> int:
    """G = gcd(32, head_dim); raises for an odd head_dim (two codes share a byte)."""
    group = math.gcd(INT4_GROUP, head_dim)
    if group < 2:
        raise SpecToolkitError(f"int4 KV needs an even head_dim, got {head_dim}; pick kv precision int8 or fp8")
    return group


def quantize_int4(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """states [..., D] -> (data uint8 [..., D/2], scale fp32 [..., D/G], zero fp32 [..., D/G])."""
    head_dim = states.shape[-1]
    group = int4_group_size(head_dim)
    groups = states.float().unflatten(-1, (head_dim // group, group))  # [..., D/G, G]
    zero = groups.amin(dim=-1)  # [..., D/G]
    scale = (groups.amax(dim=-1) - zero) / INT4_MAX  # [..., D/G]
    codes = torch.round((groups - zero[..., None]) / _safe(scale)[..., None]).clamp(0, INT4_MAX)
    codes = codes.to(torch.uint8).flatten(-2)  # [..., D]
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale, zero


def unpack_int4(data: torch.Tensor) -> torch.Tensor:
    """data uint8 [..., D/2] -> codes uint8 [..., D] in 0..15 (low nibble first)."""
    return torch.stack([data & 0x0F, data >> 4], dim=-1).flatten(-2)


def dequantize_int4(data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """data uint8 [..., D/2], scale/zero fp32 [..., D/G] -> [..., D] in ``dtype``."""
    codes = unpack_int4(data).float()  # [..., D]
    groups = codes.unflatten(-1, (scale.shape[-1], -1))  # [..., D/G, G]
    return (groups * scale[..., None] + zero[..., None]).flatten(-2).to(dtype)


# ---- the same formats as objects a cache layer holds (chosen once, at construction) ------------


class KVFormat:
    """A quantized storage format: named fields, each [..., width] of one dtype, per (token, kv-head)."""

    name: ClassVar[str]

    def fields(self, head_dim: int) -> dict[str, tuple[int, torch.dtype]]:
        """Field name -> (last-dim width, dtype) for rows of ``head_dim`` elements."""
        raise NotImplementedError

    def quantize(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        """states [..., D] -> field name -> [..., width]."""
        raise NotImplementedError

    def dequantize(self, stored: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """field name -> [..., width] -> states [..., D] in ``dtype``."""
        raise NotImplementedError


class Fp8Format(KVFormat):
    name = "fp8"

    def fields(self, head_dim: int) -> dict[str, tuple[int, torch.dtype]]:
        return {"data": (head_dim, torch.float8_e4m3fn), "scale": (1, torch.float32)}

    def quantize(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(("data", "scale"), quantize_fp8(states), strict=True))

    def dequantize(self, stored: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(stored["data"], stored["scale"], dtype)


class Int8Format(KVFormat):
    name = "int8"

    def fields(self, head_dim: int) -> dict[str, tuple[int, torch.dtype]]:
        return {"data": (head_dim, torch.int8), "scale": (1, torch.float32)}

    def quantize(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(("data", "scale"), quantize_int8(states), strict=True))

    def dequantize(self, stored: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int8(stored["data"], stored["scale"], dtype)


class Int4Format(KVFormat):
    name = "int4"

    def fields(self, head_dim: int) -> dict[str, tuple[int, torch.dtype]]:
        num_groups = head_dim // int4_group_size(head_dim)
        return {
            "data": (head_dim // 2, torch.uint8),
            "scale": (num_groups, torch.float32),
            "zero": (num_groups, torch.float32),
        }

    def quantize(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(("data", "scale", "zero"), quantize_int4(states), strict=True))

    def dequantize(self, stored: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(stored["data"], stored["scale"], stored["zero"], dtype)


KV_FORMATS: dict[str, KVFormat] = {fmt.name: fmt for fmt in (Fp8Format(), Int8Format(), Int4Format())}
# The float KV precisions: stored as a plain cast of the compute dtype's states, no scales.
CAST_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
