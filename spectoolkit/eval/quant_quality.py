"""What quantization costs: a quantized model against its float reference on held text.

Teacher-forced on real responses (the ``reference`` texts of the workload: ShareGPT replies,
HumanEval solutions), scored on response positions only:

- ``kl_mean``: mean over positions of KL(P_ref || P_quant) of the next-token distributions
- ``top1_agreement``: fraction of positions where both models' argmax agree
- ``ppl_ref`` / ``ppl_quant`` / ``ppl_delta``: perplexity of the response tokens, and quant − ref

This is the quantity DESIGN §1 keeps apart from speculation: speculative decoding is exact against
the quantized target; what quantization changed is measured here, against the float model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeldText:
    """One scored sequence: ``token_ids`` [L] = prompt + response; scoring starts at ``response_start``."""

    token_ids: list[int]
    response_start: int


@torch.inference_mode()
def _log_probs(model: torch.nn.Module, text: HeldText) -> torch.Tensor:
    """Log next-token probabilities [R, V] (fp32) predicting the response tokens."""
    ids = torch.tensor([text.token_ids], device=next(model.parameters()).device)  # [1, L]
    logits = model(input_ids=ids, use_cache=False).logits[0].float()  # [L, V]
    return torch.log_softmax(logits[text.response_start - 1 : -1], dim=-1)


def position_stats(reference: torch.Tensor, quantized: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position KL(ref || quant), top-1 agreement and both NLLs.

    reference, quantized: [R, V] log-probs over a shared vocabulary; targets: [R] token ids.
    """
    kl = (reference.exp() * (reference - quantized)).sum(dim=-1)  # [R]
    agree = reference.argmax(dim=-1) == quantized.argmax(dim=-1)  # [R]
    nll_ref = -reference.gather(-1, targets[:, None])[:, 0]
    nll_quant = -quantized.gather(-1, targets[:, None])[:, 0]
    return {"kl": kl, "agree": agree.float(), "nll_ref": nll_ref, "nll_quant": nll_quant}


def measure(quantized: torch.nn.Module, reference: torch.nn.Module, texts: list[HeldText]) -> dict[str, float]:
    """Aggregate :func:`position_stats` over all response positions of ``texts`` (token-weighted)."""
    parts: dict[str, list[torch.Tensor]] = {"kl": [], "agree": [], "nll_ref": [], "nll_quant": []}
    for text in texts:
        ref_lp, quant_lp = _log_probs(reference, text), _log_probs(quantized, text)
        vocab = min(ref_lp.shape[-1], quant_lp.shape[-1])  # padded tails are not real tokens
        targets = torch.tensor(text.token_ids[text.response_start :], device=ref_lp.device)
        stats = position_stats(
            torch.log_softmax(ref_lp[:, :vocab], -1), torch.log_softmax(quant_lp[:, :vocab].to(ref_lp.device), -1),
            targets,
        )  # fmt: skip
        for key, value in stats.items():
            parts[key].append(value.cpu())
    joined = {key: torch.cat(values) for key, values in parts.items()}
    ppl_ref = math.exp(joined["nll_ref"].mean().item())
    ppl_quant = math.exp(joined["nll_quant"].mean().item())
    return {
        "kl_mean": joined["kl"].mean().item(),
        "top1_agreement": joined["agree"].mean().item(),
        "ppl_ref": ppl_ref,
        "ppl_quant": ppl_quant,
        "ppl_delta": ppl_quant - ppl_ref,
        "positions": int(joined["kl"].numel()),
        "texts": len(texts),
    }
