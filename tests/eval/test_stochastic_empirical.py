"""Empirical exactness (spectoolkit.eval.stochastic_empirical): per-position chi-square tests.

A tiny target with a 12-token vocabulary (spread-out distributions, so 400 samples give the test
power) is continued by the target alone and by the speculative sampler: batch-1 arms of the one
engine (:mod:`tests.eval.one_engines`). The real drafters must not be rejected; their negative
controls must be, at the same sample size. Seeds are fixed, so the outcome is deterministic.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from spectoolkit.config import SamplingConfig
from spectoolkit.drafting import ModelDrafter
from spectoolkit.eval.stochastic_empirical import (
    ENDED,
    UniformReportingNgram,
    chi_square_homogeneity,
    engine_exactness,
    negative_control,
    pooled_table,
    two_sample_test,
)
from tests.eval import one_engines
from tests.eval.one_engines import EOS_IDS, PROMPT, T1, VOCAB

SAMPLES, LENGTH, SIGNIFICANCE = 400, 3, 1e-3
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return one_engines.tiny(0)


@pytest.fixture(scope="module")
def draft_model() -> torch.nn.Module:
    return one_engines.tiny(1)


def _run(target, draft_model, kind: str, sampling: SamplingConfig) -> dict:
    """The chi-square tests of ``kind``'s sampler ("model": the draft model; "ngram") and its negative control."""
    drafter = one_engines.batched(draft_model if kind == "model" else None, sampling, VOCAB, EOS_IDS)
    engines = one_engines.arms(target, drafter, negative_control(drafter, sampling), sampling, 2, EOS_IDS)
    return engine_exactness(engines.__getitem__, PROMPT, SAMPLES, LENGTH, 0, SIGNIFICANCE)


def _assert_accepted_and_control_rejected(result: dict) -> None:
    assert result["samples"] == SAMPLES and result["length"] == LENGTH
    assert len(result["positions"]) == LENGTH
    assert result["threshold"] == pytest.approx(SIGNIFICANCE / LENGTH)
    assert result["passed"] and result["min_p_value"] > result["threshold"], result["positions"]
    assert all(position["categories"] >= 2 for position in result["positions"][1:])  # something to compare
    assert result["control"]["rejected"] and result["power_shown"], result["control"]["positions"]
    assert result["control"]["min_p_value"] < 1e-5


def test_model_drafter_accepted_control_rejected(target, draft_model):
    """T1; top-k/top-p sampling: tests/serving/test_one_engine_stochastic.py (4 tokens, full γ rounds)."""
    result = _run(target, draft_model, "model", T1)
    _assert_accepted_and_control_rejected(result)
    assert 0.2 < result["acceptance_rate"] < 0.95  # both acceptances and residual samples happen


def test_ngram_drafter_accepted_control_rejected(target, draft_model):
    result = _run(target, draft_model, "ngram", T1)
    _assert_accepted_and_control_rejected(result)
    assert 0 < result["acceptance_rate"] < 1


def test_negative_control_per_drafter_kind(draft_model):
    model = one_engines.batched(draft_model, T1, VOCAB, EOS_IDS)
    control = negative_control(model, T1)
    assert type(control) is ModelDrafter and control.runner is model.runner  # same draft model, same pool
    assert control.name == f"{model.name}-argmax-control"
    assert isinstance(negative_control(one_engines.batched(None, T1, VOCAB, EOS_IDS), T1), UniformReportingNgram)
    with pytest.raises(TypeError, match="NEGATIVE_CONTROLS"):
        negative_control(object(), T1)


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
