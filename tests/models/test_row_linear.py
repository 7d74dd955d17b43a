"""The row-invariant CPU kernels (row_linear, paged_attention): close to plain torch, and a row's bits
depend only on that row, never on how many other rows share the call, their values, or the thread split."""

from __future__ import annotations

import math

import pytest
import torch

from spectoolkit.kvcache.formats import quantize_fp8, quantize_int8
from spectoolkit.models.row_linear import load_row_linear, reference_row_linear, row_linear

# Tolerances against the fp64 references, relative to the magnitude of the sum: the kernels accumulate in
# fp32 (a K-term sum: ~sqrt(K)·2^-24 typical). bf16 weights and stored KV are widened exactly (int8/fp8
# KV: codes times their fp32 scale), so the reference on the same stored values is the truth and the
# tolerance is the fp32 one.
WEIGHT_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-5}  # |out - ref| / (|x|·|w|ᵀ + |b|)
ATTENTION_TOLERANCE = 1e-5  # atol = rtol; outputs are O(1)
BF16_OUTPUT_TOLERANCE = 1e-2  # bf16 activations: the result is rounded to bf16 (8 bits of mantissa)

ROWS = (1, 2, 3, 4, 5, 7, 9)  # below, at and across the kernel's 4-row groups
INNER = (16, 40, 64, 576)  # 40: a 32-block, no 16-block remainder but an 8-element tail; 576: many blocks
OUTER = (1, 17, 64)  # 17: a thread chunk of 16 plus one
HEADS = ((4, 2), (9, 3))  # (query heads, KV heads): GQA groups of 2 and 3
HEAD_DIMS = (64, 40)
STORES = ("fp32", "bf16", "fp16", "int8", "fp8")  # the KV the compiled runner hands the kernel
FLOAT_STORES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SLOTS = 24  # slots of the pool the tests attend


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
    for kind in ("bf16", "int8"):  # with and without scales; the stores are mutated (declared in the schema)
        q, stores = _query(3, 4, 40), _stores(kind, 2, 40)
        args = (q, *_fresh(kind, 3, 2, 40), *stores, torch.tensor([5, -1, 9]), *_slot_lists(3), 0.125)
        torch.library.opcheck(torch.ops.spectoolkit.paged_attention.default, args, test_utils=checks)


# ---- paged_attention ----------------------------------------------------------------------------
# q [W, Hq, D] fp32; the pool's stores [Hkv, S, D] (+ scales [Hkv, S, 1] for int8/fp8, else empty); row i
# attends the slots key_slots[starts[i] : starts[i + 1]], after the call's new rows went to their ``write`` slots.


def _query(w: int, hq: int, d: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(w, hq, d, generator=torch.Generator().manual_seed(seed))  # [W, Hq, D]


def _encode(kind: str, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """states [..., D] -> (stored data [..., D], scale [..., 1] fp32 or an empty tensor), as the pool stores them."""
    if kind in FLOAT_STORES:
        return states.to(FLOAT_STORES[kind]), torch.empty(0)
    return (quantize_int8 if kind == "int8" else quantize_fp8)(states)


def _keys_values(kind: str, shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, ...]:
    """(keys, values, key scales, value scales) of random states of ``shape`` in ``kind``'s stored format."""
    gen = torch.Generator().manual_seed(seed)
    (keys, key_scales), (values, value_scales) = (_encode(kind, torch.randn(shape, generator=gen)) for _ in range(2))
    return keys, values, key_scales, value_scales


def _stores(kind: str, hkv: int, d: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """(k_store, v_store, k_scale_store, v_scale_store): SLOTS random slots [Hkv, SLOTS, D] (+ [Hkv, SLOTS, 1])."""
    return _keys_values(kind, (hkv, SLOTS, d), seed)


def _fresh(kind: str, w: int, hkv: int, d: int, seed: int = 2) -> tuple[torch.Tensor, ...]:
    """(k_new, v_new, k_scale_new, v_scale_new): the call's own rows [W, Hkv, D] (+ [W, Hkv, 1])."""
    return _keys_values(kind, (w, hkv, d), seed)


def _no_writes(kind: str, w: int, hkv: int, d: int) -> tuple[torch.Tensor, ...]:
    """Fresh rows and a ``write`` of -1 each: the call stores nothing."""
    return (*_fresh(kind, w, hkv, d), torch.full((w,), -1, dtype=torch.long))


def _slot_lists(w: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_slots [N], starts [W+1]): row i's own list of slots, 1 to SLOTS long, in no particular order (row 0,
    of several: every slot of the pool, the first and the last among them)."""
    gen = torch.Generator().manual_seed(seed + 100)
    lengths = torch.randint(1, SLOTS + 1, (w,), generator=gen).tolist()
    if w > 1:
        lengths[0] = SLOTS
    return _flat([torch.randperm(SLOTS, generator=gen)[:length] for length in lengths])


def _flat(lists: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([0] + [len(slots) for slots in lists])
    return torch.cat(lists).long(), lengths.cumsum(0)


def _attend(q, writes, stores, key_slots, starts, scale=0.125) -> torch.Tensor:
    """The op: writes = (k_new, v_new, k_scale_new, v_scale_new, write); stores as :func:`_stores`."""
    return torch.ops.spectoolkit.paged_attention(q, *writes[:4], *stores, writes[4], key_slots, starts, scale)


def _dequantized(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Stored rows [..., D] (and their scales [..., 1] or an empty tensor) -> fp64 states."""
    return data.double() * scale.double() if scale.numel() else data.double()


def _reference(q, stores, key_slots, starts, scale) -> torch.Tensor:
    """Plain-torch softmax attention in fp64: row i, head h over the listed slots of KV group h // (Hq/Hkv)."""
    keys, values = _dequantized(stores[0], stores[2]), _dequantized(stores[1], stores[3])  # [Hkv, S, D]
    rep = q.shape[1] // keys.shape[0]
    out = torch.empty(q.shape, dtype=torch.float64)
    for row in range(q.shape[0]):
        slots = key_slots[starts[row] : starts[row + 1]]
        for head in range(q.shape[1]):
            group = head // rep
            scores = keys[group, slots] @ q[row, head].double() * scale  # [n]
            out[row, head] = torch.softmax(scores, dim=0) @ values[group, slots]  # [D]
    return out


@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_paged_attention_matches_the_reference(heads, d, kind):
    hq, hkv = heads
    stores = _stores(kind, hkv, d)
    for w in range(1, 7):
        q = _query(w, hq, d, seed=w)
        for scale in (1 / math.sqrt(d), 0.3):
            key_slots, starts = _slot_lists(w, seed=w)
            out = _attend(q, _no_writes(kind, w, hkv, d), stores, key_slots, starts, scale)
            assert out.shape == (w, hq, d) and out.dtype == torch.float32
            ref = _reference(q, stores, key_slots, starts, scale)
            torch.testing.assert_close(out.double(), ref, rtol=ATTENTION_TOLERANCE, atol=ATTENTION_TOLERANCE)


@pytest.mark.parametrize("kind", ["bf16", "int8", "fp8"])
def test_paged_attention_of_one_slot_returns_that_value(kind):
    """One slot attended: softmax weight 1, the output is that slot's stored value (per KV group), exactly."""
    stores = _stores(kind, 3, 40)
    key_slots, starts = _flat([torch.tensor([7]), torch.tensor([0])])
    out = _attend(_query(2, 9, 40), _no_writes(kind, 2, 3, 40), stores, key_slots, starts, 0.2)
    values = stores[1].float() * stores[3] if stores[3].numel() else stores[1].float()  # [Hkv, S, D] fp32
    for row, slot in enumerate((7, 0)):
        assert torch.equal(out[row], values[:, slot].repeat_interleave(3, 0))  # [Hq, D]


def test_paged_attention_never_reads_a_slot_a_row_does_not_list():
    stores = _stores("fp32", 2, 64)
    q = _query(4, 4, 64)
    key_slots, starts = _flat([torch.tensor([3, 1]), torch.tensor([0, 2, 5]), torch.tensor([4]), torch.tensor([9, 8])])
    writes = _no_writes("fp32", 4, 2, 64)
    before = _attend(q, writes, stores, key_slots, starts)
    for store in stores[:2]:
        store[:, 10:] = float("nan")  # listed by no row: never read
    assert torch.equal(_attend(q, writes, stores, key_slots, starts), before)
    stores[0][:, 9] = 1e4  # listed by row 3 only: row 3 changes, the others do not
    after = _attend(q, writes, stores, key_slots, starts)
    assert torch.equal(after[:3], before[:3]) and not torch.equal(after[3], before[3])


@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_paged_attention_rows_are_invariant_to_the_other_rows(heads, kind):
    hq, hkv = heads
    d = 40
    stores = _stores(kind, hkv, d)
    for w in range(1, 7):
        q = _query(w, hq, d, seed=w)
        key_slots, starts = _slot_lists(w, seed=w)
        together = _attend(q, _no_writes(kind, w, hkv, d), stores, key_slots, starts)
        other_q = _query(w, hq, d, seed=w + 7)
        other_slots, other_starts = _slot_lists(w, seed=w + 8)
        for row in range(w):
            own = key_slots[starts[row] : starts[row + 1]]
            alone = _attend(q[row : row + 1], _no_writes(kind, 1, hkv, d), stores, *_flat([own]))
            assert torch.equal(alone[0], together[row]), f"W={w}: row {row} differs from itself alone"
            lists = [other_slots[other_starts[i] : other_starts[i + 1]] for i in range(w)]
            lists[row] = own
            mixed_q = other_q.clone()
            mixed_q[row] = q[row]
            mixed = _attend(mixed_q, _no_writes(kind, w, hkv, d), stores, *_flat(lists))
            assert torch.equal(mixed[row], together[row]), f"W={w}: row {row} changed with the other rows"


def test_paged_attention_is_invariant_to_the_thread_count(two_threads):
    stores = _stores("bf16", 3, 40)
    q = _query(6, 9, 40)
    key_slots, starts = _slot_lists(6)
    writes = _no_writes("bf16", 6, 3, 40)
    torch.set_num_threads(1)
    one = _attend(q, writes, stores, key_slots, starts)
    torch.set_num_threads(2)
    assert torch.equal(_attend(q, writes, stores, key_slots, starts), one)


def _snapshot(stores: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The stores' raw bits (float8 compares only as bytes)."""
    return [store.view(torch.uint8).clone() if store.numel() else store for store in stores]


@pytest.mark.parametrize("kind", STORES)
def test_writes_land_at_their_slots_before_the_rows_attend(kind):
    """Rows go to their ``write`` slots bit for bit (scales too); -1 writes nothing, no other slot changes; and a
    row that lists a slot written in the same call sees the new value (a verify row attends itself)."""
    hkv, d = 2, 64
    stores = _stores(kind, hkv, d)
    before = _snapshot(stores)
    fresh = _fresh(kind, 3, hkv, d)
    write = torch.tensor([5, -1, 17])
    key_slots, starts = _flat([torch.tensor([0, 1, 5]), torch.tensor([2]), torch.tensor([5, 17])])
    q = _query(3, 4, d)
    out = _attend(q, (*fresh, write), stores, key_slots, starts)
    after = _snapshot(stores)
    for store, new, old, now in zip(stores, fresh, before, after, strict=True):
        if not store.numel():
            continue
        new_bits = new.contiguous().view(torch.uint8)  # [W, Hkv, width bytes]
        assert torch.equal(now[:, 5], new_bits[0]) and torch.equal(now[:, 17], new_bits[2])
        untouched = [slot for slot in range(SLOTS) if slot not in (5, 17)]
        assert torch.equal(now[:, untouched], old[:, untouched])
    ref = _reference(q, stores, key_slots, starts, 0.125)  # over the stores as written by the call
    torch.testing.assert_close(out.double(), ref, rtol=ATTENTION_TOLERANCE, atol=ATTENTION_TOLERANCE)


def test_paged_attention_rejects_bad_calls():
    q, stores = _query(3, 4, 64), _stores("fp32", 2, 64)
    fresh, no_writes = _fresh("fp32", 3, 2, 64), _no_writes("fp32", 3, 2, 64)
    key_slots, starts = _flat([torch.tensor([0]), torch.tensor([SLOTS - 1]), torch.tensor([3, 4])])
    _attend(q, no_writes, stores, key_slots, starts)  # the last slot is fine
    for slots in ([0, SLOTS, 1, 2], [0, 1, 2, -1]):
        with pytest.raises(RuntimeError, match="key slot outside the pool"):
            _attend(q, no_writes, stores, torch.tensor(slots), starts)
    with pytest.raises(RuntimeError, match="write slot outside the pool"):
        _attend(q, (*fresh, torch.tensor([0, SLOTS, -1])), stores, key_slots, starts)
    with pytest.raises(RuntimeError, match="shapes"):
        _attend(q, no_writes, stores, key_slots, starts[:-1])  # one start per row, plus the end
    with pytest.raises(RuntimeError, match="shapes"):
        _attend(q[..., :40], no_writes, stores, key_slots, starts)  # head dim differs
    with pytest.raises(RuntimeError, match="fp32 q"):
        _attend(q.bfloat16(), no_writes, stores, key_slots, starts)
    with pytest.raises(RuntimeError, match="store dtype"):
        _attend(q, _no_writes("bf16", 3, 2, 64), stores, key_slots, starts)  # new rows not in the store's format
    double = tuple(store.double() for store in stores[:2]) + stores[2:]
    with pytest.raises(RuntimeError, match="KV stored as"):
        _attend(q, (*(t.double() for t in fresh[:2]), *fresh[2:], no_writes[4]), double, key_slots, starts)


# ---- inside torch.compile -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_the_ops_compile_into_one_graph_with_eager_bits(kind):
    """fullgraph=True: the custom ops trace through their fake kernels and run as extern kernels (the stores'
    mutation included); the surrounding ops are exact (reshape, relu, a power-of-two scale), so compiled and
    eager agree bit for bit, outputs and stores."""

    def block(x, w, b, q, k_new, v_new, ks_new, vs_new, k, v, ks, vs, write, key_slots, starts):
        y = row_linear(x, w, b).relu() * 2.0  # [M, N]
        a = torch.ops.spectoolkit.paged_attention(
            q, k_new, v_new, ks_new, vs_new, k, v, ks, vs, write, key_slots, starts, 0.125
        )  # [W, Hq, D]
        return y, a.reshape(a.shape[0], -1) * 0.5

    x, w, b = _linear_inputs(5, 40, 17, torch.bfloat16, True)
    key_slots, starts = _slot_lists(5)
    fresh, write = _fresh(kind, 5, 3, 40), torch.tensor([3, -1, 11, 12, -1])

    def run(function) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        stores = _stores(kind, 3, 40)  # each run writes into stores of its own
        outputs = function(x, w, b, _query(5, 9, 40), *fresh, *stores, write, key_slots, starts)
        return list(outputs), _snapshot(stores)

    (got, got_stores), (want, want_stores) = run(torch.compile(block, fullgraph=True, dynamic=False)), run(block)
    assert all(torch.equal(g, e) for g, e in zip(got + got_stores, want + want_stores, strict=True))
    assert got[0].shape == (5, 17) and got[1].shape == (5, 9 * 40)
    assert not torch.equal(want_stores[0], _snapshot(_stores(kind, 3, 40))[0])  # guard: the call did write


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
    for kind in ("bf16", "int8"):
        stores, q = _stores(kind, 3, 40), _query(6, 9, 40)
        key_slots, starts = _slot_lists(6)
        writes = _no_writes(kind, 6, 3, 40)
        together = ops.paged_attention(q, *writes[:4], *stores, writes[4], key_slots, starts, 0.125)
        ref = _reference(q, stores, key_slots, starts, 0.125)
        torch.testing.assert_close(together.double(), ref, rtol=ATTENTION_TOLERANCE, atol=ATTENTION_TOLERANCE)
        for row in range(6):
            own = _flat([key_slots[starts[row] : starts[row + 1]]])
            one = _no_writes(kind, 1, 3, 40)
            alone = ops.paged_attention(q[row : row + 1], *one[:4], *stores, one[4], *own, 0.125)
            assert torch.equal(alone[0], together[row])
