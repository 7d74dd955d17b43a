"""A GGUF file's quantized tensors in our kernel's int8 / int4 terms, holding exactly the weights ``gguf`` dequantizes.

llama.cpp stores a weight [N, K] (GGUF's ``shape`` lists it reversed, [K, N]) as N rows of blocks along K; the
``gguf`` package's :func:`gguf.quants.dequantize` is the reference for every layout below. Each block type maps
onto one kernel kind (:mod:`spectoolkit.kernels.cpu_linear`): int8, ``w = q * scale``, or int4,
``w = (u - 8) * scale + zero``, one fp32 scale (and zero) per group:

| type | block | gguf's weight                      | ours                                                        |
|------|-------|------------------------------------|-------------------------------------------------------------|
| Q8_0 | 32    | ``d * q``, q int8                  | int8 g32: q, scale d                                        |
| Q4_0 | 32    | ``d * (u - 8)``, u 4-bit           | int4 g32: u, scale d, zero 0                                |
| Q4_1 | 32    | ``d * u + m``                      | int4 g32: u, scale d, zero m + 8d                           |
| Q5_0 | 32    | ``d * (u - 16)``, u 5-bit          | int8 g32: q = u - 16, scale d (5 bits do not fit int4)      |
| Q4_K | 256   | ``d*sc_j * u - dmin*m_j``, 8 × 32  | int4 g32: u, scale d·sc_j, zero 8·d·sc_j - dmin·m_j          |
| Q6_K | 256   | ``d*sc_j * (q - 32)``, 16 × 16     | int8 g16: q - 32, scale d·sc_j                              |

d, m, dmin are fp16, sc_j/m_j small integers (Q4_K: 6 bits; Q6_K: int8), so every scale is exact in fp32 and so
is every code times it. A zero is a sum, exact in fp64 (every term is a multiple of 2^-24 below 2^26) but not
always in fp32 (terms whose exponents lie far apart): a tensor with one such block is refused
(:func:`unpackable` says why) and keeps a float path. Where every zero is exact, the packed weight is the exact
value whose fp32 rounding gguf computes (gguf rounds its one sum once), so the packed weight rounded to fp32
equals ``gguf.quants.dequantize`` bit for bit; the tests check this per type and on the real files.

That table is the wide layout (:func:`to_packed`), 1.2-1.6x the file's bytes. What a run loads is
:func:`to_compact`: the same codes and the file's own scale fields in the kernel's records at the file's size
(:mod:`spectoolkit.kernels.formats`; Q5_K too, as ``u * d·sc_j - dmin·m_j``), from which the kernel computes the
very scales and zeros above.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import gguf
import numpy as np
import torch

from spectoolkit.kernels import formats
from spectoolkit.kernels.cpu_linear import PackedWeight, pack_int4_codes, pack_int8_codes

Type = gguf.GGMLQuantizationType
_F16 = np.dtype("<f2")  # GGUF files are little-endian
_ROW_CHUNK = 4096  # rows decoded at a time: a vocabulary-sized head stays a few hundred MB of temporaries


class GgufTensor(Protocol):
    """What we read of a tensor: :class:`gguf.ReaderTensor` has it."""

    tensor_type: Type
    shape: np.ndarray  # GGUF order: [K, N] for a weight
    data: np.ndarray  # quantized: uint8 [N, bytes per row]


@dataclass(frozen=True)
class _Layout:
    """How one block type becomes a kernel kind."""

    kind: str  # "int8" (w = q * scale) or "int4" (w = (u - 8) * scale + zero)
    group: int  # weights per scale
    params: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray | None]]  # blocks [R, B, S] -> scale, zero fp64 [R, G]
    codes: Callable[[np.ndarray], np.ndarray]  # blocks [R, B, S] -> q int8 / u uint8 [R, K]


def gguf_type_name(tensor: GgufTensor) -> str:
    """The tensor's GGML type, e.g. ``"Q4_K"``."""
    return Type(tensor.tensor_type).name


def unpackable(tensor: GgufTensor) -> str | None:
    """Why ``tensor`` cannot become our kernel's panels with exactly gguf's weights (None: it can)."""
    name, layout = gguf_type_name(tensor), _LAYOUTS.get(Type(tensor.tensor_type))
    params = layout.params if layout is not None else _q5_k_params if name == "Q5_K" else None
    if params is None:
        if name in ("F32", "F16", "BF16"):
            return f"gguf {name} is a float tensor, not a quantized one"
        return f"gguf {name} has no exact kernel kind (we take {', '.join(PACKED_TYPES)})"
    if len(tensor.shape) != 2:
        return f"gguf {name} tensor of {len(tensor.shape)} dimensions, not a weight [N, K]"
    scales, zeros = params(_blocks(tensor))
    if not np.isfinite(scales).all() or (zeros is not None and not np.isfinite(zeros).all()):
        return f"gguf {name}: a scale or minimum is not finite"
    if zeros is None:
        return None
    inexact = zeros.astype(np.float32).astype(np.float64) != zeros  # [N, G]
    if inexact.any():
        row, group = (int(i[0]) for i in np.nonzero(inexact))
        zero = "m + 8·d" if name == "Q4_1" else "8·d·sc - dmin·m"
        return (
            f"gguf {name}: the zero {zero} is not exact in fp32 in {int(inexact.sum())} of {inexact.size} groups "
            f"(first: row {row}, group {group})"
        )
    return None


def to_packed(tensor: GgufTensor, rows: torch.Tensor | None = None) -> PackedWeight:
    """A tensor :func:`unpackable` accepts -> our panels, whose weight is gguf's dequantized one exactly.

    ``rows`` (int64 [N']): output rows to take, in this order (e.g. undoing a converter's q/k row permutation);
    None takes all N."""
    count, chunks = _row_chunks(tensor, rows)
    layout, columns = _LAYOUTS[Type(tensor.tensor_type)], int(tensor.shape[0])
    codes = torch.empty(count, columns, dtype=torch.int8 if layout.kind == "int8" else torch.uint8)
    scales = torch.empty(count, columns // layout.group)  # fp32
    zeros = torch.empty(count, columns // layout.group) if layout.kind == "int4" else None
    stop = 0
    for part in chunks:
        start, stop = stop, stop + part.shape[0]
        part_scales, part_zeros = layout.params(part)
        codes[start:stop] = torch.from_numpy(layout.codes(part))
        scales[start:stop] = torch.from_numpy(part_scales.astype(np.float32))
        if zeros is not None:
            zeros[start:stop] = torch.from_numpy(part_zeros.astype(np.float32))
    if zeros is None:
        return pack_int8_codes(codes, scales, layout.group)
    return pack_int4_codes(codes, scales, zeros, layout.group)


def to_compact(tensor: GgufTensor, rows: torch.Tensor | None = None) -> PackedWeight:
    """A tensor :func:`unpackable` accepts -> the kernel's records at the file's size (:mod:`spectoolkit.kernels.
    formats`), the same weight as :func:`to_packed`'s; ``rows`` as there."""
    count, chunks = _row_chunks(tensor, rows)
    name, parts = gguf_type_name(tensor), []
    for part in chunks:  # _ROW_CHUNK rows, a multiple of 16: whole panels
        codes = torch.from_numpy(np.ascontiguousarray(_UNSIGNED[name](part)))
        fields = {key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in _fields(name, part).items()}
        parts.append(formats.records(name, codes, fields))
    data = torch.cat(parts) if len(parts) > 1 else parts[0]
    return PackedWeight(data, _EMPTY, _EMPTY, count, int(tensor.shape[0]), formats.FORMATS[name].sub, name)


def _row_chunks(tensor: GgufTensor, rows: torch.Tensor | None) -> tuple[int, Iterator[np.ndarray]]:
    """A tensor :func:`unpackable` accepts (else ValueError): how many rows ``rows`` takes (None: all), and their
    blocks [R, B, S] in that order, :data:`_ROW_CHUNK` rows at a time."""
    why = unpackable(tensor)
    if why is not None:
        raise ValueError(why)
    blocks = _blocks(tensor)
    order = np.arange(blocks.shape[0]) if rows is None else rows.numpy()
    return len(order), (blocks[order[start : start + _ROW_CHUNK]] for start in range(0, len(order), _ROW_CHUNK))


_EMPTY = torch.empty(0)


def _fields(name: str, blocks: np.ndarray) -> dict[str, np.ndarray]:
    """A format's header fields of every block, each [R, B, count] (fp16 as int16 bits, the 12 K-quant scale bytes
    as 3 little-endian int32 words, Q6_K's scales int8)."""

    def raw(at: int, size: int, dtype: str) -> np.ndarray:
        return np.ascontiguousarray(blocks[..., at : at + size]).view(np.dtype(dtype))

    if name == "Q6_K":
        return {"d": raw(208, 2, "<i2"), "sc": raw(192, 16, "i1")}
    out = {"d": raw(0, 2, "<i2")}
    if name == "Q4_1":
        out["m"] = raw(2, 2, "<i2")
    if name in ("Q4_K", "Q5_K"):
        out["dmin"] = raw(2, 2, "<i2")
        out["words"] = raw(4, 12, "<i4")
    return out


def dequantized_fp32(tensor: GgufTensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: ``gguf.quants.dequantize`` of the tensor's rows (all, or ``rows`` in order), fp32 [N, K]."""
    data = np.asarray(tensor.data)
    if rows is not None:
        data = data[rows.numpy()]
    weight = gguf.quants.dequantize(data, Type(tensor.tensor_type))
    return torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32)).reshape(len(data), -1)


def _blocks(tensor: GgufTensor) -> np.ndarray:
    """The raw blocks, uint8 [N, B, S] (B blocks per row of S bytes), a view of the tensor's data."""
    block, size = gguf.GGML_QUANT_SIZES[Type(tensor.tensor_type)]
    columns, count = (int(n) for n in tensor.shape)
    data = np.asarray(tensor.data)
    if data.dtype != np.uint8 or data.size != count * columns // block * size:
        raise ValueError(f"gguf {gguf_type_name(tensor)} data {data.dtype} {data.shape} is not {count} rows of blocks")
    return data.reshape(count, columns // block, size)


# --- the block layouts (gguf/quants.py's dequantize_blocks, read as codes and scales) ---------------------


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at bytes at, at+1 of every block, as fp64 [R, B]."""
    return np.ascontiguousarray(blocks[..., at : at + 2]).view(_F16)[..., 0].astype(np.float64)


def _nibbles(packed: np.ndarray, width: int) -> np.ndarray:
    """Bytes [R, B, n] -> 4-bit codes [R, B * 2n]: per run of ``width`` bytes, their low nibbles, then high ones."""
    runs = packed.reshape(*packed.shape[:-1], -1, width)  # [R, B, n / width, width]
    return np.stack([runs & 15, runs >> 4], axis=-2).reshape(packed.shape[0], -1)


def _per_group(values: np.ndarray) -> np.ndarray:
    """[R, B, j] per block and sub-block -> [R, B * j] per group."""
    return values.reshape(values.shape[0], -1)


def _q8_0(blocks: np.ndarray) -> np.ndarray:  # d fp16, q int8 [32]
    return np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(blocks.shape[0], -1)


def _q4_0(blocks: np.ndarray) -> np.ndarray:  # d fp16, u [32] in 16 bytes: j low, j + 16 high
    return _nibbles(blocks[..., 2:], 16)


def _q4_1(blocks: np.ndarray) -> np.ndarray:  # d, m fp16, u as Q4_0
    return _nibbles(blocks[..., 4:], 16)


def _q5_0(blocks: np.ndarray) -> np.ndarray:  # d fp16, qh: bit j of a little-endian uint32 = bit 4 of u_j, low as Q4_0
    high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little").reshape(blocks.shape[0], -1)
    return ((_nibbles(blocks[..., 6:], 16) | (high << 4)).astype(np.int16) - 16).astype(np.int8)


def _q4_k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of 6-bit (sc, m) for 8 sub-blocks -> two [R, B, 8] (gguf's Q4_K.get_scale_min)."""
    packed = blocks[..., 4:16].reshape(*blocks.shape[:-1], 3, 4)  # rows: scale low bits, min low bits, high bits
    low_d, low_m, high = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = np.concatenate([low_d & 63, (high & 15) | ((low_d >> 2) & 48)], axis=-1)
    mins = np.concatenate([low_m & 63, (high >> 4) | ((low_m >> 2) & 48)], axis=-1)
    return sc.astype(np.float64), mins.astype(np.float64)


def _q4_k_params(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # d, dmin fp16, scales [12], u [256]
    sc, mins = _q4_k_scales(blocks)
    scale = _fp16(blocks, 0)[..., None] * sc  # [R, B, 8]
    return _per_group(scale), _per_group(8 * scale - _fp16(blocks, 2)[..., None] * mins)


def _q4_k(blocks: np.ndarray) -> np.ndarray:  # u: per 32 bytes, 32 low nibbles then 32 high ones
    return _nibbles(blocks[..., 16:], 32)


def _q6_k_params(blocks: np.ndarray) -> tuple[np.ndarray, None]:  # ql [128], qh [64], sc int8 [16], d fp16
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float64)
    return _per_group(_fp16(blocks, 208)[..., None] * sc), None


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Per half of 128: ql's 64 bytes give low nibbles (0..63) then high ones (64..127); qh's 32 bytes give bits
    4-5 of 32 weights per 2-bit shift 0, 2, 4, 6."""
    rows = blocks.shape[0]
    low = _nibbles(blocks[..., :128], 64)  # [R, K]
    halves = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)  # [R, B, half, 1, 32]
    high = ((halves >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3).reshape(rows, -1)
    return ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)


def _q5_k_params(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # d, dmin, scales [12], qh [32], qs [128]
    sc, mins = _q4_k_scales(blocks)
    return _per_group(_fp16(blocks, 0)[..., None] * sc), _per_group(-_fp16(blocks, 2)[..., None] * mins)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    """u in [0, 32): the low nibbles as Q4_K's (from byte 48), bit 4 of sub-block i's element e is bit i of qh[e]."""
    rows = blocks.shape[0]
    high = (blocks[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [R, B, 8, 32]
    return _nibbles(blocks[..., 48:], 32) | (high.reshape(rows, -1) << 4)


def _d_params(blocks: np.ndarray) -> tuple[np.ndarray, None]:  # Q8_0, Q5_0: scale d
    return _fp16(blocks, 0), None


def _q4_0_params(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # scale d, zero 0
    scale = _fp16(blocks, 0)
    return scale, np.zeros_like(scale)


def _q4_1_params(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # d * u + m = (u - 8) * d + (m + 8d)
    scale = _fp16(blocks, 0)
    return scale, _fp16(blocks, 2) + 8 * scale


_LAYOUTS: dict[Type, _Layout] = {
    Type.Q8_0: _Layout("int8", 32, _d_params, _q8_0),
    Type.Q4_0: _Layout("int4", 32, _q4_0_params, _q4_0),
    Type.Q4_1: _Layout("int4", 32, _q4_1_params, _q4_1),
    Type.Q5_0: _Layout("int8", 32, _d_params, _q5_0),
    Type.Q4_K: _Layout("int4", 32, _q4_k_params, _q4_k),
    Type.Q6_K: _Layout("int8", 16, _q6_k_params, _q6_k),
}
PACKED_TYPES: tuple[str, ...] = (*(qtype.name for qtype in _LAYOUTS), "Q5_K")
# Unsigned codes u per format (w = (u - offset) * scale + ...; Q8_0 keeps its int8 q), for the records.
_UNSIGNED: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": lambda blocks: (_q5_0(blocks).astype(np.int16) + 16).astype(np.uint8),
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": lambda blocks: (_q6_k(blocks).astype(np.int16) + 32).astype(np.uint8),
}
