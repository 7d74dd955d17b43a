"""What every verifier returns and promises, and the input check they share.

A verification round (DESIGN §1) checks γ drafted tokens against the target's γ+1 next-token
logits and emits N = K + 1 tokens: the K accepted drafts plus one correction (at the first
rejection) or bonus (all γ accepted) token. Following vLLM v1, verification knows nothing about how
the drafts were produced: it sees token ids and, in stochastic mode, the draft distributions. A verifier
is chosen once, by :func:`spectoolkit.kernels.verifier.make_verifier`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from spectoolkit.sampling import Processing


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one round: the round emits ``draft_ids[:num_accepted] + [next_token]``."""

    num_accepted: int  # K, 0 <= K <= γ
    next_token: int  # the correction token (first rejection) or the bonus token (all accepted)


class Verifier(Protocol):
    """Token selection for the target: alone (``select``) and against drafts (``verify``)."""

    sampling: Processing  # the rule it applies (the engine's tree verifier applies the same)

    def select(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        """The token the target alone emits from ``logits`` [V]; the baseline loop uses this."""
        ...

    def verify(
        self,
        draft_ids: torch.Tensor,
        target_logits: torch.Tensor,
        draft_probs: torch.Tensor | None,
        generator: torch.Generator | None,
    ) -> VerifyResult:
        """Check drafts against the target.

        draft_ids: [γ] long (γ may be 0). target_logits: [γ+1, V], row i = target logits after i
        accepted drafts. draft_probs: [γ, V_draft] fp32 with V_draft <= V, the distributions the
        drafts were actually sampled from (None in greedy mode).
        """
        ...


def leading_true(mask: torch.Tensor) -> int:
    """Length of the run of True at the start of ``mask`` [γ] (bool), without a Python loop."""
    return int(mask.long().cumprod(dim=0).sum().item())


def check_round(
    gamma: int, target_logits: torch.Tensor, draft_probs: torch.Tensor | None, greedy: bool
) -> torch.Tensor | None:
    """Every verifier's input check for one round; returns ``draft_probs`` (stochastic, γ = 0: an empty [0, V]).

    target_logits must be [γ+1, V]; in stochastic mode draft_probs must be [γ, V_draft] (None only when
    nothing was drafted). Raises ValueError naming the expected shape.
    """
    if target_logits.dim() != 2 or target_logits.shape[0] != gamma + 1:
        raise ValueError(f"target_logits must be [γ+1, V] = [{gamma + 1}, V], got {list(target_logits.shape)}")
    if greedy:
        return draft_probs
    if draft_probs is None and gamma == 0:
        return torch.zeros(0, target_logits.shape[-1])
    if draft_probs is None:
        raise ValueError("stochastic verification needs draft_probs: the distributions drafts came from")
    if draft_probs.dim() != 2 or draft_probs.shape[0] != gamma:
        raise ValueError(f"expected draft_probs [{gamma}, V_draft], got {list(draft_probs.shape)}")
    return draft_probs
