"""Exact speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023), DESIGN §1.

Accept draft x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample the
correction from normalize(max(0, p_i − q_i)); if all γ drafts are accepted sample a bonus token from
p_γ. The emitted tokens are then distributed exactly as the target's. p is the target's distribution
after the same temperature/top-k/top-p as the drafter applied (``spectoolkit.sampling``); q is the
distribution each draft was actually sampled from. All arithmetic is fp32.

The rule itself, given the random numbers, is :func:`~spectoolkit.verify.rules.verify_with_uniforms`
(:mod:`spectoolkit.verify.rules`, shared with the fused kernel's reference); this module draws the
uniforms from the request's generator and applies it.
"""

from __future__ import annotations

import torch

from spectoolkit.sampling import Processing, processed_probs, sample_from
from spectoolkit.verify.base import VerifyResult, check_round
from spectoolkit.verify.rules import draw_uniforms, verify_with_uniforms


class StochasticVerifier:
    """Exact speculative sampling under one sampling setting (temperature > 0): a run's or a request's."""

    def __init__(self, sampling: Processing) -> None:
        if sampling.greedy:
            raise ValueError("StochasticVerifier needs temperature > 0; use GreedyVerifier (make_verifier)")
        self.sampling = sampling

    def select(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> int:
        """logits: [V] -> one token sampled from the processed target distribution (one uniform)."""
        probs = processed_probs(logits, self.sampling)  # [V] fp32
        return sample_from(probs, draw_uniforms(1, generator, probs.device))

    def verify(
        self,
        draft_ids: torch.Tensor,
        target_logits: torch.Tensor,
        draft_probs: torch.Tensor | None,
        generator: torch.Generator | None = None,
    ) -> VerifyResult:
        """draft_ids: [γ] long; target_logits: [γ+1, V]; draft_probs: [γ, V_draft] fp32.

        ``draft_probs`` may be None only when γ == 0 (nothing was drafted).
        """
        gamma = draft_ids.shape[0]
        draft_probs = check_round(gamma, target_logits, draft_probs, greedy=False)  # [γ, V_draft]
        target_probs = processed_probs(target_logits, self.sampling)  # [γ+1, V] fp32
        uniforms = draw_uniforms(gamma + 1, generator, target_probs.device)  # [γ+1]
        return verify_with_uniforms(draft_ids, draft_probs, target_probs, uniforms)
