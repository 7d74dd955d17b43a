"""Per-request acceptance estimates (spectoolkit.policy.acceptance) against a from-the-definition reference.

The reference recomputes every count from the list of rounds: position j of a round (drafted d,
accepted a) is reached when j <= d and the first j - 1 were accepted (j <= a + 1), accepted when
j <= a; a round ``age`` rounds old weighs decay**age.
"""

from __future__ import annotations

import numpy as np
import pytest

from spectoolkit.policy.acceptance import (
    BASE_ACCEPTANCE,
    RECENT_REQUESTS,
    WORKLOAD_DECAY,
    WORKLOAD_PRIOR,
    AcceptanceModel,
)

GAMMA = 4


def _counts(rounds: list[tuple[int, int]], decay: float, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """Decayed (reached [gamma], accepted [gamma]) of ``rounds`` (oldest first), from the definition."""
    reached, accepted = np.zeros(gamma), np.zeros(gamma)
    for age, (drafted, num_accepted) in enumerate(reversed(rounds)):
        weight = decay**age
        for j in range(1, gamma + 1):
            reached[j - 1] += weight * (j <= drafted and j <= num_accepted + 1)
            accepted[j - 1] += weight * (j <= num_accepted)
    return reached, accepted


def _reference_workload(rounds: list[tuple[int, int]], gamma: int) -> np.ndarray:
    reached, accepted = _counts(rounds, WORKLOAD_DECAY, gamma)
    out, previous = np.empty(gamma), BASE_ACCEPTANCE
    for j in range(gamma):
        previous = (accepted[j] + WORKLOAD_PRIOR * previous) / (reached[j] + WORKLOAD_PRIOR)
        out[j] = previous
    return out


def _reference_survival(rounds, workload_rounds, decay: float, gamma: int, cap: int, strength: float) -> np.ndarray:
    """Position 1 shrinks toward the workload's, j >= 2 toward its own j - 1 times the workload's A_j / A_{j-1}, never
    below the workload's A_j."""
    prior = _reference_workload(workload_rounds, gamma)
    reached, accepted = _counts(rounds, decay, gamma)
    conditional: list[float] = []
    for j in range(gamma):
        target = prior[0] if j == 0 else min(1.0, max(prior[j], conditional[-1] * prior[j] / prior[j - 1]))
        conditional.append((accepted[j] + strength * target) / (reached[j] + strength))
    return np.cumprod(conditional)[:cap]


def test_reached_and_accepted_positions():
    model = AcceptanceModel(GAMMA, decay=1.0)
    model.observe("a", 4, 2)  # positions 1..3 reached, 1..2 accepted
    reached, accepted = _counts([(4, 2)], 1.0, GAMMA)
    assert reached.tolist() == [1, 1, 1, 0] and accepted.tolist() == [1, 1, 0, 0]  # the reference's own check
    workload = model.workload_acceptance()
    # A_j = (accepted_j + A_{j-1}) / (reached_j + 1), A_0 = 0.5
    assert workload == pytest.approx([0.75, 0.875, 0.4375, 0.4375], rel=1e-12)
    # one request: no spread between requests measured yet, so m is its cap (decay 1: RECENT_REQUESTS)
    m = model.prior_strength()
    assert m == RECENT_REQUESTS
    a1 = (1 + m * 0.75) / (1 + m)  # then each position toward its own previous one, in the workload's shape
    a2 = (1 + m * max(0.875, a1 * 0.875 / 0.75)) / (1 + m)  # (never below the workload's)
    a3 = (0 + m * max(0.4375, a2 * 0.4375 / 0.875)) / (1 + m)
    conditional = [a1, a2, a3, max(0.4375, a3)]  # position 4: its own a_3 (the workload is flat there)
    assert model.survival("a", 4) == pytest.approx(np.cumprod(conditional).tolist(), rel=1e-12)
    model.observe("b", 3, 3)  # all accepted: positions 1..3 reached and accepted, 4 not reached
    survival = model.survival("b", 4)
    assert survival[3] / survival[2] == pytest.approx(survival[2] / survival[1])  # a_4 = a_3: the request's tail


def test_a_request_below_the_workload_at_first_expects_the_workloads_deeper_positions():
    """A deeper position is reached only once the ones before it were accepted: a request that is accepted less often
    than the workload at its first position is not expected, at a position it has not reached, below the workload's
    acceptance there (scaled down, a lookup's 2-token matches, accepted at 0.84 at their second position, were priced
    at 0.3-0.6 and cut to one at c4). One above the workload expects more there, in the workload's shape."""
    model = AcceptanceModel(GAMMA, decay=0.9)
    for _ in range(20):
        model.observe("typical", 2, 2)
        model.observe("typical", 2, 1)
        model.observe("typical", 2, 0)
    for _ in range(10):
        model.observe("weak", 1, 0)
        model.observe("strong", 1, 1)
    workload = model.workload_acceptance()
    weak, strong = model.survival("weak", 2), model.survival("strong", 2)
    assert weak[0] < workload[0] < strong[0]
    assert weak[1] / weak[0] == pytest.approx(workload[1], rel=1e-12)  # position 2 not reached: the workload's
    assert strong[1] / strong[0] == pytest.approx(min(1.0, strong[0] * workload[1] / workload[0]), rel=1e-12)


def test_nothing_measured_is_the_base_acceptance():
    model = AcceptanceModel(GAMMA, decay=0.9)
    assert model.workload_acceptance() == pytest.approx([BASE_ACCEPTANCE] * GAMMA)
    assert model.survival("new", 3) == pytest.approx([0.5, 0.25, 0.125])
    assert model.survival("new", 0) == [] and model.survival("new", -1) == []
    model.observe("a", 0, 0)  # a plain round: nothing learnt
    assert model.workload_acceptance() == pytest.approx([BASE_ACCEPTANCE] * GAMMA)


@pytest.mark.parametrize("decay", [1.0, 0.9, 0.5])
def test_random_rounds_match_the_reference(decay):
    rng = np.random.default_rng(int(decay * 10))
    model = AcceptanceModel(GAMMA, decay)
    rounds: dict[str, list[tuple[int, int]]] = {"a": [], "b": [], "c": []}
    everything: list[tuple[int, int]] = []
    skill = {"a": 0.9, "b": 0.4, "c": 0.05}
    for _ in range(60):
        key = str(rng.choice(list(rounds)))
        drafted = int(rng.integers(1, GAMMA + 1))
        accepted = int(np.argmin(np.append(rng.random(drafted) < skill[key], False)))  # first rejection
        model.observe(key, drafted, accepted)
        rounds[key].append((drafted, accepted))
        everything.append((drafted, accepted))
        assert model.workload_acceptance() == pytest.approx(_reference_workload(everything, GAMMA), rel=1e-9)
    for key in rounds:
        for cap in range(GAMMA + 1):
            expected = _reference_survival(rounds[key], everything, decay, GAMMA, cap, model.prior_strength())
            assert model.survival(key, cap) == pytest.approx(expected.tolist(), rel=1e-9)
    good, bad = model.survival("a", 1)[0], model.survival("c", 1)[0]
    assert good > 0.6 > 0.3 > bad


def test_a_held_round_ages_a_request_and_a_lookup_miss_does_not():
    """A round the policy kept plain decays the request's counts like a drafted round's (its text moved on); a round
    whose drafter had nothing to propose (an n-gram miss, observed as drafted = 0) leaves them as they were."""
    model = AcceptanceModel(GAMMA, decay=0.5)
    for _ in range(3):
        model.observe("a", 4, 4)
    before = model.survival("a", 2)
    model.observe("a", 0, 0)  # a lookup miss
    assert model.survival("a", 2) == before
    model.age("a")
    reached, accepted = _counts([(4, 4)] * 3, 0.5, GAMMA)
    counts = model._requests["a"]
    np.testing.assert_allclose(counts.reached, reached * 0.5, rtol=1e-12)
    np.testing.assert_allclose(counts.accepted, accepted * 0.5, rtol=1e-12)
    assert model.survival("a", 1)[0] < before[0]  # toward the workload's (the same rounds, so only through m)
    model.age("unknown")  # a request never seen: nothing to age


def test_decay_forgets_old_rounds():
    slow, fast = AcceptanceModel(GAMMA, decay=1.0), AcceptanceModel(GAMMA, decay=0.5)
    for model in (slow, fast):
        for _ in range(10):
            model.observe("a", 4, 4)
        for _ in range(3):
            model.observe("a", 4, 0)
    # decay 0.5: the three rejections weigh 1.75 against the 10 old acceptances' 0.125 (times 0.5^3)
    reached, accepted = _counts([(4, 4)] * 10 + [(4, 0)] * 3, 0.5, GAMMA)
    assert reached[0] == pytest.approx(1 + 0.5 + 0.25 + 0.125 * (2 - 2**-9), rel=1e-12)
    assert accepted[0] == pytest.approx(0.125 * (2 - 2**-9), rel=1e-12)
    assert fast.survival("a", 1)[0] < 0.5 < 0.7 < slow.survival("a", 1)[0]


def test_a_request_shrinks_toward_the_workload():
    model = AcceptanceModel(GAMMA, decay=0.9)
    for _ in range(40):
        model.observe("hopeless", 4, 0)
    workload = model.workload_acceptance()
    assert workload[0] < 0.05
    assert model.survival("newcomer", 2) == pytest.approx(np.cumprod(workload[:2]).tolist())  # starts from the workload
    model.observe("newcomer", 4, 4)
    one_round = model.survival("newcomer", 1)[0]
    m = model.prior_strength()
    assert one_round == pytest.approx((1 + m * model.workload_acceptance()[0]) / (1 + m))
    for _ in range(30):
        model.observe("newcomer", 4, 4)
    assert model.survival("newcomer", 1)[0] > 0.8 > one_round  # its own rounds outweigh the prior
    model.release("newcomer")
    assert model.survival("newcomer", 1) == pytest.approx(model.workload_acceptance()[:1].tolist())


def test_unreached_positions_inherit_the_previous_acceptance():
    model = AcceptanceModel(6, decay=0.9)
    for accepted in (2, 1, 2, 0, 2):
        model.observe("a", 2, accepted)  # only positions 1 and 2 are ever drafted
    workload = model.workload_acceptance()
    assert workload[2] == workload[3] == workload[4] == workload[5] == pytest.approx(workload[1])
    survival = model.survival("a", 6)
    ratios = [survival[j] / survival[j - 1] for j in range(2, 6)]
    assert ratios == pytest.approx([survival[1] / survival[0]] * 4)  # S_j = S_{j-1} · a_2 past what it drafted


def test_survival_is_non_increasing_in_zero_one():
    rng = np.random.default_rng(3)
    model = AcceptanceModel(8, decay=0.8)
    for _ in range(300):
        drafted = int(rng.integers(0, 9))
        model.observe(int(rng.integers(4)), drafted, int(rng.integers(0, drafted + 1)))
        survival = np.array(model.survival(int(rng.integers(5)), 8))
        assert np.all(survival >= 0) and np.all(survival <= 1)
        assert np.all(np.diff(survival) <= 1e-15)


@pytest.mark.parametrize(("drafted", "accepted"), [(2, 3), (5, 1), (5, 5), (3, -1)])
def test_impossible_rounds_raise(drafted, accepted):
    model = AcceptanceModel(GAMMA, decay=0.9)
    with pytest.raises(ValueError, match="outside"):
        model.observe("a", drafted, accepted)
    assert model.workload_acceptance() == pytest.approx([BASE_ACCEPTANCE] * GAMMA)  # nothing was counted
