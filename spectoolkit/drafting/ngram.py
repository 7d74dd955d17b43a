"""Prompt-lookup (n-gram) proposer: copy what followed the last occurrence of the current suffix.

Saxena's prompt lookup decoding, as in transformers' ``prompt_lookup_num_tokens``: match the
trailing n-gram (longest n first) against earlier context and propose the tokens that followed it.
We take the most recent match, which tracks the text being generated better than the first. With a
tree (``speculate.tree``, any kind) it proposes the trie of the distinct continuations of every
earlier match instead. A proposal is deterministic: when sampling, its distribution q is one-hot at
the proposed token, which keeps the stochastic acceptance test exact. Lookup holds no per-sequence
state: commit, release and reset do nothing.
"""

from __future__ import annotations

import torch

from spectoolkit.config import TreeConfig
from spectoolkit.drafting.base import Budget, Drafter, Drafting, Lookup
from spectoolkit.drafting.tree import TokenTree


class NgramDrafter(Lookup, Drafter):
    """Proposes continuations found in each sequence's prompt and output so far."""

    def __init__(
        self, max_n: int, min_n: int, target_vocab_size: int, one_hot_probs: bool,
        tree: TreeConfig | None = None,
    ) -> None:  # fmt: skip
        """``tree`` (enabled): tries of continuations, as deep as each round's budget."""
        self.max_n, self.min_n = max_n, min_n
        self.target_vocab_size, self.one_hot_probs = target_vocab_size, one_hot_probs
        self.name = "ngram"
        self.tree = tree if tree is not None and tree.enabled else None

    def propose(self, seqs: list[Drafting], budgets: list[Budget]) -> list[TokenTree]:
        return [self._one(seq, budget) for seq, budget in zip(seqs, budgets, strict=True)]

    def _one(self, seq: Drafting, budget: Budget) -> TokenTree:
        if budget.nodes <= 0 or budget.depth <= 0:
            return TokenTree([], [])
        tokens = torch.tensor(seq.tokens)
        if self.tree is None:
            token_ids = lookup(tokens, self.max_n, self.min_n, min(budget.nodes, budget.depth))
            parents = list(range(-1, len(token_ids) - 1))
        else:
            token_ids, parents = continuation_trie(tokens, self.max_n, self.min_n, budget.depth, budget.nodes)
        return self.proposal(token_ids, parents, seq)

    def release(self, seq: Drafting) -> None:
        pass

    def reset(self) -> None:
        pass

    def describe_tree(self) -> str | None:
        return f"trie/{self.tree.max_nodes}" if self.tree is not None else None

    def variant(self, stop_below: float | None, tree: TreeConfig | None) -> NgramDrafter:
        """``stop_below`` is a draft model's rule: lookup has no probabilities to stop on."""
        if (tree if tree is not None and tree.enabled else None) == self.tree:
            return self
        return type(self)(self.max_n, self.min_n, self.target_vocab_size, self.one_hot_probs, tree)


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
    """(token_ids, parents) of a trie of what followed earlier occurrences of the suffix of ``tokens`` [L].

    Matches of the longest suffix come first, the most recent first; shorter suffixes add theirs while
    ``budget`` nodes remain.
    """
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
