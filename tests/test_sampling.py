"""Shared token selection: processed_probs follows transformers' warpers; sample_from is exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from spectoolkit.config import SamplingConfig
from spectoolkit.sampling import processed_probs, sample_from

VOCAB = 10


def _hf_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """logits [B, V] -> [B, V] through the warper chain transformers' generate() builds."""
    chain = LogitsProcessorList([TemperatureLogitsWarper(sampling.temperature)])
    if sampling.top_k:
        chain.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        chain.append(TopPLogitsWarper(sampling.top_p))
    input_ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)  # unused by these warpers
    return torch.softmax(chain(input_ids, logits.clone()), dim=-1)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [
        (1.0, 0, 1.0),  # nothing but softmax
        (0.7, 3, 1.0),
        (1.0, 0, 0.8),
        (0.5, 5, 0.9),
        (1.3, VOCAB + 2, 0.5),  # top_k beyond the vocabulary: disabled
        (2.0, 1, 1.0),  # top-1: one token left
        (1.0, 0, 0.05),  # tiny top_p still keeps the most likely token
        (1.0, 0, 0.5),  # 1 - top_p exact: cumulative mass lands on it with tied logits
    ],
)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_processed_probs_matches_transformers_warpers(temperature, top_k, top_p, ties):
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    gen = torch.Generator().manual_seed(0)
    logits = 2.0 * torch.randn(16, VOCAB, generator=gen)  # [B, V]
    if ties:  # small integers tie often: the top-k cut lands inside a tie
        logits = torch.randint(0, 3, (16, VOCAB), generator=gen).float()
        logits[0] = float("-inf")
        logits[0, :4] = 0.0  # four tokens of mass 0.25 exactly: cumulative mass hits 1 - top_p = 0.5
    ours, reference = processed_probs(logits, sampling), _hf_probs(logits, sampling)
    assert ours.dtype == torch.float32
    assert torch.equal(ours > 0, reference > 0)  # the same support, exactly
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-5)


def test_processed_probs_handles_leading_dims_and_bf16():
    sampling = SamplingConfig(temperature=0.8, top_k=4, top_p=0.9)
    logits = torch.randn(2, 3, VOCAB, generator=torch.Generator().manual_seed(1))  # [2, 3, V]
    batched = processed_probs(logits.bfloat16(), sampling)
    assert batched.dtype == torch.float32 and batched.shape == (2, 3, VOCAB)
    torch.testing.assert_close(batched.sum(-1), torch.ones(2, 3))
    rowwise = torch.stack([processed_probs(row, sampling) for row in logits.bfloat16().reshape(6, VOCAB)])
    torch.testing.assert_close(batched.reshape(6, VOCAB), rowwise)


def _probs_with_zeros() -> torch.Tensor:
    """[V] with zero mass at the first, a middle and the last two tokens."""
    probs = torch.tensor([0.0, 0.1, 0.2, 0.0, 0.05, 0.25, 0.15, 0.25, 0.0, 0.0])
    return probs / probs.sum()


@pytest.mark.parametrize("scale", [1.0, 0.3])  # 0.3: an unnormalized residual
def test_sample_from_never_returns_zero_probability_token(scale):
    probs = scale * _probs_with_zeros()
    edges = torch.tensor([0.0, torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()])
    uniforms = torch.cat([edges, torch.rand(2000, generator=torch.Generator().manual_seed(2))])
    drawn = {sample_from(probs, u) for u in uniforms}
    assert all(probs[token] > 0 for token in drawn)
    assert sample_from(probs, edges[0]) == 1  # u = 0: the first positive token
    assert sample_from(probs, edges[1]) == 7  # u just below 1: the last positive token


def test_sample_from_accepts_0d_and_1d_uniform():
    probs = _probs_with_zeros()
    assert sample_from(probs, torch.tensor(0.5)) == sample_from(probs, torch.tensor([0.5]))


def _sample_counts(probs: torch.Tensor, draws: int) -> np.ndarray:
    uniforms = torch.rand(draws, generator=torch.Generator().manual_seed(3))
    tokens = [sample_from(probs, u) for u in uniforms]
    return np.bincount(tokens, minlength=probs.shape[0])


def _pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit on the support of ``probs``; counts outside it fail outright."""
    if counts[probs == 0].any():
        return 0.0
    expected = probs[probs > 0] * counts.sum() / probs.sum()
    assert expected.min() >= 5, "test design: every cell needs an expected count of at least 5"
    return float(stats.chisquare(counts[probs > 0], expected).pvalue)


@pytest.mark.parametrize("scale", [1.0, 0.3])  # 0.3: an unnormalized residual
def test_sample_from_empirical_distribution_matches_probs(scale):
    probs = scale * _probs_with_zeros()
    counts = _sample_counts(probs, 20_000)
    assert _pvalue(counts, probs.double().numpy()) > 1e-3
    # The same check has power: a slightly different distribution is rejected.
    shifted = (probs + 0.03 * (probs > 0)).double().numpy()
    assert _pvalue(counts, shifted) < 1e-6
