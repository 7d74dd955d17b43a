"""Draft-model proposer: another checkpoint, or the target checkpoint at another precision.

KV rule (DESIGN §2): the draft cache holds positions [0, num_computed). ``propose`` first feeds
every verified token it has not seen (the pending correction/bonus token, and after a fully
accepted round also the last draft token) in one forward, then drafts one token per forward.
``rollback`` truncates the cache to the accepted prefix.
"""

from __future__ import annotations

import torch

from spectoolkit.drafting.base import Proposal
from spectoolkit.models.cached import CachedModel
from spectoolkit.sampling import GreedyChooser, RandomChooser


class ModelDrafter:
    """Proposes tokens autoregressively with a (smaller or quantized) causal LM."""

    def __init__(
        self,
        model: torch.nn.Module,
        chooser: GreedyChooser | RandomChooser,
        target_vocab_size: int,
        shared_vocab_size: int,
        eos_ids: frozenset[int],
        name: str = "model",
        kv_precision: str = "auto",
    ) -> None:
        self.runner = CachedModel(model, kv_precision)
        self.chooser = chooser
        self.target_vocab_size = target_vocab_size
        self.shared_vocab_size = shared_vocab_size
        self.eos_ids = eos_ids
        self.name = name

    def begin(self, prompt_ids: list[int]) -> None:
        self.runner.reset()

    def propose(self, tokens: list[int], budget: int, generator: torch.Generator | None) -> Proposal:
        draft_ids: list[int] = []
        draft_probs: list[torch.Tensor] = []
        feed = tokens[self.runner.num_computed :]  # >= 1 token: at least the pending one
        while len(draft_ids) < budget:
            logits = self._aligned(self.runner.forward(feed, last_only=True))  # [V_target]
            token, probs = self.chooser.choose(logits, generator)
            draft_ids.append(token)
            if probs is not None:
                draft_probs.append(probs)
            if token in self.eos_ids:  # nothing after EOS can be emitted
                break
            feed = [token]
        stacked = torch.stack(draft_probs) if draft_probs else None  # [k, V_target]
        return Proposal(draft_ids, stacked)

    def rollback(self, num_kept: int) -> None:
        self.runner.truncate(num_kept)

    def kv_bytes(self) -> int:
        return self.runner.cache.allocated_bytes()

    def _aligned(self, logits: torch.Tensor) -> torch.Tensor:
        return align_logits(logits, self.shared_vocab_size, self.target_vocab_size)


def align_logits(logits: torch.Tensor, shared: int, target: int) -> torch.Tensor:
    """Draft logits [V_draft] -> fp32 [V_target]: ids past the ``shared`` range can never be proposed."""
    logits = logits.float()
    if logits.shape[-1] == target and shared == target:
        return logits
    aligned = logits.new_full((target,), float("-inf"))
    aligned[:shared] = logits[:shared]
    return aligned
