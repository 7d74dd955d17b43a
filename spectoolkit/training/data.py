"""Training data for a draft head: the target's own greedy answers, and its states and logits along them.

Regenerating the answers with the target (rather than training on a dataset's human answers) is what
the EAGLE and HASS reports find matters most: the head learns the distribution it will be verified
against. :func:`target_sequence` runs the target once over prompt + answer for the states the head reads
(the residual stream entering its three layers) and the target's next-token logits at the draft ids.
"""

from __future__ import annotations

import torch

from spectoolkit.models.eagle3_head import aux_states
from spectoolkit.training.ttt import Sequence


@torch.inference_mode()
def greedy_answer(model, prompt: list[int], max_new_tokens: int, eos_ids: tuple[int, ...] = ()) -> list[int]:
    """The target's greedy continuation of ``prompt`` (a transformers causal LM), up to an end token."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=list(eos_ids) or None, pad_token_id=(eos_ids or (0,))[0],
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@torch.no_grad()  # not inference_mode: the head trains on these tensors
def target_sequence(
    model, prompt: list[int], answer: list[int], layers: tuple[int, ...], draft_ids: torch.Tensor,
    prompt_loss: bool = False,
):  # fmt: skip
    """A :class:`~spectoolkit.training.ttt.Sequence` of ``prompt + answer`` read off the target ``model``; the loss
    counts the answer's positions, or (``prompt_loss``) every position's: the target's predictions on the prompt
    are its distribution too, and far more data than its answers alone. Target logits are kept in bf16."""
    ids = torch.tensor([prompt + answer])
    out = model(input_ids=ids, output_hidden_states=True)
    states = aux_states(out.hidden_states, layers)[0]  # [T, 3H]
    loss_from = 1 if prompt_loss else len(prompt)
    logits = out.logits[0, loss_from - 1 :][:, draft_ids].to(torch.bfloat16)  # [T - loss_from + 1, Vd]
    return Sequence(ids[0], states.float(), logits, loss_from)
