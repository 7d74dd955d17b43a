"""Greedy verification: accept while draft == target argmax, then the argmax of the next row."""

from __future__ import annotations

import pytest
import torch

from spectoolkit.config import SamplingConfig
from spectoolkit.kernels.verifier import make_verifier
from spectoolkit.verify import GreedyVerifier, VerifyResult

VOCAB = 8


def _one_hot_logits(target_ids: list[int]) -> torch.Tensor:
    """[len, VOCAB] logits whose row i has its unique maximum at target_ids[i]."""
    logits = torch.randn(len(target_ids), VOCAB, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(target_ids)), target_ids] = 10.0
    return logits


def _ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)  # [γ]


def test_all_accepted_emits_bonus_argmax_of_last_row():
    logits = _one_hot_logits([3, 1, 4, 1, 5])  # [γ+1=5, V]
    result = GreedyVerifier().verify(_ids([3, 1, 4, 1]), logits, None, None)
    assert result == VerifyResult(num_accepted=4, next_token=5)


def test_first_rejected_emits_argmax_of_row_zero():
    logits = _one_hot_logits([3, 1, 4])
    result = GreedyVerifier().verify(_ids([2, 1]), logits, None, None)
    assert result == VerifyResult(num_accepted=0, next_token=3)


def test_middle_rejection_ignores_later_matches():
    logits = _one_hot_logits([3, 1, 4, 1, 5])
    result = GreedyVerifier().verify(_ids([3, 1, 7, 1]), logits, None, None)  # draft 3 matches, too late
    assert result == VerifyResult(num_accepted=2, next_token=4)


def test_gamma_zero_selects_from_row_zero():
    logits = _one_hot_logits([6])  # [1, V]
    result = GreedyVerifier().verify(_ids([]), logits, None, None)
    assert result == VerifyResult(num_accepted=0, next_token=6)


def test_ties_pick_first_maximum():
    logits = torch.zeros(2, VOCAB)
    logits[0, [2, 5]] = 1.0  # tie between 2 and 5: torch.argmax takes 2
    logits[1, [0, 7]] = 1.0
    verifier = GreedyVerifier()
    assert verifier.select(logits[0], None) == 2
    assert verifier.verify(_ids([5]), logits, None, None) == VerifyResult(0, 2)
    assert verifier.verify(_ids([2]), logits, None, None) == VerifyResult(1, 0)


def test_bf16_logits_use_fp32_argmax():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1)).bfloat16()  # [γ+1, V]
    expected = logits.float().argmax(dim=-1)  # [γ+1]
    result = GreedyVerifier().verify(expected[:4], logits, None, None)
    assert result == VerifyResult(4, int(expected[4]))


def test_matches_python_loop_reference_on_random_cases():
    gen = torch.Generator().manual_seed(2)
    verifier = GreedyVerifier()
    for _ in range(200):
        gamma = int(torch.randint(0, 6, (1,), generator=gen))
        logits = torch.randint(0, 3, (gamma + 1, 4), generator=gen).float()  # small range: many ties
        drafts = logits[:gamma].argmax(dim=-1)  # [γ]
        drafts = torch.where(torch.rand(gamma, generator=gen) < 0.3, (drafts + 1) % 4, drafts)
        num_accepted = 0
        while num_accepted < gamma and drafts[num_accepted] == logits[num_accepted].argmax():
            num_accepted += 1
        expected = VerifyResult(num_accepted, int(logits[num_accepted].argmax()))
        assert verifier.verify(drafts, logits, None, None) == expected


def test_select_equals_verify_with_no_drafts():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3))  # [V]
    verifier = GreedyVerifier()
    assert verifier.select(logits, None) == verifier.verify(_ids([]), logits[None], None, None).next_token


def test_wrong_row_count_raises():
    with pytest.raises(ValueError, match="γ\\+1"):
        GreedyVerifier().verify(_ids([1, 2]), torch.zeros(2, VOCAB), None, None)


def test_make_verifier_picks_greedy_for_temperature_zero():
    assert isinstance(make_verifier(SamplingConfig(temperature=0.0)), GreedyVerifier)
