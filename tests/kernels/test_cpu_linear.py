"""Our CPU linear (kernels/csrc, kernels/cpu_linear.py) against an fp64 reference, and its bits held fixed.

DESIGN §7: every output element is one fixed chain of fused multiply-adds, so the bits may not depend on
the row count, the rows batched with it, the thread count or the instruction-set path. Each test here
can fail: a tile that mixed rows, a thread split of the reduction, or a path that rounds once more
than another changes bits.
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.kernels import cpu_ops
from spectoolkit.kernels.cpu_linear import (
    NF4,
    PackedLinear,
    linear,
    pack_float,
    pack_nf4,
    pack_rtn,
    reference_linear,
    to_int8_activations,
)
from spectoolkit.kernels.rtn_format import RtnConfig, quantize_weight

UNIT = 2.0**-24  # fp32 unit roundoff
KINDS = ("fp32", "bf16", "int8-g32", "int8-channel", "int4-g32", "int4-g64", "int4-g128", "nf4-g64")
A8_KINDS = ("int8-g32+a8", "int4-g32+a8")  # integer activations (test_int8_activations.py holds their own tests)


def nf4_quantized(weight: torch.Tensor, group: int):
    """weight [N, K] -> (codes [N, K], absmax [N, K / group]): each value's nearest NF4 level times its absmax."""
    groups = weight.reshape(weight.shape[0], -1, group)  # [N, G, g]
    absmax = groups.abs().amax(-1)  # [N, G]
    codes = ((groups / absmax[..., None])[..., None] - NF4).abs().argmin(-1)  # [N, G, g]
    return codes.reshape(weight.shape), absmax


def _packed(kind: str, weight: torch.Tensor):
    if kind.endswith("+a8"):
        return to_int8_activations(_packed(kind.removesuffix("+a8"), weight))
    if kind in ("fp32", "bf16"):
        return pack_float(weight if kind == "fp32" else weight.bfloat16())
    if kind == "nf4-g64":
        return pack_nf4(*nf4_quantized(weight, 64), 64)
    bits, group = kind.split("-")
    size = weight.shape[1] if group == "channel" else int(group[1:])
    return pack_rtn(quantize_weight(weight, RtnConfig(int(bits[3:]), size)))


def _case(kind: str, rows: int, out_features: int, in_features: int, seed: int = 0, bias: bool = True):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    return x, _packed(kind, weight), b


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1, 128), (37, 128), (130, 256), (64, 640)])
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64])
def test_matches_the_fp64_reference_within_the_rounding_of_its_chains(kind, shape, rows):
    """|ours - exact| <= (K + 2G + 3) u · Σ|x||w|: the error bound of fp32 fma chains over the dequantized weight."""
    x, packed, bias = _case(kind, rows, *shape)
    got = linear(x, packed, bias).double()
    exact = reference_linear(x, packed, bias)
    magnitude = x.abs().double() @ _magnitudes(packed).t() + bias.abs().double()
    groups = packed.in_features // packed.group
    bound = (packed.in_features + 2 * groups + 3) * UNIT * magnitude
    assert got.shape == (rows, shape[0])
    assert torch.all((got - exact).abs() <= bound), (got - exact).abs().max()


def _magnitudes(packed) -> torch.Tensor:
    """[N, K] fp64: |w| of each term the kernel sums (int4: |u - 8|·s + |zero|, the two sums it adds per group)."""
    data = packed.data
    if packed.kind in ("int4", "nf4"):
        codes = torch.stack([data & 15, data >> 4], dim=2).flatten(1, 2)  # [P, K, 16]
        codes = codes.double() - 8 if packed.kind == "int4" else NF4.double()[codes.long()]
    else:
        codes = data.double()
    codes = codes.abs()
    if packed.kind in ("int8", "int4", "nf4"):
        codes = codes * packed.scales.double().abs().repeat_interleave(packed.group, dim=1)
        if packed.kind == "int4":
            codes = codes + packed.zeros.double().abs().repeat_interleave(packed.group, dim=1)
    return codes.transpose(1, 2).reshape(-1, packed.in_features)[: packed.out_features]


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_gets_the_same_bits_alone_and_with_any_rows_before_it(kind):
    """Rows 1..64: each row alone, and every prefix of the 64 rows in one call, equal the 64-row call bit for bit."""
    x, packed, bias = _case(kind, 64, 100, 256, seed=1)
    together = linear(x, packed, bias)
    for row in range(64):
        assert torch.equal(linear(x[row : row + 1], packed, bias), together[row : row + 1]), row
    for count in range(1, 65):
        assert torch.equal(linear(x[:count], packed, bias), together[:count]), count


@pytest.mark.parametrize("kind", KINDS + A8_KINDS)
def test_the_same_bits_on_one_and_two_threads(kind):
    x, packed, bias = _case(kind, 9, 300, 256, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x, packed, bias)
        torch.set_num_threads(2)
        two = linear(x, packed, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("kind", KINDS)
def test_every_instruction_set_path_gives_the_same_bits(kind):
    """The scalar std::fma path runs on every CPU; AVX2 and AVX-512 where this CPU has them."""
    x, packed, bias = _case(kind, 11, 70, 256, seed=3)
    paths = cpu_ops.available_isas()
    outs = [linear(x, packed, bias, isa=cpu_ops.ISAS.index(path)) for path in paths]
    assert paths[0] == "scalar"
    for path, out in zip(paths[1:], outs[1:], strict=True):
        assert torch.equal(out, outs[0]), path


def test_a_path_this_cpu_lacks_is_refused_and_pinning_an_unknown_path_is_a_clear_error(monkeypatch):
    x, packed, _ = _case("fp32", 1, 16, 16)
    for path in set(cpu_ops.ISAS) - set(cpu_ops.available_isas()):
        with pytest.raises(RuntimeError, match="cannot run path"):
            linear(x, packed, isa=cpu_ops.ISAS.index(path))
    monkeypatch.setenv("SPECTOOLKIT_ISA", "avx1024")
    with pytest.raises(Exception, match="SPECTOOLKIT_ISA=avx1024"):
        cpu_ops.best_isa()
    monkeypatch.setenv("SPECTOOLKIT_ISA", "scalar")
    assert cpu_ops.best_isa() == 0 and cpu_ops.isa_name() == "scalar"
    assert set(cpu_ops.kernel_paths().values()) == {"scalar"}
    for vnni, base in cpu_ops.VNNI_BASE.items():  # a VNNI path runs its base path's float kernels
        if vnni in cpu_ops.available_isas():
            monkeypatch.setenv("SPECTOOLKIT_ISA", vnni)
            assert cpu_ops.kernel_paths() == {"int8-activation linear": vnni, "float linear, attention, norms": base}


def test_packed_linear_replaces_a_linear_in_its_dtype():
    layer = torch.nn.Linear(48, 20).bfloat16()
    packed = PackedLinear(pack_float(layer.weight), layer.bias, "bf16")
    x = torch.randn(2, 3, 48).bfloat16()
    out = packed(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 20)
    exact = x.double() @ layer.weight.double().t() + layer.bias.double()
    assert torch.allclose(out.double(), exact, atol=0.05, rtol=0.02)
