"""Greedy exactness on the embedded SmolLM2-135M (fp32 target): spec output == the target alone's, for every γ.

Covers the drafters of the pipeline issue (bf16 and fp16 self-drafts, n-gram) for γ = 1..8 on real
chat-templated prompts, each a batch-1 arm of the one engine (one request in flight, its verify rows
computed as its decode steps). A divergence here is a bug unless it is a logit near-tie, which the
assertion message reports (the replay of the target alone at the divergence). γ = 4 with n-gram and an
rtn-int4 draft, trees, the adaptive policy, int8 KV and concurrency 4 are test_one_engine_exact.py's.
"""

from __future__ import annotations

import pytest

from spectoolkit.drafting import NgramDrafter
from spectoolkit.eval.exactness import divergence, near_tie_threshold
from spectoolkit.serving.one import OneRequestEngine
from spectoolkit.wiring.setup import eos_ids_of
from tests.integration import embedded

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # 170 s on AMD Zen 3; test_exact_grid runs by default

PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three facts about the Moon, as a JSON array of strings.",
)
MAX_NEW = 16


@pytest.fixture(scope="module")
def setup():
    target = embedded.model("fp32")
    eos = eos_ids_of(embedded.tokenizer(), target.model)
    prompts = [list(prompt) for prompt in embedded.encoded(PROMPTS)]
    baseline = OneRequestEngine(embedded.engine(target, "auto", eos), "baseline")
    references = [baseline.generate(prompt, MAX_NEW, None).output_ids for prompt in prompts]
    return target, baseline.target, eos, prompts, references


@pytest.mark.parametrize("drafter_kind", ["bf16", "fp16", "ngram"])
def test_greedy_spec_equals_baseline_for_all_gammas(setup, drafter_kind):
    target, replay, eos, prompts, references = setup
    accepted = 0
    for gamma in range(1, 9):
        if drafter_kind == "ngram":
            drafter = NgramDrafter(3, 1, target.vocab_size, one_hot_probs=False)
        else:
            drafter = embedded.drafter(drafter_kind, target, "auto", eos)
        engine = OneRequestEngine(embedded.engine(target, "auto", eos, drafter, gamma), "spec")
        for prompt, reference in zip(prompts, references, strict=True):
            out = engine.generate(prompt, MAX_NEW, None)
            if out.output_ids != reference:
                found = divergence(replay, prompt, reference, out.output_ids, near_tie_threshold("fp32"),
                                   draft_lengths=out.draft_lengths, accept_lengths=out.accept_lengths)  # fmt: skip
                pytest.fail(f"{drafter_kind} gamma={gamma}: {found}")
            assert max(out.draft_lengths, default=0) <= gamma
            accepted += out.accepted_tokens
    assert accepted > 0  # the drafter really proposed tokens the target accepted
