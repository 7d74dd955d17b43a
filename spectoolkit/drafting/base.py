"""What a proposer hands the engine, and the interface every proposer implements.

Proposers never import the verifier (vLLM v1 layout): they return token ids and, when sampling,
the exact distribution each token was drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one verification round."""

    draft_ids: list[int]  # [k], k <= the budget asked for; k == 0 means nothing proposed
    draft_probs: torch.Tensor | None  # [k, V_target] fp32, the distribution each token was drawn from; None if greedy

    def __len__(self) -> int:
        return len(self.draft_ids)


class Drafter(Protocol):
    """A proposer. ``tokens`` is always prompt + emitted output; its last token is pending."""

    name: str

    def begin(self, prompt_ids: list[int]) -> None:
        """Start a new request (reset any per-request state)."""

    def propose(self, tokens: list[int], budget: int, generator: torch.Generator | None) -> Proposal:
        """Propose up to ``budget`` (>= 1) tokens to follow ``tokens``."""

    def rollback(self, num_kept: int) -> None:
        """Only ``tokens[:num_kept]`` are verified; forget any state past that point."""

    def kv_bytes(self) -> int:
        """Bytes of KV cache this proposer holds now (0 for a stateless one)."""
