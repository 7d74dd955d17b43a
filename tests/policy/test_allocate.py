"""The joint draft-length choice (spectoolkit.policy.allocate) against brute force over every k vector.

Survival curves are random non-increasing sequences in [0, 1] (seeded; some on a coarse grid so
ties occur, some all 1 or all 0); step curves T(n) are linear, concave and step-shaped (a tile
boundary every 4 tokens), in milliseconds so goodput is O(0.1) and an absolute 1e-12 is tight.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest

from spectoolkit.policy.allocate import best_lengths, goodput

STEP_CURVES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "linear": lambda n: 10.0 + 0.3 * np.asarray(n, dtype=np.float64),
    "concave": lambda n: 10.0 + 2.0 * np.sqrt(np.asarray(n, dtype=np.float64)),
    "step": lambda n: 10.0 + 4.0 * np.floor(np.asarray(n, dtype=np.float64) / 4),
    "steep": lambda n: 1.0 + 1.0 * np.asarray(n, dtype=np.float64),  # drafting rarely pays
    "flat": lambda n: np.full(np.shape(n), 10.0),
}
DRAFT_FORWARDS = (0.0, 0.4, 3.0)  # ms per sequential draft forward


def _random_survival(rng: np.random.Generator, cap: int) -> list[float]:
    """A non-increasing sequence of ``cap`` values in [0, 1]."""
    kind = rng.integers(5)
    if kind == 0:
        return [1.0] * cap
    if kind == 1:
        return [0.0] * cap
    values = rng.uniform(0.0, 1.0, cap)
    if kind == 2:
        values = np.round(values * 4) / 4  # a coarse grid: ties within and across requests
    if kind == 3:
        return np.cumprod(values).tolist()  # products of conditional acceptances
    return sorted(values.tolist(), reverse=True)


def _brute_force(survival, fixed_tokens, budget, step_time, draft_forward) -> float:
    """The best goodput over every k vector with k_i <= cap_i and Σ k_i <= budget."""
    best = -np.inf
    for lengths in itertools.product(*(range(len(s) + 1) for s in survival)):
        if sum(lengths) <= budget:
            best = max(best, goodput(lengths, survival, fixed_tokens, step_time, draft_forward))
    return best


def _cases(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        caps = rng.integers(0, 5, size=int(rng.integers(1, 4))).tolist()  # B <= 3, caps <= 4
        survival = [_random_survival(rng, cap) for cap in caps]
        budget = int(rng.integers(0, sum(caps) + 2))  # from 0 to past Σ caps: binding and not
        fixed_tokens = len(caps) + int(rng.integers(0, 4))  # pending tokens, maybe a prefill chunk
        yield survival, fixed_tokens, budget


@pytest.mark.parametrize("draft_forward", DRAFT_FORWARDS)
@pytest.mark.parametrize("curve", STEP_CURVES)
def test_best_lengths_maximises_goodput(curve, draft_forward):
    step_time = STEP_CURVES[curve]
    drafting = binding = 0
    for survival, fixed_tokens, budget in _cases(seed=len(curve) + int(10 * draft_forward), count=150):
        lengths = best_lengths(survival, fixed_tokens, budget, step_time, draft_forward)
        assert len(lengths) == len(survival)
        assert all(0 <= k <= len(s) for k, s in zip(lengths, survival, strict=True)), (lengths, survival)
        assert sum(lengths) <= budget
        best = _brute_force(survival, fixed_tokens, budget, step_time, draft_forward)
        got = goodput(lengths, survival, fixed_tokens, step_time, draft_forward)
        assert got >= best - 1e-12, (survival, fixed_tokens, budget, lengths, got, best)
        drafting += sum(lengths) > 0
        binding += sum(lengths) == budget < sum(len(s) for s in survival)
    if curve != "steep" or draft_forward == 0.0:
        assert drafting > 0 and binding > 0, "the cases never drafted, or the budget never bound"


def _sequential(survival, fixed_tokens, budget, step_time, by_count, forwards) -> list[int]:
    """The scan :func:`best_lengths` vectorises, one candidate at a time (its former body, B >= 2): every deepest
    draft L, every prefix m of the candidates ranked by S within L, the running best replaced only by a value more
    than 1e-12 above it."""
    deepest = max(len(s) for s in survival)
    times = step_time(np.arange(fixed_tokens, fixed_tokens + min(budget, deepest * len(survival)) + 1)).tolist()
    best_value, best = len(survival) / times[0], (0, 0)
    for depth in range(1 if any(by_count) else deepest, deepest + 1):
        ranked = sorted((-s[j], j, i) for i, s in enumerate(survival) for j in range(min(depth, len(s))))
        emitted, drafting = float(len(survival)), 0
        for m, (gain, position, _) in enumerate(ranked[:budget], start=1):
            emitted -= gain
            drafting += position == 0
            value = emitted / (times[m] + by_count[drafting] * forwards[depth])
            if value > best_value * (1 + 1e-12):
                best_value, best = value, (depth, m)
    lengths = [0] * len(survival)
    depth, count = best
    ranked = sorted((-s[j], j, i) for i, s in enumerate(survival) for j in range(min(depth, len(s))))
    for _, _, i in ranked[:count]:
        lengths[i] += 1
    return lengths


@pytest.mark.parametrize("curve", STEP_CURVES)
def test_best_lengths_makes_the_sequential_scans_choice_at_every_batch(curve):
    """Batches of 2-16 (brute force stops at 3), caps to 8, draft forwards by drafting count and fractional
    forwards (trees), ties on a coarse grid: the same lengths as the scan one candidate at a time, to the bit."""
    rng = np.random.default_rng(len(curve))
    step_time, differed = STEP_CURVES[curve], 0
    for case in range(300):
        caps = rng.integers(0, 9, size=int(rng.integers(2, 17))).tolist()
        if not any(caps):
            continue
        survival = [_random_survival(rng, cap) for cap in caps]
        budget = int(rng.integers(1, sum(caps) + 3))
        fixed_tokens = len(caps) + int(rng.integers(0, 20))
        if case % 3 == 0:
            by_count = [0.0] * (len(caps) + 1)
        else:
            by_count = np.cumsum(rng.uniform(0.0, 2.0, len(caps) + 1)).tolist()
            by_count[0] = 0.0
        forwards = [0.0] + np.maximum.accumulate(rng.uniform(1.0, 3.0, max(caps))).tolist()
        if case % 2:
            forwards = list(range(max(caps) + 1))
        got = best_lengths(survival, fixed_tokens, budget, step_time, by_count, forwards)
        assert got == _sequential(survival, fixed_tokens, budget, step_time, by_count, forwards), (case, survival)
        differed += any(got)
    assert differed > 50, "the cases never drafted"


def test_goodput_by_hand():
    linear = STEP_CURVES["linear"]
    # emitted 1 + 0.5 + 0.25 = 1.75 over T(1 + 2) + 2 draft forwards = 10.9 + 2
    assert goodput([2], [[0.5, 0.25]], 1, linear, 1.0) == pytest.approx(1.75 / 12.9, rel=1e-15)
    # two requests: (1 + 0.9) + 1, over T(2 + 1) + one forward (the deepest draft is 1)
    assert goodput([1, 0], [[0.9], [0.3]], 2, linear, 1.0) == pytest.approx(2.9 / 11.9, rel=1e-15)
    assert goodput([], [], 1, linear) == 0.0


def test_the_budget_goes_to_the_largest_survivals_across_requests():
    survival = [[0.9, 0.8, 0.7, 0.6], [0.5, 0.4, 0.3, 0.2]]
    flat = STEP_CURVES["flat"]
    assert best_lengths(survival, 2, 5, flat) == [4, 1]
    assert best_lengths(survival, 2, 3, flat) == [3, 0]
    assert best_lengths(survival, 2, 100, flat) == [4, 4]
    assert best_lengths([[0.5, 0.4], [0.9, 0.1]], 2, 2, flat) == [1, 1]


def test_costly_steps_shorten_the_drafts():
    survival = [[0.8, 0.64, 0.512, 0.41]]  # acceptance 0.8 per position
    assert best_lengths(survival, 1, 4, STEP_CURVES["flat"]) == [4]
    cheap = best_lengths(survival, 1, 4, STEP_CURVES["linear"], 0.4)
    costly = best_lengths(survival, 1, 4, STEP_CURVES["linear"], 3.0)
    assert 4 >= cheap[0] > costly[0] >= 1
    assert best_lengths(survival, 1, 4, STEP_CURVES["steep"], 3.0) == [0]  # a draft costs more than a step


def test_ties_keep_the_shorter_drafts():
    flat = STEP_CURVES["flat"]
    assert best_lengths([[0.0, 0.0, 0.0]], 1, 3, flat) == [0]  # drafting zero-survival tokens gains nothing
    assert best_lengths([[0.5, 0.0], [0.0]], 2, 3, flat) == [1, 0]
    assert best_lengths([[1.0, 1.0], [1.0]], 2, 3, flat) == [2, 1]  # strictly better: all of them


@pytest.mark.parametrize("draft_forward", [0.0, 1.0])
def test_edge_cases_draft_nothing(draft_forward):
    linear = STEP_CURVES["linear"]
    assert best_lengths([], 0, 5, linear, draft_forward) == []
    assert best_lengths([[1.0, 1.0], [0.9]], 2, 0, linear, draft_forward) == [0, 0]  # budget 0
    assert best_lengths([[1.0, 1.0], [0.9]], 2, -3, linear, draft_forward) == [0, 0]
    assert best_lengths([[], []], 2, 8, linear, draft_forward) == [0, 0]  # caps 0
    assert best_lengths([[], [1.0, 1.0]], 2, 8, linear, draft_forward) == [0, 2]
    assert best_lengths([[1.0, 1.0], [1.0]], 2, 1, linear, draft_forward) == [1, 0]
