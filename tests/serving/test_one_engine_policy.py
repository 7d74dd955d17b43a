"""Draft-length policies at batch 1 on the one engine (spectoolkit.policy + OneRequestEngine).

Whatever k a policy picks per round, greedy speculation must emit the target-alone tokens and sampled
speculation the target's distribution (DESIGN §1); every round's k stays within min(γ, room − 1). The
adaptive policy must learn γ for a drafter that is always right and 0 for one that is always wrong (probing
it rarely, ever more rarely); the confidence policy's draft model must stop after its first token below the
threshold. Tiny-model timings are noise, not a cost curve, so where a test asserts *which* k is chosen the
policy's costs are pinned to a realistic seeded curve (:class:`PinnedCosts`); the exactness tests also run the
policy as shipped. The batched counterparts (k_i per sequence of a step) live in test_policy_serving.py.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from spectoolkit.config import SamplingConfig, SpeculateConfig, TreeConfig
from spectoolkit.drafting import Budget, ModelDrafter, NgramDrafter, TokenTree
from spectoolkit.eval.stochastic_empirical import engine_exactness, negative_control
from spectoolkit.kernels.verifier import make_verifier
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.policy import AdaptivePolicy, ConfidencePolicy, FixedPolicy, draft_depth
from spectoolkit.policy.costs import WINDOW
from spectoolkit.runtime.blocks import BlockAllocator, BlockTable
from spectoolkit.runtime.lone import lone_sequence
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import make_runner
from spectoolkit.sampling import GreedyChooser, make_chooser
from spectoolkit.serving.api import GenerationOutput, ServeRequest
from spectoolkit.serving.engine import ContinuousEngine
from spectoolkit.serving.one import OneRequestEngine
from spectoolkit.serving.scheduler import SchedulerLimits
from spectoolkit.serving.sequence import new_sequence
from spectoolkit.verify import GreedyVerifier
from tests.eval import one_engines
from tests.noise import noisy_copy
from tests.reference import alone_greedy
from tests.serving import helpers
from tests.serving.helpers import BLOCK, EOS_IDS, MAX_POSITIONS, VOCAB

GAMMA = 4
MAX_NEW = 24
LONG = 64  # generations long enough to see the policy settle
PROBE_EVERY = 8
WARMUP = 6  # rounds before the adaptive policy must have settled
STOP_BELOW = 0.0105  # the tiny draft's top probabilities are ~0.008..0.02: some rounds stop early
PROMPTS = (
    [1, 17, 93, 250, 7, 41, 300, 12],
    [1, 5, 5, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7],  # repetitive: n-gram lookup finds matches
    [1, 400, 3, 99, 123, 77],
)
pytestmark = pytest.mark.usefixtures("one_thread")


class PinnedCosts(AdaptivePolicy):
    """The adaptive policy with costs fixed at T(n) = 10 ms + 0.3 ms·n and ``draft_forward`` per forward."""

    def __init__(
        self, gamma: int = GAMMA, draft_forward: float = 0.001, probe_every: int = PROBE_EVERY, tree: bool = False
    ) -> None:
        super().__init__(gamma, 0.9, probe_every, tree)
        self.seed({1: 0.0103, 64: 0.010 + 0.0003 * 64})
        for _ in range(WINDOW):  # every width measured a window's times: none left to explore
            for width in range(1, 65):
                self.costs.observe_target(1, width, 0.010 + 0.0003 * width)
        self.draft_cost.observe(1, draft_forward)
        self.chosen: Counter = Counter()  # (cap, k) -> rounds

    def choose(self, keys, caps, fixed_tokens, budget, backlogs=None, rooms=None, settled=None):
        lengths = super().choose(keys, caps, fixed_tokens, budget, backlogs, rooms, settled)
        self.chosen.update(zip(caps, lengths, strict=True))
        return lengths

    def observe_step(self, *args, **kwargs) -> None:
        pass  # keep the seeded costs


class ReferenceDrafter(helpers.ContinuationDrafter):
    """Proposes the target's own continuation (always accepted) or, ``wrong``, one id off (never)."""

    name = "reference"

    def __init__(self, reference: list[int], wrong: bool) -> None:
        super().__init__(reference)
        self.wrong = wrong

    def adjust(self, draft_ids: list[int], length: int) -> list[int]:
        return [(token + 1) % VOCAB for token in draft_ids] if self.wrong else draft_ids


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return helpers.switched(tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0))


@pytest.fixture(scope="module")
def references(target) -> dict[tuple[int, ...], list[int]]:
    return {tuple(prompt): alone_greedy(target, prompt, LONG, EOS_IDS) for prompt in PROMPTS}


@pytest.fixture(scope="module")
def draft_models(target) -> dict[str, torch.nn.Module]:
    return {
        "copy": copy.deepcopy(target),
        "bf16-copy": copy.deepcopy(target).to(torch.bfloat16),
        "noisy-copy": noisy_copy(target, sigma=0.2, seed=5),
        "other-seed": tiny_llama(vocab_size=VOCAB, seed=1, scale=4.0),
    }


def _model_drafter(draft: torch.nn.Module, stop_below: float | None = None, chooser=None) -> ModelDrafter:
    pool, allocator = make_pool(draft, "auto", 200 * BLOCK), BlockAllocator(200, BLOCK)
    return ModelDrafter(make_runner(draft, pool), chooser or GreedyChooser(), allocator, VOCAB, VOCAB, EOS_IDS,
                        "model", stop_below)  # fmt: skip


def _drafter(name: str, draft_models, stop_below: float | None = None):
    if name == "ngram":
        return NgramDrafter(3, 1, VOCAB, one_hot_probs=False)
    return _model_drafter(draft_models[name], stop_below)


def _one(target: torch.nn.Module, drafter, policy) -> OneRequestEngine:
    """The spec arm as the wiring builds it: γ = the policy's max, one request in flight."""
    limits = SchedulerLimits(64, 1, None, None)
    runner = make_runner(target, make_pool(target, "auto", 200 * BLOCK))
    return OneRequestEngine(ContinuousEngine("spec", runner, BlockAllocator(200, BLOCK), GreedyVerifier(), limits,
                                             EOS_IDS, MAX_POSITIONS, drafter, policy=policy), "spec")  # fmt: skip


def _caps(out: GenerationOutput, max_new: int, gamma: int = GAMMA) -> list[int]:
    """Each round's cap min(γ, room − 1), from what the rounds before it emitted."""
    caps, emitted = [], 1  # the prefill's token
    for accepted in out.accept_lengths:
        caps.append(min(gamma, max_new - emitted - 1))
        emitted += accepted + 1
    return caps


def _check_rounds(out: GenerationOutput, max_new: int) -> None:
    assert len(out.chosen_lengths) == len(out.draft_lengths) == len(out.accept_lengths) == out.verify_rounds
    for chosen, drafted, accepted, cap in zip(
        out.chosen_lengths, out.draft_lengths, out.accept_lengths, _caps(out, max_new), strict=True
    ):
        assert 0 <= accepted <= drafted <= chosen <= cap


# ---- exactness ---------------------------------------------------------------------------------

POLICIES = {
    "adaptive": lambda: AdaptivePolicy(GAMMA, 0.9, PROBE_EVERY),  # as shipped: learns from real timings
    "adaptive-pinned": PinnedCosts,
    "confidence": lambda: ConfidencePolicy(GAMMA, STOP_BELOW),
}


@pytest.mark.parametrize("drafter_name", ["bf16-copy", "noisy-copy", "other-seed", "ngram"])
@pytest.mark.parametrize("policy_name", POLICIES)
def test_greedy_output_equals_the_target_alone(target, draft_models, references, policy_name, drafter_name):
    policy = POLICIES[policy_name]()
    one = _one(target, _drafter(drafter_name, draft_models, policy.stop_below), policy)
    assert one.policy is policy
    outs = []
    for prompt in PROMPTS:
        out = one.generate(prompt, MAX_NEW, None)
        assert out.output_ids == references[tuple(prompt)][:MAX_NEW], f"prompt {prompt}: diverged from the target"
        _check_rounds(out, MAX_NEW)
        outs.append(out)
    chosen = [k for out in outs for k in out.chosen_lengths]
    if policy_name == "adaptive-pinned" and drafter_name == "noisy-copy":
        assert len(set(chosen)) > 2, chosen  # the policy really varied k round by round
    if policy_name == "confidence" and drafter_name != "ngram":
        drafted = [d for out in outs for d in out.draft_lengths]
        assert any(d < c for d, c in zip(drafted, chosen, strict=True)), "the confidence stop never fired"
        assert any(d > 1 for d in drafted), "the confidence stop always fired"


TREES = {"static": TreeConfig(kind="static", branching=(2, 2, 1), max_nodes=8),
         "dynamic": TreeConfig(kind="dynamic", top_k=2, max_nodes=8, max_depth=3)}  # fmt: skip


@pytest.mark.parametrize("drafter_name", ["noisy-copy", "ngram"])
@pytest.mark.parametrize("tree_name", TREES)
def test_adaptive_tree_budgets_keep_the_output_of_the_target_alone(target, draft_models, references, tree_name,
                                                                   drafter_name):  # fmt: skip
    """The adaptive policy picks each round's node budget (0..max_nodes) of a tree arm: outputs stay exact."""
    tree = TREES[tree_name]
    policy = PinnedCosts(tree.max_nodes, tree=True)
    policy.max_depth = draft_depth(SpeculateConfig(gamma=GAMMA, tree=tree))
    one = _one(target, _drafter(drafter_name, draft_models).variant(None, tree), policy)
    assert one.engine.trees
    chosen = []
    for prompt in PROMPTS:
        out = one.generate(prompt, MAX_NEW, None)
        assert out.output_ids == references[tuple(prompt)][:MAX_NEW], f"prompt {prompt}: diverged from the target"
        assert len(out.tree_depths) == out.verify_rounds == len(out.chosen_lengths)
        for nodes, picked, depth, accepted in zip(out.draft_lengths, out.chosen_lengths, out.tree_depths,
                                                  out.accept_lengths, strict=True):  # fmt: skip
            assert accepted <= depth <= nodes <= picked <= tree.max_nodes
        chosen += out.chosen_lengths
    assert len(set(chosen)) > 1, chosen  # budgets really varied round by round


# ---- the adaptive policy settles on γ or 0 -----------------------------------------------------


@pytest.mark.parametrize("right", [True, False], ids=["always-right", "always-wrong"])
def test_adaptive_learns_gamma_or_zero_from_constructed_drafters(target, references, right):
    prompt = PROMPTS[0]
    reference = references[tuple(prompt)]
    one = _one(target, ReferenceDrafter(reference, wrong=not right), PinnedCosts())
    out = one.generate(prompt, LONG, None)
    assert out.output_ids == reference
    _check_rounds(out, LONG)
    tail = out.chosen_lengths[WARMUP:]
    if right:
        assert out.accept_lengths == out.draft_lengths  # every draft accepted
        assert tail == _caps(out, LONG)[WARMUP:], out.chosen_lengths  # γ (or what room is left)
        assert tail.count(GAMMA) >= len(tail) - 1
        return
    assert sum(out.accept_lengths) == 0  # no draft ever accepted
    assert len(tail) > 40 and set(tail) <= {0, 1}, out.chosen_lengths
    probes = [i for i, k in enumerate(tail) if k == 1]
    assert 1 <= len(probes) <= len(tail) // PROBE_EVERY, out.chosen_lengths  # 1-token probes, rarely
    gaps = [later - earlier - 1 for earlier, later in zip(probes, probes[1:], strict=False)]
    assert all(gap >= PROBE_EVERY for gap in gaps), gaps  # rejected probes: the interval only grows


@pytest.mark.parametrize(("drafter_name", "expected"), [("copy", GAMMA), ("other-seed", 0)])
def test_adaptive_learns_gamma_or_zero_from_draft_models(target, draft_models, references, drafter_name, expected):
    one = _one(target, _drafter(drafter_name, draft_models), PinnedCosts())
    for prompt in PROMPTS:
        out = one.generate(prompt, LONG, None)
        assert out.output_ids == references[tuple(prompt)]
        _check_rounds(out, LONG)
        tail = list(zip(out.chosen_lengths, _caps(out, LONG), strict=True))[WARMUP:]
        settled = sum(k == min(expected, cap) for k, cap in tail)
        assert settled >= 0.8 * len(tail), out.chosen_lengths


# ---- the confidence stop -----------------------------------------------------------------------


def _top_probs_along(draft: torch.nn.Module, prompt: list[int], draft_ids: list[int]) -> list[float]:
    """The draft's top probability at each of ``draft_ids``' positions (the draft alone, one forward)."""
    logits = lone_sequence(draft).forward(prompt + draft_ids[:-1])  # [P + k - 1, V]
    probs = torch.softmax(logits[len(prompt) - 1 :].float(), dim=-1)  # [k, V]
    return probs.max(dim=-1).values.tolist()


def _propose(drafter: ModelDrafter, prompt: list[int], budget: int, generator=None) -> TokenTree:
    """One round of ``drafter`` for a fresh sequence whose tokens are ``prompt``."""
    request = ServeRequest("0", list(prompt), MAX_NEW, generator=generator)
    seq = new_sequence(request, BlockTable(BlockAllocator(1, BLOCK)), 0, helpers.default_rule(generator is not None))
    (proposal,) = drafter.propose([seq], [Budget(budget, budget)])
    return proposal


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_model_drafter_stops_after_its_first_unsure_token(draft_models, prompt):
    draft, budget = draft_models["noisy-copy"], 8
    draft_ids = _propose(_model_drafter(draft), prompt, budget).token_ids
    assert len(draft_ids) == budget and not EOS_IDS & set(draft_ids)
    tops = _top_probs_along(draft, prompt, draft_ids)
    assert max(tops) < 0.999  # guard: every token is unsure at 0.999
    ordered = sorted(tops)
    thresholds = [1e-9, 0.999] + [(a + b) / 2 for a, b in zip(ordered, ordered[1:], strict=False) if b - a > 1e-5]
    for threshold in thresholds:
        expected = next((j + 1 for j, top in enumerate(tops) if top < threshold), budget)
        got = _propose(_model_drafter(draft, stop_below=threshold), prompt, budget).token_ids
        assert got == draft_ids[:expected], (threshold, tops)
    assert len(thresholds) > 4


def test_sampling_drafter_stops_on_the_distribution_it_drew_from(draft_models):
    prompt, chooser = PROMPTS[0], make_chooser(SamplingConfig(temperature=1.0))
    draft = draft_models["noisy-copy"]
    for stop_below, expected in ((0.999, 1), (1e-9, 6)):
        drafter = _model_drafter(draft, stop_below, chooser)
        proposal = _propose(drafter, prompt, 6, torch.Generator().manual_seed(0))
        assert len(proposal.token_ids) == expected and proposal.draft_probs.shape == (expected, VOCAB)


@pytest.mark.parametrize(("stop_below", "per_round"), [(0.999, 1), (1e-9, None)], ids=["always-unsure", "never"])
def test_confidence_policy_in_the_engine(target, draft_models, references, stop_below, per_round):
    policy = ConfidencePolicy(GAMMA, stop_below)
    one = _one(target, _drafter("bf16-copy", draft_models, policy.stop_below), policy)
    prompt = PROMPTS[0]
    out = one.generate(prompt, MAX_NEW, None)
    assert out.output_ids == references[tuple(prompt)][:MAX_NEW]
    _check_rounds(out, MAX_NEW)
    assert out.chosen_lengths == _caps(out, MAX_NEW)  # the confidence policy asks for γ like fixed
    expected = [min(per_round or chosen, chosen) for chosen in out.chosen_lengths]
    assert out.draft_lengths == expected


# ---- sampled speculation keeps the target's distribution ---------------------------------------

TINY_VOCAB, TINY_EOS = 12, frozenset({2})
STOCHASTIC_PROMPT = [1, 5, 7, 3, 9, 4, 11, 6, 8, 10, 0, 3, 5, 7]
SAMPLES, LENGTH, SIGNIFICANCE = 400, 5, 1e-3
POSITIONS = 256


def _policy_arms(model, drafter, control, sampling: SamplingConfig, policy_for) -> dict[str, OneRequestEngine]:
    """{"baseline", "spec", "control"}: stochastic one-request engines over one pool of ``model``; the drafting
    arms choose k with ``policy_for()`` (spec's policy made first)."""
    runner = make_runner(model, make_pool(model, "auto", 64 * BLOCK))
    allocator = BlockAllocator(64, BLOCK)

    def engine(name: str, chosen, policy) -> OneRequestEngine:
        limits = SchedulerLimits(POSITIONS, 1, None, None)
        return OneRequestEngine(ContinuousEngine(name, runner, allocator, make_verifier(sampling), limits, TINY_EOS,
                                                 POSITIONS, chosen, True, False, policy), name)  # fmt: skip

    spec = engine("spec", drafter, policy_for())
    return {"baseline": engine("baseline", None, FixedPolicy(0)), "spec": spec,
            "control": engine("control", control, policy_for())}  # fmt: skip


def test_adaptive_policy_keeps_the_target_distribution():
    """Chi-square per position (spectoolkit.eval.stochastic_empirical) with k chosen from each round's past."""
    sampling = SamplingConfig(temperature=1.0)
    target = tiny_llama(vocab_size=TINY_VOCAB, seed=0, num_layers=1, hidden=32, scale=3.0)
    draft = tiny_llama(vocab_size=TINY_VOCAB, seed=1, num_layers=1, hidden=32, scale=3.0)
    drafter = one_engines.batched(draft, sampling, TINY_VOCAB, TINY_EOS)
    policies: list[PinnedCosts] = []

    def policy_for() -> PinnedCosts:
        # a draft forward of 2.5 ms puts k = 2 against 3 on the fence: the request's own rounds decide
        policies.append(PinnedCosts(gamma=3, draft_forward=0.0025))
        return policies[-1]

    arms = _policy_arms(target, drafter, negative_control(drafter, sampling), sampling, policy_for)
    result = engine_exactness(arms.__getitem__, STOCHASTIC_PROMPT, SAMPLES, LENGTH, 0, SIGNIFICANCE)
    assert result["passed"] and result["min_p_value"] > result["threshold"], result["positions"]
    assert result["power_shown"] and result["control"]["min_p_value"] < 1e-5, result["control"]["positions"]
    assert 0.2 < result["acceptance_rate"] < 0.95
    spec_choices = policies[0].chosen
    assert len({k for (cap, k) in spec_choices if cap == 3}) >= 2, spec_choices  # k depended on the history
