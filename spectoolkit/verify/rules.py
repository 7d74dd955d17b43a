"""The rules of exact speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023), DESIGN §1.

Accept draft x_i when u_i·q_i(x_i) <= p_i(x_i) and p_i(x_i) > 0 (:func:`accept_mask`); at the first
rejection sample the correction from max(0, p_i − q_i) (:func:`residual`); if all γ drafts are accepted
sample a bonus token from p_γ. The uniforms come from the request's generator (:func:`draw_uniforms`).
All arithmetic is fp32.

One public module for the rules that the torch verifiers, the fused kernel's reference
(``spectoolkit.kernels.verify``) and the analytic check (``spectoolkit.eval.stochastic_analytic``)
share: :func:`verify_with_uniforms` is the pure rule given the random numbers, the reference a fused
kernel is checked against for the same uniforms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spectoolkit.sampling import sample_from
from spectoolkit.verify.base import VerifyResult, leading_true


def verify_with_uniforms(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
) -> VerifyResult:
    """Exact speculative sampling with the random numbers given.

    draft_ids: [γ] long. draft_probs: [γ, V_draft] with V_draft <= V (missing columns count as 0).
    target_probs: [γ+1, V]. uniforms: [γ+1] in [0, 1): uniforms[i] decides draft i, uniforms[γ]
    samples the correction or bonus token. Everything is moved to ``target_probs``' device, in fp32.
    """
    gamma = draft_ids.shape[0]
    target_probs = target_probs.float()  # [γ+1, V]
    fp32_here = {"device": target_probs.device, "dtype": torch.float32}
    draft_probs = pad_vocab(draft_probs.to(**fp32_here), target_probs.shape[-1])  # [γ, V]
    uniforms = uniforms.to(**fp32_here)  # [γ+1]
    accepted = accept_mask(draft_ids, draft_probs, target_probs[:gamma], uniforms[:gamma])  # [γ]
    num_accepted = leading_true(accepted)
    if num_accepted == gamma:
        return VerifyResult(gamma, sample_from(target_probs[gamma], uniforms[gamma]))
    correction_probs = residual(target_probs[num_accepted], draft_probs[num_accepted])  # [V]
    return VerifyResult(num_accepted, sample_from(correction_probs, uniforms[gamma]))


def accept_mask(
    draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """u_i < min(1, p_i(x_i)/q_i(x_i)) without dividing. All [γ] except probs [γ, V]; returns [γ] bool.

    ``<=`` makes p == q accept with certainty despite rounding; ``p > 0`` keeps a token the target
    excludes (top-k/top-p) from being accepted when u == 0 or q(x) == 0.
    """
    index = draft_ids.long().to(target_probs.device).unsqueeze(-1)  # [γ, 1]
    target_at_draft = target_probs.gather(-1, index).squeeze(-1)  # [γ]
    draft_at_draft = draft_probs.gather(-1, index).squeeze(-1)  # [γ]
    return (uniforms * draft_at_draft <= target_at_draft) & (target_at_draft > 0)


def residual(target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """max(0, p − q) for rows [V]; p itself when that mass is 0 (only possible when p == q).

    Left unnormalized: ``sample_from`` scales its uniform by the total mass.
    """
    leftover = (target_row - draft_row).clamp_min(0)  # [V]
    return leftover if leftover.sum() > 0 else target_row


def pad_vocab(draft_probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """[γ, V_draft] -> [γ, V]: a draft vocabulary smaller than the target's puts no mass on the rest."""
    missing = vocab - draft_probs.shape[-1]
    if missing < 0:
        raise ValueError(f"draft_probs has {draft_probs.shape[-1]} columns, more than the target's {vocab}")
    return F.pad(draft_probs, (0, missing)) if missing else draft_probs


def draw_uniforms(count: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """[count] uniforms in [0, 1) returned on ``device``.

    Drawn on the generator's device (the CPU RNG without one), so the stream does not depend on
    where the logits live and matches the baseline loop's draws.
    """
    source = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(count, generator=generator, device=source).to(device)
