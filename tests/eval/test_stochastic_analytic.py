"""Analytic exactness (spectoolkit.eval.stochastic_analytic): TV ≈ 0 for the real verifier, not for bugs.

Target: the tiny random checkpoint (vocab 49152). Draft: the same checkpoint with a perturbed output
head (p ≠ q substantially, yet overlapping top-k sets), or n-gram lookup (one-hot q).
"""

from __future__ import annotations

import pytest
import torch

import spectoolkit.eval.stochastic_analytic as analytic
from spectoolkit.config import SamplingConfig
from spectoolkit.errors import SpecToolkitError
from spectoolkit.eval.stochastic_analytic import (
    analytic_exactness,
    normalization_gap,
    total_variation,
    verifier_output_probs,
)
from spectoolkit.quant.packing import pack_model
from spectoolkit.wiring.loading import load_model

PROMPTS = [[1, 17, 305, 4096, 77, 9000], [1, 640, 12, 640, 12, 33]]
POSITIONS = 6
T1 = SamplingConfig(temperature=1.0)
SHARP_TOP_K_P = SamplingConfig(temperature=0.5, top_k=50, top_p=0.95)
CLEARLY_NONZERO = 1e-2
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_checkpoint) -> torch.nn.Module:
    return load_model(str(tiny_checkpoint), "fp32", torch.device("cpu")).model


@pytest.fixture(scope="module")
def draft(tiny_checkpoint) -> torch.nn.Module:
    """The target checkpoint with noise on the output head: a plausible but different draft."""
    model = load_model(str(tiny_checkpoint), "fp32", torch.device("cpu"), kernels=None).model
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        weight.add_(0.7 * weight.std() * torch.randn(weight.shape, generator=generator))
    pack_model(model)  # as load_model would have, on the perturbed weights
    return model


@pytest.mark.parametrize("sampling", [T1, SHARP_TOP_K_P], ids=["T1", "T0.5-top_k50-top_p0.95"])
def test_real_verifier_is_exact_and_controls_are_not(target, draft, sampling):
    result = analytic_exactness(target, draft, PROMPTS, sampling, POSITIONS, seed=3)
    assert result["positions"] == len(PROMPTS) * POSITIONS
    assert result["max_tv"] < 1e-6 and result["max_excess_tv"] <= result["max_tv"], result
    assert result["passed"] and result["accept_rule_mismatches"] == 0
    assert set(result["controls"]) == {"draft_argmax", "top_p_draft_only"}
    for name, control in result["controls"].items():
        assert control["max_tv"] > CLEARLY_NONZERO, (name, control)


def test_draft_differs_from_target(target, draft):
    """The check is only meaningful if p ≠ q: rejections (the residual) carry real mass."""
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        target_probs = torch.softmax(target(ids).logits[0, -1] / 0.5, -1)
        draft_probs = torch.softmax(draft(ids).logits[0, -1] / 0.5, -1)
    assert total_variation(target_probs, draft_probs) > 0.1


def test_ngram_one_hot_is_exact(target):
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # the suffix recurs: the lookup proposes at position 0
    result = analytic_exactness(target, None, [prompt], T1, 3, seed=0, ngram_min=1)
    assert result["positions"] >= 1
    assert result["positions"] + result["positions_skipped"] == 3
    assert result["passed"] and result["max_tv"] < 1e-6
    assert set(result["controls"]) == {"uniform_q", "top_p_draft_only"}
    for name, control in result["controls"].items():
        assert control["max_tv"] > CLEARLY_NONZERO, (name, control)


def test_output_probs_hand_example():
    """p = [.5, .3, .2], q = [.2, .5, .3]: accept mass .2 + .3 + .2, residual [.3, 0, 0] -> out = p."""
    target_probs, draft_probs = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    out, mismatches = verifier_output_probs(draft_probs, draft_probs, target_probs)
    assert torch.allclose(out, target_probs.double(), atol=1e-7) and mismatches == 0
    argmax = torch.tensor([0.0, 1.0, 0.0])  # proposes token 1 always, reports q: out = .6·δ1 + .4·δ0
    out, _ = verifier_output_probs(argmax, draft_probs, target_probs)
    assert torch.allclose(out, torch.tensor([0.4, 0.6, 0.0], dtype=torch.float64), atol=1e-7)


def test_unnormalized_fp32_rows_stay_within_the_normalization_gap():
    """Rows off 1 by ~1e-5 (as fp32 softmax over 49k tokens leaves them): TV ≤ |Σp/Σq − 1| + rounding."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        target_probs = torch.softmax(2 * torch.randn(64, generator=generator), -1) * (
            1 + 2e-5 * torch.rand(1, generator=generator)
        )
        draft_probs = torch.softmax(2 * torch.randn(64, generator=generator), -1) * (
            1 - 2e-5 * torch.rand(1, generator=generator)
        )
        for proposal in (draft_probs, (draft_probs == draft_probs.max()).float()):  # model draft, one-hot
            out, _ = verifier_output_probs(proposal, proposal, target_probs)
            tv, gap = total_variation(out, target_probs), normalization_gap(target_probs, proposal)
            assert tv <= gap + 1e-7, (tv, gap)
    assert gap > 1e-6  # the gap is what the rows carry, not rounding noise


def test_a_wrong_residual_in_the_verifier_shows_up(target, draft, monkeypatch):
    """The check uses the verifier's own residual: resampling from p instead of max(0, p − q) is caught."""
    monkeypatch.setattr(analytic, "_residual", lambda target_row, draft_row: target_row)
    result = analytic_exactness(target, draft, PROMPTS[:1], T1, 2, seed=3)
    assert not result["passed"] and result["max_tv"] > CLEARLY_NONZERO


def test_a_wrong_acceptance_rule_shows_up(monkeypatch):
    """``_accept_mask`` is probed: a rule without the p > 0 guard, or with q/p, is reported."""

    def no_guard(draft_ids, draft_probs, target_probs, uniforms):
        index = draft_ids.unsqueeze(-1)
        return uniforms * draft_probs.gather(-1, index).squeeze(-1) <= target_probs.gather(-1, index).squeeze(-1)

    def inverted(draft_ids, draft_probs, target_probs, uniforms):
        index = draft_ids.unsqueeze(-1)
        return uniforms * target_probs.gather(-1, index).squeeze(-1) <= draft_probs.gather(-1, index).squeeze(-1)

    target_probs, draft_probs = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.2, 0.6, 0.2])
    for wrong in (no_guard, inverted):
        monkeypatch.setattr(analytic, "_accept_mask", wrong)
        assert verifier_output_probs(draft_probs, draft_probs, target_probs)[1] > 0, wrong.__name__


def test_greedy_is_refused(target):
    with pytest.raises(SpecToolkitError, match="temperature"):
        analytic_exactness(target, None, PROMPTS, SamplingConfig(temperature=0.0), 2, seed=0)
