"""The verifier on the fused Triton kernel (:mod:`spectoolkit.kernels.verify`), and the one place a verifier is chosen.

:func:`make_verifier` picks greedy or exact stochastic verification, in torch
(:mod:`spectoolkit.verify`) or, where the kernels run (CUDA, ``kernels_usable``), as one kernel launch
(:class:`FusedVerifier`, same tokens). It lives here, above the torch rules, because the kernel's torch
reference is those rules (DESIGN §1, §4).

:class:`FusedVerifier`: same rule and same random numbers as the torch verifiers: greedy is the fp32
argmax (first maximum on ties); stochastic draws its γ+1 uniforms from the request's generator exactly as
:class:`~spectoolkit.verify.stochastic.StochasticVerifier` does, so for a seed both emit the same tokens.
``select`` is a round with no drafts, so the baseline loop samples with the same kernel rule. The kernel
module is imported at construction, never with this module (on the CPU, Triton would otherwise decorate
non-interpreted kernels).
"""

from __future__ import annotations

import torch

from spectoolkit.config import SamplingConfig
from spectoolkit.kernels.runtime import kernels_usable
from spectoolkit.sampling import Processing, processed_probs
from spectoolkit.verify.base import Verifier, VerifyResult, check_round
from spectoolkit.verify.greedy import GreedyVerifier
from spectoolkit.verify.rules import draw_uniforms
from spectoolkit.verify.stochastic import StochasticVerifier


def make_verifier(sampling: Processing, device: torch.device | str | None = None) -> Verifier:
    """The verifier for ``sampling``: greedy when ``temperature == 0``, exact stochastic otherwise.

    On a ``device`` where the Triton kernels run (CUDA, ``kernels_usable``) both rules run as one
    kernel launch (:class:`FusedVerifier`, same tokens); elsewhere in torch.
    """
    if device is not None and kernels_usable(device):
        return FusedVerifier(sampling)
    return GreedyVerifier() if sampling.greedy else StochasticVerifier(sampling)


class FusedVerifier:
    """Greedy or exact stochastic verification of one request (B = 1) in one kernel launch."""

    def __init__(self, sampling: SamplingConfig) -> None:
        from spectoolkit.kernels import verify as kernel  # here: see the module docstring

        self.sampling = sampling
        self._kernel = kernel

    def select(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> int:
        """logits: [V] -> the token the target alone emits (argmax, or one sample with one uniform)."""
        no_drafts = torch.zeros(0, dtype=torch.long, device=logits.device)
        return self.verify(no_drafts, logits.unsqueeze(0), None, generator).next_token

    def verify(
        self,
        draft_ids: torch.Tensor,
        target_logits: torch.Tensor,
        draft_probs: torch.Tensor | None,
        generator: torch.Generator | None = None,
    ) -> VerifyResult:
        """draft_ids: [γ] long; target_logits: [γ+1, V]; draft_probs: [γ, V_draft] fp32 (None if greedy or γ = 0)."""
        gamma = draft_ids.shape[0]
        device = target_logits.device
        draft_probs = check_round(gamma, target_logits, draft_probs, self.sampling.greedy)
        draft_ids = draft_ids.to(device=device, dtype=torch.long)  # [γ]
        cu_draft_lens = torch.tensor([0, gamma], dtype=torch.long, device=device)  # [2]
        if self.sampling.greedy:
            result = self._kernel.verify_greedy(draft_ids, cu_draft_lens, target_logits)
        else:
            target_probs = processed_probs(target_logits, self.sampling)  # [γ+1, V] fp32
            draft_probs = draft_probs.to(device=device, dtype=torch.float32)  # [γ, V_draft]
            uniforms = draw_uniforms(gamma + 1, generator, device)  # [γ+1], the torch verifier's stream
            result = self._kernel.verify_stochastic(draft_ids, cu_draft_lens, draft_probs, target_probs, uniforms)
        num_accepted, next_token = torch.cat([result.num_accepted, result.next_token]).tolist()  # one sync
        return VerifyResult(num_accepted, next_token)
