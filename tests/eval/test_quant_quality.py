"""quant_quality: KL, top-1 agreement and perplexity against hand-computed values and tiny models."""

from __future__ import annotations

import math

import pytest
import torch

from spectoolkit.eval.quant_quality import HeldText, measure, position_stats
from spectoolkit.models.tiny import tiny_llama


def test_position_stats_match_hand_computation():
    ref = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]))
    quant = torch.log(torch.tensor([[0.25, 0.5, 0.25], [0.1, 0.7, 0.2]]))
    targets = torch.tensor([0, 1])
    stats = position_stats(ref, quant, targets)
    kl0 = 0.5 * math.log(2) + 0.25 * math.log(0.5)
    kl1 = 0.8 * math.log(0.8 / 0.7) + 0.1 * math.log(0.1 / 0.2)
    torch.testing.assert_close(stats["kl"], torch.tensor([kl0, kl1]))
    assert stats["agree"].tolist() == [0.0, 1.0]
    torch.testing.assert_close(stats["nll_ref"], torch.tensor([math.log(2), -math.log(0.8)]))
    torch.testing.assert_close(stats["nll_quant"], torch.tensor([math.log(4), -math.log(0.7)]))


def _texts() -> list[HeldText]:
    return [HeldText(list(range(3, 30)), 10), HeldText(list(range(40, 60)), 5)]


def test_identical_models_cost_nothing():
    model = tiny_llama(vocab_size=96, seed=2, scale=3.0)
    result = measure(model, model, _texts())
    assert result["kl_mean"] == pytest.approx(0.0, abs=1e-6)
    assert result["top1_agreement"] == 1.0
    assert result["ppl_delta"] == pytest.approx(0.0, abs=1e-4)
    assert result["positions"] == (27 - 10) + (20 - 5) and result["texts"] == 2


def test_perturbed_model_costs_more_the_more_it_is_perturbed():
    reference = tiny_llama(vocab_size=96, seed=2, scale=3.0)
    costs = []
    for noise in (0.01, 0.2):
        perturbed = tiny_llama(vocab_size=96, seed=2, scale=3.0)
        torch.manual_seed(0)
        with torch.no_grad():
            for param in perturbed.parameters():
                param.add_(noise * torch.randn_like(param))
        costs.append(measure(perturbed, reference, _texts()))
    assert 0 < costs[0]["kl_mean"] < costs[1]["kl_mean"]
    assert costs[0]["top1_agreement"] >= costs[1]["top1_agreement"]
