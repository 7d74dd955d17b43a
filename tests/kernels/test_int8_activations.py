"""The integer-activation linear (kernels/csrc/int_body.inc, issue 47): activations quantized per row and 32-element
block to int8, exact int32 dot products with the weights' integer codes, an fp32 epilogue per sub-block in order.

DESIGN §7: integer sums are associative, so the bits may not depend on the path (scalar, AVX2, AVX-512, VNNI), the
row count, the rows batched with a row, or the thread count (test_cpu_linear.py's thread test takes these kinds
too); each test here can fail. The int32 sums are compared
with an int64 reference at the extremes, and the same comparison is shown to catch an int16-saturating layout.
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.kernels import cpu_ops
from spectoolkit.kernels.cpu_linear import (
    QBLOCK,
    PackedWeight,
    _float_layout,
    int8_activations_why,
    linear,
    pack_float,
    pack_int4_codes,
    pack_int8_codes,
    pack_nf4,
    quantize_activations,
    reference_linear,
    to_int8_activations,
)

CASES = ("int8-g16", "int8-g32", "int8-g128", "int4-g16", "int4-g32", "int4-g64", "int4-channel")


def _codes(kind: str, n: int, k: int, generator: torch.Generator, extreme: str | None = None) -> PackedWeight:
    """Random (or ``extreme``: "max"/"min") integer codes of ``kind`` [n, k] with small random scales."""
    bits, group = kind.split("-")
    size = k if group == "channel" else int(group[1:])
    scales = torch.rand(n, k // size, generator=generator) * 0.02 + 1e-3
    if bits == "int8":
        codes = torch.randint(-128, 128, (n, k), generator=generator)
        if extreme:
            codes = torch.full((n, k), 127 if extreme == "max" else -128)
        return pack_int8_codes(codes, scales, size)
    codes = torch.randint(0, 16, (n, k), generator=generator)
    if extreme:
        codes = torch.full((n, k), 15 if extreme == "max" else 0)
    zeros = torch.randn(n, k // size, generator=generator) * 0.01
    return pack_int4_codes(codes, scales, zeros, size)


def _case(kind: str, rows: int, n: int, k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    packed = to_int8_activations(_codes(kind, n, k, generator))
    x = torch.randn(rows, k, generator=generator) * torch.rand(rows, 1, generator=generator) * 4
    return x, packed, torch.randn(n, generator=generator)


def _paths() -> list[int]:
    return [cpu_ops.ISAS.index(path) for path in cpu_ops.available_isas()]


def test_activations_quantize_per_block_half_to_even_the_same_in_the_kernel_and_in_torch():
    cpu_ops.load()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4 * QBLOCK, generator=generator) * 3
    x[1, :QBLOCK] = 0  # a zero block: codes 0, scale 0
    x[2, :QBLOCK] = torch.tensor([127.0] + [2.5, 3.5, -2.5, -0.5] * 7 + [1.0, 0.0, 0.0])  # d = 1: ties
    codes, scales = torch.ops.spectoolkit.quantize_activations(x)
    ref_codes, ref_scales = quantize_activations(x)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    assert codes[2, 1:5].tolist() == [2, 4, -2, 0]  # half to even
    assert scales[1, 0] == 0 and not codes[1, :QBLOCK].any()
    assert codes.abs().max() <= 127  # never -128: the sign trick's |q| <= 128 times |x| <= 127 fits int16 pairs


@pytest.mark.parametrize("isa", _paths())
def test_every_path_quantizes_activations_to_the_scalar_paths_bits(isa):
    """The vector paths' block quantization (max |x|, one division per lane, the nearest-even instruction) gives the
    scalar rule's codes and scales: ties, zero and negative-zero blocks, tiny and huge blocks, a NaN ignored by the
    maximum as std::max ignores it."""
    cpu_ops.load()
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(8, 6 * QBLOCK, generator=generator)
    scale = x[0].abs().view(-1, QBLOCK).amax(-1) / 127
    x[0] = (
        (torch.randint(-254, 255, (6 * QBLOCK,), generator=generator).float() / 2)
        .view(-1, QBLOCK)
        .mul(scale[:, None])
        .flatten()
    )  # x / d lands on halves: every tie rule shows
    x[1] = 0
    x[2] = -0.0
    x[3] *= 1e-40  # subnormal blocks
    x[4] *= 1e30
    x[5, 3] = float("nan")
    codes, scales = torch.ops.spectoolkit.quantize_activations(x, isa)
    ref_codes, ref_scales = torch.ops.spectoolkit.quantize_activations(x, 0)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32))  # bit patterns: +0 and -0 differ
    plain = torch.cat([x[:5], x[6:]])
    assert torch.equal(codes[[0, 1, 2, 3, 4, 6, 7]], quantize_activations(plain)[0])


@pytest.mark.parametrize("kind", CASES)
def test_the_layouts_hold_the_same_weight(kind):
    packed = _codes(kind, 40, 128, torch.Generator().manual_seed(1))
    relaid = to_int8_activations(packed)
    assert relaid.activations == "int8" and relaid.data.shape[-2:] == (16, 4)
    assert torch.equal(_float_layout(relaid).data, packed.data)


def test_what_cannot_take_int8_activations_says_why():
    weight = torch.randn(32, 96)
    assert "not integer codes" in int8_activations_why(pack_float(weight))
    assert "not integer codes" in int8_activations_why(pack_nf4(torch.zeros(32, 96, dtype=torch.long),
                                                                torch.ones(32, 3), 32))  # fmt: skip
    odd = pack_int8_codes(torch.zeros(32, 48, dtype=torch.long), torch.ones(32, 1), 48)
    assert "multiple of 32" in int8_activations_why(odd)
    with pytest.raises(ValueError, match="multiple of 32"):
        to_int8_activations(odd)


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("rows", [1, 5, 17, 64])
def test_matches_the_fp64_product_of_the_quantized_rows(kind, rows):
    """The kernel multiplies exactly the quantized rows: what is left is the fp32 epilogue's rounding."""
    x, packed, bias = _case(kind, rows, 70, 256)
    got = linear(x, packed, bias).double()
    exact = reference_linear(x, packed, bias)
    assert torch.allclose(got, exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


@pytest.mark.parametrize("kind", CASES)
def test_every_path_gives_the_same_bits(kind):
    """Scalar runs everywhere; AVX2, AVX-512, AVX512-VNNI and AVX-VNNI where this CPU has them."""
    x, packed, bias = _case(kind, 13, 70, 256, seed=3)
    paths = _paths()
    outs = [linear(x, packed, bias, isa=path) for path in paths]
    assert paths[0] == 0
    for path, out in zip(paths[1:], outs[1:], strict=True):
        assert torch.equal(out, outs[0]), cpu_ops.ISAS[path]


@pytest.mark.parametrize("kind", CASES)
def test_a_row_is_the_same_bits_alone_in_any_company_and_at_1_to_64_rows(kind):
    x, packed, bias = _case(kind, 64, 50, 128, seed=4)
    together = linear(x, packed, bias)
    for rows in (1, 2, 3, 8, 9, 33, 64):
        assert torch.equal(linear(x[:rows], packed, bias), together[:rows]), rows
    companions = torch.randn(7, 128) * 100  # other rows, other scales
    for row in (0, 5, 63):
        alone = linear(x[row : row + 1], packed, bias)
        mixed = linear(torch.cat([companions[:3], x[row : row + 1], companions[3:]]), packed, bias)
        assert torch.equal(alone[0], together[row]) and torch.equal(mixed[3], together[row])


def _int64_sums(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """The sub-block sums of weight codes times activation codes in int64: [M, K/S, N]."""
    codes, _ = quantize_activations(x)
    plain = _float_layout(packed)
    if plain.kind == "int8":
        weight = plain.data.long()  # [P, K, 16]
    else:
        weight = torch.stack([plain.data & 15, plain.data >> 4], dim=2).flatten(1, 2).long() - 8
    weight = weight.transpose(1, 2).reshape(-1, packed.in_features)  # [P*16, K]
    sub = min(packed.group, QBLOCK)
    products = codes.long()[:, None, :] * weight[None]  # [M, N, K]
    return products.view(x.shape[0], weight.shape[0], -1, sub).sum(-1).transpose(1, 2)  # [M, K/S, N]


def _int_sums(x: torch.Tensor, packed: PackedWeight, path: int) -> torch.Tensor:
    return torch.ops.spectoolkit.int_sums(x, packed.data, packed.scales, packed.zeros, packed.out_features,
                                          packed.group, path)  # fmt: skip


def _extreme_rows(k: int) -> torch.Tensor:
    """Rows whose codes are all +127, all -127 and alternating: the largest products there are."""
    plus, minus = torch.ones(k), -torch.ones(k)
    alternating = torch.tensor([1.0, -1.0]).repeat(k // 2)
    return torch.stack([plus, minus, alternating])


@pytest.mark.parametrize("kind", ["int8-g16", "int8-g32", "int4-g16", "int4-g32", "int4-channel"])
@pytest.mark.parametrize("extreme", ["max", "min"])
def test_int32_sums_equal_an_int64_reference_at_the_extremes_on_every_path(kind, extreme):
    packed = to_int8_activations(_codes(kind, 32, 256, torch.Generator().manual_seed(5), extreme))
    x = _extreme_rows(256)
    reference = _int64_sums(x, packed)
    assert reference.abs().max() >= (32 if "g32" in kind or "channel" in kind else 16) * 127 * 7  # truly extreme
    for path in _paths():
        assert torch.equal(_int_sums(x, packed, path).long(), reference), cpu_ops.ISAS[path]


def _maddubs(unsigned: torch.Tensor, signed: torch.Tensor) -> torch.Tensor:
    """AVX2's vpmaddubsw on [..., 2j:2j+2] pairs: u8 x s8 products summed in pairs, saturated to int16."""
    pairs = (unsigned.long() * signed.long()).view(*unsigned.shape[:-1], -1, 2).sum(-1)
    return pairs.clamp(-32768, 32767)


def test_a_saturating_int16_step_fails_the_int64_comparison_and_ours_does_not():
    """The planted failure: int8 codes stored offset to unsigned (q + 128, the obvious layout for vpmaddubsw)
    saturate its int16 pairs at the extremes, and the int64 comparison above catches it; the kernel's layout (|q|
    unsigned, x with q's sign) stays within int16 on the same operands."""
    q = torch.full((32,), 127)
    x = torch.full((32,), 127)
    exact = (q * x).sum()
    offset = _maddubs(q + 128, x).sum() - 128 * x.sum()  # the saturating layout, corrected for its offset
    ours = _maddubs(q.abs(), torch.where(q < 0, -x, x)).sum()
    assert offset != exact  # planted: saturation changes the sum
    assert ours == exact
