"""``runtime.compile`` on the embedded SmolLM2-135M: the compiled runner against the stock transformers forward.

Compiled fp32 steps (a lone sequence on the session's compiled runner, :mod:`tests.integration.embedded`) give
the stock forward's greedy tokens, logits within ``LOGIT_TOLERANCE``, and compile no graph beyond the runner's
widths. That speculation with a compiled target (n-gram; the rtn-int4 self-draft, itself compiled) equals the
compiled target alone is tests/integration/test_one_engine_exact.py's ``compiled`` cases.

Slow: the embedded model's graphs take ~50 s each to compile on 2 cores with a cold inductor cache.
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.runtime.lone import LoneSequence
from tests.integration import embedded
from tests.reference import stock_greedy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three facts about the Moon, as a JSON array of strings.",
)
MAX_NEW = 24
LOGIT_TOLERANCE = 1e-3  # |compiled - stock| logits, fp32 (different summation orders, same math)


@torch.inference_mode()
def _greedy(sequence: LoneSequence, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """The prompt, then one-token greedy steps: (``steps`` tokens, the logits [steps, V] that chose them)."""
    sequence.reset()
    rows = [sequence.forward(prompt, last_only=True)]
    tokens = [int(rows[-1].argmax())]
    while len(tokens) < steps:
        rows.append(sequence.forward([tokens[-1]], last_only=True))
        tokens.append(int(rows[-1].argmax()))
    sequence.reset()
    return tokens, torch.stack(rows)


@torch.inference_mode()
def test_compiled_steps_match_the_stock_forward():
    fp32 = embedded.model("fp32", True)
    runner, allocator = embedded.runner("fp32", "auto", compiled=True)
    sequence = LoneSequence(runner, allocator)
    for prompt in embedded.encoded(PROMPTS):
        tokens, rows = _greedy(sequence, list(prompt), MAX_NEW)
        assert tokens == stock_greedy(fp32.model, list(prompt), MAX_NEW)
        stock = fp32.model(torch.tensor([list(prompt) + tokens[:-1]])).logits[0, len(prompt) - 1 :]  # [MAX_NEW, V]
        worst = (rows - stock).abs().max().item()
        assert worst < LOGIT_TOLERANCE, worst
    assert set(runner.compile_stats.widths) <= set(embedded.COMPILED_WIDTHS)  # a prompt chunks, no new width
    assert allocator.num_free == allocator.num_blocks
