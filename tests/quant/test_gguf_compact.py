"""GGUF kinds held at their own size (issue 55): spectoolkit/kernels/formats.py's records from gguf_codes.to_compact.

Per kind: the records take the file's bytes (panels padded to 16 columns); their weight, rounded to fp32, is
``gguf.quants.dequantize``'s bit for bit; they widen to exactly the wide layout the tensor was packed as before;
the kernel gives the same bits from both, on every path this CPU runs, at 1 to 9 rows; its int32 sub-block sums
equal an int64 reference; and a planted wrong code or scale field breaks the comparisons (so they can fail).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Type

from spectoolkit.kernels import cpu_ops, formats
from spectoolkit.kernels.cpu_linear import (
    PackedWeight,
    dequantized,
    format_id,
    linear,
    quantize_activations,
    reference_linear,
    to_int8_activations,
    widen,
)
from spectoolkit.quant import gguf_codes
from tests.quant.test_gguf_codes import COLUMNS, ROWS, _blocks, _fp16_bytes, _tensor

KINDS = (Type.Q8_0, Type.Q4_0, Type.Q4_1, Type.Q5_0, Type.Q4_K, Type.Q5_K, Type.Q6_K)
WIDE = tuple(kind for kind in KINDS if kind != Type.Q5_K)


def _kind(qtype: Type, seed: int = 0, rows: int = ROWS) -> gguf.ReaderTensor:
    """``_blocks``' tensors, and Q5_K from random bytes under fp16 d, dmin in one binade (as Q4_K there)."""
    if qtype != Type.Q5_K:
        return _blocks(qtype, seed, rows)
    rng = np.random.default_rng(seed)
    count = rows * COLUMNS // 256
    rest = rng.integers(0, 256, (count, 172), dtype=np.uint8)  # 12 scale bytes, 32 of qh, 128 of qs
    halves = _fp16_bytes(rng.uniform(2**-10, 2**-9, (count, 2))).reshape(count, 4)
    return _tensor(qtype, np.concatenate([halves, rest], axis=1).reshape(rows, -1), COLUMNS)


def _paths() -> list[int]:
    return [cpu_ops.ISAS.index(path) for path in cpu_ops.available_isas()]


def _int_sums(x: torch.Tensor, packed: PackedWeight, path: int) -> torch.Tensor:
    return torch.ops.spectoolkit.int_sums(x, packed.data, packed.scales, packed.zeros, packed.out_features,
                                          packed.group, path, format_id(packed))  # fmt: skip


@pytest.mark.parametrize("qtype", KINDS, ids=lambda t: t.name)
def test_the_records_take_the_files_bytes_and_hold_its_weights(qtype: Type) -> None:
    tensor = _kind(qtype)
    packed = gguf_codes.to_compact(tensor)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    padded = -(-ROWS // 16) * 16
    assert packed.nbytes() == padded * COLUMNS // block * size  # the file's bytes per row, every row
    assert (packed.fmt, packed.kind, packed.activations) == (qtype.name, qtype.name, "int8")
    assert torch.equal(dequantized(packed).float(), gguf_codes.dequantized_fp32(tensor))
    assert gguf_codes.dequantized_fp32(tensor).abs().sum() > 0


@pytest.mark.parametrize("qtype", WIDE, ids=lambda t: t.name)
def test_the_records_widen_to_exactly_the_wide_layout_of_before(qtype: Type) -> None:
    tensor = _kind(qtype, seed=1)
    rows = torch.randperm(ROWS, generator=torch.Generator().manual_seed(1))[:37]
    wide = to_int8_activations(gguf_codes.to_packed(tensor, rows))
    got = widen(gguf_codes.to_compact(tensor, rows))
    for field in ("data", "scales", "zeros"):
        assert torch.equal(getattr(got, field), getattr(wide, field)), field
    assert (got.group, got.kind, got.out_features) == (wide.group, wide.kind, 37)


@pytest.mark.parametrize("qtype", KINDS, ids=lambda t: t.name)
def test_the_kernel_gives_the_wide_layouts_bits_on_every_path_at_1_to_9_rows(qtype: Type) -> None:
    tensor = _kind(qtype, seed=2)
    packed = gguf_codes.to_compact(tensor)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(9, COLUMNS, generator=generator) * torch.rand(9, 1, generator=generator) * 4
    bias = torch.randn(ROWS, generator=generator)
    if qtype in WIDE:
        expected = linear(x, to_int8_activations(gguf_codes.to_packed(tensor)), bias, isa=0)
    else:  # no layout before: the scalar path's bits, within the fp32 bound of the fp64 product
        expected = linear(x, packed, bias, isa=0)
        exact = reference_linear(x, packed, bias)
        assert ((expected.double() - exact).abs() <= 1e-4 * exact.abs().max()).all()
    for path in _paths():
        for count in (1, 2, 5, 9):
            got = linear(x[:count], packed, bias, isa=path)
            assert torch.equal(got, expected[:count]), (cpu_ops.ISAS[path], count)


@pytest.mark.parametrize("qtype", KINDS, ids=lambda t: t.name)
def test_int32_sums_equal_an_int64_reference_on_every_path(qtype: Type) -> None:
    """Extreme rows (all +127, all -127, alternating) against each sub-block's sum of (u - offset) * x in int64."""
    packed = gguf_codes.to_compact(_kind(qtype, seed=3))
    fmt = formats.FORMATS[qtype.name]
    x = torch.stack([torch.ones(COLUMNS), -torch.ones(COLUMNS), torch.tensor([1.0, -1.0]).repeat(COLUMNS // 2)])
    codes, _ = quantize_activations(x)
    weight = (formats.codes_of(packed.data, qtype.name).long() - fmt.offset).transpose(1, 2).reshape(-1, COLUMNS)
    products = codes.long()[:, None, :] * weight[None]  # [M, N, K]
    reference = products.view(3, weight.shape[0], -1, fmt.sub).sum(-1).transpose(1, 2)  # [M, K/S, N]
    for path in _paths():
        assert torch.equal(_int_sums(x, packed, path).long(), reference), cpu_ops.ISAS[path]


def _plant(packed: PackedWeight, at: int, bits: int) -> PackedWeight:
    """Record 1 of panel 0: byte ``at`` xor ``bits``."""
    data = packed.data.clone()
    data[0, 1 if data.shape[1] > 1 else 0, at] ^= bits
    return PackedWeight(data, packed.scales, packed.zeros, packed.out_features, packed.in_features, packed.group,
                        packed.fmt)  # fmt: skip


@pytest.mark.parametrize("qtype", KINDS, ids=lambda t: t.name)
def test_a_planted_wrong_code_plane_or_scale_field_fails_the_comparisons(qtype: Type) -> None:
    tensor = _kind(qtype, seed=4)
    packed = gguf_codes.to_compact(tensor)
    fmt = formats.FORMATS[qtype.name]
    x = torch.randn(3, COLUMNS, generator=torch.Generator().manual_seed(4))
    plane = fmt.header_bytes + fmt.sub_field_bytes if fmt.interleaved else fmt.header_bytes  # sub-block 0's plane
    code = plane + (fmt.plane_bytes // fmt.subs if fmt.interleaved else fmt.plane_bytes)
    plants = {"code": code + 5, "d": 1}  # a code byte; d's high byte (sign, exponent)
    if fmt.plane_bytes:
        plants["plane"] = plane + 2
    if qtype in (Type.Q4_K, Type.Q5_K):
        plants["scale bits"] = 64 + 16 * 4 * 2  # word 2 (high bits of sub-blocks 4-7), column 0
    if qtype == Type.Q6_K:
        plants["sc"] = fmt.header_bytes + 3 * (fmt.record_bytes - fmt.header_bytes) // fmt.subs  # sub-block 3: scale
    for what, at in plants.items():
        bad = _plant(packed, at, 0x11)
        assert not torch.equal(dequantized(bad).float(), gguf_codes.dequantized_fp32(tensor)), what
        assert not torch.equal(linear(x, bad), linear(x, packed)), what


def test_a_format_widens_to_float_panels_and_fuses_only_with_its_own_kind() -> None:
    """activations=float gets the wide float panels of the same weight; Q5_K (no wide kind) its fp32 weight."""
    from spectoolkit.kernels.cpu_linear import float_layout

    for qtype in (Type.Q4_K, Type.Q5_K):
        packed = gguf_codes.to_compact(_kind(qtype, seed=5))
        floating = float_layout(packed)
        assert floating.activations == "float" and not floating.fmt
        assert torch.equal(dequantized(floating).float(), dequantized(packed).float())
