"""The speculative-decoding cost model (DESIGN §1): expected tokens per round, round cost, speedup.

Convention. In one verification round the drafter proposes k <= γ tokens (the draft length γ caps
k; an n-gram drafter or the end of the request may propose fewer), the target accepts a prefix of
K <= k of them and emits one more token (correction or bonus), so the round yields N = K + 1
tokens and

    E[N] = 1 + Σ_{i=1..γ} Pr(K >= i)                    (measured: a round with k < i has K < i)
    E[N] = (1 - α^(γ+1)) / (1 - α)                      (constant per-position acceptance α)

A round costs D_γ (all draft steps of the round: draft_step · k) + V_γ (one target forward of the
k + 1 tokens [pending, d1..dk]) + C (acceptance test, KV commit, loop), and

    speedup ≈ E[N] · T₁ / (D_γ + V_γ + C)

with T₁ one target-alone decode step. Worked example: α=0.8, γ=4 → E=3.36; T₁=10 ms, D_γ=4, V_γ=14,
C=1 ms → 1.77x; with D_γ=25 ms → 0.84x. V_γ is not T₁: a wider forward does more attention, KV and
logits work, which is why V is calibrated per width (:mod:`spectoolkit.bench.protocol.calibrate`).

Whole-request prediction: both arms pay the prefill P, which also yields the first token, so for a
request of n output tokens baseline = P + (n-1)·T₁ and speculative = P + (n-1)/E · round_cost.

What-if at another γ' (:func:`predicted_by_gamma`): exact for γ' <= the measured γ (truncating a round
keeps its accepted prefix), an extrapolation beyond it. So an arm's ``recommended_gamma`` is the best γ'
of the measured range 1..γ only, and the best γ' beyond it is a separate ``extrapolated_gamma`` (predicted,
not measured). A draft-length policy other than :data:`FIXED` varies k per round: :func:`predict` over
its actual rounds still holds, but no fixed-γ what-if describes it, so its ``predicted_by_gamma``,
``recommended_gamma``, ``extrapolated_gamma`` and ``break_even_alpha`` are None.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from spectoolkit.metrics.records import RequestRecord, Round, rounds_of
from spectoolkit.policy.costs import monotone_fit

TIE_TOLERANCE = 0.01  # recommend_gamma: the smallest γ within 1% of the best speedup
BISECT_STEPS = 60
PREDICTED_GAMMA_MAX = 16  # predictions per draft length cover γ' = 1..max(PREDICTED_GAMMA_MAX, measured γ)
FIXED = "fixed"  # the draft-length policy whose rounds all draft min(γ, room - 1): the one a γ what-if describes


# ---- expected tokens per round ----------------------------------------------------------------


def expected_tokens_constant_alpha(alpha: float, gamma: int) -> float:
    """E[N] = (1 - α^(γ+1)) / (1 - α) for constant acceptance ``alpha`` (γ + 1 when α = 1)."""
    if not 0.0 <= alpha <= 1.0 or gamma < 0:
        raise ValueError(f"need 0 <= alpha <= 1 and gamma >= 0, got alpha={alpha}, gamma={gamma}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_tokens(prob_accept_at_least: Sequence[float]) -> float:
    """E[N] = 1 + Σ_i Pr(K >= i) from measured ``prob_accept_at_least`` [γ]."""
    return 1.0 + float(sum(prob_accept_at_least))


def speedup_estimate(
    expected_tokens: float, t1: float, draft_cost: float, verify_cost: float, overhead: float
) -> float:
    """E[N]·T₁ / (D_γ + V_γ + C); ``draft_cost`` is the whole round's drafting (γ steps), in seconds."""
    return expected_tokens * t1 / (draft_cost + verify_cost + overhead)


def _check_rounds(rounds: Sequence[Round], gamma: int) -> None:
    for drafted, accepted in rounds:
        if not 0 <= accepted <= drafted <= gamma:
            raise ValueError(f"round (drafted={drafted}, accepted={accepted}) violates 0 <= K <= k <= gamma={gamma}")


def acceptance_histogram(rounds: Sequence[Round], gamma: int) -> list[int]:
    """Counts [γ+1] of rounds that accepted exactly K = 0, 1, ..., γ drafts."""
    _check_rounds(rounds, gamma)
    counts = [0] * (gamma + 1)
    for _, accepted in rounds:
        counts[accepted] += 1
    return counts


def prob_accept_at_least(rounds: Sequence[Round], gamma: int) -> list[float]:
    """Pr(K >= i) [γ] for i = 1..γ over all rounds (short drafts count as K < i); zeros when empty."""
    counts = acceptance_histogram(rounds, gamma)
    total = len(rounds)
    tail = [sum(counts[i:]) for i in range(1, gamma + 1)]
    return [n / total if total else 0.0 for n in tail]


# ---- per-step costs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCosts:
    """Measured costs, all in seconds."""

    t1: float  # one target-alone decode step
    draft_step: float  # per drafted token (draft forwards and draft KV upkeep, amortised)
    verify: dict[int, float]  # target forward width → time; width 1 required
    overhead: float = 0.0  # C, per round
    prefill: float = 0.0  # P, mean per request

    def __post_init__(self) -> None:
        if self.t1 <= 0 or self.draft_step < 0 or self.overhead < 0 or self.prefill < 0:
            raise ValueError(f"need t1 > 0 and non-negative draft_step/overhead/prefill: {self}")
        if 1 not in self.verify or any(w < 1 or t <= 0 for w, t in self.verify.items()):
            raise ValueError(f"verify needs width 1 and positive times at widths >= 1, got {self.verify}")

    def verify_cost(self, width: int) -> float:
        """V(width): linear between calibrated widths; beyond the largest, the least-squares slope of
        all calibrated points (the last two alone are too noisy to extrapolate from).

        The extrapolation slope is floored at 0: a wider forward is never cheaper (calibration noise).
        """
        widths = sorted(self.verify)
        if width in self.verify:
            return self.verify[width]
        if width < 1:
            raise ValueError(f"verify width must be >= 1, got {width}")
        if width > widths[-1]:
            if len(widths) == 1:
                return self.verify[widths[0]]
            mean_w = sum(widths) / len(widths)
            mean_v = sum(self.verify.values()) / len(widths)
            covariance = sum((w - mean_w) * (self.verify[w] - mean_v) for w in widths)
            slope = max(0.0, covariance / sum((w - mean_w) ** 2 for w in widths))
            return self.verify[widths[-1]] + slope * (width - widths[-1])
        hi = widths[bisect.bisect_left(widths, width)]
        lo = widths[bisect.bisect_left(widths, width) - 1]
        share = (width - lo) / (hi - lo)
        return self.verify[lo] + share * (self.verify[hi] - self.verify[lo])


def round_cost(costs: StepCosts, draft_len: int) -> float:
    """D·k + V(k+1) + C: one round that drafted ``draft_len`` = k tokens."""
    return costs.draft_step * draft_len + costs.verify_cost(draft_len + 1) + costs.overhead


def _speedups(expected: float, mean_round_cost: float, costs: StepCosts, output_len: float) -> dict[str, float]:
    """Decode-only and whole-request (prefill included) speedups for ``output_len`` = n tokens."""
    decode_steps = max(output_len - 1.0, 0.0)  # the first token comes from the prefill in both arms
    baseline = costs.prefill + decode_steps * costs.t1
    spec = costs.prefill + decode_steps / expected * mean_round_cost
    return {
        "predicted_decode_speedup": expected * costs.t1 / mean_round_cost,
        "predicted_speedup": baseline / spec if spec > 0 else 1.0,
    }


def predict(rounds: Sequence[Round], costs: StepCosts, output_len: float) -> dict[str, float]:
    """Prediction from measured ``rounds``: E = mean(K+1), mean round cost over their actual k.

    Returns expected_tokens, round_cost, predicted_decode_speedup, predicted_speedup (prefill included).
    """
    if not rounds:
        raise ValueError("predict needs at least one round")
    expected = sum(accepted + 1 for _, accepted in rounds) / len(rounds)
    mean_cost = sum(round_cost(costs, drafted) for drafted, _ in rounds) / len(rounds)
    return {"expected_tokens": expected, "round_cost": mean_cost, **_speedups(expected, mean_cost, costs, output_len)}


# ---- what-if: break-even acceptance and the best draft length -----------------------------------


def break_even_alpha(gamma: int, costs: StepCosts, output_len: float | None = None) -> float | None:
    """Constant α at which E(α, γ)·T₁ / round_cost(γ) = 1 (bisection; E grows with α).

    None when even α = 1 does not break even; 0.0 when α = 0 already gains. ``output_len`` is
    accepted for symmetry with :func:`predict`: the prefill both arms pay cancels at break-even
    (P + (n-1)·T₁ = P + (n-1)/E·cost ⇔ E·T₁ = cost), so it does not change the answer.
    """
    del output_len
    needed = round_cost(costs, gamma) / costs.t1  # the E[N] at which the round pays for itself
    if expected_tokens_constant_alpha(0.0, gamma) >= needed:
        return 0.0
    if expected_tokens_constant_alpha(1.0, gamma) < needed:
        return None
    low, high = 0.0, 1.0
    for _ in range(BISECT_STEPS):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens_constant_alpha(mid, gamma) < needed else (low, mid)
    return high


def tail_acceptance(rounds: Sequence[Round], gamma: int) -> float:
    """Pr(K >= γ | K >= γ-1) over full rounds (k = γ); accepted/drafted when that is undefined."""
    full = [accepted for drafted, accepted in rounds if drafted == gamma]
    reached = sum(accepted >= gamma - 1 for accepted in full)
    if reached:
        return sum(accepted >= gamma for accepted in full) / reached
    drafted = sum(k for k, _ in rounds)
    return sum(accepted for _, accepted in rounds) / drafted if drafted else 0.0


def _at_gamma(rounds: Sequence[Round], costs: StepCosts, gamma: int, new_gamma: int) -> tuple[float, float]:
    """(E, mean round cost) had the run used ``new_gamma`` instead of ``gamma``."""
    if new_gamma <= gamma:  # acceptance is a prefix: truncating a round is exact
        result = predict([(min(k, new_gamma), min(n, new_gamma)) for k, n in rounds], costs, 1.0)
        return result["expected_tokens"], result["round_cost"]
    alpha = tail_acceptance(rounds, gamma)
    extra = sum(alpha**j for j in range(1, new_gamma - gamma + 1))  # geometric run past γ
    all_accepted = sum(n == gamma for _, n in rounds) / len(rounds)
    expected = sum(n + 1 for _, n in rounds) / len(rounds) + all_accepted * extra
    lengths = [new_gamma if k == gamma else k for k, _ in rounds]  # full drafts grow to γ'
    return expected, sum(round_cost(costs, k) for k in lengths) / len(rounds)


def predicted_by_gamma(
    rounds: Sequence[Round], costs: StepCosts, gamma: int, max_gamma: int = PREDICTED_GAMMA_MAX, *, output_len: float
) -> dict[int, float]:
    """predicted_speedup for every γ' in 1..``max_gamma`` from rounds measured at ``gamma``.

    γ' <= γ truncates each round (k' = min(k, γ'), K' = min(K, γ')): exact. γ' > γ lets full rounds
    (k = γ) draft γ' tokens and extends an all-accepted run geometrically with :func:`tail_acceptance`.
    """
    if not rounds:
        raise ValueError("predicted_by_gamma needs at least one round")
    _check_rounds(rounds, gamma)
    out = {}
    for new_gamma in range(1, max_gamma + 1):
        expected, mean_cost = _at_gamma(rounds, costs, gamma, new_gamma)
        out[new_gamma] = _speedups(expected, mean_cost, costs, output_len)["predicted_speedup"]
    return out


def recommend_gamma(
    rounds: Sequence[Round], costs: StepCosts, gamma: int, max_gamma: int = PREDICTED_GAMMA_MAX, *, output_len: float
) -> int:
    """The γ' of :func:`predicted_by_gamma` with the best speedup (the smallest one within 1% of it)."""
    return best_gamma(predicted_by_gamma(rounds, costs, gamma, max_gamma, output_len=output_len))


def best_gamma(speedups: Mapping[int, float]) -> int | None:
    """The γ of ``speedups`` (γ -> speedup) with the best value, the smallest within 1% of it; None when empty."""
    if not speedups:
        return None
    best = max(speedups.values())
    return min(g for g, value in speedups.items() if value >= best * (1.0 - TIE_TOLERANCE))


def recommendation(speedups: Mapping[int, float], measured_max: int) -> dict[str, Any]:
    """The cost_model fields that name a γ: ``recommended_gamma`` (and its predicted speedup), the best γ in
    1..``measured_max``, and ``extrapolated_gamma`` (and its speedup), the best γ above it (None: none)."""
    within = {g: value for g, value in speedups.items() if g <= measured_max}
    beyond = {g: value for g, value in speedups.items() if g > measured_max}
    recommended, extrapolated = best_gamma(within), best_gamma(beyond)
    return {
        "measured_gamma_max": measured_max,
        "recommended_gamma": recommended,
        "recommended_speedup": within[recommended] if recommended is not None else None,
        "extrapolated_gamma": extrapolated,
        "extrapolated_speedup": beyond[extrapolated] if extrapolated is not None else None,
    }


NO_RECOMMENDATION = dict.fromkeys(("measured_gamma_max", "recommended_gamma", "recommended_speedup",
                                   "extrapolated_gamma", "extrapolated_speedup"))  # fmt: skip


# ---- from run records (the summary's cost_model entry) -----------------------------------------

Records = list[RequestRecord]


def _total(records: Records, name: str) -> float:
    return float(sum(getattr(record, name) or 0 for record in records))


def _throughput(records: Records) -> float | None:
    total_time = _total(records, "total_time")
    return _total(records, "output_len") / total_time if total_time > 0 else None


def _linear_verify(mean_verify: float, mean_width: float, t1: float, gamma: int) -> dict[int, float]:
    """V(w) through the in-run mean verify forward at the mean width, and T₁ at width 1.

    The slope is floored at 0 (then V is flat at the measured mean), so the measured point is kept.
    """
    slope = max(0.0, (mean_verify - t1) / (mean_width - 1)) if mean_width > 1 else 0.0
    return {width: mean_verify + (width - mean_width) * slope for width in range(1, gamma + 2)}


def _monotone(times: Mapping[int, float]) -> dict[int, float]:
    """The non-decreasing fit of V over widths closest in least squares (pool adjacent violators).

    A wider forward never costs less; a calibrated dip is timing noise, and left in it would make the
    recommended γ chase it. Adjacent widths that violate the order are replaced by their mean.
    """
    widths = sorted(times)
    fitted = monotone_fit(np.array([times[width] for width in widths], dtype=np.float64))
    return dict(zip(widths, fitted.tolist(), strict=True))


def _verify_table(
    verify_costs: Mapping[int, float] | None, t1: float, arm: Records, rounds: list[Round], gamma: int
) -> dict[int, float]:
    """V per width: calibration scaled to this run's T₁, else the in-run linear fallback."""
    if verify_costs:
        calibrated = {int(width): float(seconds) for width, seconds in verify_costs.items()}  # JSON: str keys
        if 1 not in calibrated:
            raise ValueError(f"verify_costs needs width 1 (the T₁-like forward), got widths {sorted(calibrated)}")
        monotone = _monotone(calibrated)
        scale = t1 / monotone[1]
        return {width: seconds * scale for width, seconds in monotone.items()}
    mean_verify = _total(arm, "verify_time") / _total(arm, "verify_rounds")
    mean_width = sum(drafted + 1 for drafted, _ in rounds) / len(rounds)
    return _linear_verify(mean_verify, mean_width, t1, gamma)


def measured_costs(
    arm: Records,
    reference: Records,
    verify_costs: Mapping[int, float] | None,
    gamma: int,
) -> StepCosts:
    """StepCosts from successful records of a drafting arm and its target-alone reference arm.

    T₁ = Σ(total - prefill) / Σ(output_len - 1) over the reference (each decode step after the first
    token); P = mean prefill over both arms; D = Σdraft_time / Σdrafted_tokens (0 if nothing was
    drafted); C = Σoverhead_time / Σverify_rounds. V comes from ``verify_costs`` (calibrated width →
    seconds) multiplied by T₁ / verify_costs[1]: the calibration gives the *shape* of V over widths,
    the run gives its level (context length, per-step selection). Without calibration V is linear,
    V(1) = T₁ through the in-run mean Σverify_time / Σverify_rounds at the mean width mean(k+1).
    """
    t1 = sum((r.total_time or 0) - (r.prefill_time or 0) for r in reference) / sum(
        max((r.output_len or 0) - 1, 0) for r in reference
    )
    drafted = _total(arm, "drafted_tokens")
    return StepCosts(
        t1=t1,
        draft_step=_total(arm, "draft_time") / drafted if drafted else 0.0,
        verify=_verify_table(verify_costs, t1, arm, rounds_of(arm), gamma),
        overhead=max(0.0, _total(arm, "overhead_time") / _total(arm, "verify_rounds")),
        prefill=_total(arm + reference, "prefill_time") / len(arm + reference),
    )


def cost_model_for_arm(
    arm_records: Records,
    reference_records: Records,
    verify_costs: Mapping[int, float] | None,
    gamma: int,
    policy: str = FIXED,
) -> dict[str, Any] | None:
    """The summary's cost_model entry of one drafting arm (the JSON form of
    :class:`~spectoolkit.metrics.summary_sections.CostModel`, less ``recommended_source``, which
    :func:`spectoolkit.metrics.summary.cost_models` adds; error records ignored).

    Rounds are zip(draft_lengths, accept_lengths) over the arm's records; measured speedup is the arm's
    net throughput over the reference's. Width-keyed dicts ("verify", "predicted_by_gamma") use str keys
    so the JSON round-trip is the identity. ``recommended_gamma`` is searched over 1..``gamma`` (exact
    truncation), ``extrapolated_gamma`` above it; an arm whose ``policy`` is not :data:`FIXED` gets None
    for every fixed-γ what-if. None when either arm has no successful records, the arm has no rounds or
    the reference no decode steps (nothing to fit).
    """
    arm = [r for r in arm_records if not r.error]
    reference = [r for r in reference_records if not r.error]
    rounds = rounds_of(arm)
    if not arm or not reference or not rounds or not sum(max((r.output_len or 0) - 1, 0) for r in reference):
        return None
    costs = measured_costs(arm, reference, verify_costs, gamma)
    output_len = _total(arm, "output_len") / len(arm)
    prediction = predict(rounds, costs, output_len)
    arm_rate, reference_rate = _throughput(arm), _throughput(reference)
    measured = arm_rate / reference_rate if arm_rate and reference_rate else None
    fixed = policy == FIXED
    by_gamma = (predicted_by_gamma(rounds, costs, gamma, max(PREDICTED_GAMMA_MAX, gamma), output_len=output_len)
                if fixed else None)  # fmt: skip
    return {
        "policy": policy,
        "t1": costs.t1,
        "draft_step": costs.draft_step,
        "verify": {str(width): seconds for width, seconds in sorted(costs.verify.items())},
        "overhead": costs.overhead,
        "prefill": costs.prefill,
        "mean_output_len": output_len,
        **prediction,
        "measured_speedup": measured,
        "prediction_error": prediction["predicted_speedup"] / measured - 1 if measured else None,
        "break_even_alpha": break_even_alpha(gamma, costs) if fixed else None,
        **(recommendation(by_gamma, gamma) if by_gamma is not None else NO_RECOMMENDATION),
        "predicted_by_gamma": {str(g): value for g, value in by_gamma.items()} if by_gamma is not None else None,
        "verify_measured_mean": _total(arm, "verify_time") / _total(arm, "verify_rounds"),
    }
