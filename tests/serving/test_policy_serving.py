"""Draft-length policies under continuous batching (spectoolkit.policy through the serving scheduler).

The scheduler asks the policy once per step for every decoding sequence's k_i, jointly, within
``max_draft_tokens``. Whatever it picks, each request's greedy output must be the target-alone one
(DESIGN §1, §6). The adaptive policy must give the sequences of one step different drafts when their
acceptance differs, and never more than the step's draft budget. As in the batch-1 tests, where a
test asserts *which* k is chosen the costs are pinned to a seeded curve (tiny-model timings are noise).
"""

from __future__ import annotations

import time

import pytest
import torch

from spectoolkit.drafting import ModelDrafter, NgramDrafter
from spectoolkit.drafting.base import BACKLOG_ROWS
from spectoolkit.policy import AdaptivePolicy, ConfidencePolicy, FixedPolicy
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import make_runner
from spectoolkit.sampling import GreedyChooser
from spectoolkit.serving.api import ServeRequest
from spectoolkit.serving.engine import ContinuousEngine
from spectoolkit.serving.scheduler import SchedulerLimits
from spectoolkit.verify import GreedyVerifier
from tests.serving import helpers
from tests.serving.helpers import BLOCK, EOS_IDS, MAX_POSITIONS, VOCAB, StepLog

pytestmark = pytest.mark.usefixtures("one_thread")
GAMMA = 4
MAX_NEW = 24
STOP_BELOW = 0.0074  # about the median top probability of the noisy draft: some drafts stop early, some not


class PinnedCosts(AdaptivePolicy):
    """The adaptive policy with costs fixed at T(n) = 10 ms + 0.3 ms·n and 1 ms per draft forward."""

    def __init__(self, gamma: int = GAMMA) -> None:
        super().__init__(gamma, 0.9, 8)
        self.seed({1: 0.0103, 64: 0.010 + 0.0003 * 64})
        for batch in range(2, 9):  # every batch's plain step measured (a batch size's first decode step is plain)
            self.costs.observe_target(batch, batch, 0.010 + 0.0003 * batch)
        self.draft_cost.observe(1, 0.001)

    def observe_step(self, *args, **kwargs) -> None:
        pass  # keep the seeded costs


def _engine(model, drafter, policy, max_num_tokens: int = 64, max_draft_tokens: int | None = None):
    limits = SchedulerLimits(max_num_tokens, 8, None, max_draft_tokens)
    return ContinuousEngine(
        "test", make_runner(model, make_pool(model, "auto", 200 * BLOCK)), BlockAllocator(200, BLOCK), GreedyVerifier(),
        limits, EOS_IDS, MAX_POSITIONS, drafter, policy=policy,
    )  # fmt: skip


def _model_drafter(draft: torch.nn.Module, stop_below: float | None = None) -> ModelDrafter:
    pool = make_pool(draft, "auto", 200 * BLOCK)
    return ModelDrafter(make_runner(draft, pool), GreedyChooser(), BlockAllocator(200, BLOCK), VOCAB, VOCAB,
                             EOS_IDS, "model", stop_below)  # fmt: skip


@pytest.fixture(scope="module")
def target():
    return helpers.tiny()


@pytest.fixture(scope="module")
def batch():
    return helpers.prompts((5, 13, 21, 40, 7, 9, 3))


@pytest.fixture(scope="module")
def references(target, batch):
    return helpers.baseline_outputs(target, batch, MAX_NEW)


def _check_rounds(done) -> None:
    for result in done.values():
        assert len(result.chosen_lengths) == len(result.draft_lengths) == len(result.accept_lengths)
        for chosen, drafted, accepted in zip(result.chosen_lengths, result.draft_lengths, result.accept_lengths,
                                             strict=True):  # fmt: skip
            assert 0 <= accepted <= drafted <= chosen <= GAMMA


POLICIES = {
    "adaptive": lambda: AdaptivePolicy(GAMMA, 0.9, 8),  # as shipped: learns from the engine's timings
    "adaptive-pinned": PinnedCosts,
    "confidence": lambda: ConfidencePolicy(GAMMA, STOP_BELOW),
}
DRAFTERS = {
    "model-noisy": lambda stop_below: _model_drafter(helpers.noisy_target(0.2, seed=5), stop_below),
    "ngram": lambda stop_below: NgramDrafter(3, 1, VOCAB, one_hot_probs=False),
}


@pytest.mark.parametrize(
    ("policy_name", "drafter_name"),
    [(policy, drafter) for policy in POLICIES for drafter in DRAFTERS if (policy, drafter) != ("confidence", "ngram")],
)  # the confidence stop is a draft model's
def test_batch_equals_target_alone(target, batch, references, policy_name, drafter_name):
    policy = POLICIES[policy_name]()
    eng = _engine(target, DRAFTERS[drafter_name](policy.stop_below), policy, max_draft_tokens=12)
    log = StepLog()
    eng.on_step = log
    done = helpers.run(eng, helpers.requests(batch, MAX_NEW))
    assert helpers.outputs(done) == references
    _check_rounds(done)
    assert max(max(r.batch_sizes) for r in done.values()) == len(batch), "the requests never ran together"
    assert all(s.draft_tokens <= 12 for s in log.steps)
    assert helpers.all_free(eng) and eng.drafter.kv_bytes() == 0
    chosen = [k for r in done.values() for k in r.chosen_lengths]
    drafted = [d for r in done.values() for d in r.draft_lengths]
    if policy_name == "adaptive-pinned" and drafter_name == "model-noisy":
        assert len({tuple(r.chosen_lengths) for r in done.values()}) > 1 and len(set(chosen)) > 2, chosen
    if policy_name == "confidence":
        assert any(d < c for d, c in zip(drafted, chosen, strict=True)), "the confidence stop never fired"
        assert any(d > 1 for d in drafted), "the confidence stop always fired"


def _planned_drafts(eng) -> list[dict[str, int]]:
    """Record, per step, each request's planned drafts (request id -> k_i)."""
    plans, schedule = [], eng.scheduler.schedule

    def recorded(on_preempt):
        plan = schedule(on_preempt)
        plans.append({work.seq.request.request_id: work.drafts for work in plan.work})
        return plan

    eng.scheduler.schedule = recorded
    return plans


@pytest.mark.parametrize("max_draft_tokens", [None, 6, 3])
def test_sequences_of_one_step_draft_by_their_own_acceptance(target, batch, references, max_draft_tokens):
    """Constructed histories: "good" and "fine" always fully accepted, "bad" never; one step's k_i differ."""
    policy = PinnedCosts()
    eng = _engine(target, _model_drafter(helpers.tiny(seed=0)), policy, max_draft_tokens=max_draft_tokens)
    plans = _planned_drafts(eng)
    names = {"good": 0, "bad": 4, "fine": 6}  # -> index in the batch (short prompts: one prefill step)
    for name, index in names.items():
        eng.submit(ServeRequest(name, list(batch[index]), MAX_NEW))
    eng.step()  # the three prefills
    assert all(seq.decoding for seq in eng.scheduler.running)
    for seq in eng.scheduler.running:
        accepted = 0 if seq.request.request_id == "bad" else GAMMA
        for _ in range(30):
            policy.observe(seq, GAMMA, GAMMA, accepted)
    log = StepLog()
    eng.on_step = log
    eng.step()
    drafts = plans[-1]
    budget = 2 * GAMMA if max_draft_tokens is None else max_draft_tokens
    assert drafts["bad"] == 0, drafts
    assert drafts["good"] + drafts["fine"] == budget, drafts  # the wanted γ each, or the whole budget
    assert drafts["good"] > 0 and drafts["fine"] > 0 or budget < 2, drafts
    assert log.steps[-1].draft_tokens == sum(drafts.values())
    done = helpers.run(eng, [])  # finish the run: outputs still exact, every step within the budget
    expected = {name: references[str(index)] for name, index in names.items()}
    assert helpers.outputs(done) == expected
    if max_draft_tokens is not None:
        assert all(sum(plan.values()) <= max_draft_tokens for plan in plans)
        assert all(s.draft_tokens <= max_draft_tokens for s in log.steps)


def test_fixed_policy_allocates_in_running_order(target, batch, references):
    """The default policy of before: γ each, in running order, while ``max_draft_tokens`` lasts."""
    eng = _engine(target, _model_drafter(helpers.tiny(seed=0)), FixedPolicy(GAMMA), max_draft_tokens=6)
    plans = _planned_drafts(eng)
    done = helpers.run(eng, helpers.requests(batch[:3], MAX_NEW))
    assert helpers.outputs(done) == {str(i): references[str(i)] for i in range(3)}
    assert plans[1] == {"0": 4, "1": 2, "2": 0}  # the first decode step: all three may draft γ
    assert all(sum(plan.values()) <= 6 for plan in plans)


def test_a_draft_models_catch_up_is_priced_apart_from_its_draft_forwards(target, batch, references):
    """A prompt longer than BACKLOG_ROWS is fed to the draft model in a forward of its own (made slow here): the
    policy hears of it per row (``observe_catch_up``) and its draft time holds draft forwards only. (Booked as a
    draft forward, one prompt's catch-up made drafting look too dear to ever start again: on the pair the adaptive
    policy stopped drafting after its first round.)"""
    policy = AdaptivePolicy(GAMMA, 0.9, 8)
    drafter = _model_drafter(helpers.noisy_target(0.2, seed=5))
    forward = drafter.runner.forward

    def slow_catch_up(step):
        if len(step.logit_rows) == 0:  # a backlog's forward: no logits wanted
            time.sleep(0.2)
        return forward(step)

    drafter.runner.forward = slow_catch_up
    caught_up, draft_seconds = [], []
    observe_catch_up, observe_step = policy.observe_catch_up, policy.observe_step
    policy.observe_catch_up = lambda rows, seconds: caught_up.append((rows, seconds)) or observe_catch_up(rows, seconds)
    policy.observe_step = lambda *args: draft_seconds.append(args[3]) or observe_step(*args)
    eng = _engine(target, drafter, policy)
    done = helpers.run(eng, helpers.requests(batch, MAX_NEW))
    assert helpers.outputs(done) == references
    assert caught_up and sum(rows for rows, _ in caught_up) == drafter.upkeep().rows
    # a long prompt's catch-up was booked as such (the requests that drafted; a batch size's first step is plain)
    assert sum(rows for rows, _ in caught_up) >= min(len(p) for p in batch if len(p) >= BACKLOG_ROWS)
    assert all(seconds >= 0.2 for _, seconds in caught_up)
    assert draft_seconds and max(draft_seconds) < 0.1 and policy.draft_cost.per_forward < 0.05


def test_a_lookup_that_proposes_ahead_books_no_draft_forward(target, batch, references):
    """A lookup's proposals are made before the plan, whatever it then chooses: no drafted position costs a draft
    forward, so the policy hears of none (the step's scheduling and lookup time, booked per depth, made every
    position look dear). Asked after the plan, the same lookup's rounds are booked by depth (the guard)."""
    forwards = {}
    for lookup in (NgramDrafter, helpers.NgramAfterPlan):
        drafter = lookup(3, 1, VOCAB, one_hot_probs=False)
        policy, booked = AdaptivePolicy(GAMMA, 0.9, 8), []
        observe_step = policy.observe_step
        policy.observe_step = lambda *args, book=booked, observe=observe_step: book.append(args[1]) or observe(*args)
        eng = _engine(target, drafter, policy)
        done = helpers.run(eng, helpers.requests(batch, MAX_NEW))
        assert helpers.outputs(done) == references
        assert sum(r.drafted_tokens for r in done.values()) > 0
        forwards[drafter.ahead] = sum(booked)
    assert forwards[True] == 0 < forwards[False]


def test_the_step_log_sets_the_policys_expectation_beside_the_measurement(target, batch):
    """Issue 57: every decode step of the adaptive policy carries what it expected (emitted tokens from its acceptance
    estimates, T_B(n) from its curve, the draft forwards' cost) beside what was measured; a fixed γ predicts nothing."""
    policy = PinnedCosts()
    eng = _engine(target, DRAFTERS["model-noisy"](None), policy, max_draft_tokens=12)
    log = StepLog()
    eng.on_step = log
    helpers.run(eng, helpers.requests(batch, MAX_NEW))
    decode = [s for s in log.steps if s.predicted_tokens is not None and not s.prefill_tokens]
    assert decode and any(s.draft_tokens for s in decode)
    for s in decode:
        assert len(s.acceptance_estimates) == len(s.drafted) == len(s.accepted) == s.batch_size
        assert sum(map(len, s.acceptance_estimates)) == s.draft_tokens  # S_1..S_k per request, for the k planned
        assert all(len(estimate) >= d for estimate, d in zip(s.acceptance_estimates, s.drafted, strict=True))
        expected = s.batch_size + sum(sum(estimate) for estimate in s.acceptance_estimates)
        assert s.predicted_tokens == pytest.approx(expected, abs=1e-3)
        assert s.predicted_target_seconds == pytest.approx(0.010 + 0.0003 * s.num_tokens, rel=1e-9)  # pinned T(n)
        ran = s.batch_size + sum(s.drafted)  # the drafter may propose fewer than planned: the curve where it ran
        assert s.predicted_actual_seconds == pytest.approx(0.010 + 0.0003 * ran, rel=1e-5)
        assert s.predicted_draft_seconds == pytest.approx(0.001 * max(map(len, s.acceptance_estimates)), rel=1e-9)
        assert s.emitted_tokens <= s.batch_size + sum(s.accepted)
        assert s.prior_strength >= 1
    fixed = _engine(target, DRAFTERS["ngram"](None), FixedPolicy(GAMMA), max_draft_tokens=12)
    fixed.on_step = fixed_log = StepLog()
    helpers.run(fixed, helpers.requests(batch, MAX_NEW))
    assert fixed_log.steps and all(s.predicted_tokens is None for s in fixed_log.steps)
    assert any(s.accepted for s in fixed_log.steps)
