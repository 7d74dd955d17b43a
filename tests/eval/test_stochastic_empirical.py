"""Empirical exactness (spectoolkit.eval.stochastic_empirical): per-position chi-square tests.

A tiny target with a 12-token vocabulary (spread-out distributions, so 400 samples give the test
power) is continued by the target alone and by the speculative sampler. The real drafters must not
be rejected; their negative controls must be, at the same sample size. Seeds are fixed, so the
outcome is deterministic.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from spectoolkit.config import SamplingConfig
from spectoolkit.drafting import ModelDrafter, NgramDrafter
from spectoolkit.engine import SpeculativeEngine
from spectoolkit.eval.stochastic_empirical import (
    ENDED,
    PromptKept,
    chi_square_homogeneity,
    empirical_exactness,
    engine_exactness,
    negative_control,
    pooled_table,
    two_sample_test,
)
from spectoolkit.kernels.verifier import make_verifier
from spectoolkit.models.cached import CachedModel
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.sampling import make_chooser
from tests.eval import one_engines

VOCAB = 12
EOS_IDS = frozenset({2})
PROMPT = [1, 5, 7, 3, 9, 4, 11, 6, 8, 10, 0, 3, 5, 7]  # every non-EOS id occurs: n-gram lookup proposes
SAMPLES, LENGTH, SIGNIFICANCE = 400, 3, 1e-3
T1 = SamplingConfig(temperature=1.0)
TOP_K_P = SamplingConfig(temperature=1.0, top_k=5, top_p=0.9)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> CachedModel:
    return CachedModel(tiny_llama(vocab_size=VOCAB, seed=0, num_layers=1, hidden=32, scale=3.0))


@pytest.fixture(scope="module")
def draft_model() -> torch.nn.Module:
    return tiny_llama(vocab_size=VOCAB, seed=1, num_layers=1, hidden=32, scale=3.0)


def _run(target, drafter, sampling: SamplingConfig) -> dict:
    def make_drafter(control: bool):
        return negative_control(drafter, sampling) if control else drafter

    return empirical_exactness(target, make_drafter, sampling, 2, EOS_IDS, PROMPT, SAMPLES, LENGTH, 0, SIGNIFICANCE)


def _assert_accepted_and_control_rejected(result: dict) -> None:
    assert result["samples"] == SAMPLES and result["length"] == LENGTH
    assert len(result["positions"]) == LENGTH
    assert result["threshold"] == pytest.approx(SIGNIFICANCE / LENGTH)
    assert result["passed"] and result["min_p_value"] > result["threshold"], result["positions"]
    assert all(position["categories"] >= 2 for position in result["positions"][1:])  # something to compare
    assert result["control"]["rejected"] and result["power_shown"], result["control"]["positions"]
    assert result["control"]["min_p_value"] < 1e-5


@pytest.mark.parametrize("sampling", [T1, TOP_K_P], ids=["T1", "top_k5-top_p0.9"])
def test_model_drafter_accepted_control_rejected(target, draft_model, sampling):
    drafter = ModelDrafter(draft_model, make_chooser(sampling), VOCAB, VOCAB, EOS_IDS)
    result = _run(target, drafter, sampling)
    _assert_accepted_and_control_rejected(result)
    assert 0.2 < result["acceptance_rate"] < 0.95  # both acceptances and residual samples happen


def test_ngram_drafter_accepted_control_rejected(target):
    drafter = NgramDrafter(max_n=3, min_n=1, target_vocab_size=VOCAB, one_hot_probs=True)
    result = _run(target, drafter, T1)
    _assert_accepted_and_control_rejected(result)
    assert 0 < result["acceptance_rate"] < 1


def test_chi_square_matches_scipy_reference():
    """A 3×2 table: statistic and p-value by hand (2 dof: closed form) and as scipy's chi2_contingency."""
    rows = [[30, 10], [20, 25], [10, 25]]
    got = chi_square_homogeneity(rows)
    reference = stats.chi2_contingency(np.array(rows), correction=False)
    assert got.dof == 2 and got.statistic == pytest.approx(reference.statistic, rel=1e-12)
    assert got.p_value == pytest.approx(reference.pvalue, rel=1e-9)
    # by hand: expected counts 20, 22.5, 17.5 per arm; χ² = 2·(10²/20 + 2.5²/22.5 + 7.5²/17.5) = 1070/63
    assert got.statistic == pytest.approx(1070 / 63, rel=1e-12)
    assert got.p_value == pytest.approx(math.exp(-1070 / 126), rel=1e-9)  # χ² sf with 2 dof: exp(-x/2)
    assert got.p_value == pytest.approx(2.0508962237e-04, rel=1e-9)


def test_single_category_is_not_rejected():
    assert chi_square_homogeneity([[50, 50]]).p_value == 1.0
    assert two_sample_test(Counter({4: 100}), Counter({4: 100})).dof == 0


def test_pooling_merges_rare_outcomes():
    common = Counter({token: 100 for token in range(6)})
    rare_first, rare_second = Counter({9: 1, 8: 2, ENDED: 3}), Counter({7: 3, 9: 4})
    rows = pooled_table(common + rare_first, common + rare_second)
    assert rows[:6] == [[100, 100]] * 6 and rows[6] == [6, 7]  # 13 rare outcomes pooled: expected 6.5 each
    tiny_other = pooled_table(common + Counter({9: 1}), common + Counter({8: 2}))
    assert len(tiny_other) == 6 and sum(map(sum, tiny_other)) == 1203  # too small: folded into a row
    assert two_sample_test(common + rare_first, common + rare_second).p_value > 0.5
    shifted = Counter({token: 100 + 100 * (token % 2) for token in range(6)})
    assert two_sample_test(common, shifted).p_value < 1e-3


def test_prompt_kept_generations_equal_fresh_ones(target, draft_model):
    """Prefix caching changes nothing: seeded generations are token for token those of fresh runs."""
    sampling = TOP_K_P
    prompt = [3, 1, 4, 1, 5]
    verifier = make_verifier(sampling)
    fresh_drafter = ModelDrafter(draft_model, make_chooser(sampling), VOCAB, VOCAB, EOS_IDS)
    fresh = SpeculativeEngine(target, fresh_drafter, verifier, 2, EOS_IDS)
    expected = [fresh.generate(prompt, 6, torch.Generator().manual_seed(s)).output_ids for s in range(5)]
    kept_runner = PromptKept(CachedModel(target.model), prompt)
    kept_drafter = ModelDrafter(draft_model, make_chooser(sampling), VOCAB, VOCAB, EOS_IDS)
    kept_drafter.runner = PromptKept(kept_drafter.runner, prompt)
    kept = SpeculativeEngine(kept_runner, kept_drafter, verifier, 2, EOS_IDS)
    got = [kept.generate(prompt, 6, torch.Generator().manual_seed(s)).output_ids for s in range(5)]
    assert got == expected
    assert kept_runner.prompt_logits is not None and kept_drafter.runner.num_computed >= len(prompt)


# ---- the same test through the one engine: batch-1 arms of the continuous-batching engine ----


@pytest.mark.parametrize("kind", ["model", "ngram"])
def test_the_one_engine_sampler_is_accepted_and_its_control_rejected(target, draft_model, kind):
    drafter = one_engines.batched(draft_model if kind == "model" else None, T1, VOCAB, EOS_IDS)
    engines = one_engines.arms(target.model, drafter, negative_control(drafter, T1), T1, 2, EOS_IDS)
    result = engine_exactness(engines.__getitem__, PROMPT, SAMPLES, LENGTH, 0, SIGNIFICANCE)
    _assert_accepted_and_control_rejected(result)
    assert 0 < result["acceptance_rate"] < 1
