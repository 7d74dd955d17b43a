"""Triton int4/int8 weight-only matmul against the plain-torch reference; packing round trip; RtnLinear on it.

Row invariance (DESIGN §7): a row's output bits do not depend on how many rows came with it, which, or
where it sits among them — checked bit for bit (``torch.equal``), rows alone against rows together, on CUDA
(under the interpreter a row's summation order within a tile is numpy's BLAS's: tests/kernels/conftest.py);
the same calls meet the reference everywhere.

Tolerance: kernel and reference both sum the exact canonical weights in fp32 (the kernel as
``scale·Σ x·code + zero·Σ x`` per group, the reference as ``Σ x·w``), so before the final rounding
they differ by fp32 reordering only: at most ~K·2^-24 of ``|x| @ |W|ᵀ`` (bounded here by
:data:`SUM_TOL`). Rounding that sum once to the output dtype can then land one ulp apart when the two
straddle a rounding boundary: :data:`ULP` relative to ``|reference|`` (bf16: 8 significant bits,
fp16: 11, fp32: no second rounding).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from spectoolkit.quant.rtn import RtnConfig, RtnLinear, dequantize_weight, quantize_weight

ULP = {torch.float32: 0.0, torch.float16: 2**-10, torch.bfloat16: 2**-7}
SUM_TOL = 2**-14  # >= K·2^-24 for K <= 1024
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GROUPS = (32, 64, 128, -1)
SHAPES = ((48, 128), (96, 256))  # (N, K): N = 48 is not a multiple of BLOCK_N = 64
# Fast grid: every (bits, group, dtype) once, M / shape / bias cycled over it so each value recurs.
FAST_GRID = [
    (bits, group, dtype, (1, 2, 5, 9)[i % 4], SHAPES[i // 4 % 2], i % 3 == 0)
    for i, (bits, group, dtype) in enumerate(itertools.product((4, 8), GROUPS, DTYPES))
]
FULL_GRID = list(itertools.product((4, 8), GROUPS, DTYPES, (1, 2, 5, 9), SHAPES, (False, True)))


@pytest.fixture(scope="module")
def qm():
    """The kernel module, imported after conftest has chosen interpreter or CUDA."""
    from spectoolkit.kernels import quant_matmul

    return quant_matmul


def _weight(rows: int, cols: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Gaussian weights with an outlier, an all-zero row and a one-sided group (as in test_rtn)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen) * 0.05
    weight[0, 3] = 1.5
    weight[1] = 0.0
    weight[2, :32] = weight[2, :32].abs() + 0.3
    return weight.to(device)


def _inputs(m: int, cols: int, dtype: torch.dtype, device: torch.device, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, cols, generator=gen).to(device=device, dtype=dtype)  # [M, K]


def _assert_close(out: torch.Tensor, x: torch.Tensor, q, bias: torch.Tensor | None, qm) -> None:
    """|out - reference| <= ULP·|reference| + SUM_TOL·(|x| @ |W|ᵀ) elementwise (module docstring)."""
    expected = qm.reference_quant_matmul(x, q, bias)
    assert out.dtype == x.dtype and out.shape == expected.shape
    magnitude = x.float().abs() @ dequantize_weight(q).abs().t()  # [M, N]
    bound = ULP[x.dtype] * expected.float().abs() + SUM_TOL * magnitude + 1e-30
    error = (out.float() - expected.float()).abs()
    assert (error <= bound).all(), f"max error {error.max().item():.3g}, worst ratio {(error / bound).max():.3g}"


def _check_case(qm, device, bits, group, dtype, m, shape, with_bias):
    rows, cols = shape
    q = quantize_weight(_weight(rows, cols, device), RtnConfig(bits, group))
    x = _inputs(m, cols, dtype, device)
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(2)).to(device) if with_bias else None
    _assert_close(qm.quant_matmul(x, qm.pack_for_kernel(q), bias), x, q, bias, qm)


@pytest.mark.parametrize(("bits", "group", "dtype", "m", "shape", "with_bias"), FAST_GRID)
def test_matches_reference(qm, device, bits, group, dtype, m, shape, with_bias):
    _check_case(qm, device, bits, group, dtype, m, shape, with_bias)


@pytest.mark.slow
@pytest.mark.parametrize(("bits", "group", "dtype", "m", "shape", "with_bias"), FULL_GRID)
def test_matches_reference_full_grid(qm, device, bits, group, dtype, m, shape, with_bias):
    _check_case(qm, device, bits, group, dtype, m, shape, with_bias)


INVARIANCE_ROWS = 17  # two M tiles: rows 0..15 and 16


def _invariance_case(qm, device, bits, group, dtype):
    """(x [17, K], packed weight, canonical weight, bias, rows one call each [17, N]) of the invariance tests."""
    rows, cols = 48, 256  # N = 48: a ragged N tile; K = 256: several K tiles per group or channel
    weight = _weight(rows, cols, device)
    # An amplifier, so that a reordered fp32 sum shows even in a bf16 output: columns 0 and `last` (the ends of
    # the first group) hold the same weights and x holds ±2^10 there, so the result's small terms are summed
    # beside a large partial sum that cancels at the end (their lost low bits depend on the order).
    last = (cols if group == -1 else group) - 1
    weight[:, last] = weight[:, 0]
    q = quantize_weight(weight, RtnConfig(bits, group))
    packed = qm.pack_for_kernel(q)
    x = _inputs(INVARIANCE_ROWS, cols, torch.float32, device)
    x[:, 0], x[:, last] = 2.0**10, -(2.0**10)
    x = x.to(dtype)  # [17, K]
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(3)).to(device) if bits == 4 else None
    alone = torch.cat([qm.quant_matmul(x[i : i + 1], packed, bias) for i in range(INVARIANCE_ROWS)])  # [17, N]
    return x, packed, q, bias, alone


INVARIANCE_CASES = [(4, 64), (4, -1), (8, 32), (8, -1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("bits", "group"), INVARIANCE_CASES)
def test_rows_alone_equal_rows_together(qm, device, gpu_tile_order, bits, group, dtype):
    """Rows 1..M one call each equal, bit for bit, the same rows in one call of M = 2, 5, 17 (every prefix for
    bf16), and in reverse order (each row in another tile position). CUDA only (conftest: the interpreter's
    tile order is numpy's BLAS); the calls' agreement with the reference is checked everywhere below."""
    x, packed, q, bias, alone = _invariance_case(qm, device, bits, group, dtype)
    widths = range(2, INVARIANCE_ROWS + 1) if dtype == torch.bfloat16 else (2, 5, INVARIANCE_ROWS)
    for m in widths:
        together = qm.quant_matmul(x[:m], packed, bias)
        mismatched = (together != alone[:m]).any(dim=1).nonzero().flatten().tolist()
        assert not mismatched, f"M={m}: rows {mismatched} differ from the same rows alone"
    assert torch.equal(qm.quant_matmul(x.flip(0), packed, bias), alone.flip(0)), "reversed rows differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("bits", "group"), INVARIANCE_CASES)
def test_rows_alone_and_together_meet_the_reference(qm, device, bits, group, dtype):
    """The invariance test's calls — rows alone, prefixes of 2, 5 and 17 rows, the rows reversed — each within the
    reference's bound (module docstring), on the interpreter too, where their bits are numpy's BLAS's."""
    x, packed, q, bias, alone = _invariance_case(qm, device, bits, group, dtype)
    _assert_close(alone, x, q, bias, qm)
    for m in (2, 5, INVARIANCE_ROWS):
        _assert_close(qm.quant_matmul(x[:m], packed, bias), x[:m], q, bias, qm)
    _assert_close(qm.quant_matmul(x.flip(0), packed, bias), x.flip(0), q, bias, qm)


@pytest.mark.parametrize(("bits", "cols"), [(4, 100), (4, 200), (8, 100)])
def test_per_channel_with_a_ragged_k_tail(qm, device, bits, cols):
    """Per channel, K need not be a multiple of BLOCK_K (nor of 8 for int4: the last word is padded)."""
    _check_case(qm, device, bits, -1, torch.float32, 2, (48, cols), True)
    _check_case(qm, device, bits, -1, torch.bfloat16, 1, (48, cols), False)


@pytest.mark.parametrize(("bits", "group", "cols"), [(4, 32, 128), (4, -1, 100), (4, -1, 6), (8, 64, 256), (8, -1, 5)])
def test_pack_round_trip_is_exact(qm, bits, group, cols):
    q = quantize_weight(_weight(40, cols, torch.device("cpu")), RtnConfig(bits, group))
    packed = qm.pack_for_kernel(q)
    back = qm.unpack_from_kernel(packed)
    assert packed.shape == q.shape
    assert torch.equal(back.qweight, q.qweight) and torch.equal(back.scales, q.scales)
    assert back.zeros is None if bits == 8 else torch.equal(back.zeros, q.zeros)
    assert (back.group_size, back.bits) == (q.group_size, q.bits)
    assert packed.nbytes <= q.qweight.numel() + 4 * q.shape[0] + 2 * (q.scales.numel() + q.scales.numel())


def test_int4_word_layout(qm):
    """Word (r, n) holds column 8r + s of row n in bits 4s..4s+3."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(3, 1)  # [N=3, K=16]: column k has code k
    from spectoolkit.quant.rtn import QuantizedWeight, pack_int4

    scales = torch.ones(3, 1, dtype=torch.bfloat16)
    packed = qm.pack_for_kernel(QuantizedWeight(pack_int4(codes), scales, scales, 16, 4))
    assert packed.qweight.shape == (2, 3) and packed.qweight.dtype == torch.int32
    assert packed.qweight[0, 0].item() == 0x76543210
    assert packed.qweight[1, 0].item() == 0xFEDCBA98 - 2**32


def test_leading_batch_dims(qm, device):
    q = quantize_weight(_weight(48, 128, device), RtnConfig(4, 32))
    x = _inputs(6, 128, torch.float16, device).view(2, 3, 128)
    out = qm.quant_matmul(x, qm.pack_for_kernel(q))
    assert out.shape == (2, 3, 48)
    _assert_close(out.view(6, 48), x.view(6, 128), q, None, qm)


def test_wrapper_rejects_bad_input(qm, device):
    q = quantize_weight(_weight(48, 128, device), RtnConfig(4, 64))
    packed = qm.pack_for_kernel(q)
    x = _inputs(2, 128, torch.bfloat16, device)
    with pytest.raises(ValueError, match="K=128"):
        qm.quant_matmul(_inputs(2, 64, torch.bfloat16, device), packed)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        qm.quant_matmul(x.double(), packed)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        qm.quant_matmul(x.to(torch.int32), packed)
    with pytest.raises(ValueError, match="bias"):
        qm.quant_matmul(x, packed, torch.zeros(47, device=device))
    with pytest.raises(ValueError, match="one device"):
        qm.quant_matmul(x, packed, torch.zeros(48, device="meta"))
    with pytest.raises(ValueError, match="scales"):
        qm.quant_matmul(x, qm.PackedWeight(packed.qweight, packed.scales.t(), packed.zeros, 64, 4, 128))
    with pytest.raises(ValueError, match="needs zeros"):
        qm.quant_matmul(x, qm.PackedWeight(packed.qweight, packed.scales, None, 64, 4, 128))
    with pytest.raises(ValueError, match="qweight"):
        qm.quant_matmul(x, qm.PackedWeight(packed.qweight.to(torch.int8), packed.scales, packed.zeros, 64, 4, 128))
    odd_group = quantize_weight(_weight(48, 96, device), RtnConfig(4, 48))
    assert qm.unsupported_reason(odd_group) is not None
    with pytest.raises(ValueError, match="group_size"):
        qm.pack_for_kernel(odd_group)


def test_rtn_linear_triton_variant_matches_reference_forward(qm, device):
    """The CUDA RtnLinear subclass, built directly (on the CPU it runs under the interpreter)."""
    from spectoolkit.quant.rtn import _TritonCuda

    for bits, group in ((4, 64), (8, -1)):
        q = quantize_weight(_weight(96, 128, device), RtnConfig(bits, group))
        layer = _TritonCuda.build(q, torch.randn(96).to(device))
        assert isinstance(layer, RtnLinear)
        back = layer.quantized()
        assert torch.equal(back.qweight, q.qweight) and torch.equal(back.scales, q.scales)
        for dtype in DTYPES:
            x = _inputs(10, 128, dtype, device).view(2, 5, 128)
            out = layer(x)
            assert out.shape == (2, 5, 96) and out.dtype == dtype
            expected = layer.reference_forward(x.float()).to(dtype)  # the reference in fp32, rounded once
            magnitude = x.float().abs() @ layer.dequantized_weight().abs().t() + layer.bias.abs()
            bound = ULP[dtype] * expected.float().abs() + SUM_TOL * magnitude
            assert ((out.float() - expected.float()).abs() <= bound).all()
        x = _inputs(3, 128, torch.float64, device)  # no kernel for fp64: the reference
        torch.testing.assert_close(layer(x), layer.reference_forward(x), rtol=0, atol=0)
    assert _TritonCuda.build(quantize_weight(_weight(48, 96, device), RtnConfig(8, 48)), None) is None


@pytest.mark.parametrize(("group", "cols"), [(32, 4096), (64, 4096), (128, 4096), (256, 4096), (-1, 14336), (-1, 5)])
def test_tiles_are_fixed_by_the_weight(qm, group, cols):
    """One tiling per weight, whatever M: BLOCK_K divides g (a tile never crosses a group); autotuning may only
    change num_stages (no config carries a tile size, all share num_warps)."""
    group_size = cols if group == -1 else group
    tiles = qm.tile_config(group_size, cols)
    assert tiles == {"BLOCK_M": qm.BLOCK_M, "BLOCK_N": qm.BLOCK_N, "BLOCK_K": qm.block_k(group_size, cols)}
    assert group == -1 or group_size % tiles["BLOCK_K"] == 0
    assert tiles["BLOCK_K"] == (min(group_size, 128) if group != -1 else 128)
    assert len(qm.AUTOTUNE_CONFIGS) > 1
    for config in qm.AUTOTUNE_CONFIGS:
        assert config.kwargs == {} and config.num_warps == qm.NUM_WARPS


def test_autotuned_launch_runs_the_same_tiles(qm, device, monkeypatch):
    """The CUDA launch (autotuned over num_stages; here its timing stubbed, under the interpreter) passes the
    same tiles and gives the same bits as the one launch the interpreter path makes."""
    import triton

    keys = qm._autotuned_kernel.keys
    tuned = triton.autotune(qm.AUTOTUNE_CONFIGS, key=keys, do_bench=lambda fn, quantiles=None: fn() or 1.0)
    q = quantize_weight(_weight(48, 256, device), RtnConfig(4, 64))
    packed, x = qm.pack_for_kernel(q), _inputs(5, 256, torch.float32, device)
    expected = qm.quant_matmul(x, packed)
    monkeypatch.setattr(qm, "_autotuned_kernel", tuned(qm._quant_matmul_kernel))
    monkeypatch.setattr(qm, "interpreting", lambda: False)
    assert torch.equal(qm.quant_matmul(x, packed), expected)
    assert qm._autotuned_kernel.best_config.num_warps == qm.NUM_WARPS


def test_prefill_sized_calls(qm, device):
    """Seventy rows: five M tiles of the one tiling."""
    _check_case(qm, device, 4, 64, torch.float16, 70, (48, 128), True)
    _check_case(qm, device, 8, -1, torch.bfloat16, 70, (48, 128), False)


def test_bench_cases_time_the_kernel_and_the_torch_path(qm, device, monkeypatch):
    """At toy shapes (the Llama ones are for the GPU): both callables agree, bytes count what is streamed."""
    monkeypatch.setattr(qm, "LLAMA_8B_SHAPES", ((48, 128, "toy"),))
    cases = qm.bench_cases(device)
    assert len(cases) == 4  # int4 g128 / int8 per channel × M = 1, 5
    for case in cases:
        fast, slow = case.run_triton(), case.run_torch()
        assert fast.shape == slow.shape and fast.dtype == slow.dtype == torch.bfloat16
        torch.testing.assert_close(fast.float(), slow.float(), rtol=2**-6, atol=2**-6)
    m = 5
    int4_bytes = 48 * 128 // 2 + 2 * 2 * 48 + 2 * m * 128 + 2 * m * 48  # codes, scales+zeros (G=1), x, y
    assert cases[1].bytes_moved == int4_bytes
    assert cases[3].bytes_moved == 48 * 128 + 2 * 48 + 2 * m * 128 + 2 * m * 48
