"""CPU fast paths for :mod:`spectoolkit.quant.rtn`: torch's weight-only int4/int8 matmul kernels.

Two ATen kernels do the work; both are vectorized (AVX2/AVX-512) **only for bf16 activations**
(fp32/fp16 inputs fall to a scalar loop, tens of times slower), accumulate in fp32, return bf16:

- ``aten._weight_int4pack_mm_for_cpu(x [M, K] bf16, packed [N, K/2] uint8, group_size,
  scales_and_zeros [K/g, N, 2] bf16) -> [M, N] bf16`` ("tinygemm"): per element it computes
  ``w = (u - 8) * scale + zero`` in fp32 (u = the stored 4-bit code in [0, 15]) — exactly the
  canonical int4 formula of :mod:`~spectoolkit.kernels.rtn_format`. Constraints: ``N % 16 == 0``,
  ``group_size in {32, 64, 128, 256}``. ``packed`` comes from
  ``aten._convert_weight_to_int4pack_for_cpu(codes [N, K] int32, 1)`` in an ISA-dependent blocked
  layout (:func:`unpack_cpu_int4` inverts it; it is checked against the codes on every pack).
- ``aten._weight_int8pack_mm(x [M, K] bf16, w [N, K] int8, scales [N] bf16) -> [M, N] bf16``:
  per-output-channel scales only. It needs ``K % 16 == 0``: otherwise it silently returns wrong
  values (K = 12, 40, 66, ...) or crashes (K = 63) in torch 2.13.

Group-wise int8 rides on the int4 kernel, exactly: a code q in [-127, 127] splits into
``q = 16·h + l`` with ``h = floor(q / 16)`` in [-8, 7] and ``l = q mod 16`` in [0, 15]. Stored as
the int4 matrix ``[h + 8 | l]`` of shape [N, 2K] with per-group (scale, zero) = (16·s, 0) for the
``h`` half and (s, 8·s) for the ``l`` half, the kernel computes ``16·s·h + s·l = s·q`` on the
activations ``[x | x]`` — the very same weights (each product is exact in fp32), N·K bytes, no
float copy of the weight. It costs about twice the int4 kernel (two FMAs per weight) and measured
as fast as ``_weight_int8pack_mm`` in a whole-model decode step; dequantizing to a temporary bf16
weight per call was 5-10x slower than either.

No one-row padding needed for speed: unlike fp32 ``F.linear`` (see :mod:`spectoolkit.kernels.kernel_choice`), both
kernels run one row through the same blocked code as two, and one row measured cheaper than two.
Measurements: ``experiments/rtn_speed.py``.
"""

from __future__ import annotations

import torch

INT4_KERNEL_GROUP_SIZES = (32, 64, 128, 256)
FAST_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)  # fp32 is rounded to bf16 on the way in


def int4_kernel_fits(out_features: int, group_size: int) -> bool:
    """Whether the tinygemm CPU kernel accepts this shape (see the module docstring)."""
    return out_features % 16 == 0 and group_size in INT4_KERNEL_GROUP_SIZES


def int8_kernel_fits(in_features: int) -> bool:
    """Whether ``_weight_int8pack_mm`` computes this shape correctly (see the module docstring)."""
    return in_features % 16 == 0


def _cpu_int4_layout() -> tuple[int, bool]:
    """(block_n, split) of ``_convert_weight_to_int4pack_for_cpu`` on this CPU (ATen int4mm_kernel.cpp).

    Rows go in blocks of ``block_n`` (= 4 float vectors: 64 on AVX-512, 32 otherwise); a block is
    stored as [K, block_n / 2] bytes. ``split``: in a full block, byte j holds row j (low nibble)
    and row j + block_n/2 (high nibble); otherwise (and in a tail block of 16/32/48 rows) byte j
    holds rows 2j (low) and 2j + 1 (high).
    """
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return 64, True
    if capability == "AVX2":
        return 32, True
    return 32, False


def unpack_cpu_int4(packed: torch.Tensor, num_rows: int, num_cols: int) -> torch.Tensor:
    """packed [N, K/2] uint8 (CPU tinygemm layout) -> codes [N, K] uint8 in [0, 15]."""
    block_n, split = _cpu_int4_layout()
    num_full = num_rows // block_n if split else 0
    flat = packed.reshape(-1)
    parts = []
    if num_full:
        blocks = flat[: num_full * block_n * num_cols // 2].view(num_full, num_cols, block_n // 2)  # [B, K, bn/2]
        rows = torch.cat([blocks & 15, blocks >> 4], dim=2)  # [B, K, bn]: low nibbles are rows 0..bn/2-1
        parts.append(rows.transpose(1, 2).reshape(num_full * block_n, num_cols))
    start = num_full * block_n
    offset = start * num_cols // 2
    while start < num_rows:
        size = min(block_n, num_rows - start)
        block = flat[offset : offset + size * num_cols // 2].view(num_cols, size // 2)  # [K, size/2]
        pairs = torch.stack([block & 15, block >> 4], dim=2)  # [K, size/2, 2]: rows 2j, 2j+1
        parts.append(pairs.reshape(num_cols, size).t())
        start += size
        offset += size * num_cols // 2
    return torch.cat(parts).contiguous() if len(parts) > 1 else parts[0].contiguous()


def pack_cpu_int4(codes: torch.Tensor) -> torch.Tensor | None:
    """codes [N, K] uint8 in [0, 15] -> packed [N, K/2] uint8 for the CPU kernel.

    ``None`` when this CPU's layout is not the one :func:`unpack_cpu_int4` knows (then the caller
    keeps the canonical format: the codes must stay recoverable bit-exactly).
    """
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    if not torch.equal(unpack_cpu_int4(packed, *codes.shape), codes):
        return None
    return packed


def int4_matmul(
    inputs: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """inputs [M, K] (fp32/bf16), packed [N, K/2], scales_and_zeros [K/g, N, 2] bf16 -> [M, N] bf16."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(
        inputs.to(torch.bfloat16).contiguous(), packed, group_size, scales_and_zeros
    )


def int8_channel_matmul(inputs: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """inputs [M, K] (fp32/bf16), qweight [N, K] int8, scales [N] bf16 -> [M, N] bf16."""
    return torch.ops.aten._weight_int8pack_mm(inputs.to(torch.bfloat16).contiguous(), qweight, scales)


def split_int8(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [N, K] + scales [N, G] bf16 -> (int4 codes [N, 2K] uint8, scales_and_zeros [2G, N, 2]).

    ``codes = [h + 8 | l]`` with ``q = 16 h + l`` (module docstring); scales_and_zeros holds
    (16·s, 0) for the ``h`` groups, then (s, 8·s) for the ``l`` groups (exact in bf16).
    """
    wide = qweight.to(torch.int16)
    high = torch.div(wide, 16, rounding_mode="floor")  # [N, K] in [-8, 7]
    low = wide - 16 * high  # [N, K] in [0, 15]
    codes = torch.cat([high + 8, low], dim=1).to(torch.uint8)  # [N, 2K]
    scales_t = scales.t()  # [G, N]
    high_sz = torch.stack([scales_t * 16, torch.zeros_like(scales_t)], dim=-1)  # [G, N, 2]
    low_sz = torch.stack([scales_t, scales_t * 8], dim=-1)  # [G, N, 2]
    return codes, torch.cat([high_sz, low_sz]).contiguous()


def join_int8(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`split_int8`: (codes [N, 2K], scales_and_zeros [2G, N, 2]) -> (int8 [N, K], scales [N, G])."""
    num_cols = codes.shape[1] // 2
    wide = codes.to(torch.int16)
    qweight = (16 * (wide[:, :num_cols] - 8) + wide[:, num_cols:]).to(torch.int8)
    num_groups = scales_and_zeros.shape[0] // 2
    return qweight, scales_and_zeros[num_groups:, :, 0].t().contiguous()


def int8_split_matmul(
    inputs: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """inputs [M, K] (fp32/bf16), packed [N, K] (split int8 as int4), scales_and_zeros [2K/g, N, 2] -> [M, N] bf16."""
    doubled = inputs.to(torch.bfloat16).repeat(1, 2)  # [M, 2K] = [x | x]
    return torch.ops.aten._weight_int4pack_mm_for_cpu(doubled, packed, group_size, scales_and_zeros)
