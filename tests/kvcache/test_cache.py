"""Rollback by length over the paged pool: what is kept is exactly the KV of the kept tokens (DESIGN §2).

The pool never erases: a rolled-back sequence's rejected slots are written over by its next tokens. So
after any rollback the slots of positions [0, n) must hold what a sequence that never saw the rejected
tokens holds, in every layer; :class:`~spectoolkit.runtime.lone.LoneSequence` does that bookkeeping for
one sequence (its block table, ``num_computed``, ``truncate``, ``reset``, ``kv_bytes``).
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.models.tiny import tiny_llama
from spectoolkit.runtime.lone import LONE_BLOCK, lone_sequence
from spectoolkit.runtime.paged_kv import KINDS, PagedKVPool

LAYERS, HEADS, DIM, SLOTS = 3, 2, 4, 40
pytestmark = pytest.mark.usefixtures("one_thread")


def _kv(n: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random key/value states [H_kv, n, D]."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(HEADS, n, DIM, generator=gen).to(dtype) for _ in range(2))


def _cat(*chunks: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.cat(states, dim=1) for states in zip(*chunks, strict=True))


def _slot_of() -> torch.Tensor:
    """[SLOTS] long: the pool slot of each position, scattered as a sequence's blocks may be."""
    return torch.randperm(SLOTS, generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rollback_equals_never_having_written_the_rejected_slots(dtype):
    """Every layer: prefix (7), accepted (2) + rejected (3) drafts, rollback to 9, next (4) over the rejected slots."""
    slot_of = _slot_of()
    rolled, clean = (PagedKVPool(LAYERS, HEADS, DIM, SLOTS, "auto", dtype, torch.device("cpu")) for _ in range(2))
    for layer in range(LAYERS):
        prefix, accepted, rejected, nxt = (_kv(n, 10 * layer + seed, dtype) for seed, n in enumerate((7, 2, 3, 4)))
        rolled.write(layer, slot_of[:7], *prefix)
        rolled.write(layer, slot_of[7:12], *_cat(accepted, rejected))
        rolled.write(layer, slot_of[9:13], *nxt)  # the rollback to 9 writes nothing: the next tokens overwrite
        for start, states in zip((0, 7, 9), (prefix, accepted, nxt), strict=True):
            clean.write(layer, slot_of[start : start + states[0].shape[1]], *states)
        expected = _cat(prefix, accepted, nxt)  # [H_kv, 13, D] each
        for kind, states in zip(KINDS, expected, strict=True):
            got = rolled.gather(layer, kind, slot_of[:13])  # what attention reads
            assert got.dtype == dtype and torch.equal(got, states), f"layer {layer} {kind}"
            assert torch.equal(clean.gather(layer, kind, slot_of[:13]), states)


# ---- a lone sequence through a real model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(seed=3, scale=4.0)


def test_rollback_matches_a_single_prefill(model):
    prompt, drafts, correction = [1, 17, 93, 250, 7, 41], [300, 12, 5, 88, 401], 77
    rolled = lone_sequence(model)
    rolled.forward(prompt, last_only=True)
    rolled.forward(drafts)  # t1..t5; only t1, t2 get accepted
    rolled.truncate(len(prompt) + 2)
    assert rolled.num_computed == len(prompt) + 2
    rolled_logits = rolled.forward([correction])  # [1, V]

    fresh = lone_sequence(model)
    fresh_logits = fresh.forward(prompt + drafts[:2] + [correction])  # [n, V]
    assert rolled.num_computed == fresh.num_computed == len(prompt) + 3
    torch.testing.assert_close(rolled_logits[-1], fresh_logits[-1], atol=1e-5, rtol=0)
    # Rejected drafts must have changed nothing: without the rollback the logits differ.
    stale = lone_sequence(model)
    stale.forward(prompt + drafts)
    assert not torch.allclose(stale.forward([correction])[-1], fresh_logits[-1], atol=1e-3)


def test_truncate_never_grows(model):
    sequence = lone_sequence(model)
    sequence.forward([1, 2, 3, 4, 5, 6, 7])
    sequence.truncate(9)
    assert sequence.num_computed == 7
    sequence.truncate(5)
    assert sequence.num_computed == 5
    sequence.truncate(0)
    assert sequence.num_computed == 0 and sequence.table.blocks == []


def _buffers(pool: PagedKVPool) -> list[int]:
    """The addresses of every stored buffer of ``pool``."""
    return [buf.data_ptr() for layer in pool.layers for fields in layer.values() for buf in fields.values()]


def test_reset_starts_a_new_sequence_on_the_same_buffers(model):
    sequence = lone_sequence(model)
    buffers = _buffers(sequence.runner.pool)
    sequence.forward([1, 2, 3, 4, 5, 6, 7])
    sequence.reset()
    allocator = sequence.allocator
    assert sequence.num_computed == 0 and allocator.num_free == allocator.num_blocks  # every block returned
    again = sequence.forward([1, 40, 50], last_only=True)  # [V]
    reference = lone_sequence(model).forward([1, 40, 50], last_only=True)
    torch.testing.assert_close(again, reference, atol=1e-5, rtol=0)
    assert again.shape == (model.config.vocab_size,)
    assert _buffers(sequence.runner.pool) == buffers  # the pool is kept for the next request


def test_kv_bytes_count_the_blocks_held(model):
    config = model.config
    sequence = lone_sequence(model, "bf16")
    head_dim = config.hidden_size // config.num_attention_heads
    slot_bytes = config.num_hidden_layers * len(KINDS) * config.num_key_value_heads * head_dim * 2  # bf16
    assert sequence.runner.pool.slot_bytes() == slot_bytes
    assert sequence.kv_bytes() == 0
    sequence.forward(list(range(3, 3 + LONE_BLOCK + 4)))  # crosses into a second block
    assert sequence.kv_bytes() == 2 * LONE_BLOCK * slot_bytes
    sequence.truncate(LONE_BLOCK - 1)  # the second block is freed
    assert sequence.kv_bytes() == LONE_BLOCK * slot_bytes
    sequence.reset()
    assert sequence.kv_bytes() == 0
