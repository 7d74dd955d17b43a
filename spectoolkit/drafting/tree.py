"""A token tree: what a tree proposer hands the engine (SpecInfer, Miao et al. 2024; EAGLE-2; Sequoia).

Node ``i`` is drafted token ``token_ids[i]`` whose parent is node ``parents[i]`` (``-1``: the root,
i.e. the pending token, which is verified already and is the first row of the verify forward).
Parents come before their children (``parents[i] < i``), so a node's ancestors are always earlier
rows, and siblings are listed in the order they were drawn: the verifier tries them in that order.

When sampling, ``draft_probs[i]`` is the distribution node ``i`` was actually drawn from *given the
siblings drawn before it*: for children drawn i.i.d. from the parent's q every row is that q; a
deterministic proposal (n-gram) is one-hot. The multi-candidate rule of :mod:`spectoolkit.verify.tree`
is exact for any such sequence of proposals.

A chain of k tokens is the tree with ``parents = [-1, 0, 1, …, k-2]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenTree:
    """Drafted nodes of one round, in an order where every parent precedes its children."""

    token_ids: list[int]  # [n]
    parents: list[int]  # [n], -1 = child of the root (the pending token)
    draft_probs: torch.Tensor | None = None  # [n, V_target] fp32, per node (see the module doc); None if greedy

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.parents)} parents")
        for index, parent in enumerate(self.parents):
            if not -1 <= parent < index:
                raise ValueError(f"node {index} has parent {parent}: parents must precede their children")

    def __len__(self) -> int:
        return len(self.token_ids)

    @staticmethod
    def chain(token_ids: list[int], draft_probs: torch.Tensor | None = None) -> TokenTree:
        return TokenTree(list(token_ids), list(range(-1, len(token_ids) - 1)), draft_probs)

    def depths(self) -> list[int]:
        """Depth of every node: 1 for a child of the root."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return out

    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.parents) - 1))

    def shape(self) -> list[int]:
        """Nodes per depth, e.g. [3, 6, 6] for a static [3, 2, 1] tree."""
        widths: list[int] = []
        for depth in self.depths():
            if depth > len(widths):
                widths.append(0)
            widths[depth - 1] += 1
        return widths

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (``[]`` for the root, -1)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def truncated(self, budget: int) -> TokenTree:
        """The first ``budget`` nodes (still a tree: parents come first)."""
        if budget >= len(self):
            return self
        probs = self.draft_probs[:budget] if self.draft_probs is not None else None
        return TokenTree(self.token_ids[:budget], self.parents[:budget], probs)
