"""The adaptive draft-length policy (spectoolkit.policy.adaptive) driven round by round, and the fixed ones.

Costs are seeded with a realistic curve (T(n) = 10 ms + 0.3 ms·n, one draft forward 1 ms) so the
choice depends on the acceptance that each test constructs through ``observe``.
"""

from __future__ import annotations

import numpy as np
import pytest

from spectoolkit.policy import AdaptivePolicy, ConfidencePolicy, FixedPolicy
from spectoolkit.policy.adaptive import EXPLORE, MAX_PROBE_INTERVAL, DecodeView
from spectoolkit.policy.costs import WINDOW

GAMMA = 4
STEP_BASE, STEP_PER_TOKEN, DRAFT_FORWARD = 0.010, 0.0003, 0.001  # seconds


def _time(tokens: int) -> float:
    return STEP_BASE + STEP_PER_TOKEN * tokens


def _policy(probe_every: int = 8, decay: float = 0.9, gamma: int = GAMMA) -> AdaptivePolicy:
    """Batch 1 measured a window of steps at every width up to 2γ + 1 (no width below a plan is left to measure), and
    a plain step at batches 2 and 3 (a batch's first step is plain)."""
    policy = AdaptivePolicy(gamma, decay, probe_every)
    policy.seed({n: _time(n) for n in (1, 2, 4, 8, 16, 32)})
    for _ in range(WINDOW):
        for width in range(1, 2 * gamma + 2):
            policy.observe_step(width, 0, _time(width), 0.0)
    for batch in (2, 3):
        policy.observe_step(batch, 0, _time(batch), 0.0, sequences=batch)
    policy.draft_cost.observe(1, DRAFT_FORWARD)
    return policy


def _hopeless(policy: AdaptivePolicy, key, rounds: int = 30) -> None:
    for _ in range(rounds):
        policy.observe(key, GAMMA, GAMMA, 0)


def _perfect(policy: AdaptivePolicy, key, rounds: int = 30) -> None:
    for _ in range(rounds):
        policy.observe(key, GAMMA, GAMMA, GAMMA)


def _one(policy: AdaptivePolicy, key, cap: int = GAMMA) -> int:
    """One batch-1 round's k (fixed tokens: the pending one; budget: the cap)."""
    return policy.choose([key], [cap], 1, cap)[0]


# ---- fixed and confidence ----------------------------------------------------------------------


def _old_fixed(gamma: int, caps: list[int], budget: int) -> list[int]:
    """The constant-γ allocation of before the policies: min(γ, cap, what is left), in order."""
    out = []
    for cap in caps:
        out.append(max(0, min(gamma, cap, budget)))
        budget -= out[-1]
    return out


@pytest.mark.parametrize("cls", [FixedPolicy, ConfidencePolicy])
def test_fixed_caps_reproduce_the_old_allocation(cls):
    policy = cls(4) if cls is FixedPolicy else cls(4, 0.25)
    assert policy.choose(["a", "b", "c", "d", "e"], [4, 2, 5, 0, 3], 5, 7) == [4, 2, 1, 0, 0]
    assert policy.choose([], [], 0, 10) == []
    rng = np.random.default_rng(0)
    for _ in range(200):
        caps = rng.integers(-1, 9, size=int(rng.integers(1, 7))).tolist()
        budget = int(rng.integers(-2, 30))
        keys = list(range(len(caps)))
        assert policy.choose(keys, caps, len(caps), budget) == _old_fixed(4, caps, budget)
    for method, args in (("observe", ("a", 4, 4, 0)), ("observe_step", (5, 4, 0.1, 0.1)), ("release", ("a",))):
        getattr(policy, method)(*args)  # no state: the same choice afterwards
    policy.seed({1: 1.0})
    assert policy.choose(["a"], [9], 1, 9) == [4]


def test_confidence_policy_carries_its_threshold():
    assert ConfidencePolicy(3, 0.4).stop_below == 0.4 and ConfidencePolicy(3, 0.4).name == "confidence"
    assert FixedPolicy(3).stop_below is None and AdaptivePolicy(3, 0.9, 8).stop_below is None


# ---- adaptive: acceptance decides --------------------------------------------------------------


def test_never_accepted_drafts_nothing_always_accepted_drafts_gamma():
    policy = _policy()
    _hopeless(policy, "never")
    _perfect(policy, "always")
    assert _one(policy, "never") == 0
    assert _one(policy, "always") == GAMMA
    assert _one(policy, "always", cap=2) == 2  # never past its cap
    assert policy.choose(["never", "always"], [GAMMA, GAMMA], 2, 8) == [0, GAMMA]


def test_the_choice_follows_where_drafts_are_rejected():
    policy = _policy()
    for _ in range(30):
        policy.observe("two", GAMMA, GAMMA, 2)  # always exactly 2 of 4 accepted
    assert _one(policy, "two") == 2


def test_a_fresh_policy_learns_gamma_from_full_rounds_and_zero_from_rejections():
    for accepted_share, expected in ((1.0, GAMMA), (0.0, 0)):
        policy, chosen = _policy(probe_every=1000), []
        for _ in range(15):
            k = _one(policy, "r")
            chosen.append(k)
            policy.observe("r", k, k, round(accepted_share * k))
        assert chosen[0] not in (0, GAMMA)  # the prior (0.5) starts in between
        assert chosen[-5:] == [expected] * 5, chosen


def test_costlier_draft_forwards_shorten_the_drafts():
    cheap, costly = _policy(), _policy()
    costly.draft_cost.observe(1, 0.2)  # EWMA of 1 ms and 200 ms: ~100 ms per forward, ten target steps
    for policy in (cheap, costly):
        for _ in range(30):
            policy.observe("r", GAMMA, GAMMA, 3)  # the 4th draft is always rejected
    assert _one(cheap, "r") == 3 and _one(costly, "r") == 0


def test_joint_choice_respects_caps_and_budget():
    policy = _policy()
    keys = ["a", "b", "c"]
    for key in keys:
        _perfect(policy, key)
    assert policy.choose(keys, [GAMMA] * 3, 3, 12) == [GAMMA] * 3
    tight = policy.choose(keys, [GAMMA] * 3, 3, 5)
    assert sum(tight) == 5 and all(0 <= k <= GAMMA for k in tight)
    assert policy.choose(keys, [1, 0, 9], 3, 12) == [1, 0, GAMMA]  # caps past max_gamma are clipped
    assert policy.choose(keys, [GAMMA] * 3, 3, 0) == [0, 0, 0]


def test_release_forgets_a_request():
    policy = _policy()
    _perfect(policy, "a")
    _hopeless(policy, "b", rounds=3)
    policy.release("a")
    prior = np.cumprod(policy.acceptance.workload_acceptance()[:GAMMA]).tolist()
    assert policy.acceptance.survival("a", GAMMA) == pytest.approx(prior)


# ---- adaptive: probing -------------------------------------------------------------------------


def _rounds_until_probe(policy: AdaptivePolicy, key, limit: int = 2000) -> int:
    """Plain rounds of ``key`` before its next 1-token probe (the probe itself is not counted)."""
    for plain in range(limit):
        k = _one(policy, key)
        if k:
            assert k == 1, "a request at 0 is probed with one token"
            return plain
        policy.observe(key, 0, 0, 0)
    raise AssertionError("never probed")


def test_the_probe_interval_spends_the_exploration_share():
    assert AdaptivePolicy.probe_interval(0.05, 1) == 5  # a probe costing 5% of a plain step: one in 5 rounds
    assert AdaptivePolicy.probe_interval(0.05, 16) == 80  # 16 requests each probing: each 16 times as rarely
    assert AdaptivePolicy.probe_interval(-0.2, 4) == 0  # a probe that pays is not rationed


@pytest.mark.parametrize("draft_forward", [0.001, 0.004, 0.008])
def test_probes_of_a_hopeless_request_cost_the_exploration_share(draft_forward):
    """Rejected probes every so many plain rounds: what they add to the time is EXPLORE of it (the request's own
    estimate is near 0, as it is), whatever a probe costs; and they do happen."""
    policy = _policy(probe_every=1)
    for _ in range(20):
        policy.draft_cost.observe(1, draft_forward)
    _hopeless(policy, "a")
    seconds = extra = 0.0
    for _ in range(3000):
        k = _one(policy, "a")
        assert k in (0, 1)
        seconds += _time(1 + k) + draft_forward * k
        extra += (_time(2) + draft_forward - _time(1)) * k
        policy.observe("a", k, k, 0)
    assert 0.6 * EXPLORE < extra / seconds < 1.1 * EXPLORE


@pytest.mark.parametrize("probe_every", [3, 8])
def test_no_request_is_probed_more_often_than_probe_every(probe_every):
    policy = _policy(probe_every)
    for _ in range(20):
        policy.draft_cost.observe(1, 0.0)  # a free lookup: a probe costs a 0.3 ms row, 3% of a step
    _hopeless(policy, "a")
    assert [_rounds_until_probe(policy, "a") for _ in range(3)] == [probe_every] * 3


def test_a_request_more_likely_to_be_accepted_is_probed_sooner():
    policy = _policy(probe_every=1)
    _hopeless(policy, "never")
    for _ in range(30):
        policy.observe("rarely", GAMMA, GAMMA, 0)
        policy.observe("rarely", GAMMA, GAMMA, int(_ % 5 == 0))  # a first draft accepted one round in ten
    assert _one(policy, "rarely") == 0
    assert 1 < _rounds_until_probe(policy, "rarely") < _rounds_until_probe(policy, "never")


def test_a_drafting_request_probes_one_position_past_its_choice():
    """Always exactly 2 of 4 accepted: the policy drafts 2 and, now and then, 3 (the estimate of a position no round
    reaches is otherwise never corrected); never 4."""
    policy = _policy(probe_every=1)
    chosen = []
    for _ in range(300):
        policy.observe("two", GAMMA, GAMMA, 2)
        chosen.append(_one(policy, "two"))
    assert set(chosen) == {2, 3} and chosen.count(3) < 0.2 * len(chosen)


def test_only_a_request_the_policy_kept_plain_ages():
    """Kept at k = 0 by the policy, a request's rejected history fades toward the workload's until it drafts again; with
    nothing to draft (cap 0: a lookup with no match), its history stays as it was."""
    held, missed = _policy(probe_every=1000), _policy(probe_every=1000)  # no probes
    for policy in (held, missed):
        for _ in range(20):
            policy.draft_cost.observe(1, 0.004)  # a draft forward of ~4 ms: a draft pays above ~40% acceptance
        for _ in range(30):
            policy.observe("w", GAMMA, GAMMA, GAMMA)  # the workload: always accepted
        for _ in range(20):
            policy.observe("a", GAMMA, GAMMA, 0)
    before = held.acceptance.survival("a", 1)[0]
    assert held.choose(["a"], [GAMMA], 1, GAMMA) == [0]
    held.observe("a", 0, 0, 0)
    rounds = 1
    while not held.choose(["a"], [GAMMA], 1, GAMMA)[0]:
        held.observe("a", 0, 0, 0)
        rounds += 1
        assert rounds < 100, "never drafted again"
    assert rounds > 0 and held.acceptance.survival("a", 1)[0] > before
    for _ in range(rounds + 10):
        assert missed.choose(["a"], [0], 1, GAMMA) == [0]
        missed.observe("a", 0, 0, 0)
    assert missed.acceptance.survival("a", 1)[0] == pytest.approx(before)


def test_a_batch_size_s_first_decode_step_is_plain():
    """Its baseline is measured, not borrowed from a batch whose rows cost otherwise; its drafts come after."""
    policy = _policy()
    keys = ["a", "b", "c", "d"]
    for key in keys:
        _perfect(policy, key)
    assert policy.choose(keys, [GAMMA] * 4, 4, 16) == [0, 0, 0, 0]
    policy.observe_step(4, 0, _time(4), 0.0, sequences=4)
    assert policy.choose(keys, [GAMMA] * 4, 4, 16) == [GAMMA] * 4
    assert policy.choose(keys[:3], [GAMMA] * 3, 3 + 40, 12) == [GAMMA] * 3  # a step with a prefill chunk: not plain


def test_no_probe_without_spare_budget_and_none_for_zero_caps():
    policy = _policy(probe_every=2)
    _hopeless(policy, "a")
    for _ in range(100):
        assert policy.choose(["a"], [GAMMA], 1, 0) == [0]  # the step has no candidate room
    assert policy.choose(["a"], [GAMMA], 1, 1) == [1]  # as soon as it has, the overdue probe goes
    policy.observe("a", 1, 1, 0)
    for _ in range(100):
        assert policy.choose(["a"], [0], 1, 4) == [0]  # a request that may not draft is never probed


@pytest.mark.parametrize("fixed", [2, 2 + 40], ids=["decode", "with-prefill"])
def test_a_step_where_nothing_may_draft_is_predicted_as_pricing_zero_drafts_would(fixed):
    """Every cap 0 (a lookup that proposed nothing) takes a short path: no draft, no request held plain, the probe
    counts kept as they were (a round a request could not draft in is not one it was held plain), and the prediction
    that pricing zero drafts on the step's curve gives."""
    policy = _policy(probe_every=2)
    _hopeless(policy, "a")
    _perfect(policy, "b")
    policy.choose(["a", "b"], [GAMMA, GAMMA], 2, 8)  # "a" is held plain, its probe count running
    assert policy._held == {"a"} and policy._idle == {"a": 1}
    assert policy.choose(["a", "b"], [0, 0], fixed, 8) == [0, 0]
    assert policy._held == set() and policy._idle == {"a": 1}
    short = policy.prediction()
    curve = policy.step_curve(2)
    if fixed > 2:
        curve = DecodeView(curve, fixed, 2)
    policy._predict(["a", "b"], [0, 0], [[], []], fixed, curve, policy.costs.drafts_by_count(2), policy.forwards(0))
    assert short == policy.prediction() and short.tokens == 2.0
    policy.choose(["a", "b"], [0, GAMMA], 2, 8)  # a round it cannot draft in, where another request may
    assert policy._idle.get("a") == 1


def test_a_request_whose_drafts_turn_good_is_picked_up_again():
    policy = _policy(probe_every=4)
    _hopeless(policy, "a", rounds=40)
    chosen = []
    for _ in range(120):  # from now on the drafter is always right
        k = _one(policy, "a")
        chosen.append(k)
        policy.observe("a", k, k, k)
    first_probe = chosen.index(1)
    assert first_probe >= 4 and set(chosen[:first_probe]) == {0}
    assert first_probe < 20
    assert any(k > 1 for k in chosen), chosen  # picked up by the optimiser, not only by probes
    assert chosen[-10:] == [GAMMA] * 10, chosen


def test_while_even_perfect_drafts_would_not_pay_probes_are_rare():
    policy = _policy(probe_every=2)
    _hopeless(policy, "a")
    for _ in range(20):
        policy.draft_cost.observe(1, 1.0)  # a draft forward of ~1 s: a hundred target steps
    # Its probes are priced at what they cost: far beyond the longest interval (1% of the time at ~100 steps each).
    assert all(_one(policy, "a") == 0 for _ in range(2 * MAX_PROBE_INTERVAL))
    cheap = _policy(probe_every=2)
    _hopeless(cheap, "a")
    assert _rounds_until_probe(cheap, "a") < 50  # the same history with a cheap drafter is probed


def test_costs_a_warm_up_measured_too_high_are_measured_again():
    """Issue 57: a warm-up priced the draft forward at 15 ms where it takes 1 ms (a target step: 10.3 ms), so that even
    drafts always accepted looked as if they would not pay. Only drafting measures that cost again: the request is
    probed after the longest interval, each probe measures the true cost, and the policy drafts again (without
    those probes it never drafted in the rest of the run)."""
    policy = _policy(probe_every=2)
    _perfect(policy, "a")
    for _ in range(10):
        policy.observe_step(2, 1, _time(2), 0.015)  # the warm-up's slow draft forwards
    assert _one(policy, "a") == 0
    chosen = []
    for _ in range(8 * MAX_PROBE_INTERVAL):
        k = _one(policy, "a")
        chosen.append(k)
        policy.observe("a", k, k, k)  # the drafter is always right
        policy.observe_step(1 + k, k, _time(1 + k), k * DRAFT_FORWARD)  # and its forwards take what they take
    assert chosen.index(1) == MAX_PROBE_INTERVAL - 1  # not one before the longest interval
    assert chosen[-10:] == [GAMMA] * 10, chosen[-10:]


def test_a_curve_known_at_one_width_only_still_drafts():
    """Serving starts without calibration: plain steps alone must not make drafting look never worth it."""
    policy = AdaptivePolicy(GAMMA, decay=0.9, probe_every=8)
    for _ in range(20):
        policy.observe_step(1, 0, 0.05, 0.0)  # only plain decode steps measured so far
    assert policy.choose(["a"], [GAMMA], 1, GAMMA)[0] > 0


def test_under_a_load_where_typical_drafts_do_not_pay_only_the_longest_interval_probes():
    """The workload accepts half the first drafts: that pays for a lone request (T(n) = 10 ms + 0.3 ms·n), but not in
    a step of four sequences where every token costs 5 ms (a busy CPU; drafts always accepted would still pay). Four
    requests at k = 0 are then probed only after MAX_PROBE_INTERVAL plain rounds; alone, after probe_every again."""
    policy = _policy(probe_every=2)
    keys = ["a", "b", "c", "d"]
    for key in keys:
        _hopeless(policy, key)
    for _ in range(300):  # the workload: other requests with half their first drafts accepted
        policy.observe("w", 1, 1, 1)
        policy.observe("w", 1, 1, 0)
    for _ in range(3):
        for tokens in (4, 8):
            policy.observe_step(tokens, 0, 0.020 + 0.005 * tokens, 0.0, sequences=4)
    assert policy.acceptance.workload_acceptance()[0] == pytest.approx(0.5, abs=0.05)
    plain = 0
    while not any(policy.choose(keys, [GAMMA] * 4, 4, 16)):
        plain += 1
        assert plain <= MAX_PROBE_INTERVAL, "never probed"
    assert plain == MAX_PROBE_INTERVAL
    policy.release("a")
    _hopeless(policy, "a")
    # Alone: probed after probe_every, or drafting at once (the prior's weight m now comes from how much requests
    # differ: a lone step's 1 ms draft and 0.3 ms row pay even at the acceptance that a's prior leaves it).
    assert _rounds_until_probe(policy, "a") <= 2


@pytest.mark.parametrize(("room", "drafts"), [(3, 0), (400, GAMMA)])
def test_a_request_drafts_after_a_backlog_only_if_its_remaining_tokens_repay_the_catch_up(room, drafts):
    """A request whose drafts are always accepted holds 300 rows its drafter must feed first, at 0.1 ms a row (30 ms).
    With 400 tokens left its drafts save seconds: it drafts γ. With 3 left they save about 18 ms (3 tokens at
    10.3 ms plainly, at 4.3 ms drafting 2): it decodes plainly. With nothing held, or no catch-up measured yet, it
    drafts as before."""
    policy = _policy()
    _perfect(policy, "a")
    cap = min(GAMMA, room - 1)
    assert policy.choose(["a"], [cap], 1, cap, backlogs=[300], rooms=[room]) == [cap]  # no catch-up cost measured
    policy.observe_catch_up(100, 0.010)
    assert policy.choose(["a"], [cap], 1, cap, backlogs=[300], rooms=[room]) == [drafts]
    assert policy.choose(["a"], [cap], 1, cap, backlogs=[0], rooms=[room]) == [cap]


def test_in_a_batch_a_request_with_a_backlog_drafts_where_the_batch_drafting_together_pays():
    """Four requests accept every draft, in steps of 50 ms plus 4.4 ms a row; a draft forward costs 9 ms for one
    sequence and 16.5 ms for four (the pair on Zen 5). Drafting pays jointly (the forward is shared) but not for
    one request beside three plain ones. A request holding 200 rows (0.2 s to feed) with 128 tokens to go must draft
    with the others: priced as if it drafted alone, it never drafted again (issue 57, the chain at c4). One near its
    end (3 tokens left) still decodes plainly, and so does one whose batch is about to grow to where drafts do not
    pay."""
    policy = AdaptivePolicy(6, 0.9, 8)
    for key in "abcd":
        for _ in range(30):
            policy.observe(key, 6, 6, 6)
    for _ in range(WINDOW):
        for width in (4, 10, 16, 22, 28):
            policy.observe_step(width, 0, 0.050 + 0.0044 * (width - 4), 0.0, 4, 0)
        for drafting, seconds in ((1, 0.009), (2, 0.014), (3, 0.0147), (4, 0.0165)):
            policy.costs.observe_draft(drafting, 6, 6 * seconds)
    policy.observe_catch_up(200, 0.2)
    lengths = policy.choose(list("abcd"), [6] * 4, 4, 64, backlogs=[0, 0, 0, 200], rooms=[100, 100, 100, 128])
    assert lengths[3] > 0 and all(lengths)
    lengths = policy.choose(list("abcd"), [6, 6, 6, 2], 4, 64, backlogs=[0, 0, 0, 200], rooms=[100, 100, 100, 3])
    assert lengths[3] == 0 and all(lengths[:3])
    # Twelve more prompts are being computed: the batch settles at 16, where a plain step takes 115 ms and every row
    # 4 ms more (drafts do not pay there). The catch-up would buy drafts for a step or two only: it is not paid.
    for _ in range(WINDOW):
        for width in (16, 48):
            policy.observe_step(width, 0, 0.115 + 0.004 * (width - 16), 0.0, 16, 0)
    lengths = policy.choose(list("abcd"), [6] * 4, 4, 64, [0, 0, 0, 200], [100, 100, 100, 128], settled=16)
    assert lengths[3] == 0 and all(lengths[:3])


@pytest.mark.parametrize(("backlog", "drafts"), [(100, False), (20, True)])
def test_a_catch_up_is_repaid_by_the_requests_share_of_what_the_batch_saves(backlog, drafts):
    """Four requests accept every draft, in steps of 30 ms plus 2.7 ms a row; a draft forward costs 17 ms for four,
    14.5 ms for three. All four drafting six tokens saves ~10 ms a round against plain steps; three drafting beside
    one plain request lose. A newcomer holding its prompt (1.2 ms a row) beside three that draft: without it the
    batch would decode plainly, so its drafts alone seem to save all ~190 ms over its 128 tokens, and so would every
    newcomer's, each paying its own prompt for them (issue 57: the chain on code at c4 drafted one token a request,
    +8% a step, and its catch-ups made it 0.94x the target alone). Its share, a quarter (~47 ms), must repay it: 100
    rows (120 ms) do not, and the batch decodes plainly; 20 rows (24 ms) do."""
    policy = AdaptivePolicy(6, 0.9, 8)
    for key in "abcd":
        for _ in range(30):
            policy.observe(key, 6, 6, 6)
    for _ in range(WINDOW):
        for width in range(4, 29, 4):
            policy.observe_step(width, 0, 0.030 + 0.0027 * (width - 4), 0.0, 4, 0)
        for drafting, seconds in ((1, 0.009), (2, 0.012), (3, 0.0145), (4, 0.017)):
            policy.costs.observe_draft(drafting, 1, seconds)
    policy.observe_catch_up(160, 0.192)
    lengths = policy.choose(list("abcd"), [6] * 4, 4, 64, backlogs=[0, 0, 0, backlog], rooms=[100, 100, 100, 128])
    assert all(lengths) if drafts else not any(lengths), lengths


def test_a_catch_up_waits_for_a_plain_step_of_the_batch_it_is_repaid_in():
    """Three requests decode beside a prompt being computed (the batch settles at 4, never run yet); every draft is
    kept, rows cost 0.5 ms on a 30 ms step, a draft forward 5 ms. The request owing its draft model 50 rows (50 ms)
    is held back until a batch of 4 has run a plain step: priced on another batch's curve before, its catch-up was
    judged against a plain step that never ran (issue 57: 33.7 ms where it took 22.4). The others draft meanwhile."""
    policy = AdaptivePolicy(6, 0.9, 8)
    for key in "abc":
        for _ in range(30):
            policy.observe(key, 6, 6, 6)
    for _ in range(WINDOW):
        for width in (3, 9, 15, 21):
            policy.observe_step(width, 0, 0.030 + 0.0005 * (width - 3), 0.0, 3, 0)
        for drafting in (1, 2, 3):
            policy.costs.observe_draft(drafting, 1, 0.005)
    policy.observe_catch_up(100, 0.1)

    def choose() -> list[int]:
        return policy.choose(list("abc"), [6] * 3, 3, 64, [0, 0, 50], [100, 100, 128], settled=4)

    assert choose() == [6, 6, 0]
    policy.observe_step(4, 0, 0.031, 0.0, 4, 0)  # the batch of 4's first step, plain
    assert choose() == [6, 6, 6]


@pytest.mark.parametrize(("room", "probed"), [(3, False), (400, True)])
def test_a_request_at_zero_is_probed_after_a_backlog_only_if_a_typical_request_would_repay_it(room, probed):
    """The workload accepts half the first drafts; a request at k = 0 holds 300 rows (30 ms to feed). With 400 tokens
    left, drafts at the workload's acceptance would repay that: it is probed after probe_every plain rounds as ever.
    With 3 left they would not: it is never probed."""
    policy = _policy(probe_every=2)
    _hopeless(policy, "h", rounds=100)
    for _ in range(300):
        policy.observe("w", 1, 1, 1)
        policy.observe("w", 1, 1, 0)
    policy.observe_catch_up(100, 0.010)
    rounds = [policy.choose(["h"], [2], 1, 2, backlogs=[300], rooms=[room])[0] for _ in range(50)]
    assert any(rounds) == probed


def test_a_step_carrying_a_prefill_chunk_drafts_only_what_a_plain_decode_step_would():
    """Four requests accept half their first drafts, in steps where every token costs 5 ms: drafts do not pay in a
    plain decode step. A 200-token prefill chunk in the same step (a second of work) must not make them look cheap
    beside it; drafts that are always accepted still pay there, as they do in a plain step."""
    policy = _policy(probe_every=1000)
    keys = ["a", "b", "c", "d"]
    for _ in range(30):
        for key in keys:
            policy.observe(key, 1, 1, 1)
            policy.observe(key, 1, 1, 0)
    for _ in range(3):
        for tokens in (4, 8):
            policy.observe_step(tokens, 0, 0.020 + 0.005 * tokens, 0.0, sequences=4)
    assert policy.choose(keys, [GAMMA] * 4, 4, 16) == [0, 0, 0, 0]
    assert policy.choose(keys, [GAMMA] * 4, 4 + 200, 16) == [0, 0, 0, 0]
    for key in keys:
        _perfect(policy, key)
    assert policy.choose(keys, [GAMMA] * 4, 4 + 200, 16) == [GAMMA] * 4
    assert sum(policy.choose(keys, [GAMMA] * 4, 4, 16)) >= 4 * GAMMA - 1  # (a plain step may measure the width below)


@pytest.mark.parametrize("seed", range(4))
def test_the_bound_on_a_catch_ups_saving_never_falls_below_the_saving(seed):
    """_not_repaid blocks a request whose catch-up costs at least _most_saved without planning the step without it:
    exact only while the bound is never under _time_saved (plans of 2-16 requests, drafts priced by drafting count)."""
    from spectoolkit.policy.adaptive import _best_step, _most_saved, _time_saved

    rng = np.random.default_rng(seed)
    checked = 0
    for _ in range(60):
        batch = int(rng.integers(2, 17))
        survival = [np.cumprod(rng.uniform(0.3, 1.0, int(rng.integers(0, 7)))).tolist() for _ in range(batch)]
        slope = rng.uniform(0.0001, 0.004)
        curve = lambda n, s=slope, b=batch: 0.02 + s * (np.asarray(n, dtype=np.float64) - b)  # noqa: E731
        by_count = [0.0] + np.cumsum(rng.uniform(0.0, 0.001, batch)).tolist()
        budget = int(rng.integers(1, 40))
        plan = _best_step(survival, batch, budget, curve, by_count, list(range(7)))
        for i, k in enumerate(plan.lengths):
            if k:
                room = int(rng.integers(1, 300))
                assert _most_saved(plan, i, room) >= _time_saved(plan, i, room, budget)
                checked += 1
    assert checked > 20, "the plans never drafted"
