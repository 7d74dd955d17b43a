"""PositionalKVCache: rollback by length must leave exactly the KV of the kept tokens (DESIGN §2)."""

from __future__ import annotations

import pytest
import torch

from spectoolkit.kvcache import PositionalKVCache, PositionalKVLayer
from spectoolkit.kvcache.cache import _INITIAL_CAPACITY
from spectoolkit.models.cached import CachedModel
from spectoolkit.models.tiny import tiny_llama

BATCH, HEADS, DIM = 1, 2, 4
pytestmark = pytest.mark.usefixtures("one_thread")


def _kv(n: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random key/value states [B, H_kv, n, D]."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(BATCH, HEADS, n, DIM, generator=gen).to(dtype) for _ in range(2))


def _assert_valid_equal(layer: PositionalKVLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    valid_keys, valid_values = layer.valid()
    assert torch.equal(valid_keys, keys)
    assert torch.equal(valid_values, values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layer_rollback_equals_never_having_written_the_rejected_slots(dtype):
    prefix, accepted, rejected, nxt = _kv(7, 0, dtype), _kv(2, 1, dtype), _kv(3, 2, dtype), _kv(4, 3, dtype)
    rolled = PositionalKVLayer()
    rolled.update(*prefix)
    chunk = [torch.cat([a, r], dim=-2) for a, r in zip(accepted, rejected, strict=True)]  # accepted + rejected drafts
    rolled.update(*chunk)
    assert rolled.get_seq_length() == 7 + 5
    rolled.truncate(7 + 2)
    assert rolled.get_seq_length() == 9
    keys, values = rolled.update(*nxt)  # overwrites the rejected slots by position

    clean = PositionalKVLayer()
    for states in (prefix, accepted, nxt):
        clean.update(*states)
    expected_keys = torch.cat([prefix[0], accepted[0], nxt[0]], dim=-2)
    expected_values = torch.cat([prefix[1], accepted[1], nxt[1]], dim=-2)
    _assert_valid_equal(rolled, expected_keys, expected_values)
    _assert_valid_equal(clean, expected_keys, expected_values)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)  # what attention reads
    assert rolled.get_seq_length() == clean.get_seq_length() == 13


def test_cache_update_by_layer_index_rolls_back_every_layer():
    rolled, clean = PositionalKVCache(3), PositionalKVCache(3)
    for layer_idx in range(3):
        seed = 10 * layer_idx
        rolled.update(*_kv(5, seed), layer_idx)
        rolled.update(*_kv(4, seed + 1), layer_idx)  # 1 accepted + 3 rejected
        clean.update(*_kv(5, seed), layer_idx)
        clean.update(*[s[:, :, :1] for s in _kv(4, seed + 1)], layer_idx)
    rolled.truncate(6)
    assert rolled.get_seq_length() == 6
    for layer_idx in range(3):
        rolled.update(*_kv(2, 99 + layer_idx), layer_idx)
        clean.update(*_kv(2, 99 + layer_idx), layer_idx)
    for rolled_layer, clean_layer in zip(rolled.layers, clean.layers, strict=True):
        _assert_valid_equal(rolled_layer, *clean_layer.valid())
        assert rolled_layer.get_seq_length() == 8


def test_growth_past_initial_capacity_keeps_contents():
    layer = PositionalKVLayer()
    first, second = _kv(_INITIAL_CAPACITY - 6, 0), _kv(20, 1)
    layer.update(*first)
    allocated = layer.allocated_bytes()
    layer.update(*second)  # crosses the initial capacity: the buffers are reallocated
    assert layer.allocated_bytes() > allocated
    assert layer.get_seq_length() == _INITIAL_CAPACITY + 14
    _assert_valid_equal(layer, *[torch.cat([a, b], dim=-2) for a, b in zip(first, second, strict=True)])
    one_big = _kv(3 * _INITIAL_CAPACITY, 2)  # a single write larger than twice the capacity
    layer.update(*one_big)
    assert layer.get_seq_length() == 4 * _INITIAL_CAPACITY + 14
    assert torch.equal(layer.valid()[0][:, :, -3 * _INITIAL_CAPACITY :], one_big[0])
    assert torch.equal(layer.valid()[0][:, :, : first[0].shape[-2]], first[0])


def test_crop_negative_removes_that_many_positive_is_a_length():
    layer = PositionalKVLayer()
    keys, values = _kv(10, 0)
    layer.update(keys, values)
    layer.crop(-3)
    assert layer.get_seq_length() == 7
    _assert_valid_equal(layer, keys[:, :, :7], values[:, :, :7])
    layer.crop(0)  # transformers calls crop(-n) with n == 0 when every candidate was accepted
    assert layer.get_seq_length() == 7
    layer.crop(5)  # legacy form: an absolute length
    assert layer.get_seq_length() == 5
    layer.crop(9)  # never grows
    assert layer.get_seq_length() == 5
    layer.crop(-50)  # never negative
    assert layer.get_seq_length() == 0


def test_cache_crop_applies_to_all_layers():
    cache = PositionalKVCache(2)
    for layer_idx in range(2):
        cache.update(*_kv(6, layer_idx), layer_idx)
    cache.crop(-2)
    assert [layer.get_seq_length() for layer in cache.layers] == [4, 4]
    cache.crop(-0)
    assert cache.get_seq_length() == 4


def test_reset_empties_and_reuses_buffers():
    cache = PositionalKVCache(2)
    for layer_idx in range(2):
        cache.update(*_kv(6, layer_idx), layer_idx)
    allocated = cache.allocated_bytes()
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.used_bytes() == 0
    assert cache.allocated_bytes() == allocated  # buffers are kept for the next request
    fresh = _kv(3, 7)
    cache.update(*fresh, 0)
    _assert_valid_equal(cache.layers[0], *fresh)


def test_used_and_allocated_bytes():
    empty = PositionalKVCache(2)
    assert empty.used_bytes() == empty.allocated_bytes() == 0
    cache = PositionalKVCache(2)
    for layer_idx in range(2):
        cache.update(*_kv(5, layer_idx, torch.bfloat16), layer_idx)
    per_token = 2 * BATCH * HEADS * DIM * 2  # keys + values, 2 bytes each
    assert cache.used_bytes() == 2 * 5 * per_token
    assert cache.allocated_bytes() == 2 * _INITIAL_CAPACITY * per_token
    cache.truncate(2)
    assert cache.used_bytes() == 2 * 2 * per_token
    assert cache.allocated_bytes() == 2 * _INITIAL_CAPACITY * per_token


# ---- through a real model ----------------------------------------------------------------------


def test_cached_model_rollback_matches_single_prefill():
    model = tiny_llama(seed=3, scale=4.0)
    prompt, drafts, correction = [1, 17, 93, 250, 7, 41], [300, 12, 5, 88, 401], 77
    rolled = CachedModel(model)
    rolled.forward(prompt, last_only=True)
    rolled.forward(drafts)  # t1..t5; only t1, t2 get accepted
    rolled.truncate(len(prompt) + 2)
    assert rolled.num_computed == len(prompt) + 2
    rolled_logits = rolled.forward([correction])  # [1, V]

    fresh = CachedModel(model)
    fresh_logits = fresh.forward(prompt + drafts[:2] + [correction])  # [n, V]
    assert rolled.num_computed == fresh.num_computed == len(prompt) + 3
    torch.testing.assert_close(rolled_logits[-1], fresh_logits[-1], atol=1e-5, rtol=0)
    # Rejected drafts must have changed nothing: without the rollback the logits differ.
    stale = CachedModel(model)
    stale.forward(prompt + drafts)
    assert not torch.allclose(stale.forward([correction])[-1], fresh_logits[-1], atol=1e-3)


def test_cached_model_reset_starts_a_new_sequence():
    model = tiny_llama(seed=3, scale=4.0)
    runner = CachedModel(model)
    runner.forward([1, 2, 3, 4, 5, 6, 7])
    runner.reset()
    assert runner.num_computed == 0
    again = runner.forward([1, 40, 50], last_only=True)  # [V]
    reference = CachedModel(model).forward([1, 40, 50], last_only=True)
    torch.testing.assert_close(again, reference, atol=1e-5, rtol=0)
    assert again.shape == (model.config.vocab_size,)
