"""The CPU fast paths against their references: linear kernel variants vs F.linear, packed/row-wise GQA vs SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spectoolkit.models.attention import (
    ATTN_NAME,
    ROWWISE_ATTN_NAME,
    packed_gqa_attention,
    rowwise_gqa_attention,
    use_packed_attention,
    use_rowwise_attention,
)
from spectoolkit.models.cached import CachedModel
from spectoolkit.models.kernel_choice import (
    BY_NAME,
    ChoiceCache,
    ChunkedForward,
    choose_kernels,
    install,
    linear_layers,
)
from spectoolkit.models.tiny import tiny_llama


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_kernel_variants_match_f_linear(rows, bias, name):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(96, 160, bias=bias)
    inputs = torch.randn(1, rows, 96)
    expected = F.linear(inputs, layer.weight, layer.bias)
    install(layer, BY_NAME[name])
    got = layer(inputs)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_kernel_choice_keeps_tied_parameters():
    model = tiny_llama(vocab_size=64)
    model.lm_head.weight = model.model.embed_tokens.weight  # tie
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    chosen = choose_kernels(model, "auto", cache=ChoiceCache(None))
    assert chosen and all(isinstance(m.forward, ChunkedForward) for _, m in linear_layers(model))
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == before
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_kernel_variant_model_logits_match_reference():
    reference, fast = tiny_llama(vocab_size=128, seed=3), tiny_llama(vocab_size=128, seed=3)
    for _, layer in linear_layers(fast):
        install(layer, BY_NAME["gemm8"])
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("use, name", [(use_packed_attention, ATTN_NAME), (use_rowwise_attention, ROWWISE_ATTN_NAME)])
def test_fast_attention_matches_transformers_sdpa_through_a_rollback(use, name):
    reference, fast = tiny_llama(vocab_size=128, seed=1), tiny_llama(vocab_size=128, seed=1)
    assert use(fast) and fast.config._attn_implementation == name
    assert reference.config.num_attention_heads > reference.config.num_key_value_heads  # GQA is exercised
    ref_runner, fast_runner = CachedModel(reference), CachedModel(fast)
    chunks = [list(range(3, 40)), [5], [6, 7, 8, 9], [10]]
    for chunk in chunks:  # prefill, decode, verify-width, decode
        torch.testing.assert_close(fast_runner.forward(chunk), ref_runner.forward(chunk), rtol=1e-5, atol=1e-6)
    for runner in (ref_runner, fast_runner):
        runner.truncate(30)  # reject the tail: the next multi-token forward sees a shorter prefix
    torch.testing.assert_close(fast_runner.forward([1, 2, 3]), ref_runner.forward([1, 2, 3]), rtol=1e-5, atol=1e-6)


def test_packed_attention_is_skipped_for_non_sdpa_models():
    model = tiny_llama(vocab_size=64)
    model.set_attn_implementation("eager")
    assert not use_packed_attention(model)
    assert model.config._attn_implementation == "eager"


def test_rowwise_attention_is_kept_by_use_packed_attention():
    model = tiny_llama(vocab_size=64)
    assert use_packed_attention(model) and use_rowwise_attention(model)  # packed -> rowwise is allowed
    assert not use_packed_attention(model)  # ... but never back: load_model must not undo a rowwise choice
    assert model.config._attn_implementation == ROWWISE_ATTN_NAME


def _causal_mask(q_len: int, kv_len: int) -> torch.Tensor:  # [1, 1, q, L], what sdpa_mask builds for batch 1
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None]


@pytest.mark.parametrize("masked", [False, True])
def test_rowwise_attention_rows_equal_single_row_calls(masked):
    """Each row of a q-row call is bit-identical to the decode-step call at its position."""
    torch.manual_seed(0)
    module = torch.nn.Module().eval()
    q_len, kv_len = 5, 23
    query = torch.randn(1, q_len, 6, 16).transpose(1, 2)  # [B, Hq, q, D], strided like a real model's
    key, value = torch.randn(1, 2, kv_len, 16), torch.randn(1, 2, kv_len, 16)  # [B, Hkv, L, D]
    mask = _causal_mask(q_len, kv_len) if masked else None
    batch, _ = rowwise_gqa_attention(module, query, key, value, mask, scaling=0.25)  # [B, q, Hq, D]
    packed, _ = packed_gqa_attention(module, query, key, value, mask, scaling=0.25)
    torch.testing.assert_close(batch, packed, rtol=1e-5, atol=1e-6)
    for i in range(q_len):
        end = kv_len - q_len + i + 1
        row, _ = rowwise_gqa_attention(
            module, query[:, :, i : i + 1], key[:, :, :end], value[:, :, :end], None, scaling=0.25
        )
        assert torch.equal(batch[:, i : i + 1], row)


def test_rowwise_attention_keeps_a_non_causal_mask():
    torch.manual_seed(0)
    module = torch.nn.Module().eval()
    query, key, value = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    mask = _causal_mask(3, 10).clone()
    mask[..., :2] = False  # left padding
    rowwise, _ = rowwise_gqa_attention(module, query, key, value, mask)
    packed, _ = packed_gqa_attention(module, query, key, value, mask)
    torch.testing.assert_close(rowwise, packed, rtol=1e-5, atol=1e-6)
