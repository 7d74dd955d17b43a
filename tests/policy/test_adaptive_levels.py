"""Issue 57: the adaptive policy against the best fixed γ at every load level, on a scripted engine.

Known step costs T_B(n) and draft forward d_B, known per-position acceptance (:mod:`tests.policy.scripted`); the
best fixed γ per level (batch size) is computed exactly; the policy runs the levels one after another as a sweep
does (c1, c4, c16 with the same policy, so what it learnt at one level meets the next), with 5% noise on every
measured time and a batch-1 calibration seeded first. It must reach 97% of the best fixed γ at every level, and
98% of the target alone where no γ pays (a probe now and then is the price of finding a request that would).
Nothing is timed: the costs are scripted.
"""

from __future__ import annotations

import pytest

from spectoolkit.policy import AdaptivePolicy, FixedPolicy
from tests.policy.scripted import Costs, Workload, best_fixed, run_level

GAMMAS = (1, 2, 3, 4, 5, 6)
LEVELS = {1: 1500, 4: 600, 16: 250}  # batch size -> steps (a few hundred requests' rounds each)


def _linear(base: float, row: float, per_sequence: float):
    """T_B(n) = base·(1 + per_sequence·(B − 1)) + row·(n − 1): every row costs (a 2-core CPU's verify)."""
    return lambda b, n: base * (1 + per_sequence * (b - 1)) + row * (n - 1)


def _roofline(base: float, free: int, row: float, per_sequence: float):
    """Rows free up to ``free`` tokens (the weights' read dominates), then ``row`` each (cheap rows: AMX)."""
    return lambda b, n: base * (1 + per_sequence * (b - 1)) + row * max(0, n - free)


MODEL_DRAFT = _linear(0.060, 0.007, 0.05), lambda b: 0.012 + 0.002 * b  # a 0.5B draft beside a 1.5B target
SCENARIOS = {
    "code, draft model": (Costs(*MODEL_DRAFT), Workload((0.8, 0.88, 0.9, 0.92, 0.93, 0.94))),
    "chat, draft model": (Costs(*MODEL_DRAFT), Workload((0.6, 0.55, 0.55, 0.55, 0.55, 0.55))),
    "busy CPU": (Costs(_linear(0.060, 0.03, 0.05), lambda b: 0.02 + 0.002 * b), Workload((0.7, 0.8, 0.85))),
    "hopeless draft": (Costs(_linear(0.060, 0.01, 0.05), lambda b: 0.04), Workload((0.3,))),
}


def _sweep(costs: Costs, workload: Workload, seed: int) -> dict[int, tuple[float, float, float]]:
    """Level -> (adaptive, best fixed γ, target alone) committed tokens per second."""
    policy, out = AdaptivePolicy(max(GAMMAS), 0.9, 8), {}
    for batch, steps in LEVELS.items():
        calibrate = range(1, max(GAMMAS) + 2) if batch == 1 else ()
        adaptive = run_level(policy, costs, workload, batch, steps, seed=seed + batch, calibrate=calibrate)
        alone = best_fixed(costs, workload, batch, ())[1]
        out[batch] = (adaptive, best_fixed(costs, workload, batch, GAMMAS)[1], alone)
    return out


CASES = [(scenario, seed) for scenario in SCENARIOS for seed in (0, 1)]


@pytest.mark.parametrize(("scenario", "seed"), CASES)
def test_adaptive_reaches_the_best_fixed_gamma_at_every_level(scenario, seed):
    for batch, (adaptive, best, alone) in _sweep(*SCENARIOS[scenario], seed).items():
        assert adaptive >= 0.97 * best, f"c{batch}: {adaptive / best:.3f} of the best fixed γ"
        assert adaptive >= 0.98 * alone, f"c{batch}: {adaptive / alone:.3f} of the target alone"


@pytest.mark.xfail(
    strict=True,
    reason="issue 57, undone: at a cost kink (rows free up to 16 tokens, 6 ms after) c4 "
    "reaches ~0.93 of γ=3; a noisy 1-row segment past the kink prices the free rows before it",
)
def test_cheap_rows_up_to_a_kink():
    costs = Costs(_roofline(0.060, 16, 0.006, 0.05), lambda b: 0.0002)
    for batch, (adaptive, best, _) in _sweep(costs, Workload((0.5, 0.6, 0.7, 0.7, 0.7, 0.7)), 0).items():
        assert adaptive >= 0.97 * best, f"c{batch}: {adaptive / best:.3f} of the best fixed γ"


def test_the_scripted_best_fixed_gamma_is_what_a_fixed_policy_gets():
    """The closed form the test compares against is what the scripted engine measures for a fixed γ."""
    costs, workload = SCENARIOS["code, draft model"]
    for batch in LEVELS:
        gamma, best = best_fixed(costs, workload, batch, GAMMAS)
        measured = run_level(FixedPolicy(gamma), costs, workload, batch, 400, noise=0.0)
        assert measured == pytest.approx(best, rel=0.01)  # the requests' last rounds (caps) differ slightly
