"""Greedy (T = 0) verification: accept while each draft equals the target's argmax (DESIGN §1).

The output must equal the target-alone greedy output token for token, so ``select`` and ``verify``
use the same rule: ``torch.argmax`` over fp32 logits, which returns the first maximum on ties.
"""

from __future__ import annotations

import torch

from spectoolkit.config import SamplingConfig
from spectoolkit.verify.base import VerifyResult, check_round, leading_true


def _argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits: [..., V] any float dtype -> [...] long, first maximum on ties."""
    return torch.argmax(logits.float(), dim=-1)


class GreedyVerifier:
    """Accept the longest prefix of drafts that matches the target's argmax; then its argmax."""

    sampling = SamplingConfig(temperature=0.0)

    def select(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> int:
        """logits: [V] -> argmax token id. ``generator`` is unused (greedy draws nothing)."""
        return int(_argmax_ids(logits).item())

    def verify(
        self,
        draft_ids: torch.Tensor,
        target_logits: torch.Tensor,
        draft_probs: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> VerifyResult:
        """draft_ids: [γ] long; target_logits: [γ+1, V]. ``draft_probs`` and ``generator`` are unused."""
        gamma = draft_ids.shape[0]
        check_round(gamma, target_logits, None, greedy=True)
        target_ids = _argmax_ids(target_logits)  # [γ+1]
        matches = draft_ids.to(target_ids.device) == target_ids[:gamma]  # [γ]
        num_accepted = leading_true(matches)
        return VerifyResult(num_accepted, int(target_ids[num_accepted].item()))
