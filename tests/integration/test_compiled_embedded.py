"""``runtime.compile`` on the embedded SmolLM2-135M: compiled vs eager, and exact speculation compiled.

- Compiled fp32 steps give the eager (transformers) target's greedy tokens, logits within
  ``LOGIT_TOLERANCE``.
- With a compiled target, speculative output (n-gram; the rtn-int4 self-draft, itself compiled)
  equals the compiled target alone, token for token — verify rows are the decode steps' bits.
- Graphs: one decode width and one verify bucket per model, none after warm-up.

Slow: the two embedded-model graphs take ~50 s each to compile on 2 cores with a cold inductor cache.
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.drafting import ModelDrafter, NgramDrafter
from spectoolkit.engine import BaselineEngine, SpeculativeEngine
from spectoolkit.models.cached import CachedModel
from spectoolkit.models.compiled import LOGIT_TOLERANCE, CompiledModel
from spectoolkit.sampling import GreedyChooser
from spectoolkit.verify import GreedyVerifier
from spectoolkit.wiring.loading import load_model
from spectoolkit.wiring.setup import eos_ids_of
from tests.integration.embedded import encoded, tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three facts about the Moon, as a JSON array of strings.",
)
MAX_NEW = 24
GAMMA = 4


@pytest.fixture(scope="module")
def models():
    cpu = torch.device("cpu")
    fp32 = load_model(None, "fp32", cpu, kernels=None)
    int4 = load_model(None, "rtn-int4", cpu, group_size=32, kernels=None)
    target = CompiledModel(fp32.model)
    target.warm(GAMMA + 1)
    return fp32, int4, target


def _greedy(runner, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    runner.reset()
    logits = runner.forward(prompt, last_only=True)
    tokens, rows = [], []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = runner.forward([tokens[-1]])[0]
        rows.append(logits)
    return tokens, rows


def test_compiled_steps_match_eager_transformers(models):
    fp32, _, target = models
    eager = CachedModel(fp32.model)
    for prompt in encoded(PROMPTS):
        compiled_tokens, compiled_rows = _greedy(target, list(prompt), MAX_NEW)
        eager_tokens, eager_rows = _greedy(eager, list(prompt), MAX_NEW)
        assert compiled_tokens == eager_tokens
        worst = max((a - b).abs().max().item() for a, b in zip(compiled_rows, eager_rows, strict=True))
        assert worst < LOGIT_TOLERANCE, worst


@pytest.mark.parametrize("drafter_kind", ["ngram", "rtn-int4"])
def test_compiled_speculation_is_exact(models, drafter_kind):
    fp32, int4, target = models
    eos = eos_ids_of(tokenizer(), fp32.model)
    if drafter_kind == "ngram":
        drafter = NgramDrafter(3, 1, fp32.vocab_size, False)
    else:
        drafter = ModelDrafter(int4.model, GreedyChooser(), fp32.vocab_size, fp32.vocab_size, eos, compiled=True)
        drafter.runner.warm(2)
    baseline = BaselineEngine(target, GreedyVerifier(), eos)
    spec = SpeculativeEngine(target, drafter, GreedyVerifier(), GAMMA, eos)
    accepted = 0
    for prompt in encoded(PROMPTS):
        alone = baseline.generate(list(prompt), MAX_NEW, None)
        out = spec.generate(list(prompt), MAX_NEW, None)
        assert out.output_ids == alone.output_ids
        accepted += out.accepted_tokens
    assert accepted > 0  # verify windows were exercised, not only single steps
    assert target.compile_stats.widths == (1, 8)  # the decode step and the γ+1 bucket, nothing more
    if drafter_kind != "ngram":
        assert drafter.runner.compile_stats.widths == (1, 2)
