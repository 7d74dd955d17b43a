"""Greedy exactness on the embedded SmolLM2-135M (fp32 target): spec output == baseline output.

Covers the drafters of the pipeline issue (bf16 and fp16 self-drafts, n-gram) for γ = 1..8 on real
chat-templated prompts. A divergence here is a bug unless it is a logit near-tie, which the
assertion message reports (top-2 margin of the target at the divergence).
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.drafting import ModelDrafter, NgramDrafter
from spectoolkit.engine import BaselineEngine, SpeculativeEngine
from spectoolkit.eval.exactness import divergence, near_tie_threshold
from spectoolkit.models.cached import CachedModel
from spectoolkit.sampling import GreedyChooser
from spectoolkit.verify import GreedyVerifier
from spectoolkit.wiring.loading import load_model, load_tokenizer
from spectoolkit.wiring.setup import eos_ids_of
from spectoolkit.workloads.prompts import Request, encode_prompt

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # 170 s on AMD Zen 3; test_exact_grid runs by default

PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three facts about the Moon, as a JSON array of strings.",
)
MAX_NEW = 16


@pytest.fixture(scope="module")
def setup():
    cpu = torch.device("cpu")
    tokenizer = load_tokenizer(None)
    target = load_model(None, "fp32", cpu)
    eos = eos_ids_of(tokenizer, target.model)
    prompts = [encode_prompt(tokenizer, Request(str(i), "chat", p), True) for i, p in enumerate(PROMPTS)]
    runner = CachedModel(target.model)
    baseline = BaselineEngine(runner, GreedyVerifier(), eos)
    references = [baseline.generate(ids, MAX_NEW, None).output_ids for ids in prompts]
    drafts = {p: load_model(None, p, cpu).model for p in ("bf16", "fp16")}
    return target, runner, eos, prompts, references, drafts


@pytest.mark.parametrize("drafter_kind", ["bf16", "fp16", "ngram"])
def test_greedy_spec_equals_baseline_for_all_gammas(setup, drafter_kind):
    target, runner, eos, prompts, references, drafts = setup
    if drafter_kind == "ngram":
        drafter = NgramDrafter(3, 1, target.vocab_size, one_hot_probs=False)
    else:
        drafter = ModelDrafter(drafts[drafter_kind], GreedyChooser(), target.vocab_size, target.vocab_size, eos)
    accepted = 0
    for gamma in range(1, 9):
        engine = SpeculativeEngine(runner, drafter, GreedyVerifier(), gamma, eos)
        for prompt, reference in zip(prompts, references, strict=True):
            out = engine.generate(prompt, MAX_NEW, None)
            if out.output_ids != reference:
                found = divergence(runner, prompt, reference, out.output_ids, near_tie_threshold("fp32"),
                                   draft_lengths=out.draft_lengths, accept_lengths=out.accept_lengths)  # fmt: skip
                pytest.fail(f"{drafter_kind} gamma={gamma}: {found}")
            accepted += out.accepted_tokens
    assert accepted > 0  # the drafter really proposed tokens the target accepted
