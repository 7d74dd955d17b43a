"""The row-invariant CPU kernels (row_linear, row_attention): close to plain torch, and a row's bits
depend only on that row, never on how many other rows share the call, their values, or the thread split."""

from __future__ import annotations

import math

import pytest
import torch

from spectoolkit.models.row_linear import (
    load_row_linear,
    reference_row_attention,
    reference_row_linear,
    row_attention,
    row_linear,
)

# Tolerances against the fp64 reference (row_linear) and fp32 SDPA (row_attention), relative to the
# magnitude of the sum: the kernel accumulates in fp32 (a K-term sum: ~sqrt(K)·2^-24 typical). bf16
# weights/caches are widened exactly, so the reference on the same bf16 values cast up is the truth
# and the tolerance is the fp32 one.
WEIGHT_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-5}  # |out - ref| / (|x|·|w|ᵀ + |b|)
ATTENTION_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-5}  # atol = rtol; outputs are O(1)
BF16_OUTPUT_TOLERANCE = 1e-2  # bf16 activations: the result is rounded to bf16 (8 bits of mantissa)

ROWS = (1, 2, 3, 4, 5, 7, 9)  # below, at and across the kernel's 4-row groups
INNER = (16, 40, 64, 576)  # 40: a 32-block, no 16-block remainder but an 8-element tail; 576: many blocks
OUTER = (1, 17, 64)  # 17: a thread chunk of 16 plus one
HEADS = ((4, 2), (9, 3))  # (query heads, KV heads): GQA groups of 2 and 3
HEAD_DIMS = (64, 40)
CAPACITY = 24


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    load_row_linear()  # builds once per machine (~1 min), cached afterwards


@pytest.fixture
def two_threads():
    """Restores the intra-op thread count a test changes."""
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def _linear_inputs(m: int, k: int, n: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


def _attention_inputs(w: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(w, hq, d, generator=gen)
    keys = torch.randn(hkv, CAPACITY, d, generator=gen).to(dtype)
    values = torch.randn(hkv, CAPACITY, d, generator=gen).to(dtype)
    return q, keys, values


def _positions(w: int, seed: int = 0) -> torch.Tensor:
    """[w] positions: the first and last slot among them (w >= 2), the rest random, not in order."""
    gen = torch.Generator().manual_seed(seed + 100)
    rest = torch.randint(0, CAPACITY, (w,), generator=gen).tolist()
    chosen = ([0, CAPACITY - 1] + rest)[:w] if w >= 2 else rest
    return torch.tensor(chosen[::-1])  # out of order: the kernel must not assume consecutive rows


# ---- row_linear ---------------------------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", OUTER)
@pytest.mark.parametrize("k", INNER)
def test_row_linear_matches_the_reference(k, n, dtype, with_bias):
    for m in ROWS:
        x, w, b = _linear_inputs(m, k, n, dtype, with_bias, seed=m)
        out = row_linear(x, w, b)
        ref = x.double() @ w.double().t() + (b.double() if b is not None else 0)  # bf16 widens exactly
        scale = x.double().abs() @ w.double().abs().t() + (b.double().abs() if b is not None else 0)
        assert out.shape == (m, n) and out.dtype == torch.float32
        error = ((out.double() - ref).abs() / scale).max().item()
        assert error <= WEIGHT_TOLERANCE[dtype], f"M={m} K={k} N={n}: relative error {error:.2e}"
        torch.testing.assert_close(out, reference_row_linear(x, w, b), rtol=1e-4, atol=1e-4 * math.sqrt(k))


def test_row_linear_takes_leading_dims_and_non_contiguous_inputs():
    x, w, b = _linear_inputs(6, 64, 17, torch.float32, True)
    batched = x.reshape(2, 3, 64)
    out = row_linear(batched, w, b)
    assert out.shape == (2, 3, 17)
    assert torch.equal(out.reshape(6, 17), row_linear(x, w, b))
    wide = torch.randn(6, 128)
    strided = wide[:, ::2]  # [6, 64], stride 2
    assert torch.equal(row_linear(strided, w, b), row_linear(strided.contiguous(), w, b))
    assert torch.equal(row_linear(x, w.t().contiguous().t(), b), row_linear(x, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", INNER)
def test_row_linear_rows_are_invariant_to_the_other_rows(k, dtype):
    n = 64
    for m in ROWS:
        x, w, b = _linear_inputs(m, k, n, dtype, True, seed=m)
        together = row_linear(x, w, b)
        others = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 1))
        for row in range(m):
            alone = row_linear(x[row : row + 1], w, b)
            assert torch.equal(together[row : row + 1], alone), f"M={m} K={k}: row {row} differs from itself alone"
            mixed = others.clone()
            mixed[row] = x[row]
            assert torch.equal(row_linear(mixed, w, b)[row], together[row]), f"M={m} K={k}: row {row}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_linear_is_invariant_to_the_thread_count(dtype, two_threads):
    x, w, b = _linear_inputs(9, 576, 200, dtype, True)  # N=200: many 16-column chunks to split
    torch.set_num_threads(1)
    one = [row_linear(x[:m], w, b) for m in ROWS]
    torch.set_num_threads(2)
    two = [row_linear(x[:m], w, b) for m in ROWS]
    for m, a, c in zip(ROWS, one, two, strict=True):
        assert torch.equal(a, c), f"M={m}: 1 vs 2 threads"
        assert torch.equal(a, one[-1][:m])  # and a prefix of rows is the prefix of the 9-row call


def test_row_linear_output_dtype_is_the_input_dtype():
    x, w, b = _linear_inputs(3, 64, 17, torch.bfloat16, True)
    for activations in (torch.float32, torch.bfloat16, torch.float16):
        out = row_linear(x.to(activations), w, b)
        assert out.dtype == activations
        torch.testing.assert_close(
            out.float(),
            reference_row_linear(x.to(activations).float(), w, b),
            rtol=BF16_OUTPUT_TOLERANCE if activations != torch.float32 else 1e-4,
            atol=BF16_OUTPUT_TOLERANCE * 8 if activations != torch.float32 else 1e-3,
        )
    assert reference_row_linear(x.bfloat16(), w, b).dtype == torch.bfloat16


def test_row_linear_rejects_mismatched_shapes_and_dtypes():
    x, w, b = _linear_inputs(2, 64, 8, torch.float32, True)
    with pytest.raises(RuntimeError, match="row_linear"):
        torch.ops.spectoolkit.row_linear(x[:, :40], w, b)  # K mismatch
    with pytest.raises(RuntimeError, match="fp32 activations"):
        torch.ops.spectoolkit.row_linear(x.double(), w, b)
    with pytest.raises(RuntimeError, match="fp32 or bf16 weights"):
        torch.ops.spectoolkit.row_linear(x, w.half(), b)


def test_the_ops_pass_torch_library_checks():
    x, w, b = _linear_inputs(3, 40, 17, torch.bfloat16, True)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.spectoolkit.row_linear.default, (x, w, b), test_utils=checks)
    torch.library.opcheck(torch.ops.spectoolkit.row_linear.default, (x, w.float(), None), test_utils=checks)
    q, keys, values = _attention_inputs(3, 4, 2, 40, torch.bfloat16)
    args = (q, keys, values, _positions(3), 0.125)
    torch.library.opcheck(torch.ops.spectoolkit.row_attention.default, args, test_utils=checks)


# ---- row_attention ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_row_attention_matches_the_reference(heads, d, dtype):
    hq, hkv = heads
    tolerance = ATTENTION_TOLERANCE[dtype]
    for w in range(1, 7):
        q, keys, values = _attention_inputs(w, hq, hkv, d, dtype, seed=w)
        for positions in (_positions(w, seed=w), torch.zeros(w, dtype=torch.long), torch.full((w,), CAPACITY - 1)):
            for scale in (1 / math.sqrt(d), 0.3):
                out = row_attention(q, keys, values, positions, scale)
                ref = reference_row_attention(q, keys, values, positions, scale)
                assert out.shape == (w, hq, d) and out.dtype == torch.float32
                torch.testing.assert_close(out, ref, rtol=tolerance, atol=tolerance)


def test_row_attention_at_position_zero_returns_the_first_value():
    """One slot attended: softmax weight 1, the output is that slot's value (per KV group)."""
    q, keys, values = _attention_inputs(2, 9, 3, 40, torch.bfloat16)
    out = row_attention(q, keys, values, torch.tensor([0, 0]), 0.2)
    expected = values[:, 0].float().repeat_interleave(3, 0)  # [Hq, D]
    assert torch.equal(out[0], expected) and torch.equal(out[1], expected)


def test_row_attention_never_reads_slots_past_a_row_position():
    q, keys, values = _attention_inputs(4, 4, 2, 64, torch.float32)
    positions = torch.tensor([3, 7, 0, 12])
    before = row_attention(q, keys, values, positions, 0.125)
    keys[:, 13:] = float("nan")  # past every position: never read
    values[:, 13:] = float("nan")
    assert torch.equal(row_attention(q, keys, values, positions, 0.125), before)
    keys[:, 8:] = 1e4  # past rows 0..2 only: row 3 changes, the others do not
    after = row_attention(q, keys, values, positions, 0.125)
    assert torch.equal(after[:3], before[:3]) and not torch.equal(after[3], before[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_row_attention_rows_are_invariant_to_the_other_rows(heads, d, dtype):
    hq, hkv = heads
    for w in range(1, 7):
        q, keys, values = _attention_inputs(w, hq, hkv, d, dtype, seed=w)
        positions = _positions(w, seed=w)
        together = row_attention(q, keys, values, positions, 0.125)
        other_q = torch.randn(w, hq, d, generator=torch.Generator().manual_seed(w + 7))
        other_positions = torch.randint(0, CAPACITY, (w,), generator=torch.Generator().manual_seed(w + 8))
        for row in range(w):
            alone = row_attention(q[row : row + 1], keys, values, positions[row : row + 1], 0.125)
            assert torch.equal(alone[0], together[row]), f"W={w}: row {row} differs from itself alone"
            mixed_q, mixed_positions = other_q.clone(), other_positions.clone()
            mixed_q[row], mixed_positions[row] = q[row], positions[row]
            mixed = row_attention(mixed_q, keys, values, mixed_positions, 0.125)
            assert torch.equal(mixed[row], together[row]), f"W={w}: row {row} changed with the other rows"


def test_row_attention_is_invariant_to_the_thread_count(two_threads):
    q, keys, values = _attention_inputs(6, 9, 3, 40, torch.bfloat16)
    positions = _positions(6)
    torch.set_num_threads(1)
    one = row_attention(q, keys, values, positions, 0.125)
    singles = [row_attention(q[i : i + 1], keys, values, positions[i : i + 1], 0.125) for i in range(6)]
    torch.set_num_threads(2)
    two = row_attention(q, keys, values, positions, 0.125)
    assert torch.equal(one, two)
    assert torch.equal(torch.cat(singles), two)


def test_row_attention_rejects_a_position_past_the_cache():
    q, keys, values = _attention_inputs(3, 4, 2, 64, torch.float32)
    row_attention(q, keys, values, torch.tensor([0, 5, CAPACITY - 1]), 0.125)  # the last slot is fine
    with pytest.raises(RuntimeError, match="position outside the cache"):
        row_attention(q, keys, values, torch.tensor([0, CAPACITY, 1]), 0.125)
    with pytest.raises(RuntimeError, match="position outside the cache"):
        row_attention(q[:1], keys, values, torch.tensor([CAPACITY + 10]), 0.125)
    with pytest.raises(RuntimeError, match="position outside the cache"):
        row_attention(q[:1], keys, values, torch.tensor([-1]), 0.125)


def test_row_attention_rejects_mismatched_caches():
    q, keys, values = _attention_inputs(2, 4, 2, 64, torch.float32)
    positions = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="row_attention"):
        row_attention(q, keys, values.bfloat16(), positions, 0.125)  # k/v dtypes differ
    with pytest.raises(RuntimeError, match="row_attention"):
        row_attention(q[..., :40], keys, values, positions, 0.125)  # head dim differs
    with pytest.raises(RuntimeError, match="row_attention"):
        row_attention(q, keys, values, torch.tensor([0, 1, 2]), 0.125)  # one position per row
    with pytest.raises(RuntimeError, match="contiguous"):
        row_attention(q, keys.transpose(0, 1).contiguous().transpose(0, 1), values, positions, 0.125)


def test_row_attention_output_dtype_is_the_query_dtype():
    q, keys, values = _attention_inputs(3, 4, 2, 64, torch.bfloat16)
    positions = _positions(3)
    out = row_attention(q.bfloat16(), keys, values, positions, 0.125)
    assert out.dtype == torch.bfloat16
    ref = reference_row_attention(q.bfloat16(), keys, values, positions, 0.125)
    assert ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=BF16_OUTPUT_TOLERANCE, atol=BF16_OUTPUT_TOLERANCE)


# ---- inside torch.compile -----------------------------------------------------------------------


def test_the_ops_compile_into_one_graph_with_eager_bits():
    """fullgraph=True: the custom ops trace through their fake kernels and run as extern kernels; the
    surrounding ops are exact (reshape, relu, a power-of-two scale), so compiled and eager agree bit for bit."""

    def block(x, w, b, q, keys, values, positions):
        y = row_linear(x, w, b).relu() * 2.0  # [M, N]
        a = row_attention(q, keys, values, positions, 0.125)  # [W, Hq, D]
        return y, a.reshape(a.shape[0], -1) * 0.5

    x, w, b = _linear_inputs(5, 40, 17, torch.bfloat16, True)
    q, keys, values = _attention_inputs(5, 9, 3, 40, torch.bfloat16)
    args = (x, w, b, q, keys, values, _positions(5))
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    got = compiled(*args)
    want = block(*args)
    assert all(torch.equal(g, e) for g, e in zip(got, want, strict=True))
    assert got[0].shape == (5, 17) and got[1].shape == (5, 9 * 40)


# ---- the portable (non-AVX-512) kernel ----------------------------------------------------------


@pytest.mark.slow
def test_the_portable_fallback_is_close_and_row_invariant_too(two_threads):
    """Machines without AVX-512 build the portable branch (-march=native picks it): built here as its
    own op namespace with -mno-avx512f (~1 min the first time, cached afterwards)."""
    from torch.utils.cpp_extension import load_inline

    from spectoolkit.models import row_linear as module

    source = module._SOURCE.replace("TORCH_LIBRARY(spectoolkit,", "TORCH_LIBRARY(spectoolkit_portable,")
    source = source.replace("TORCH_LIBRARY_IMPL(spectoolkit,", "TORCH_LIBRARY_IMPL(spectoolkit_portable,")
    assert source.count("spectoolkit_portable") == 2
    flags = ["-O3", "-march=native", "-mno-avx512f", "-ffp-contract=fast", "-fopenmp"]
    load_inline(name="spectoolkit_row_linear_portable", cpp_sources=[source], extra_cflags=flags,
                extra_ldflags=["-fopenmp"], is_python_module=False)  # fmt: skip
    ops = torch.ops.spectoolkit_portable
    for dtype in (torch.float32, torch.bfloat16):
        for k in INNER:
            x, w, b = _linear_inputs(9, k, 64, dtype, True, seed=k)
            out = ops.row_linear(x, w, b)
            scale = x.double().abs() @ w.double().abs().t() + b.double().abs()
            error = ((out.double() - (x.double() @ w.double().t() + b.double())).abs() / scale).max().item()
            assert error <= WEIGHT_TOLERANCE[dtype], f"K={k}: relative error {error:.2e}"
            for m in ROWS:
                torch.set_num_threads(1 + m % 2)
                assert torch.equal(ops.row_linear(x[:m], w, b), out[:m]), f"K={k}: the first {m} rows"
                assert torch.equal(ops.row_linear(x[m - 1 : m], w, b)[0], out[m - 1]), f"K={k}: row {m - 1} alone"
        q, keys, values = _attention_inputs(6, 9, 3, 40, dtype)
        positions = _positions(6)
        together = ops.row_attention(q, keys, values, positions, 0.125)
        ref = reference_row_attention(q, keys, values, positions, 0.125)
        torch.testing.assert_close(together, ref, rtol=ATTENTION_TOLERANCE[dtype], atol=ATTENTION_TOLERANCE[dtype])
        for row in range(6):
            alone = ops.row_attention(q[row : row + 1], keys, values, positions[row : row + 1], 0.125)
            assert torch.equal(alone[0], together[row])
