"""Training data for a draft head: token sequences the target labels with its own states and next-token
distribution.

Two kinds of sequence, both labelled the same way:

- the target's own greedy answers to workload prompts — what the EAGLE and HASS reports find matters most:
  the head learns the distribution it will be verified against;
- a dataset's reference replies (ShareGPT's, HumanEval's canonical solutions) after the prompt, which cost
  one target forward each, no generation: the text is not the target's, but every label is its distribution.

:func:`target_sequence` runs the target once over the tokens for the states the head reads (the residual
stream entering its three layers) and its final hidden state, kept in bf16; the next-token logits at the
draft ids are that state times the target's output rows (``lm_rows``, shared by every sequence), computed when
a step needs them — storing them would take 32 KB a token at a 16k draft vocabulary.
"""

from __future__ import annotations

import torch

from spectoolkit.errors import SpecToolkitError
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


@torch.no_grad()
def output_rows(model, draft_ids: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """The target's output-head rows of the draft ids [Vd, H] fp32, for :func:`target_sequence`: read off the head
    itself (fed the identity), so a packed or quantized head gives the weights it really multiplies by."""
    head = model.get_output_embeddings()
    size = model.get_input_embeddings().weight.shape[1]
    probe = next(model.parameters())
    if head(torch.zeros(1, size, dtype=probe.dtype)).abs().max() != 0:
        raise SpecToolkitError("draft-head training needs a target whose output head has no bias")
    eye = torch.eye(size, dtype=probe.dtype)
    columns = [head(eye[i : i + chunk])[:, draft_ids].float() for i in range(0, size, chunk)]  # [H, Vd] in parts
    return torch.cat(columns).T.contiguous()


@torch.no_grad()  # not inference_mode: the head trains on these tensors
def target_sequence(
    model, prompt: list[int], answer: list[int], layers: tuple[int, ...], draft_ids: torch.Tensor,
    prompt_loss: bool = False, lm_rows: torch.Tensor | None = None,
):  # fmt: skip
    """A :class:`~spectoolkit.training.ttt.Sequence` of ``prompt + answer`` read off the target ``model``; the loss
    counts the answer's positions, or (``prompt_loss``) every position's: the target's predictions on the prompt
    are its distribution too, and far more data than its answers alone. ``lm_rows``: :func:`output_rows`, shared
    by the sequences of one job (computed here when not given)."""
    rows = output_rows(model, draft_ids) if lm_rows is None else lm_rows
    ids = torch.tensor([prompt + answer])
    out = model(input_ids=ids, output_hidden_states=True, logits_to_keep=4)  # logits only for the check below
    states = aux_states(out.hidden_states, layers)[0]  # [T, 3H]
    loss_from = 1 if prompt_loss else len(prompt)
    final = out.hidden_states[-1][0, loss_from - 1 :]  # [T - loss_from + 1, H]: after the final norm
    last = min(4, len(final))
    want, got = out.logits[0, -last:][:, draft_ids].float(), final[-last:].float() @ rows.T
    if not torch.allclose(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max())):
        raise SpecToolkitError(
            "the target's last hidden state times its output head is not its logits (logit scaling or "
            "soft-capping?): draft-head training takes plain Llama-family heads"
        )
    return Sequence(ids[0], states.to(torch.bfloat16), final.to(torch.bfloat16), rows, loss_from)
