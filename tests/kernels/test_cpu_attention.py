"""Our paged attention kernel (``spectoolkit::paged_attention``) against an fp64 reference, bits held fixed.

Per (row, head) the kernel attends exactly the slots listed for that row, in order, with fixed-order
sums (DESIGN §7): the bits may not depend on the other rows of the call, the thread count or the
instruction-set path, and the new rows it is handed land in their slots in the store's own format.
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.kernels import cpu_ops


@pytest.fixture(autouse=True, scope="module")
def _built():
    cpu_ops.load()


STORES = ("fp32", "bf16", "fp16", "int8", "fp8")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8,
          "fp8": torch.float8_e4m3fn}  # fmt: skip


def _stores(kind: str, heads: int, slots: int, dim: int, generator: torch.Generator):
    """(k, v, k_scale, v_scale) stores [H, S, D] and the values they hold as fp64."""
    out = []
    for _ in range(2):
        values = torch.randn(heads, slots, dim, generator=generator)
        if kind == "int8":
            scale = torch.rand(heads, slots, 1, generator=generator) * 0.05 + 0.01
            data = (values / scale).round().clamp(-127, 127).to(torch.int8)
            out.append((data, scale, data.double() * scale.double()))
        elif kind == "fp8":
            scale = torch.rand(heads, slots, 1, generator=generator) + 0.5
            data = (values / scale).to(torch.float8_e4m3fn)
            out.append((data, scale, data.double() * scale.double()))
        else:
            data = values.to(DTYPES[kind])
            out.append((data, torch.empty(0), data.double()))
    (k, k_scale, k64), (v, v_scale, v64) = out
    return (k, v, k_scale, v_scale), (k64, v64)


def _rows(count: int, slots: int, generator: torch.Generator):
    """Each row's slot list (random subsets in position order, sizes 1..slots) -> (flat key_slots, starts)."""
    lists = []
    for _ in range(count):
        size = int(torch.randint(1, slots + 1, (1,), generator=generator))
        lists.append(torch.randperm(slots, generator=generator)[:size].sort().values)
    starts = torch.tensor([0] + [len(each) for each in lists]).cumsum(0)
    return lists, torch.cat(lists), starts


def _call(q, stores, key_slots, starts, scale, isa=-1, new=None, write=None):
    rows, _, dim = q.shape
    k, v, k_scale, v_scale = stores
    heads = k.shape[0]
    if new is None:  # nothing written
        new = [torch.zeros(rows, heads, dim, dtype=k.dtype)] * 2 + [torch.zeros(rows, heads, 1)] * 2
        write = torch.full((rows,), -1, dtype=torch.long)
    k_scale_new, v_scale_new = (s if k_scale.numel() else k_scale for s in new[2:])
    return torch.ops.spectoolkit.paged_attention(
        q, new[0], new[1], k_scale_new, v_scale_new, k, v, k_scale, v_scale, write, key_slots, starts, scale, isa
    )


def _reference(q, k64, v64, lists, scale):
    rows, heads, _ = q.shape
    rep = heads // k64.shape[0]
    out = torch.empty(rows, heads, q.shape[2], dtype=torch.float64)
    for row, picks in enumerate(lists):
        for head in range(heads):
            keys, values = k64[head // rep, picks], v64[head // rep, picks]  # [n, D]
            weights = torch.softmax(keys @ q[row, head].double() * scale, dim=0)
            out[row, head] = weights @ values
    return out


@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("dim,heads,kv_heads", [(16, 4, 2), (64, 9, 3), (128, 4, 4)])
def test_matches_the_fp64_reference(kind, dim, heads, kv_heads):
    generator = torch.Generator().manual_seed(dim + heads)
    stores, (k64, v64) = _stores(kind, kv_heads, 40, dim, generator)
    q = torch.randn(6, heads, dim, generator=generator) * 0.8  # scores spread over tens: exp's range is exercised
    lists, key_slots, starts = _rows(6, 40, generator)
    got = _call(q, stores, key_slots, starts, dim**-0.5 * 3)
    exact = _reference(q, k64, v64, lists, dim**-0.5 * 3)
    assert torch.allclose(got.double(), exact, rtol=2e-5, atol=2e-5 * v64.abs().max().item())


@pytest.mark.parametrize("kind", STORES)
def test_a_row_gets_the_same_bits_alone_on_any_thread_count_and_path(kind):
    generator = torch.Generator().manual_seed(5)
    stores, _ = _stores(kind, 3, 70, 64, generator)
    q = torch.randn(12, 9, 64, generator=generator)
    lists, key_slots, starts = _rows(12, 70, generator)
    together = _call(q, stores, key_slots, starts, 0.125)
    for row, picks in enumerate(lists):
        alone = _call(q[row : row + 1], stores, picks, torch.tensor([0, len(picks)]), 0.125)
        assert torch.equal(alone, together[row : row + 1]), row
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_call(q, stores, key_slots, starts, 0.125), together)
    finally:
        torch.set_num_threads(threads)
    for path in cpu_ops.available_isas():
        assert torch.equal(_call(q, stores, key_slots, starts, 0.125, cpu_ops.ISAS.index(path)), together), path


def test_new_rows_land_in_their_slots_before_they_are_read():
    generator = torch.Generator().manual_seed(6)
    stores, _ = _stores("int8", 2, 10, 16, generator)
    before = [store.clone() for store in stores]
    k_new = torch.randint(-127, 128, (3, 2, 16), generator=generator, dtype=torch.int8)
    v_new = torch.randint(-127, 128, (3, 2, 16), generator=generator, dtype=torch.int8)
    scales = [torch.rand(3, 2, 1, generator=generator) for _ in range(2)]
    write = torch.tensor([4, -1, 7])
    q = torch.randn(3, 4, 16, generator=generator)
    key_slots, starts = torch.tensor([4, 0, 1, 7]), torch.tensor([0, 1, 2, 4])
    got = _call(q, stores, key_slots, starts, 0.25, new=[k_new, v_new, *scales], write=write)
    k, v, k_scale, v_scale = stores
    for row, slot in ((0, 4), (2, 7)):
        assert torch.equal(k[:, slot], k_new[row]) and torch.equal(v_scale[:, slot], scales[1][row])
    untouched = [s for s in range(10) if s not in (4, 7)]
    assert torch.equal(k[:, untouched], before[0][:, untouched]) and torch.equal(
        v[:, untouched], before[1][:, untouched]
    )
    # row 0 attends only its own new slot: its output is that value row (softmax of one score is 1)
    value = v_new[0].double() * scales[1][0].double()  # [H, D]
    assert torch.allclose(got[0].double(), value.repeat_interleave(2, dim=0), atol=1e-6)


def test_bad_calls_are_refused():
    generator = torch.Generator().manual_seed(7)
    stores, _ = _stores("fp32", 2, 8, 16, generator)
    q = torch.randn(1, 4, 16)
    with pytest.raises(RuntimeError, match="outside the pool"):
        _call(q, stores, torch.tensor([8]), torch.tensor([0, 1]), 1.0)
    with pytest.raises(RuntimeError, match="at least one slot"):
        _call(q, stores, torch.tensor([1]), torch.tensor([0, 0]), 1.0)
    odd = _stores("fp32", 2, 8, 24, generator)[0]
    with pytest.raises(RuntimeError, match="head dim"):
        _call(torch.randn(1, 4, 24), odd, torch.tensor([1]), torch.tensor([0, 1]), 1.0)
