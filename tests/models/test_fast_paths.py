"""The CPU fast paths against their references: GemmLinear vs F.linear, packed GQA vs transformers SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spectoolkit.models.attention import ATTN_NAME, use_packed_attention
from spectoolkit.models.cached import CachedModel
from spectoolkit.models.fast_linear import GemmLinear, use_gemm_linears
from spectoolkit.models.tiny import tiny_llama


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_linear_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(96, 160, bias=bias)
    inputs = torch.randn(1, rows, 96)
    expected = F.linear(inputs, layer.weight, layer.bias)
    use_gemm_linears(layer)
    assert isinstance(layer, GemmLinear)
    got = layer(inputs)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_use_gemm_linears_keeps_tied_parameters_and_skips_half_precision():
    model = tiny_llama(vocab_size=64)
    model.lm_head.weight = model.model.embed_tokens.weight  # tie
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    count = use_gemm_linears(model)
    assert count == sum(isinstance(m, GemmLinear) for m in model.modules()) > 0
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == before
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert use_gemm_linears(tiny_llama(vocab_size=64).to(torch.bfloat16)) == 0


def test_gemm_linear_model_logits_match_reference():
    reference, fast = tiny_llama(vocab_size=128, seed=3), tiny_llama(vocab_size=128, seed=3)
    use_gemm_linears(fast)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-5)


def test_packed_attention_matches_transformers_sdpa_through_a_rollback():
    reference, fast = tiny_llama(vocab_size=128, seed=1), tiny_llama(vocab_size=128, seed=1)
    assert use_packed_attention(fast) and fast.config._attn_implementation == ATTN_NAME
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
