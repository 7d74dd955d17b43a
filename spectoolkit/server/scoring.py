"""Log-probabilities of given tokens under the target: OpenAI ``echo``/``logprobs`` (issue 17).

One stock forward of the target over the ids (the model's own attention, untouched by the runner; run
on the engine thread between steps, so it never overlaps a step). Position i > 0 gets
log p(ids[i] | ids[:i]) and the ``top`` most likely tokens there; position 0 has no context (None),
as in OpenAI's completions API. This is what lm-eval's loglikelihood requests read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenScores:
    token_logprobs: list[float | None]  # [L]: None at position 0
    top: list[list[tuple[int, float]] | None]  # [L]: the top (id, logprob) pairs, most likely first


@torch.inference_mode()
def score_tokens(model: torch.nn.Module, ids: list[int], top: int) -> TokenScores:
    """``ids`` [L] scored by ``model``; ``top`` alternatives per position (0: none)."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # [1, L]
    logits = model(input_ids=input_ids, use_cache=False).logits[0, :-1].float()  # [L-1, V]
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = input_ids[0, 1:]  # [L-1]
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()  # [L-1]
    alternatives: list[list[tuple[int, float]] | None] = [None]
    if top > 0:
        values, indices = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # [L-1, top]
        alternatives += [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
    else:
        alternatives += [[] for _ in chosen]
    return TokenScores([None, *chosen], alternatives)
