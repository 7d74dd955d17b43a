"""The CPU fast paths against their references: linear kernel variants vs F.linear, the runners' attention over
the paged pool vs the stock transformers forward, row-wise rows vs single-row (decode-step) calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spectoolkit.kernels.kernel_choice import (
    BY_NAME,
    ChoiceCache,
    ChunkedLinear,
    choose_kernels,
    install,
    linear_layers,
)
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.runtime.attention import paged_attention
from spectoolkit.runtime.blocks import BlockAllocator, BlockTable
from spectoolkit.runtime.eager import EagerRunner
from spectoolkit.runtime.lone import lone_sequence
from spectoolkit.runtime.paged_kv import PagedKVPool, make_pool
from spectoolkit.runtime.runner import run_segments
from spectoolkit.runtime.step import ROW_MODES, Segment, build_step, tree_layout

CPU = torch.device("cpu")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_kernel_variants_match_f_linear(rows, bias, name):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(96, 160, bias=bias)
    inputs = torch.randn(1, rows, 96)
    expected = F.linear(inputs, layer.weight, layer.bias)
    got = install(layer, BY_NAME[name])(inputs)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_kernel_choice_keeps_tied_parameters():
    model = tiny_llama(vocab_size=64)
    model.lm_head.weight = model.model.embed_tokens.weight  # tie
    before = {name: t.data_ptr() for name, t in model.state_dict().items()}
    chosen = choose_kernels(model, "auto", cache=ChoiceCache(None))
    assert chosen and all(isinstance(m, ChunkedLinear) for _, m in linear_layers(model))
    assert {name: t.data_ptr() for name, t in model.state_dict().items()} == before  # same keys, same tensors
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.layer.weight is model.model.embed_tokens.weight


def test_kernel_variant_model_logits_match_reference():
    reference, fast = tiny_llama(vocab_size=128, seed=3), tiny_llama(vocab_size=128, seed=3)
    for name, layer in linear_layers(fast):
        fast.set_submodule(name, install(layer, BY_NAME["gemm8"]))
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-5)


# ---- the runners' attention over the paged pool vs the stock forward ---------------------------------------


@pytest.mark.parametrize("mode", ROW_MODES)
@torch.inference_mode()
def test_paged_attention_matches_the_stock_forward_through_a_rollback(mode):
    """Prefill, decode, a verify-width chunk, decode; then a rollback and a 3-token chunk after a shorter prefix."""
    model = tiny_llama(vocab_size=128, seed=1)
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # GQA is exercised
    runner, table = EagerRunner(model, make_pool(model, "auto", 64)), BlockTable(BlockAllocator(8, 8))
    ids: list[int] = []

    def forward(chunk: list[int]) -> torch.Tensor:  # [len(chunk), V]
        table.ensure(len(ids) + len(chunk))
        logits = run_segments(runner, [Segment(table, chunk, len(ids), list(range(len(chunk))))], mode)
        ids.extend(chunk)
        return logits

    def stock(count: int) -> torch.Tensor:  # the stock forward over the whole sequence: its last ``count`` rows
        return model(torch.tensor([ids])).logits[0, -count:]

    for chunk in (list(range(3, 40)), [5], [6, 7, 8, 9], [10]):
        torch.testing.assert_close(forward(chunk), stock(len(chunk)), rtol=1e-5, atol=1e-5)
    del ids[30:]  # reject the tail: the next multi-token forward sees a shorter prefix
    table.truncate(30)
    torch.testing.assert_close(forward([1, 2, 3]), stock(3), rtol=1e-5, atol=1e-5)


def test_runners_leave_the_stock_attention_alone():
    """The stock forward stays the reference: building and running a runner swaps no attention in."""
    model = tiny_llama(vocab_size=64, seed=2)
    implementation = model.config._attn_implementation
    ids = torch.arange(3, 20)[None]
    with torch.inference_mode():
        before = model(ids).logits
        lone_sequence(model).forward(ids[0].tolist())
        after = model(ids).logits
    assert model.config._attn_implementation == implementation
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)
    assert torch.equal(before, after)


# ---- row-wise rows are decode-step calls -------------------------------------------------------------------

HEADS, KV_HEADS, DIM, CONTEXT = 6, 2, 16, 18


def _states(n: int, heads: int, seed: int) -> torch.Tensor:
    """[heads, n, D] random states, strided as a real model's (a transpose of [n, heads, D])."""
    return torch.randn(n, heads, DIM, generator=torch.Generator().manual_seed(seed)).transpose(0, 1)


def _attend(pool, table, start, query, keys, values, mode, tree=None) -> torch.Tensor:
    """One layer-0 attention call of q rows at positions [start, start+q) of ``table``: [q, Hq, D]."""
    count = query.shape[1]
    batch = build_step([Segment(table, [0] * count, start, list(range(count)), tree)], mode, CPU)
    return paged_attention(pool, 0, batch, query, keys, values, 0.25)


def _context(slots: int = 64) -> tuple[PagedKVPool, BlockTable]:
    """A pool whose sequence holds CONTEXT positions of random keys/values."""
    pool = PagedKVPool(1, KV_HEADS, DIM, slots, "auto", torch.float32, CPU)
    table = BlockTable(BlockAllocator(slots // 8, 8))
    table.ensure(CONTEXT)
    pool.write(0, torch.tensor(table.slots(0, CONTEXT)), _states(CONTEXT, KV_HEADS, 1), _states(CONTEXT, KV_HEADS, 2))
    return pool, table


@pytest.mark.parametrize("mode", ["chosen", "invariant"])
def test_rowwise_rows_equal_single_row_calls(mode):
    """Each row of a q-row call is bit-identical to the decode-step call at its position; plain mode is close."""
    pool, table = _context()
    q = 5
    table.ensure(CONTEXT + q)
    query, keys, values = _states(q, HEADS, 3), _states(q, KV_HEADS, 4), _states(q, KV_HEADS, 5)
    rows = _attend(pool, table, CONTEXT, query, keys, values, mode)  # [q, Hq, D]
    assert rows.shape == (q, HEADS, DIM)
    for i in range(q):
        step = _attend(pool, table, CONTEXT + i, query[:, i : i + 1], keys[:, i : i + 1], values[:, i : i + 1], mode)
        assert torch.equal(rows[i : i + 1], step), f"row {i}"
    plain = _attend(pool, table, CONTEXT, query, keys, values, "plain")  # one masked SDPA call
    torch.testing.assert_close(plain, rows, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["chosen", "invariant"])
def test_rowwise_tree_rows_equal_decode_steps_over_their_paths(mode):
    """A tree row equals the decode step of a chain holding the context, its ancestors and itself."""
    parents = [-1, 0, 0, 1, -1]  # rows 1 and 2 are siblings; row 4 hangs off the context
    pool, table = _context()
    q = len(parents)
    table.ensure(CONTEXT + q)
    query, keys, values = _states(q, HEADS, 3), _states(q, KV_HEADS, 4), _states(q, KV_HEADS, 5)
    rows = _attend(pool, table, CONTEXT, query, keys, values, mode, tree_layout(parents, CONTEXT))  # [q, Hq, D]
    for row in range(q):
        path = [row]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        chain = BlockTable(table.allocator)  # the context's keys, then the path's, at slots of their own
        chain.ensure(CONTEXT + len(path))
        context = torch.tensor(table.slots(0, CONTEXT))
        pool.write(0, torch.tensor(chain.slots(0, CONTEXT)), pool.gather(0, "key", context),
                   pool.gather(0, "value", context))  # fmt: skip
        if len(path) > 1:
            pool.write(0, torch.tensor(chain.slots(CONTEXT, CONTEXT + len(path) - 1)), keys[:, path[:-1]],
                       values[:, path[:-1]])  # fmt: skip
        start = CONTEXT + len(path) - 1
        step = _attend(pool, chain, start, query[:, row : row + 1], keys[:, row : row + 1], values[:, row : row + 1],
                       mode)  # fmt: skip
        assert torch.equal(rows[row : row + 1], step), f"row {row}"
        chain.release()


def test_a_padded_batched_call_is_close_to_each_sequence_alone():
    """Plain mode pads B sequences (different contexts and row counts) into one SDPA call; the padding is masked."""
    pool = PagedKVPool(1, KV_HEADS, DIM, 96, "auto", torch.float32, CPU)
    allocator = BlockAllocator(12, 8)
    lengths = ((3, 2), (21, 4), (9, 1))  # (context, rows) per sequence
    segments, tables = [], []
    for index, (context, count) in enumerate(lengths):
        table = BlockTable(allocator)
        table.ensure(context + count)
        slots = torch.tensor(table.slots(0, context))
        pool.write(0, slots, _states(context, KV_HEADS, 10 + index), _states(context, KV_HEADS, 20 + index))
        segments.append(Segment(table, [0] * count, context, list(range(count))))
        tables.append(table)
    total = sum(count for _, count in lengths)
    query, keys, values = _states(total, HEADS, 3), _states(total, KV_HEADS, 4), _states(total, KV_HEADS, 5)
    batch = build_step(segments, "plain", CPU)
    assert batch.padded is not None
    padded = paged_attention(pool, 0, batch, query, keys, values, 0.25)  # [T, Hq, D]
    invariant = paged_attention(pool, 0, build_step(segments, "invariant", CPU), query, keys, values, 0.25)
    torch.testing.assert_close(padded, invariant, rtol=1e-5, atol=1e-6)
