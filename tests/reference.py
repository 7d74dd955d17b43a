"""References for tests, with the old batch-1 engine gone (issue 28).

- :func:`alone_greedy`: the target alone on the one runner — a lone sequence, its prompt prefilled, then one
  decode step per token. Greedy speculation and batching must reproduce it token for token.
- :func:`stock_greedy`: the stock transformers forward over the whole sequence at every step — the oracle
  the runners are compared with (to a tolerance: different kernels, same math).
"""

from __future__ import annotations

import torch

from spectoolkit.runtime.lone import lone_sequence


@torch.inference_mode()
def alone_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new: int, eos_ids: frozenset[int] = frozenset(),
                 kv: str = "auto", compiled: bool = False) -> list[int]:  # fmt: skip
    """Greedy tokens of ``model`` alone after ``prompt_ids``: up to ``max_new``, ending at an EOS."""
    sequence = lone_sequence(model, kv, positions=len(prompt_ids) + max_new + 1, compiled=compiled)
    out = [int(torch.argmax(sequence.forward(list(prompt_ids), last_only=True)))]
    while len(out) < max_new and out[-1] not in eos_ids:
        out.append(int(torch.argmax(sequence.forward([out[-1]], last_only=True))))
    return out


@torch.inference_mode()
def stock_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new: int,
                 eos_ids: frozenset[int] = frozenset()) -> list[int]:  # fmt: skip
    """Greedy tokens of the stock forward (no cache: the whole sequence every step)."""
    ids, out = list(prompt_ids), []
    while len(out) < max_new and (not out or out[-1] not in eos_ids):
        logits = model(torch.tensor([ids])).logits[0, -1]
        out.append(int(torch.argmax(logits)))
        ids.append(out[-1])
    return out
