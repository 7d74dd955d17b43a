"""End-to-end exactness of stochastic speculation at batch 1 on the one engine (DESIGN §1).

With temperature > 0 the spec arm (a :class:`~spectoolkit.serving.one.OneRequestEngine` drafting γ = 2) must emit
tokens distributed exactly as the target alone's. A tiny target with a 12-token vocabulary and spread-out
distributions is decoded from one prompt under many seeds by both arms and compared position by position with
:func:`~spectoolkit.eval.stochastic_empirical.engine_exactness` (two-sample chi-square, Bonferroni over
positions); a drafter that lies about the distribution its tokens came from (the negative control) must be
caught by the same test at the same sample size. The T1 model and n-gram drafters at 3 tokens (γ cut by the
room) are tested that way in tests/eval/test_stochastic_empirical.py; here: top-k/top-p sampling and n-gram
lookup over full γ rounds, and the round counters of a budget-cut run.
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.config import SamplingConfig
from spectoolkit.eval.stochastic_empirical import engine_exactness, negative_control
from spectoolkit.serving.api import GenerationOutput
from spectoolkit.serving.one import OneRequestEngine
from tests.eval import one_engines
from tests.eval.one_engines import EOS_IDS, PROMPT, T1, TOP_K_P, VOCAB

GAMMA = 2
SAMPLES, SIGNIFICANCE = 400, 1e-3
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return one_engines.tiny(0)


@pytest.fixture(scope="module")
def draft_model() -> torch.nn.Module:
    return one_engines.tiny(1)


class Recording:
    """An arm that keeps every output it returns (engine_exactness only calls ``generate``)."""

    def __init__(self, engine: OneRequestEngine) -> None:
        self.engine, self.outputs = engine, []

    def generate(self, *args, **kwargs) -> GenerationOutput:
        self.outputs.append(self.engine.generate(*args, **kwargs))
        return self.outputs[-1]


def _exactness(target, draft_model, sampling: SamplingConfig, length: int) -> tuple[dict, list[GenerationOutput]]:
    """engine_exactness of the spec arm (a model drafter, or n-gram lookup with one-hot q when ``draft_model`` is
    None) against the target alone, ``length`` tokens per generation; (the result, the spec arm's outputs)."""
    drafter = one_engines.batched(draft_model, sampling, VOCAB, EOS_IDS)
    arms = one_engines.arms(target, drafter, negative_control(drafter, sampling), sampling, GAMMA, EOS_IDS)
    spec = arms["spec"] = Recording(arms["spec"])
    result = engine_exactness(arms.__getitem__, PROMPT, SAMPLES, length, 0, SIGNIFICANCE)
    assert len(spec.outputs) == SAMPLES
    assert result["passed"] and result["min_p_value"] > result["threshold"], result["positions"]
    assert result["power_shown"] and result["control"]["min_p_value"] < 1e-5, result["control"]["positions"]
    return result, spec.outputs


def _check_counters(outputs: list[GenerationOutput], max_new: int) -> None:
    for out in outputs:
        assert len(out.output_ids) <= max_new
        assert out.verify_rounds == len(out.accept_lengths) == len(out.draft_lengths) == len(out.chosen_lengths)
        assert sum(out.accept_lengths) == out.accepted_tokens <= out.drafted_tokens == sum(out.draft_lengths)
        assert all(0 <= a <= d <= c <= GAMMA for a, d, c in zip(out.accept_lengths, out.draft_lengths,
                                                                out.chosen_lengths, strict=True))  # fmt: skip
        assert out.rollback_count == sum(a < d for a, d in zip(out.accept_lengths, out.draft_lengths, strict=True))
        assert out.proposed_rounds == sum(d > 0 for d in out.draft_lengths)


def test_top_k_top_p_model_drafter_keeps_the_target_distribution(target, draft_model):
    """4 tokens: the first round drafts the full γ = 2 after the prefill's token."""
    result, outputs = _exactness(target, draft_model, TOP_K_P, 4)
    _check_counters(outputs, 4)
    assert 0.2 < result["acceptance_rate"] < 0.9  # both acceptances and rejections (residual samples) happen
    first_round = [o.draft_lengths[0] for o in outputs if o.verify_rounds]
    assert max(first_round) == GAMMA  # fewer only when a draft is EOS


def test_ngram_drafter_one_hot_keeps_the_target_distribution(target):
    result, outputs = _exactness(target, None, T1, 4)
    _check_counters(outputs, 4)
    rounds = sum(o.verify_rounds for o in outputs)
    assert sum(o.proposed_rounds for o in outputs) > 0.5 * rounds  # the lookup really proposes
    assert 0 < sum(o.accepted_tokens for o in outputs) < sum(o.drafted_tokens for o in outputs)


def test_a_budget_cut_run_drafts_what_room_is_left(target, draft_model):
    """3 tokens leave room for 1 draft in round one (plus the target's token); after a rejection the last round
    has no room to draft: 0 drafts, the bonus token only. (Its distribution: tests/eval/test_stochastic_empirical.)"""
    drafter = one_engines.batched(draft_model, T1, VOCAB, EOS_IDS)
    spec = one_engines.arms(target, drafter, negative_control(drafter, T1), T1, GAMMA, EOS_IDS)["spec"]
    outputs = [spec.generate(PROMPT, 3, torch.Generator().manual_seed(seed)) for seed in range(200)]
    _check_counters(outputs, 3)
    accepted, drafted = sum(o.accepted_tokens for o in outputs), sum(o.drafted_tokens for o in outputs)
    assert 0.2 < accepted / drafted < 0.9
    assert max(o.draft_lengths[0] for o in outputs if o.verify_rounds) == 1 == min(GAMMA, 3 - 2)
    assert any(o.draft_lengths[1:] == [0] for o in outputs)
    assert all(o.chosen_lengths[1:] == [0] for o in outputs if o.accept_lengths[:1] == [0] and len(o.output_ids) == 3)
