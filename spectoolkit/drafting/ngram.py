"""Prompt-lookup (n-gram) proposer: copy what followed the last occurrence of the current suffix.

Saxena's prompt lookup decoding, as in transformers' ``prompt_lookup_num_tokens``: match the
trailing n-gram (longest n first) against earlier context and propose the tokens that followed it.
We take the most recent match, which tracks the text being generated better than the first.
A proposal is deterministic: when sampling, its distribution q is one-hot at the proposed token,
which keeps the stochastic acceptance test exact.
"""

from __future__ import annotations

import torch

from spectoolkit.drafting.base import Proposal
from spectoolkit.drafting.tree import TokenTree


class NgramDrafter:
    """Proposes continuations found in the prompt and the output so far."""

    def __init__(self, max_n: int, min_n: int, target_vocab_size: int, one_hot_probs: bool) -> None:
        self.max_n = max_n
        self.min_n = min_n
        self.target_vocab_size = target_vocab_size
        self.one_hot_probs = one_hot_probs
        self.name = "ngram"
        self.tree_kind = "trie"  # its trees are tries of continuations, whatever speculate.tree.kind says

    def begin(self, prompt_ids: list[int]) -> None:
        pass

    def rollback(self, num_kept: int) -> None:
        pass  # stateless: the next lookup reads the verified tokens only

    def kv_bytes(self) -> int:
        return 0  # no model, no cache

    def propose_tree(self, tokens: list[int], tree, budget: int, max_depth: int, generator) -> TokenTree:
        """The distinct continuations (depth <= ``max_depth``) of every earlier match of the suffix, as a trie.

        Matches of the longest suffix come first, the most recent first; shorter suffixes add theirs
        while ``budget`` nodes remain. Children are deterministic, so each node's q is one-hot.
        """
        token_ids, parents = continuation_trie(torch.tensor(tokens), self.max_n, self.min_n, max_depth, budget)
        probs = None
        if self.one_hot_probs:
            probs = torch.zeros(len(token_ids), self.target_vocab_size)  # [n, V]
            probs[torch.arange(len(token_ids)), token_ids] = 1.0
        return TokenTree(token_ids, parents, probs)

    def commit_path(self, num_prefix: int, path: list[int]) -> None:
        pass  # stateless

    def propose(self, tokens: list[int], budget: int, generator: torch.Generator | None) -> Proposal:
        draft_ids = lookup(torch.tensor(tokens), self.max_n, self.min_n, budget)
        probs = None
        if self.one_hot_probs:
            probs = torch.zeros(len(draft_ids), self.target_vocab_size)  # [k, V]
            probs[torch.arange(len(draft_ids)), draft_ids] = 1.0
        return Proposal(draft_ids, probs)


def lookup(tokens: torch.Tensor, max_n: int, min_n: int, budget: int) -> list[int]:
    """Up to ``budget`` tokens that followed the latest earlier occurrence of the suffix of ``tokens`` [L]."""
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]  # [n]
        windows = tokens[: length - 1].unfold(0, n, 1)  # [L-n, n]: windows that end before the last token
        starts = torch.nonzero((windows == suffix).all(dim=1)).flatten()
        if starts.numel():
            follow = int(starts[-1]) + n  # index of the first token after the latest match
            return tokens[follow : follow + budget].tolist()
    return []


def continuation_trie(
    tokens: torch.Tensor, max_n: int, min_n: int, depth: int, budget: int
) -> tuple[list[int], list[int]]:
    """(token_ids, parents) of a trie of what followed earlier occurrences of the suffix of ``tokens`` [L]."""
    length = tokens.shape[0]
    token_ids: list[int] = []
    parents: list[int] = []
    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        windows = tokens[: length - 1].unfold(0, n, 1)  # [L-n, n]
        starts = torch.nonzero((windows == suffix).all(dim=1)).flatten().tolist()
        for start in reversed(starts):  # most recent first
            node = -1
            for token in tokens[start + n : start + n + depth].tolist():
                if (node, token) not in child:
                    if len(token_ids) >= budget:
                        return token_ids, parents
                    child[(node, token)] = len(token_ids)
                    token_ids.append(token)
                    parents.append(node)
                node = child[(node, token)]
    return token_ids, parents
