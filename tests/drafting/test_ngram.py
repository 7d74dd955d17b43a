"""Prompt-lookup proposer: latest match, longest n first, budget, no self-match."""

from __future__ import annotations

import pytest
import torch

from spectoolkit.drafting import Budget, Lone, NgramDrafter, TokenTree, lookup


def _lookup(tokens: list[int], max_n: int = 3, min_n: int = 1, budget: int = 4) -> list[int]:
    return lookup(torch.tensor(tokens), max_n, min_n, budget)


def test_proposes_what_followed_the_match():
    assert _lookup([5, 6, 7, 8, 9, 1, 5, 6]) == [7, 8, 9, 1]


def test_takes_the_latest_match():
    # [3] occurs at 0 (followed by 10) and at 2 (followed by 20): the later one wins.
    assert _lookup([3, 10, 3, 20, 21, 3], budget=2) == [20, 21]


def test_prefers_the_longest_n():
    # Suffix [1, 2]: as a 2-gram it matches at 0 (-> 3); the 1-gram [2] matches later, at 4 (-> 5).
    tokens = [1, 2, 3, 9, 2, 5, 7, 1, 2]
    assert _lookup(tokens, max_n=2, budget=2) == [3, 9]
    assert _lookup(tokens, max_n=1, budget=2) == [5, 7]


def test_min_n_above_the_only_match_finds_nothing():
    tokens = [1, 2, 3, 9, 2, 5, 7, 4, 2]  # only the 1-gram [2] recurs
    assert _lookup(tokens, max_n=3, min_n=1, budget=2) == [5, 7]
    assert _lookup(tokens, max_n=3, min_n=2, budget=2) == []


def test_no_match_returns_empty():
    assert _lookup([4, 5, 6, 7, 8]) == []
    assert _lookup([4]) == []  # nothing before the suffix


def test_never_matches_the_suffix_with_itself():
    # Distinct tokens: the suffix occurs only as itself, at the end.
    assert _lookup(list(range(10, 30)), max_n=5) == []
    # An overlapping earlier occurrence is a real match: [4, 4] at 0 is followed by the last 4.
    assert _lookup([4, 4, 4], max_n=2, budget=3) == [4]


@pytest.mark.parametrize("budget", [1, 2, 3, 10])
def test_respects_budget_and_context_end(budget):
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    proposal = _lookup(tokens, budget=budget)
    assert proposal == [3, 4, 5, 6, 1, 2][:budget]  # at most what follows the match in the context


def _propose(drafter: NgramDrafter, tokens: list[int], budget: int) -> TokenTree:
    """A chain of at most ``budget`` drafts for a lone sequence of ``tokens``."""
    (chain,) = drafter.propose([Lone(tokens)], [Budget(budget, budget)])
    assert chain.is_chain()
    return chain


def test_drafter_one_hot_probs():
    vocab = 16
    drafter = NgramDrafter(max_n=3, min_n=1, target_vocab_size=vocab, one_hot_probs=True)
    proposal = _propose(drafter, [5, 6, 7, 8, 9, 5, 6], budget=3)
    assert proposal.token_ids == [7, 8, 9]
    assert proposal.draft_probs.shape == (3, vocab)
    assert proposal.draft_probs.dtype == torch.float32
    expected = torch.zeros(3, vocab)
    expected[torch.arange(3), torch.tensor([7, 8, 9])] = 1.0
    assert torch.equal(proposal.draft_probs, expected)


def test_drafter_empty_and_greedy_proposals():
    one_hot = NgramDrafter(max_n=3, min_n=1, target_vocab_size=16, one_hot_probs=True)
    empty = _propose(one_hot, [1, 2, 3], budget=4)
    assert len(empty) == 0 and empty.draft_probs.shape == (0, 16)
    greedy = NgramDrafter(max_n=3, min_n=1, target_vocab_size=16, one_hot_probs=False)
    proposal = _propose(greedy, [1, 2, 3, 1], budget=4)
    assert proposal.token_ids == [2, 3, 1] and proposal.draft_probs is None
