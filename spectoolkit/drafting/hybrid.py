"""Hybrid drafting (ArcticInference's suffix + model speculator): per round and sequence, the suffix tries' draft
when it is expected to keep more tokens than the head's drafts have been keeping, else the EAGLE head's.

The suffix proposal is computed first (far below a millisecond) with its score: the sum of its nodes' path
probabilities in the trie, the tokens it expects accepted. The head's expectation is what its own drafts kept
for this sequence: an exponential mean of its accepted lengths (a new sequence starts from the mean over every
sequence). The head drafts only for the sequences the suffix does not take, in one batched call; a round the
head sits out costs it nothing but a longer catch-up feed next time (its KV follows the verified tokens, see
:mod:`~spectoolkit.drafting.eagle`). The choice depends on past rounds only, never on this round's draws, so
verification stays exact (each proposal carries its own q: one-hot for the suffix, the head's for the head).
"""

from __future__ import annotations

import torch

from spectoolkit.config import TreeConfig
from spectoolkit.drafting.base import Budget, Drafting
from spectoolkit.drafting.eagle import EagleDrafter
from spectoolkit.drafting.suffix import SuffixDrafter
from spectoolkit.drafting.tree import TokenTree

DECAY = 0.7  # weight of the past in the head's mean accepted length
PRIOR = 1.0  # the head's expected accepted tokens before any round


class HybridDrafter:
    """Suffix decoding or the EAGLE head, per round and sequence (module docstring)."""

    name = "hybrid"

    def __init__(self, suffix: SuffixDrafter, head: EagleDrafter) -> None:
        self.suffix, self.head = suffix, head
        self.capture = head.capture
        self.tree, self.max_depth, self.gamma = head.tree, head.max_depth, head.gamma
        self.overall = PRIOR  # the head's mean accepted length over every sequence
        self._mean: dict[int, float] = {}  # per sequence
        self._drafted_by: dict[int, str] = {}  # who proposed the sequence's last round
        self.rounds = {"suffix": 0, "head": 0}

    def variant(self, stop_below: float | None, tree: TreeConfig | None, gamma: int) -> HybridDrafter:
        return type(self)(self.suffix.variant(stop_below, tree, gamma), self.head.variant(stop_below, tree, gamma))

    def propose(self, seqs: list[Drafting], budgets: list[Budget]) -> list[TokenTree]:
        out: list[TokenTree] = []
        to_head = []
        for i, (seq, budget) in enumerate(zip(seqs, budgets, strict=True)):
            proposal, score = self.suffix.scored(seq, budget)
            if len(proposal) and score >= self._mean.get(id(seq), self.overall):
                self._drafted_by[id(seq)] = "suffix"
                self.rounds["suffix"] += 1
            else:
                to_head.append(i)
            out.append(proposal)
        if to_head:
            made = self.head.propose([seqs[i] for i in to_head], [budgets[i] for i in to_head])
            for i, proposal in zip(to_head, made, strict=True):
                out[i] = proposal
                if len(proposal):  # an empty round (no room) says nothing of what the head keeps
                    self._drafted_by[id(seqs[i])] = "head"
                    self.rounds["head"] += 1
        return out

    def keep_states(self, seq: Drafting, start: int, states: torch.Tensor) -> None:
        self.head.keep_states(seq, start, states)

    @property
    def upkeep_seconds(self) -> float:
        return self.head.upkeep_seconds

    @property
    def upkeep_rows(self) -> int:
        return self.head.upkeep_rows

    def backlog(self, seq: Drafting) -> int:
        return self.head.backlog(seq)  # a round the head drafts pays it (the policy's acceptance covers both)

    def commit(self, seq: Drafting, num_prefix: int, path: list[int]) -> None:
        self.head.commit(seq, num_prefix, path)
        self.suffix.commit(seq, num_prefix, path)
        if self._drafted_by.pop(id(seq), None) == "head":
            key = id(seq)
            self._mean[key] = DECAY * self._mean.get(key, self.overall) + (1 - DECAY) * len(path)
            self.overall = DECAY * self.overall + (1 - DECAY) * len(path)

    def release(self, seq: Drafting) -> None:
        self.head.release(seq)
        self.suffix.release(seq)
        self._mean.pop(id(seq), None)
        self._drafted_by.pop(id(seq), None)

    def reset(self) -> None:
        self.head.reset()
        self.suffix.reset()
        self._mean.clear()
        self._drafted_by.clear()
        self.overall = PRIOR

    def runners(self) -> dict:
        return {}

    def kv_bytes(self) -> int:
        return self.head.kv_bytes()

    def describe_tree(self) -> str | None:
        return self.head.describe_tree()
