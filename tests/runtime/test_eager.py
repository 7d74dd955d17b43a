"""The eager runner: the stock forward's numbers through our decoder loop over the paged pool."""

from __future__ import annotations

import pytest
import torch

from spectoolkit.errors import SpecToolkitError
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.runtime.blocks import BlockAllocator, BlockTable
from spectoolkit.runtime.eager import EagerRunner
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import run_segments
from spectoolkit.runtime.step import ROW_MODES, Segment, build_step, tree_layout

BLOCK = 4


def _runner(model, blocks: int = 16):
    pool = make_pool(model, "auto", blocks * BLOCK)
    return EagerRunner(model, pool), BlockAllocator(blocks, BLOCK)


@pytest.mark.parametrize("mode", ROW_MODES)
@torch.inference_mode()
def test_a_prompt_then_decode_steps_match_the_stock_forward(mode):
    model = tiny_llama(vocab_size=128, seed=3)
    runner, allocator = _runner(model)
    table = BlockTable(allocator)
    ids = torch.randint(3, 128, (11,), generator=torch.Generator().manual_seed(0)).tolist()
    table.ensure(8)
    first = run_segments(runner, [Segment(table, ids[:8], 0, list(range(8)))], mode)  # [8, V]
    table.ensure(11)
    rest = run_segments(runner, [Segment(table, ids[8:], 8, [0, 1, 2])], mode)  # [3, V]
    stock = model(torch.tensor([ids])).logits[0]  # [11, V]
    torch.testing.assert_close(torch.cat([first, rest]), stock, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_a_tree_row_sees_its_ancestors_only():
    model = tiny_llama(vocab_size=128, seed=3)
    runner, allocator = _runner(model)
    table = BlockTable(allocator)
    prefix, nodes, parents = [5, 6, 7, 8, 9], [10, 11, 12], [-1, 0, 0]  # 11 and 12 are siblings
    table.ensure(len(prefix) + len(nodes))
    run_segments(runner, [Segment(table, prefix, 0, [4])], "plain")
    logits = run_segments(runner, [Segment(table, nodes, 5, [0, 1, 2], tree_layout(parents, 5))], "plain")
    sibling = model(torch.tensor([prefix + [10, 12]])).logits[0, -1]  # node 12 after its parent, not after 11
    torch.testing.assert_close(logits[2], sibling, rtol=1e-4, atol=1e-4)


def test_a_step_batch_describes_every_sequence():
    model = tiny_llama(vocab_size=64)
    _, allocator = _runner(model)
    tables = [BlockTable(allocator), BlockTable(allocator)]
    tables[0].ensure(6)
    tables[1].ensure(3)
    batch = build_step([Segment(tables[0], [1, 2], 4, [1]), Segment(tables[1], [3, 4, 5], 0, [0, 2])], "plain",
                       torch.device("cpu"))  # fmt: skip
    assert batch.query_starts == [0, 2, 5] and batch.context_lens == [6, 3]
    assert batch.positions.tolist() == [4, 5, 0, 1, 2] and batch.logit_rows.tolist() == [1, 2, 4]
    assert batch.slots.tolist() == tables[0].slots(4, 6) + tables[1].slots(0, 3)
    assert [batch.start_of(b) for b in range(2)] == [4, 0] and batch.padded is not None
    with pytest.raises(ValueError, match="row mode"):
        build_step([], "fast", torch.device("cpu"))


def test_a_model_outside_the_llama_family_is_refused_clearly():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(SpecToolkitError, match="Llama-family.*gpt2"):
        EagerRunner(gpt2, None)
