"""The one engine on the embedded SmolLM2-135M (fp32): greedy speculation equals the target alone (issue 28).

For n-gram lookup, an rtn-int4 self-draft, a [3,2,1,1] token tree of that draft, the adaptive draft-length
policy and an int8 KV cache:

- concurrency 1 (a batch-1 arm: one request in flight, its verify rows computed as its decode steps):
  every output equals the target alone's, request by request;
- concurrency 4 in batch-invariant mode (``serve.batch_invariant``): four requests at once, each output
  equal to the target alone's with that request alone — no row's numerics depend on its companions.

Both runners: eager, and compiled (``runtime.compile``; three graph widths per runner, built once per
session). And concurrency 8 in the default mode (issue 29): our kernels compute every row by itself, so fp32
and rtn-int4 targets, int8 KV, n-gram and a tree drafter give each request the target alone's output
without the batch-invariant switch.
"""

from __future__ import annotations

import pytest

from spectoolkit.config import SpeculateConfig, TreeConfig
from spectoolkit.policy import make_policy
from spectoolkit.serving.api import ServeRequest
from spectoolkit.serving.one import OneRequestEngine
from spectoolkit.wiring.setup import eos_ids_of
from tests.integration import embedded

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~1 min per case on AMD Zen 3
PROMPTS = (
    "Write a Python function that reverses a string.",
    "Explain in two sentences why the sky is blue.",
    "List three tips for writing clear emails.",
    "Repeat after me: one two three, one two three, one two three.",
)
MAX_NEW, GAMMA = 24, 4
TREE = TreeConfig(kind="static", branching=(3, 2, 1, 1), max_nodes=8)
CASES = {  # name: (draft, KV of the target, tree, policy kind)
    "ngram": ("ngram", "auto", None, "fixed"),
    "rtn-int4": ("rtn-int4", "auto", None, "fixed"),
    "tree-3211": ("rtn-int4", "auto", TREE, "fixed"),
    "adaptive": ("ngram", "auto", None, "adaptive"),
    "int8-kv": ("ngram", "int8", None, "fixed"),
}


def _engines(case: str, invariant: bool, max_seqs: int, compiled: bool):
    draft, kv, tree, policy = CASES[case]
    target = embedded.model("fp32", compiled)
    eos = eos_ids_of(embedded.tokenizer(), target.model)
    budget = tree.max_nodes if tree else GAMMA
    chosen = make_policy(SpeculateConfig(policy=policy, gamma=GAMMA), policy, budget)
    drafter = embedded.drafter(draft, target, "auto", eos, compiled=compiled)
    spec = embedded.engine(target, kv, eos, drafter, budget, invariant=invariant, policy=chosen, tree=tree,
                           max_seqs=max_seqs, compiled=compiled)  # fmt: skip
    return embedded.engine(target, kv, eos, invariant=invariant, compiled=compiled), spec


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", list(CASES))
def test_one_request_in_flight_equals_the_target_alone(case, compiled):
    target_alone, speculating = _engines(case, False, 1, compiled)
    baseline, spec = OneRequestEngine(target_alone, "baseline"), OneRequestEngine(speculating, "spec")
    embedded.assert_greedy_identical(baseline, spec, PROMPTS, MAX_NEW, case)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", list(CASES))
def test_four_at_once_equal_the_target_alone(case, compiled):
    baseline, spec = _engines(case, True, 4, compiled)
    alone = OneRequestEngine(baseline, "baseline")
    prompts = [list(prompt) for prompt in embedded.encoded(PROMPTS)]
    _all_at_once_equal_alone(case, alone, spec, prompts)
    assert spec.allocator.num_free == spec.allocator.num_blocks  # every block back


EIGHT = {  # name: (target precision, draft, KV of the target, tree)
    "fp32-ngram": ("fp32", "ngram", "auto", None),
    "rtn-int4-ngram": ("rtn-int4", "ngram", "auto", None),
    "int8-kv-ngram": ("fp32", "ngram", "int8", None),
    "fp32-tree-3211": ("fp32", "rtn-int4", "auto", TREE),
}


@pytest.mark.parametrize("case", list(EIGHT))
def test_eight_at_once_in_the_default_mode_equal_the_target_alone(case):
    """Concurrency 8 without ``serve.batch_invariant`` (issue 29): our kernels compute every row by itself, so each
    output equals the target alone's with its request alone, and the engine holds itself batch-invariant."""
    precision, draft, kv, tree = EIGHT[case]
    target = embedded.model(precision)
    eos = eos_ids_of(embedded.tokenizer(), target.model)
    budget = tree.max_nodes if tree else GAMMA
    drafter = embedded.drafter(draft, target, "auto", eos)
    spec = embedded.engine(target, kv, eos, drafter, budget, tree=tree, max_seqs=8)
    baseline = embedded.engine(target, kv, eos)
    assert spec.invariant and baseline.invariant  # by construction, not by the switch
    alone = OneRequestEngine(baseline, "baseline")
    prompts = [list(prompt) for prompt in embedded.encoded(PROMPTS)] * 2  # eight in flight
    prompts = prompts[:4] + [prompt[1:] for prompt in prompts[4:]]  # the second four one token shorter
    _all_at_once_equal_alone(case, alone, spec, prompts)


def _all_at_once_equal_alone(case: str, alone: OneRequestEngine, spec, prompts: list[list[int]]) -> None:
    """Every prompt submitted to ``spec`` at once: each output equals ``alone``'s for it, and something was drafted."""
    references = [alone.generate(prompt, MAX_NEW, None).output_ids for prompt in prompts]
    for index, prompt in enumerate(prompts):
        spec.submit(ServeRequest(str(index), prompt, MAX_NEW))
    done = {}
    while spec.has_work():
        done.update({result.request_id: result for result in spec.step()})
    assert [done[str(i)].output_ids for i in range(len(prompts))] == references, case
    assert sum(done[str(i)].drafted_tokens for i in range(len(prompts))) > 0
