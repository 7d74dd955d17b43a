"""rtn and GPTQ weights held at their own size (issue 55): spectoolkit/kernels/formats.py's rtn-int4/rtn-int8/gptq-int4
records at groups of 32, 64, 128, from cpu_linear.pack_rtn_records and gptq_codes.to_records.

Per format and group: the records take the checkpoint's own bytes (codes, scales, zeros; panels padded to 16
columns); they widen to exactly the wide layout the weight was packed as before (and to its float panels); the kernel
gives the same bits from both on every path this CPU runs, at 1 to 9 rows; its int32 sub-block sums equal an int64
reference; a planted wrong code, scale or zero breaks the comparisons (so they can fail); the loader packs them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from spectoolkit.kernels import cpu_ops, formats
from spectoolkit.kernels.cpu_linear import (
    PackedWeight,
    dequantized,
    float_layout,
    format_id,
    linear,
    pack_int4_codes,
    pack_rtn,
    pack_rtn_records,
    quantize_activations,
    to_int8_activations,
    widen,
)
from spectoolkit.kernels.rtn_format import RtnConfig, quantize_weight
from spectoolkit.quant import gptq_codes
from spectoolkit.quant.packing import pack_model
from spectoolkit.quant.rtn import RtnLinear

ROWS, COLUMNS = 40, 256  # 40 rows: the last panel padded; a multiple of 8 (GPTQ packs 8 zero points a word)
CASES = [(family, group) for family in ("rtn-int4", "rtn-int8", "gptq-int4") for group in formats.OWN_GROUPS]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _gptq_layer(group: int, seed: int) -> SimpleNamespace:
    """What gptq_codes reads of a GPTQModel layer: random codes, zero points and bf16 scales in its int32 packing."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (COLUMNS // 8, 8, ROWS), generator=generator, dtype=torch.int32)  # [K/8, 8, N]
    zeros = torch.randint(0, 16, (COLUMNS // group, ROWS // 8, 8), generator=generator, dtype=torch.int32)
    scales = (torch.rand(COLUMNS // group, ROWS, generator=generator) * 0.02 + 1e-3).to(torch.bfloat16)
    return SimpleNamespace(
        qweight=(codes << _SHIFTS[None, :, None]).sum(1, dtype=torch.int32), bits=4, group_size=group,
        qzeros=(zeros << _SHIFTS).sum(-1, dtype=torch.int32), scales=scales, out_features=ROWS, in_features=COLUMNS,
        g_idx=torch.arange(COLUMNS, dtype=torch.int32) // group,
    )  # fmt: skip


def _case(family: str, group: int, seed: int) -> tuple[PackedWeight, PackedWeight, PackedWeight, int]:
    """(records, today's wide int8-activation layout, today's float panels, the checkpoint's bytes of the weight)."""
    if family == "gptq-int4":
        layer = _gptq_layer(group, seed)
        assert gptq_codes.unpackable(layer) is None
        panels = pack_int4_codes(*gptq_codes.int4_codes(layer))
        stored = sum(t.numel() * t.element_size() for t in (layer.qweight, layer.qzeros, layer.scales))
        return gptq_codes.to_records(layer), to_int8_activations(panels), panels, stored
    weight = torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(seed))
    quantized = quantize_weight(weight, RtnConfig(int(family[-1]), group))
    panels = pack_rtn(quantized)
    fields = (quantized.qweight, quantized.scales, quantized.zeros)
    stored = sum(t.numel() * t.element_size() for t in fields if t is not None)
    return pack_rtn_records(quantized), to_int8_activations(panels), panels, stored


def _paths() -> list[int]:
    return [cpu_ops.ISAS.index(path) for path in cpu_ops.available_isas()]


@pytest.mark.parametrize(("family", "group"), CASES)
def test_the_records_take_the_checkpoints_bytes(family: str, group: int) -> None:
    packed, wide, _, stored = _case(family, group, seed=0)
    padded = -(-ROWS // 16) * 16
    assert (packed.fmt, packed.kind, packed.activations, packed.group) == (f"{family}-g{group}",) * 2 + ("int8", group)
    assert packed.nbytes() * ROWS == stored * padded  # codes + scales + zeros per row, exactly the checkpoint's
    assert packed.nbytes() < wide.nbytes()


@pytest.mark.parametrize(("family", "group"), CASES)
def test_the_records_widen_to_exactly_the_wide_layout_of_before(family: str, group: int) -> None:
    packed, wide, panels, _ = _case(family, group, seed=1)
    got, floating = widen(packed), float_layout(packed)
    for field in ("data", "scales", "zeros"):
        assert torch.equal(getattr(got, field), getattr(wide, field)), field
        assert torch.equal(getattr(floating, field), getattr(panels, field)), field
    assert (got.group, got.kind, got.fmt, floating.activations) == (wide.group, wide.kind, "", "float")
    assert torch.equal(dequantized(packed), dequantized(wide))


@pytest.mark.parametrize(("family", "group"), CASES)
def test_the_kernel_gives_the_wide_layouts_bits_on_every_path_at_1_to_9_rows(family: str, group: int) -> None:
    packed, wide, _, _ = _case(family, group, seed=2)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(9, COLUMNS, generator=generator) * torch.rand(9, 1, generator=generator) * 4
    bias = torch.randn(ROWS, generator=generator)
    expected = linear(x, wide, bias, isa=0)
    for path in _paths():
        assert torch.equal(linear(x, wide, bias, isa=path), expected), cpu_ops.ISAS[path]
        for count in (1, 2, 5, 9):
            got = linear(x[:count], packed, bias, isa=path)
            assert torch.equal(got, expected[:count]), (cpu_ops.ISAS[path], count)


@pytest.mark.parametrize(("family", "group"), CASES)
def test_int32_sums_equal_an_int64_reference_on_every_path(family: str, group: int) -> None:
    """Extreme rows (all +127, all -127, alternating) against each sub-block's sum of (u - offset) * x in int64."""
    packed, _, _, _ = _case(family, group, seed=3)
    fmt = formats.FORMATS[packed.fmt]
    x = torch.stack([torch.ones(COLUMNS), -torch.ones(COLUMNS), torch.tensor([1.0, -1.0]).repeat(COLUMNS // 2)])
    codes, _ = quantize_activations(x)
    weight = (formats.codes_of(packed.data, packed.fmt).long() - fmt.offset).transpose(1, 2).reshape(-1, COLUMNS)
    reference = (codes.long()[:, None, :] * weight[None]).view(3, weight.shape[0], -1, fmt.sub).sum(-1).transpose(1, 2)
    for path in _paths():
        sums = torch.ops.spectoolkit.int_sums(x, packed.data, packed.scales, packed.zeros, packed.out_features,
                                              packed.group, path, format_id(packed))  # fmt: skip
        assert torch.equal(sums.long(), reference), cpu_ops.ISAS[path]


@pytest.mark.parametrize(("family", "group"), CASES)
def test_a_planted_wrong_code_scale_or_zero_fails_the_comparisons(family: str, group: int) -> None:
    packed, wide, _, _ = _case(family, group, seed=4)
    fmt = formats.FORMATS[packed.fmt]
    x = torch.randn(3, COLUMNS, generator=torch.Generator().manual_seed(4))
    plants = {"code": fmt.header_bytes + 5, "scale": 1}  # a code byte; column 0's bf16 scale, high byte (exponent)
    if fmt.zero:  # column 0's bf16 zero (high byte), or GPTQ's zero points of columns 0 and 8
        plants["zero"] = 32 if fmt.zero_codes else 33
    for what, at in plants.items():
        data = packed.data.clone()
        data[0, 1, at] ^= 0x11  # record 1 of panel 0
        bad = PackedWeight(data, packed.scales, packed.zeros, ROWS, COLUMNS, packed.group, packed.fmt)
        assert not torch.equal(dequantized(bad), dequantized(wide)), what
        assert not torch.equal(linear(x, bad), linear(x, packed)), what


def test_gptq_scales_that_are_not_bf16_values_stay_wide() -> None:
    layer = _gptq_layer(64, seed=5)
    assert gptq_codes.to_records(layer) is not None
    layer.scales = layer.scales.float() * (1 + 2**-12)  # off the bf16 grid: no record holds it exactly
    assert gptq_codes.to_records(layer) is None


@pytest.mark.parametrize("group", [16, 64, -1])
def test_the_loader_packs_rtn_at_its_own_size_for_int8_activations_only(group: int) -> None:
    """Group 64: records at int8 activations, today's float panels at float ones; 16 and per channel (K = 256) have
    no format: wide either way."""
    weight = torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(6))
    for activations in ("int8", "float"):
        model = nn.Sequential(RtnLinear.from_linear(_linear(weight), RtnConfig(4, group)))
        expected = pack_rtn(model[0].quantized())
        assert set(pack_model(model, activations).values()) == {"packed, int8 activations" if activations == "int8"
                                                               else "packed"}  # fmt: skip
        own = group == 64 and activations == "int8"
        assert model[0].fmt == ("rtn-int4-g64" if own else "")
        wide = to_int8_activations(expected) if activations == "int8" else expected
        assert torch.equal(widen(model[0].packed).data, wide.data)


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data.copy_(weight)
    return layer
