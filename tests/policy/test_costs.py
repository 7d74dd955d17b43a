"""Learnt step costs (spectoolkit.policy.costs): windowed medians per width, the (weighted) monotone fit and its
brute reference, the convex fit built on it, inter- and extrapolation, and the draft forward's EWMA."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.optimize import minimize

from spectoolkit.policy.costs import (
    REFIT,
    WINDOW,
    Chords,
    DraftCost,
    StepCosts,
    StepCurve,
    convex_fit,
    monotone_fit,
)


def _brute_monotone_fit(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit by enumeration: the optimum is constant on consecutive blocks
    (each at its block's weighted mean), so try every split of the sequence into blocks with non-decreasing means."""
    n, best, best_error = len(values), None, np.inf
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [n]
        means = [np.average(values[a:b], weights=weights[a:b]) for a, b in itertools.pairwise(bounds)]
        if any(later < earlier for earlier, later in itertools.pairwise(means)):
            continue
        blocks = zip(itertools.pairwise(bounds), means, strict=True)
        fitted = np.concatenate([np.full(b - a, mean) for (a, b), mean in blocks])
        error = float((weights * (fitted - values) ** 2).sum())
        if error < best_error:
            best, best_error = fitted, error
    return best


def _curve(points: dict[int, float]) -> StepCurve:
    curve = StepCurve()
    curve.seed(points)
    return curve


@pytest.mark.parametrize("length", range(1, 8))
def test_monotone_fit_matches_brute_force(length):
    rng = np.random.default_rng(length)
    for trial in range(40):
        values = rng.normal(size=length)
        if trial % 4 == 0:
            values = np.round(values)  # ties
        if trial % 4 == 1:
            values = np.sort(values)  # already monotone: unchanged
        fitted = monotone_fit(values)
        assert fitted.shape == values.shape
        assert np.all(np.diff(fitted) >= -1e-12)
        np.testing.assert_allclose(fitted, _brute_monotone_fit(values, np.ones(length)), rtol=0, atol=1e-12)
        if trial % 4 == 1:
            np.testing.assert_allclose(fitted, values, rtol=0, atol=1e-15)
        weights = rng.uniform(0.5, 8.0, size=length)  # segment widths, as the convex fit weighs slopes
        weighted = monotone_fit(values, weights)
        np.testing.assert_allclose(weighted, _brute_monotone_fit(values, weights), rtol=0, atol=1e-12)


def _increments(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    return np.diff(ys) / np.diff(xs)


@pytest.mark.parametrize("length", range(1, 8))
def test_convex_fit_never_falls_and_each_row_costs_at_least_the_one_before(length):
    rng = np.random.default_rng(100 + length)
    for _ in range(40):
        xs = np.unique(rng.integers(1, 40, size=length)).astype(np.float64)
        ys = rng.uniform(0.5, 2.0, size=len(xs))
        fitted = convex_fit(xs, ys)
        assert fitted.shape == ys.shape
        slopes = _increments(xs, fitted)
        assert np.all(slopes >= -1e-12), "a wider step costs less"
        assert np.all(np.diff(slopes) >= -1e-12), "an extra row costs less than the one before"
        assert fitted.mean() == pytest.approx(ys.mean())  # the offset fits the values in least squares


def test_convex_input_is_returned_unchanged():
    xs = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 33.0])
    for ys in (0.010 + 0.0003 * xs, 0.01 + 0.0001 * xs**2, np.full(6, 0.02), np.array([1.0, 1.0, 1.0, 1.1, 1.3, 2.0])):
        np.testing.assert_allclose(convex_fit(xs, ys), ys, rtol=1e-12, atol=0)
    np.testing.assert_array_equal(convex_fit(np.array([4.0]), np.array([0.7])), [0.7])


def test_concave_input_becomes_convex():
    xs = np.array([1.0, 2.0, 3.0])
    concave = np.array([1.0, 2.0, 2.5])  # increments 1 then 0.5: no convex curve bends down, so a straight line
    fitted = convex_fit(xs, concave)
    np.testing.assert_allclose(fitted, [13 / 12, 11 / 6, 31 / 12], rtol=1e-12)  # the least-squares line
    sqrt = np.sqrt(np.arange(1.0, 9.0))  # concave throughout: the least-squares line
    line = convex_fit(np.arange(1.0, 9.0), sqrt)
    np.testing.assert_allclose(line, np.polyval(np.polyfit(np.arange(1.0, 9.0), sqrt, 1), np.arange(1.0, 9.0)))
    falling = convex_fit(np.array([1.0, 2.0, 3.0]), np.array([3.0, 2.0, 1.0]))  # never falls: flat at the mean
    np.testing.assert_allclose(falling, [2.0, 2.0, 2.0], rtol=1e-12)


def _weighted_error(fitted: np.ndarray, ys: np.ndarray, counts: np.ndarray) -> float:
    return float(np.sum(counts * (fitted - ys) ** 2))


@pytest.mark.parametrize("length", range(3, 9))
def test_convex_fit_is_the_least_squares_one_weighted_by_observations(length):
    """No convex, non-decreasing curve through the widths fits the medians closer, each weighted by its count: checked
    against a general constrained solver, and against the slopes-made-monotone fit of before (issue 57)."""
    rng = np.random.default_rng(length)
    for _ in range(10):
        xs = np.unique(rng.integers(1, 60, size=length)).astype(np.float64)
        ys = 0.05 + 0.002 * np.maximum(xs - 20, 0) + rng.normal(0, 0.004, size=len(xs))
        counts = rng.integers(1, 16, size=len(xs)).astype(np.float64)
        fitted = convex_fit(xs, ys, counts)
        widths = np.diff(xs)
        constraints = [
            {"type": "ineq", "fun": lambda v, w=widths: np.diff(v)[:1] / w[:1]},  # never falls
            {"type": "ineq", "fun": lambda v, w=widths: np.diff(np.diff(v) / w)},  # each row at least the one before
        ]
        reference = minimize(_weighted_error, ys.copy(), args=(ys, counts), constraints=constraints, method="SLSQP",
                             options={"ftol": 1e-14, "maxiter": 500}).x  # fmt: skip
        assert _weighted_error(fitted, ys, counts) <= _weighted_error(reference, ys, counts) * (1 + 1e-6) + 1e-15
        slopes = _increments(xs, fitted)
        assert np.all(slopes >= -1e-12) and np.all(np.diff(slopes) >= -1e-12)
    heavy = convex_fit(np.array([1.0, 2.0, 3.0]), np.array([1.0, 1.3, 1.0]), np.array([15.0, 1.0, 15.0]))
    np.testing.assert_allclose(heavy, [1.3 / 31 + 30 / 31] * 3, rtol=1e-9)  # a width seen once barely moves it


def test_empty_curve_costs_the_same_at_every_width():
    curve = StepCurve()
    np.testing.assert_array_equal(curve(np.array([1, 2, 7, 100])), np.ones(4))
    assert curve.points() == {}


def test_each_width_costs_the_median_of_its_recent_steps():
    curve = StepCurve()
    for seconds in range(1, 11):
        curve.observe(3, float(seconds))
    assert curve.points() == {3: pytest.approx(5.5)}
    curve.observe(3, 1000.0)  # one preempted or interrupted step is not a trend
    assert curve.points() == {3: pytest.approx(6.0)}
    assert curve(np.array([3]))[0] == pytest.approx(6.0)
    for _ in range(WINDOW):  # a full window of new times: the old ones are forgotten
        curve.observe(3, 2.0)
    assert curve.points() == {3: pytest.approx(2.0)}


def test_the_fit_follows_new_observations_within_refit_steps():
    curve = _curve({1: 1.0, 2: 2.0, 4: 4.0})
    assert curve(np.array([4]))[0] == pytest.approx(4.0)
    for _ in range(REFIT):
        curve.observe(4, 8.0)  # median of [4, 8 x REFIT]: 8
    assert curve(np.array([4, 3]))[0] == pytest.approx(8.0)
    # 3 lies in a gap of unmeasured widths: the least a convex curve through the refitted points allows there (the
    # segment 1-2 extended), not the chord to 4 (5.0): an unmeasured width is priced so that it gets measured
    assert curve(np.array([3]))[0] == pytest.approx(3.0)


def test_a_catch_up_is_judged_on_the_chord_inside_a_gap():
    """A catch-up is paid for good: inside a gap of unmeasured widths it is judged on the most a convex curve through
    the measured ones costs there (the chord), not the least (what draws drafts into the gap to measure it); at and
    past the measured widths both read the curve (issue 57, a cost kink: an 8-token step between a 7-token one at
    31 ms and a 10-token one at 48, priced at 31.7 ms, and four prompts fed for it)."""
    costs = StepCosts()
    for n, seconds in ((4, 0.029), (7, 0.031), (10, 0.048)):
        costs.observe_target(4, n, seconds)
    chords, curve = costs.judged(4), costs.target(4)
    assert isinstance(chords, Chords) and curve is costs.curves[4]
    assert curve(np.array([8]))[0] < 0.032  # the segment 4-7 extended
    assert chords(np.array([8]))[0] == pytest.approx(np.interp(8, [7, 10], curve(np.array([7, 10]))))
    np.testing.assert_allclose(chords(np.array([4, 7, 10, 16])), curve(np.array([4, 7, 10, 16])), rtol=1e-12)
    for n, seconds in ((7, 0.031), (10, 0.048), (16, 0.090)):  # 16 seen once past widths seen twice: the plan doubts it
        costs.observe_target(4, n, seconds)
    assert curve(np.array([16]))[0] < 0.085 and chords(np.array([16]))[0] == pytest.approx(0.090)


def test_seed_counts_as_one_observation_and_bad_steps_are_ignored():
    curve = StepCurve()
    curve.seed({2: 1.0, 5: 2.0})
    curve.observe(2, 3.0)
    curve.observe(2, 5.0)
    assert curve.points() == {2: pytest.approx(3.0), 5: pytest.approx(2.0)}  # the median of the seed and two steps
    for tokens, seconds in ((0, 1.0), (-1, 1.0), (4, 0.0), (4, -1.0), (4, float("nan"))):
        curve.observe(tokens, seconds)
    assert set(curve.points()) == {2, 5}


def test_a_width_seen_fewer_than_three_times_costs_its_least_step():
    """Interference only slows a step: one slowed step of two does not price its width out (their mean would), and
    from three on the median drops the slowed one."""
    curve = StepCurve()
    for seconds in (0.020, 0.039):
        curve.observe(8, seconds)
    assert curve.points() == {8: 0.020}
    curve.observe(8, 0.022)
    assert curve.points() == {8: 0.022}


def test_a_noisy_dip_is_fitted_away_and_interpolated():
    curve = _curve({1: 1.0, 2: 1.2, 3: 1.0, 4: 1.4})  # the bump is noise: the least-squares convex rise, then 1.4
    np.testing.assert_allclose(curve(np.array([1, 2, 3, 4])), [1.0, 1.04, 1.08, 1.4], rtol=1e-9)
    np.testing.assert_allclose(curve(np.array([1.5, 3.5])), [1.02, 1.24], rtol=1e-9)
    assert curve.points() == {1: 1.0, 2: 1.2, 3: 1.0, 4: 1.4}  # the medians themselves are kept
    grid = curve(np.arange(1, 40))
    assert np.all(np.diff(grid) >= 0)
    assert np.all(np.diff(grid, 2) >= -1e-12)  # convex past the points too


def test_extrapolates_past_the_widest_with_the_last_segments_slope():
    linear = _curve({n: 0.010 + 0.0003 * n for n in (1, 2, 4, 8)})
    np.testing.assert_allclose(linear(np.array([16, 64])), [0.010 + 0.0003 * 16, 0.010 + 0.0003 * 64], rtol=1e-9)
    bent = _curve({1: 1.0, 2: 1.0, 3: 2.0})  # the last row cost 1.0: every row past it at least that
    np.testing.assert_allclose(bent(np.array([5])), [2.0 + 1.0 * 2], rtol=1e-12)
    falling = _curve({1: 2.0, 2: 1.0})  # flat at the plain step's 2.0: slope 0, never falling
    np.testing.assert_allclose(falling(np.array([2, 10, 1000])), [2.0, 2.0, 2.0], rtol=1e-12)


def test_the_plain_step_is_kept_as_measured():
    """The narrowest width (a batch's plain decode step, every decision's baseline) is never moved by the fit. Issue
    57, the pair on Zen 5 at c4: a batch of 4's plain step 30.7 ms, its first draft row 17 ms more and the next ones
    ~2 ms each. No convex curve follows that; fitted through every width, the plain step read 32.6 ms and drafts
    that lose 3% (11.9 tokens in 62 + 32 ms against 4 in 30.7) looked 2% ahead; every pass of the adaptive arm
    drafted and gave 0.89x the target alone."""
    medians = {4: 30.7, 5: 47.5, 6: 38.8, 10: 57.6, 11: 58.9, 12: 62.2, 13: 75.3, 20: 96.1, 28: 130.6}
    seen = {4: 15, 5: 3, 6: 2, 10: 4, 11: 15, 12: 15, 13: 1, 20: 1, 28: 1}
    curve = StepCurve()
    for tokens, times in seen.items():
        for _ in range(times):
            curve.observe(tokens, medians[tokens] / 1000)
    at = curve(np.array([4, 12])) * 1000
    assert at[0] == pytest.approx(30.7, rel=1e-9)
    assert at[1] == pytest.approx(62.2, rel=0.03)  # the drafting width the steps ran at, fitted within noise
    assert 4 / at[0] > 11.9 / (at[1] + 32.4)  # so plain wins, as it did


def test_a_width_seen_once_is_doubted_until_seen_again():
    """One slow step at a wide width never prices the widths past the settled ones out for good. Issue 57, the hybrid
    on the pair at c4 (Zen 5): rows at ~3.8 ms from 9 to 17 tokens (15 steps each), single steps of 20, 22 and 25
    tokens 3-6% slow; taken as they were, rows past 16 cost 4.75 ms and the policy drafted 10-14 tokens a step where
    fixed γ 4's 16 were faster. Seen twice, a width's own (least) time is fitted."""

    def line(n: int) -> float:
        return 0.0245 + 0.0038 * (n - 4) - (0.005 if n > 4 else 0.0)  # the plain step, then rows at 3.8 ms

    curve = StepCurve()
    for _ in range(15):
        for tokens in [4, *range(9, 18)]:
            curve.observe(tokens, line(tokens))
    for tokens, slow in ((20, 1.04), (22, 1.06), (25, 1.05)):
        curve.observe(tokens, line(tokens) * slow)
    widths = np.array([16, 20, 24])
    np.testing.assert_allclose(curve(widths), [line(16), line(20), line(24)], rtol=0.005)
    curve.observe(22, line(22) * 1.06)  # a second step at 22, slow again: that is its cost, fitted with the rest
    assert curve(np.array([22]))[0] > line(22) * 1.03


def test_below_the_narrowest_never_under_proportional():
    flat = _curve({4: 1.0, 8: 1.0})  # slope 0: the narrowest cost carries down
    np.testing.assert_allclose(flat(np.array([1, 2, 3])), [1.0, 1.0, 1.0], rtol=1e-12)
    gentle = _curve({4: 4.0, 8: 5.0})  # slope 0.25, above proportional at 2: 3.5 (not 2.0)
    np.testing.assert_allclose(gentle(np.array([2])), [3.5], rtol=1e-12)
    steep = _curve({4: 1.0, 8: 5.0})  # slope 1 would go to 0 or below: proportional instead
    np.testing.assert_allclose(steep(np.array([1, 2, 3])), [0.25, 0.5, 0.75], rtol=1e-12)


def test_one_point_is_flat_above_and_never_under_proportional_below():
    curve = _curve({4: 2.0})  # wider steps look free, so the policy drafts and measures a second width
    np.testing.assert_allclose(curve(np.array([1, 2, 4, 8, 12])), [2.0, 2.0, 2.0, 2.0, 2.0], rtol=1e-12)
    curve.observe(8, 2.2)  # a second width: interpolation and the LS slope take over
    np.testing.assert_allclose(curve(np.array([6, 12])), [2.1, 2.4], rtol=1e-12)


def test_draft_cost_is_per_forward_and_zero_until_measured():
    cost = DraftCost()
    assert cost.per_forward == 0.0
    cost.observe(0, 5.0)  # no draft forward in that step: nothing learnt
    cost.observe(2, -1.0)
    assert cost.per_forward == 0.0
    cost.observe(2, 0.004)
    assert cost.per_forward == pytest.approx(0.002)
    cost.observe(4, 0.016)  # second observation: the plain mean of 2 ms and 4 ms
    assert cost.per_forward == pytest.approx(0.003)
    for _ in range(200):
        cost.observe(1, 0.001)
    assert cost.per_forward == pytest.approx(0.001, rel=1e-6)


def test_step_costs_by_batch_and_drafting_count():
    """Issue 57: a batch measured at one width prices its rows at the nearest batch's cost per row; a draft forward
    is priced by the sequences drafting (measured, else the line through the counts measured)."""
    costs = StepCosts()
    assert costs.draft(4) == 0.0 and costs.target(4)(np.array([4, 8])).tolist() == [1.0, 1.0]  # nothing yet
    for n in (4, 8, 12):
        costs.observe_target(4, n, 0.1 + 0.01 * n)
    costs.observe_target(16, 16, 0.5)  # batch 16: one width only
    np.testing.assert_allclose(costs.target(16)(np.array([16, 20, 32])), [0.5, 0.54, 0.66], rtol=1e-9)
    assert costs.target(4) is costs.curves[4]
    costs.observe_draft(1, 2, 0.02)  # 10 ms a forward for one sequence
    assert costs.draft(1) == costs.draft(16) == pytest.approx(0.01)  # one count measured: its cost everywhere
    assert costs.draft(4, per_row=0.002) == pytest.approx(
        0.016
    )  # ... or, with a row's measured cost, that per row more
    costs.observe_draft(4, 1, 0.016)
    assert costs.draft(4) == pytest.approx(0.016) and costs.draft(16) == pytest.approx(0.01 + 0.002 * 15)
    assert costs.drafts_by_count(2) == pytest.approx([0.0, 0.01, 0.012])
