"""Exact stochastic speculation under batching (DESIGN §1, §6): per request, the target's distribution.

Many requests (several prompts x many per-request seeds) are decoded together at temperature 1 by the
continuous engine with the :class:`StochasticVerifier`, speculating with a draft model or an EAGLE-3 head
(RandomChooser: q is the distribution each draft was drawn from) or with n-gram or suffix lookup (one-hot
q). At each of the first ``LENGTH`` output positions, each prompt's tokens are compared with the target
alone's (a batch-1 arm of the one engine, its own seeds) by the two-sample chi-square of
:mod:`spectoolkit.eval.stochastic_empirical` (rare tokens pooled, Bonferroni over prompts x positions). A
negative control — a verifier that accepts every draft, so its tokens follow q; for trees, siblings that report a
distribution they were not drawn from — must be rejected by the same test at the same sample size. Trees of a
draft model grow for every request of a step together, depth by depth. With n-gram drafts in batch-invariant
mode, a request's sampled output depends on its seed alone: the batch must reproduce each request's
concurrency-1 output exactly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from spectoolkit.config import SamplingConfig, TreeConfig
from spectoolkit.drafting import NgramDrafter, SuffixDrafter, SuffixSettings
from spectoolkit.eval.stochastic_empirical import ENDED, ArgmaxReportingSoftmax, two_sample_test
from spectoolkit.eval.tree_empirical import tree_negative_control
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.sampling import RandomChooser, processed_probs, sample_from
from spectoolkit.serving.api import ServeRequest
from spectoolkit.serving.engine import ContinuousEngine
from spectoolkit.serving.one import OneRequestEngine
from spectoolkit.verify.base import VerifyResult
from spectoolkit.verify.rules import draw_uniforms
from spectoolkit.verify.stochastic import StochasticVerifier
from tests.serving import helpers

pytestmark = pytest.mark.usefixtures("one_thread")
SAMPLING = SamplingConfig(temperature=1.0)
LENGTH = 3  # output positions compared (0: the prefill's token; 1, 2: speculation's)
SIGNIFICANCE = 1e-3
GAMMA = 3
ARM_SEEDS = {"target": 0, "spec": 1_000_003, "control": 2_000_006}  # disjoint seed ranges: independent arms


class AcceptEveryDraft(StochasticVerifier):
    """BUG on purpose (negative control): accepts every draft, then a bonus token from p."""

    def verify(self, draft_ids, target_logits, draft_probs, generator=None) -> VerifyResult:
        gamma = draft_ids.shape[0]
        bonus = processed_probs(target_logits[gamma], self.sampling)  # [V]
        return VerifyResult(gamma, sample_from(bonus, draw_uniforms(1, generator, bonus.device)))


def _noisy(model_seed: int, vocab: int, scale: float, sigma: float) -> torch.nn.Module:
    model = tiny_llama(vocab_size=vocab, seed=model_seed, scale=scale)
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(sigma * param.std() * torch.randn(param.shape, generator=gen))
    return helpers.switched(model)


def _counts_of(outputs: list[list[int]]) -> list[Counter]:
    """Per position, token counts over ``outputs`` (ENDED after an early EOS)."""
    counts = [Counter() for _ in range(LENGTH)]
    for ids in outputs:
        for position, token in enumerate((ids + [ENDED] * LENGTH)[:LENGTH]):
            counts[position][token] += 1
    return counts


def _target_alone(target, prompts: list[list[int]], samples: int) -> list[list[Counter]]:
    """Per prompt, per position counts of the target alone (batch-1 arm of the one engine)."""
    seed, counts = ARM_SEEDS["target"], []
    engine = OneRequestEngine(helpers.engine(target, verifier=StochasticVerifier(SAMPLING), stochastic=True), "alone")
    for prompt in prompts:
        outputs = [engine.generate(prompt, LENGTH, torch.Generator().manual_seed(seed + s)).output_ids
                   for s in range(samples)]  # fmt: skip
        counts.append(_counts_of(outputs))
    return counts


def _batched(eng, prompts: list[list[int]], samples: int, arm: str) -> tuple[list[list[Counter]], dict]:
    """Every (prompt, seed) request submitted at once: they run in batches of up to max_num_seqs."""
    seed = ARM_SEEDS[arm]
    requests = [
        ServeRequest(f"{i}/{s}", p, LENGTH, seed=seed + s) for s in range(samples) for i, p in enumerate(prompts)
    ]
    done = helpers.run(eng, requests)
    outputs = helpers.outputs(done)  # every request finished without error
    by_prompt = [[ids for rid, ids in outputs.items() if rid.startswith(f"{i}/")] for i in range(len(prompts))]
    assert helpers.all_free(eng)
    return [_counts_of(outs) for outs in by_prompt], done


def _min_p(reference: list[list[Counter]], other: list[list[Counter]]) -> float:
    return min(two_sample_test(a, b).p_value for ref, oth in zip(reference, other, strict=True)
               for a, b in zip(ref, oth, strict=True))  # fmt: skip


@dataclass
class Case:
    target: torch.nn.Module
    spec: Callable[[], ContinuousEngine]
    controls: dict[str, Callable[[], ContinuousEngine]]  # each must be rejected
    prompts: list[list[int]]
    samples: int


def _check(case: Case) -> dict:
    """The spec arm passes and every negative control is rejected; returns the spec arm's acceptance counts."""
    prompts, samples = case.prompts, case.samples
    threshold = SIGNIFICANCE / (len(prompts) * LENGTH)
    reference = _target_alone(case.target, prompts, samples)
    spec, done = _batched(case.spec(), prompts, samples, "spec")
    spec_p = _min_p(reference, spec)
    assert spec_p >= threshold, f"batched speculation changed the distribution: p={spec_p:.2e} < {threshold:.1e}"
    for name, make_control in case.controls.items():
        control_p = _min_p(reference, _batched(make_control(), prompts, samples, "control")[0])
        assert control_p < threshold, f"no power: negative control {name} passed (p={control_p:.2e})"
    assert max(max(r.batch_sizes) for r in done.values()) >= 32, "the requests were not batched"
    return {"drafted": sum(r.drafted_tokens for r in done.values()),
            "accepted": sum(r.accepted_tokens for r in done.values())}  # fmt: skip


def _model_case(samples: int):
    vocab, scale = 512, 15.0  # sharp enough that a few hundred samples resolve the top tokens
    target = helpers.switched(tiny_llama(vocab_size=vocab, seed=0, scale=scale))
    draft = _noisy(0, vocab, scale, sigma=0.3)

    def make_engine(verifier, chooser):
        drafter = helpers.model_drafter(draft, chooser, num_blocks=600)
        return helpers.engine(target, gamma=GAMMA, drafter=drafter, verifier=verifier, stochastic=True,
                              num_blocks=600, max_num_seqs=48, max_num_tokens=4096)  # fmt: skip

    controls = {
        "accept-every-draft": lambda: make_engine(AcceptEveryDraft(SAMPLING), RandomChooser(SAMPLING)),
        "q-not-sampled-from": lambda: make_engine(StochasticVerifier(SAMPLING), ArgmaxReportingSoftmax(SAMPLING)),
    }
    spec = lambda: make_engine(StochasticVerifier(SAMPLING), RandomChooser(SAMPLING))  # noqa: E731
    return Case(target, spec, controls, helpers.prompts((4, 6, 9)), samples)


def _ngram_case(samples: int, lookup=lambda vocab: NgramDrafter(3, 1, vocab, one_hot_probs=True)):
    vocab = 24  # a small vocabulary: sampled tokens recur in the prompt, so lookup proposes often
    target = helpers.switched(tiny_llama(vocab_size=vocab, seed=3, scale=8.0))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (10, 16, 22)]

    def make_engine(verifier, invariant=False):
        drafter = lookup(vocab)
        return helpers.engine(target, gamma=GAMMA, drafter=drafter, verifier=verifier, stochastic=True,
                              num_blocks=400, max_num_seqs=48, max_num_tokens=4096, invariant=invariant)  # fmt: skip

    spec = lambda invariant=False: make_engine(StochasticVerifier(SAMPLING), invariant)  # noqa: E731
    return Case(target, spec, {"accept-every-draft": lambda: make_engine(AcceptEveryDraft(SAMPLING))}, prompts, samples)


def _eagle_case(samples: int):
    """An untrained EAGLE-3 head drafting for a 6-layer tiny target (its q is far from p: the control has power)."""
    vocab = 96
    target = helpers.switched(tiny_llama(vocab_size=vocab, seed=2, num_layers=6, scale=6.0))
    head = helpers.eagle_head(target)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 8, 11)]

    def make_engine(verifier):
        drafter = helpers.eagle_drafter(target, head, RandomChooser(SAMPLING), None, num_blocks=600)
        return helpers.engine(target, gamma=GAMMA, drafter=drafter, verifier=verifier, stochastic=True,
                              num_blocks=600, max_num_seqs=48, max_num_tokens=4096)  # fmt: skip

    spec = lambda: make_engine(StochasticVerifier(SAMPLING))  # noqa: E731
    return Case(target, spec, {"accept-every-draft": lambda: make_engine(AcceptEveryDraft(SAMPLING))}, prompts, samples)


def _tree_case(samples: int):
    """Dynamic trees of a noisy draft model, grown for every request of a step together (one draft forward per
    depth); negative control: the same trees with every sibling group reporting the ranked top tokens of its mean q
    (:func:`~spectoolkit.eval.tree_empirical.rank_siblings`), which the multi-candidate rule is not exact for."""
    vocab, scale = 512, 15.0
    target = helpers.switched(tiny_llama(vocab_size=vocab, seed=0, scale=scale))
    draft = _noisy(0, vocab, scale, sigma=0.3)
    tree = TreeConfig(kind="dynamic", max_nodes=6, top_k=2)

    def drafter():
        return helpers.model_drafter(draft, RandomChooser(SAMPLING), num_blocks=900).variant(None, tree)

    def make_engine(chosen):
        return helpers.engine(target, gamma=tree.max_nodes, depth=GAMMA, drafter=chosen,
                              verifier=StochasticVerifier(SAMPLING), stochastic=True, num_blocks=600, max_num_seqs=48,
                              max_num_tokens=4096)  # fmt: skip

    controls = {"rank-siblings": lambda: make_engine(tree_negative_control(drafter(), SAMPLING))}
    return Case(target, lambda: make_engine(drafter()), controls, helpers.prompts((4, 6, 9)), samples)


def test_batched_model_trees_keep_each_requests_distribution():
    stats = _check(_tree_case(samples=200))
    assert 0 < stats["accepted"] < stats["drafted"]


def test_eagle_drafter_batch_keeps_each_requests_distribution():
    stats = _check(_eagle_case(samples=200))
    assert 0 < stats["accepted"] < stats["drafted"]


def test_model_drafter_batch_keeps_each_requests_distribution():
    stats = _check(_model_case(samples=200))
    assert 0 < stats["accepted"] < stats["drafted"]


def test_ngram_drafter_batch_keeps_each_requests_distribution():
    stats = _check(_ngram_case(samples=200))
    assert 0 < stats["accepted"] < stats["drafted"]


def test_suffix_drafter_batch_keeps_each_requests_distribution():
    suffix = lambda vocab: SuffixDrafter(SuffixSettings(min_match=1), vocab, one_hot_probs=True)  # noqa: E731 (drafts often)
    stats = _check(_ngram_case(200, suffix))
    assert 0 < stats["accepted"] < stats["drafted"]


@pytest.mark.slow
@pytest.mark.parametrize("case", [_model_case, _ngram_case], ids=["model", "ngram"])
def test_batch_keeps_each_requests_distribution_many_samples(case):
    _check(case(samples=2000))


def test_invariant_batch_reproduces_each_requests_seeded_output():
    """Batch-invariant numerics + deterministic drafts: a request's samples depend on its seed alone."""
    case = _ngram_case(samples=0)
    eng = case.spec(invariant=True)
    requests = [ServeRequest(f"{i}/{s}", p, 12, seed=s) for s in range(6) for i, p in enumerate(case.prompts)]
    batched = helpers.run(eng, requests)
    assert sum(r.drafted_tokens for r in batched.values()) > 0
    assert helpers.outputs(batched) == helpers.alone(eng, requests)
