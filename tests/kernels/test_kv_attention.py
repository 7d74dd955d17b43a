"""kv_attention (Triton) against dequantize + fp32 SDPA, over formats, head shapes, windows and dtypes.

Stored KV comes from the real formats.py quantizers applied to random states, in buffers larger than
the attended prefix, or straight from a paged pool's stored fields. Tolerances per query dtype, because kernel and
reference dequantize the same codes and differ only in rounding:

- fp32: scores and P·V in fp32 on both sides (``ieee`` dots); only summation order differs -> 2e-5.
- fp16: the kernel feeds q, the dequantized K/V (int4 / float formats) and the probabilities P to the
  dot in fp16 (10-bit mantissa, ~5e-4 relative each) and rounds the output to fp16 -> 4e-3.
- bf16: the same with an 8-bit mantissa (~4e-3 relative each) -> 3e-2.

Invariance (DESIGN §7) is checked bit for bit (``torch.equal``): a request alone against the same request
batched with others of other lengths (each row keeps its place in its tile), and a decode step against the
verify-window row at its position — with 64-slot splits, so the contexts here span several splits and the merge
kernel runs. The decode-vs-verify check moves a row within the query tile, so it runs on CUDA only (under the
interpreter that order is numpy's BLAS's: tests/kernels/conftest.py); its calls meet the reference everywhere.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from spectoolkit.kvcache.formats import KV_FORMATS
from spectoolkit.runtime.attention import packed_attention, paged_attention
from spectoolkit.runtime.blocks import BlockAllocator, BlockTable
from spectoolkit.runtime.paged_kv import PagedKVPool
from spectoolkit.runtime.step import Segment, build_step

FORMATS = ("fp8", "int8", "int4", "bf16")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
HEADS = ((4, 4), (8, 2))  # (H, H_kv)


@pytest.fixture(scope="module")
def kva():
    """The kernel module, imported after conftest chose the interpreter (CPU) or CUDA."""
    from spectoolkit.kernels import kv_attention

    return kv_attention


def _stored(fmt: str, states: torch.Tensor) -> dict[str, torch.Tensor]:
    """states [B, H_kv, cap, D] -> the fields the paged pool stores for them (per token, per kv-head)."""
    if fmt == "bf16":
        return {"data": states.bfloat16()}
    return KV_FORMATS[fmt].quantize(states)


def _case(fmt, heads, q_len, head_dim, contexts, dtype, device, seed=0):
    """(query [B, H, Q, D], key fields, value fields, prefix lengths) for total KV lengths ``contexts``."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, kv_heads = heads
    batch, capacity = len(contexts), max(contexts) + 11
    query = torch.randn(batch, q_len, num_heads, head_dim, generator=gen).transpose(1, 2)  # strided, as HF makes it
    keys, values = (torch.randn(batch, kv_heads, capacity, head_dim, generator=gen) for _ in range(2))
    fields = [{k: t.to(device) for k, t in _stored(fmt, states).items()} for states in (keys, values)]
    prefix_lens = [context - q_len for context in contexts]
    return query.to(device, dtype), *fields, prefix_lens


def _check(kva, fmt, heads, q_len, head_dim, contexts, dtype, device, split_len=None, softmax_scale=None, mask=None):
    query, key_fields, value_fields, prefix_lens = _case(fmt, heads, q_len, head_dim, contexts, dtype, device)
    args = (query, key_fields, value_fields, fmt, prefix_lens, softmax_scale)
    out = kva.kv_attention(*args, split_len=split_len or kva.SPLIT_LEN, key_mask=mask)
    ref = kva.kv_attention_reference(*args, key_mask=mask)
    assert out.shape == query.shape and out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


_FAST = [
    (*combo, DTYPES[i % 3]) for i, combo in enumerate(itertools.product(FORMATS, HEADS, (1, 5), (64, 128)))
]  # fmt: skip  (every dtype meets every format and head shape across the cycle)


@pytest.mark.parametrize(("fmt", "heads", "q_len", "head_dim", "dtype"), _FAST)
def test_matches_reference(kva, device, fmt, heads, q_len, head_dim, dtype):
    _check(kva, fmt, heads, q_len, head_dim, (37, 130), dtype, device)  # B = 2, different lengths
    _check(kva, fmt, heads, q_len, head_dim, (max(1, q_len),), dtype, device)  # B = 1, empty prefix


@pytest.mark.parametrize("fmt", FORMATS)
def test_split_merge_matches_reference(kva, device, fmt):
    """Several KV splits per request, merged by the second kernel (64-slot splits: three for the long request,
    one for the short one, normalized in place while its companion's splits are merged)."""
    _check(kva, fmt, (8, 2), 5, 64, (1 + 5, 130), torch.float32, device, split_len=64, softmax_scale=0.3)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "heads", "q_len", "head_dim", "dtype"), list(itertools.product(FORMATS, HEADS, (1, 5), (64, 128), DTYPES))
)
@pytest.mark.parametrize("split_len", [None, 64])
def test_matches_reference_full_grid(kva, device, fmt, heads, q_len, head_dim, dtype, split_len):
    for contexts in ((5,), (37,), (130,), (37, 130), (300, 64)):
        _check(kva, fmt, heads, q_len, head_dim, contexts, dtype, device, split_len)


@pytest.mark.parametrize("split_len", [None, 64])
def test_key_mask_matches_reference(kva, device, split_len):
    """An extra key mask (left padding of 3 and 20 slots, one hole) on top of the causal window."""
    mask = torch.ones(2, 5, 140, dtype=torch.bool)
    mask[0, :, :3], mask[1, :, :20], mask[1, 2, 60] = False, False, False
    _check(kva, "int4", (8, 2), 5, 64, (37, 130), torch.float32, device, split_len, mask=mask.to(device))


INVARIANCE_CONTEXTS = (37, 130, 6, 200)  # with 64-slot splits: 1, 3, 1 and 4 splits
# fp32 in every format (a reordered sum shows in its last bit; bf16 output rounding would mostly hide it), bf16 once.
SPLIT_CASES = [(fmt, q_len, torch.float32) for fmt in FORMATS for q_len in (1, 5)] + [("int4", 5, torch.bfloat16)]


@pytest.mark.parametrize(("fmt", "q_len", "dtype"), SPLIT_CASES)
def test_request_alone_equals_request_batched(kva, device, fmt, q_len, dtype):
    """Each request's output bits are the same alone (B = 1) as beside requests of other lengths, whose split
    counts differ from its own (64-slot splits); the batched call also meets the reference."""
    query, key_fields, value_fields, prefix_lens = _case(fmt, (8, 2), q_len, 64, INVARIANCE_CONTEXTS, dtype, device)
    batched = kva.kv_attention(query, key_fields, value_fields, fmt, prefix_lens, split_len=64)
    for b, prefix in enumerate(prefix_lens):
        own = [{name: t[b : b + 1] for name, t in fields.items()} for fields in (key_fields, value_fields)]
        alone = kva.kv_attention(query[b : b + 1], *own, fmt, prefix, split_len=64)
        assert torch.equal(alone, batched[b : b + 1]), f"request {b} (prefix {prefix}) differs alone and batched"
    reference = kva.kv_attention_reference(query, key_fields, value_fields, fmt, prefix_lens)
    torch.testing.assert_close(batched.float(), reference.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


DECODE_CASES = [("int8", torch.float32, 61), ("int4", torch.float32, 126), ("fp8", torch.float32, 126),
                ("bf16", torch.bfloat16, 61)]  # fmt: skip


def _decode_and_verify(kva, device, fmt, dtype, prefix):
    """(query, key fields, value fields, a verify window's output [1, 8, 5, 64], five decode steps' outputs)."""
    query, key_fields, value_fields, _ = _case(fmt, (8, 2), 5, 64, (prefix + 5,), dtype, device)
    window = kva.kv_attention(query, key_fields, value_fields, fmt, prefix, split_len=64)  # [1, 8, 5, 64]
    steps = [kva.kv_attention(query[:, :, i : i + 1], key_fields, value_fields, fmt, prefix + i, split_len=64)
             for i in range(5)]  # fmt: skip
    return query, key_fields, value_fields, window, steps


@pytest.mark.parametrize(("fmt", "dtype", "prefix"), DECODE_CASES)
def test_decode_step_equals_verify_row(kva, device, gpu_tile_order, fmt, dtype, prefix):
    """Row i of a verify window over ``prefix`` equals, bit for bit, a decode step at position prefix + i over the
    same slots — across a split boundary too (64-slot splits: the window at 61 spans two, the first decode steps
    one; at 126 the window spans three). CUDA only: a decode row sits at another place of the query tile than
    its verify row (tests/kernels/conftest.py)."""
    _, _, _, window, steps = _decode_and_verify(kva, device, fmt, dtype, prefix)
    for i, step in enumerate(steps):
        assert torch.equal(step, window[:, :, i : i + 1]), f"position {prefix + i}: decode differs from verify row {i}"


@pytest.mark.parametrize(("fmt", "dtype", "prefix"), DECODE_CASES)
def test_decode_steps_and_verify_window_meet_the_reference(kva, device, fmt, dtype, prefix):
    """The calls of the decode-vs-verify test, each against the reference, on the interpreter too."""
    query, key_fields, value_fields, window, steps = _decode_and_verify(kva, device, fmt, dtype, prefix)
    reference = kva.kv_attention_reference(query, key_fields, value_fields, fmt, [prefix]).float()  # [1, 8, 5, 64]
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(window.float(), reference, atol=tol, rtol=tol)
    torch.testing.assert_close(torch.cat(steps, dim=2).float(), reference, atol=tol, rtol=tol)


def test_split_len_must_be_whole_blocks(kva, device):
    query, key_fields, value_fields, prefix_lens = _case("int8", (8, 2), 1, 64, (37,), torch.float32, device)
    for split_len in (0, 100, -64):
        with pytest.raises(ValueError, match="split_len"):
            kva.kv_attention(query, key_fields, value_fields, "int8", prefix_lens, split_len=split_len)


def test_rejects_bad_input(kva, device):
    query, key_fields, value_fields, prefix_lens = _case("int4", (8, 2), 5, 64, (37, 130), torch.float16, device)
    call = kva.kv_attention
    with pytest.raises(ValueError, match="unknown KV format"):
        call(query, key_fields, value_fields, "nf4", prefix_lens)
    with pytest.raises(ValueError, match="fields for int8"):
        call(query, key_fields, value_fields, "int8", prefix_lens)
    with pytest.raises(ValueError, match="query must be"):
        call(query[0], key_fields, value_fields, "int4", prefix_lens)
    with pytest.raises(ValueError, match="query must be"):
        call(query.to(torch.float64), key_fields, value_fields, "int4", prefix_lens)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        call(query[:, :7], key_fields, value_fields, "int4", prefix_lens)
    with pytest.raises(ValueError, match="head_dim"):
        call(query[..., :48], key_fields, value_fields, "int4", prefix_lens)
    with pytest.raises(ValueError, match="key scale"):
        call(query, {**key_fields, "scale": key_fields["scale"].half()}, value_fields, "int4", prefix_lens)
    with pytest.raises(ValueError, match="value data"):
        call(query, key_fields, {**value_fields, "data": value_fields["data"][:1]}, "int4", prefix_lens)
    with pytest.raises(ValueError, match="exceeds the KV capacity"):
        call(query, key_fields, value_fields, "int4", [37, 137])
    with pytest.raises(ValueError, match="prefix_lens"):
        call(query, key_fields, value_fields, "int4", [3])
    with pytest.raises(ValueError, match="key_mask"):
        call(query, key_fields, value_fields, "int4", prefix_lens, key_mask=torch.ones(2, 5, 100, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_mask"):
        call(query, key_fields, value_fields, "int4", prefix_lens, key_mask=torch.ones(2, 5, 140))
    with pytest.raises(ValueError, match="is on meta"):
        call(
            query, {**key_fields, "zero": torch.empty_like(key_fields["zero"], device="meta")}, value_fields, "int4", 3
        )


def test_kernel_supports(kva):
    assert kva.kernel_supports(128, "int4") and kva.kernel_supports(64, "fp8")
    assert not kva.kernel_supports(48, "int8") and not kva.kernel_supports(8, "int8")
    assert not kva.kernel_supports(64, "nf4")


# ---- stored fields of the paged pool ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4", "bf16"])
def test_kernel_over_a_pools_stored_fields_equals_the_runners_attention(kva, device, fmt):
    """A sequence in scattered pool blocks: prefill, a verify window rolled back to 2 accepted, a new window over
    the rejected slots. The kernel over the sequence's stored fields (codes, scales, zeros as the pool holds them)
    equals the eager runner's attention of that window (dequantize, then packed-GQA SDPA)."""
    gen = torch.Generator().manual_seed(1)
    pool = PagedKVPool(1, 2, 64, 64, fmt, torch.float32, device)
    allocator = BlockAllocator(8, 8)
    table, other = BlockTable(allocator), BlockTable(allocator)
    table.ensure(8)
    other.ensure(8)  # another sequence's block between: the table's slots are not one span
    table.ensure(47)

    def states(n: int) -> torch.Tensor:  # [H_kv, n, D]
        return torch.randn(2, n, 64, generator=gen).to(device)

    pool.write(0, torch.tensor(table.slots(0, 45), device=device), states(45), states(45))  # prefill + window
    query = torch.randn(8, 5, 64, generator=gen).to(device)  # the new window at positions [42, 47): [Hq, 5, D]
    batch = build_step([Segment(table, [0] * 5, 42, list(range(5)))], "plain", device)
    assert batch.spans == [None]  # guard: the keys are gathered from scattered slots
    expected = paged_attention(pool, 0, batch, query, states(5), states(5), 0.125)  # [5, Hq, D]; writes the window
    slots = torch.tensor(table.slots(0, 47), device=device)
    fields = [{name: stored[None] for name, stored in pool.stored(0, kind, slots).items()} for kind in ("key", "value")]
    out = kva.kv_attention(query[None], *fields, fmt, 42, softmax_scale=0.125)  # [1, Hq, 5, D]
    torch.testing.assert_close(out[0].transpose(0, 1), expected, atol=2e-5, rtol=2e-5)


def test_bench_cases_run_and_agree(kva, device):
    """Every bench case's kernel agrees with its torch path (bf16 tolerance); bytes count codes, scales, q and out."""
    cases = kva.bench_cases(device)
    assert {case.kernel for case in cases} == {"kv attention int8", "kv attention fp8", "kv attention int4"}
    small = [case for case in cases if "B=1 " in case.shape and "ctx=1024 " in case.shape]
    assert len(small) == 6
    for case in small if device.type == "cuda" else (small[0], small[-1]):  # interpreter: int8 decode, int4 verify
        torch.testing.assert_close(case.run_triton().float(), case.run_torch().float(), atol=3e-2, rtol=3e-2)
    int8_decode = next(case for case in small if case.kernel.endswith("int8") and case.shape.endswith("Q=1"))
    assert int8_decode.bytes_moved == 2 * 8 * 1024 * (128 + 4) + 2 * 32 * 128 * 2


def test_bench_torch_path_is_the_runners_packed_attention(kva):
    """The benchmark's restated torch path is ``spectoolkit.runtime.attention.packed_attention``, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    for q_len in (1, 5):  # a decode step, a verify window (causal within it)
        query = torch.randn(2, 8, q_len, 16, generator=gen)  # [B, H, Q, D]
        keys, values = (torch.randn(2, 2, 12, 16, generator=gen) for _ in range(2))  # [B, H_kv, L, D]
        mask = None if q_len == 1 else torch.ones(q_len, 12, dtype=torch.bool).tril(12 - q_len)  # [Q, L]
        expected = torch.stack(
            [packed_attention(query[b], keys[b], values[b], mask, 16**-0.5).transpose(0, 1) for b in range(2)]
        )  # [B, H, Q, D]
        torch.testing.assert_close(kva._packed_gqa_sdpa(query, keys, values), expected, atol=0, rtol=0)
