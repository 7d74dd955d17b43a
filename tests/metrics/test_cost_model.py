"""The cost model (DESIGN §1): worked examples, measured acceptance, predictions from records."""

from __future__ import annotations

import json

import pytest

from spectoolkit.metrics.cost_model import (
    StepCosts,
    acceptance_histogram,
    break_even_alpha,
    cost_model_for_arm,
    expected_tokens,
    expected_tokens_constant_alpha,
    predict,
    predicted_by_gamma,
    prob_accept_at_least,
    recommend_gamma,
    round_cost,
    speedup_estimate,
    tail_acceptance,
)
from spectoolkit.metrics.records import RequestRecord

# ---- DESIGN §1 worked examples ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("alpha", "gamma", "expected"), [(0.8, 4, 3.36), (0.6, 4, 2.31), (0.5, 8, 2.00), (1.0, 4, 5.0)]
)
def test_expected_tokens_worked_examples(alpha: float, gamma: int, expected: float) -> None:
    assert expected_tokens_constant_alpha(alpha, gamma) == pytest.approx(expected, abs=0.005)


def test_expected_tokens_constant_alpha_matches_the_sum_of_tails() -> None:
    # Pr(K >= i) = α^i with constant α, so 1 + Σ α^i is the same number
    assert expected_tokens([0.7**i for i in range(1, 6)]) == pytest.approx(expected_tokens_constant_alpha(0.7, 5))


def test_speedup_worked_examples() -> None:
    assert speedup_estimate(3.36, t1=10, draft_cost=4, verify_cost=14, overhead=1) == pytest.approx(1.77, abs=0.005)
    assert speedup_estimate(3.36, t1=10, draft_cost=25, verify_cost=14, overhead=1) == pytest.approx(0.84, abs=0.005)


# ---- measured acceptance ----------------------------------------------------------------------

ROUNDS = [(3, 3), (3, 1), (1, 1), (0, 0), (3, 0)]  # short drafts (k < γ) included


def test_prob_accept_at_least_counts_short_drafts_as_misses() -> None:
    assert prob_accept_at_least(ROUNDS, 3) == pytest.approx([3 / 5, 1 / 5, 1 / 5])
    assert acceptance_histogram(ROUNDS, 3) == [2, 2, 0, 1]
    assert prob_accept_at_least([], 3) == [0.0, 0.0, 0.0]
    assert acceptance_histogram([], 2) == [0, 0, 0]


def test_expected_tokens_from_tails_equals_mean_round_length() -> None:
    mean_tokens = sum(accepted + 1 for _, accepted in ROUNDS) / len(ROUNDS)
    assert expected_tokens(prob_accept_at_least(ROUNDS, 3)) == pytest.approx(mean_tokens)


def test_impossible_rounds_are_rejected() -> None:
    with pytest.raises(ValueError, match="violates"):
        acceptance_histogram([(2, 3)], 4)
    with pytest.raises(ValueError, match="violates"):
        prob_accept_at_least([(5, 1)], 4)


# ---- step costs and predictions -----------------------------------------------------------------

COSTS = StepCosts(t1=0.010, draft_step=0.001, verify={1: 0.010, 2: 0.012, 5: 0.018}, overhead=0.0005, prefill=0.05)


def test_verify_cost_interpolates_and_extrapolates() -> None:
    assert COSTS.verify_cost(2) == 0.012
    assert COSTS.verify_cost(3) == pytest.approx(0.014)  # a third of the way from 2 to 5
    assert COSTS.verify_cost(8) == pytest.approx(0.024)  # slope 0.002 per token past 5
    falling = StepCosts(t1=0.02, draft_step=0, verify={1: 0.02, 2: 0.015, 3: 0.01})
    assert falling.verify_cost(6) == pytest.approx(0.01)  # a falling V is noise: never cheaper
    # a noisy dip between the last two points does not flatten the tail: all points give the slope
    noisy_tail = StepCosts(t1=0.01, draft_step=0, verify={1: 0.010, 2: 0.012, 3: 0.014, 4: 0.016, 5: 0.016})
    assert noisy_tail.verify_cost(9) == pytest.approx(0.016 + 4 * 0.0016)


def test_step_costs_validate() -> None:
    with pytest.raises(ValueError, match="width 1"):
        StepCosts(t1=0.01, draft_step=0, verify={2: 0.01})
    with pytest.raises(ValueError, match="t1 > 0"):
        StepCosts(t1=0.0, draft_step=0, verify={1: 0.01})


def test_predict_matches_a_hand_computation() -> None:
    rounds = [(4, 4), (4, 1), (2, 2), (0, 0)]
    # E = mean(5, 2, 3, 1) = 2.75; round costs: k=4: 0.004 + 0.018 + 0.0005, k=2: 0.002 + 0.014 + 0.0005,
    # k=0: 0.010 + 0.0005 → mean (2·0.0225 + 0.0165 + 0.0105) / 4 = 0.018
    result = predict(rounds, COSTS, output_len=12)
    assert result["expected_tokens"] == pytest.approx(2.75)
    assert result["round_cost"] == pytest.approx(0.018)
    assert result["predicted_decode_speedup"] == pytest.approx(2.75 * 0.010 / 0.018)
    # baseline 0.05 + 11·0.010 = 0.16; spec 0.05 + 11 / 2.75 · 0.018 = 0.122
    assert result["predicted_speedup"] == pytest.approx(0.16 / 0.122)
    assert round_cost(COSTS, 4) == pytest.approx(0.0225)


def test_break_even_alpha_gives_speedup_one() -> None:
    alpha = break_even_alpha(4, COSTS)
    assert 0.0 < alpha < 1.0
    speedup = speedup_estimate(expected_tokens_constant_alpha(alpha, 4), COSTS.t1, 0.004, 0.018, 0.0005)
    assert speedup == pytest.approx(1.0, abs=1e-9)
    assert speedup_estimate(expected_tokens_constant_alpha(alpha - 0.01, 4), COSTS.t1, 0.004, 0.018, 0.0005) < 1


def test_break_even_alpha_edges() -> None:
    expensive = StepCosts(t1=0.01, draft_step=0.001, verify={1: 0.01, 5: 0.1})
    assert break_even_alpha(4, expensive) is None  # even 5 tokens a round cannot pay for 0.104 s
    free = StepCosts(t1=0.01, draft_step=0.0, verify={1: 0.01, 2: 0.01})
    assert break_even_alpha(4, free) == 0.0


def test_predicted_by_gamma_truncation_is_exact() -> None:
    rounds = [(4, 4), (4, 1), (2, 2), (0, 0), (4, 3)]
    by_gamma = predicted_by_gamma(rounds, COSTS, 4, max_gamma=6, output_len=20)
    assert sorted(by_gamma) == [1, 2, 3, 4, 5, 6]
    assert by_gamma[4] == pytest.approx(predict(rounds, COSTS, 20)["predicted_speedup"])
    for gamma in (1, 2, 3):
        truncated = [(min(k, gamma), min(n, gamma)) for k, n in rounds]
        assert by_gamma[gamma] == pytest.approx(predict(truncated, COSTS, 20)["predicted_speedup"])


def test_predicted_by_gamma_extends_full_runs_geometrically() -> None:
    rounds = [(2, 2), (2, 2), (2, 1), (2, 0)]
    assert tail_acceptance(rounds, 2) == pytest.approx(2 / 3)  # Pr(K >= 2 | K >= 1)
    costs = StepCosts(t1=0.01, draft_step=0.001, verify={1: 0.01, 2: 0.011}, overhead=0.0)
    # γ'=4: half the rounds accepted everything and go on with 2/3 + 4/9; every round drafts 4
    expected = 9 / 4 + 0.5 * (2 / 3 + 4 / 9)
    cost = 0.004 + 0.014
    by_gamma = predicted_by_gamma(rounds, costs, 2, max_gamma=4, output_len=50)
    assert by_gamma[4] == pytest.approx(expected * 0.01 / cost)  # prefill 0: decode speedup


def test_tail_acceptance_falls_back_to_the_acceptance_rate() -> None:
    assert tail_acceptance([(3, 0), (3, 1), (1, 1)], 3) == pytest.approx(2 / 7)  # no full round reached K = 2
    assert tail_acceptance([(0, 0)], 3) == 0.0


def test_recommend_gamma_picks_the_obvious_best() -> None:
    costs = StepCosts(t1=0.01, draft_step=0.002, verify={1: 0.01, 2: 0.01}, overhead=0.0)
    # every round accepts exactly 2 of 4: more than 2 drafts only cost
    assert recommend_gamma([(4, 2)] * 10, costs, 4, output_len=64) == 2
    assert recommend_gamma([(4, 0)] * 10, costs, 4, output_len=64) == 1
    # everything accepted and drafting nearly free: the longest draft wins
    cheap = StepCosts(t1=0.01, draft_step=0.0001, verify={1: 0.01, 2: 0.01})
    assert recommend_gamma([(4, 4)] * 10, cheap, 4, max_gamma=12, output_len=64) == 12
    # ties within 1%: the smallest (γ'=3 gains only 1 round in 100 one more token, +0.3%)
    free = StepCosts(t1=0.01, draft_step=0.0, verify={1: 0.01, 2: 0.01})
    near_tie = [(4, 2)] * 99 + [(4, 3)]
    by_gamma = predicted_by_gamma(near_tie, free, 4, output_len=64)
    assert by_gamma[2] < by_gamma[3] < by_gamma[2] * 1.01
    assert recommend_gamma(near_tie, free, 4, output_len=64) == 2


# ---- from records -------------------------------------------------------------------------------

T1, DRAFT, OVERHEAD = 0.010, 0.002, 0.0005
CASES = [  # (prefill s, draft lengths, accept lengths)
    (0.03, [4, 4, 4, 2], [4, 1, 0, 2]),
    (0.05, [4, 4, 1], [3, 4, 1]),
    (0.04, [4, 0, 4, 4, 4], [0, 0, 2, 4, 1]),
]


def _verify_time(width: int) -> float:
    return T1 + 0.001 * (width - 1)  # linear, V(1) = T₁


def _baseline_record(prefill: float, output_len: int) -> RequestRecord:
    decode = (output_len - 1) * T1
    return RequestRecord.from_dict({
        "arm": "baseline", "output_len": output_len, "prefill_time": prefill, "total_time": prefill + decode,
        "verify_time": decode, "verify_rounds": output_len - 1, "draft_time": 0.0, "overhead_time": 0.0,
        "drafted_tokens": 0, "draft_lengths": [], "accept_lengths": [], "error": None
    })  # fmt: skip


def _spec_record(prefill: float, drafts: list[int], accepts: list[int]) -> RequestRecord:
    """A record whose times follow the cost model exactly."""
    draft, verify = DRAFT * sum(drafts), sum(_verify_time(k + 1) for k in drafts)
    overhead = OVERHEAD * len(drafts)
    return RequestRecord.from_dict({
        "arm": "spec", "output_len": 1 + sum(n + 1 for n in accepts), "prefill_time": prefill,
        "total_time": prefill + draft + verify + overhead, "draft_time": draft, "verify_time": verify,
        "overhead_time": overhead, "verify_rounds": len(drafts), "drafted_tokens": sum(drafts),
        "accepted_tokens": sum(accepts), "draft_lengths": drafts, "accept_lengths": accepts,
        "error": None
    })  # fmt: skip


def _error_record(arm: str) -> RequestRecord:
    # nonsense numbers: any of them leaking into the model would change every result
    return RequestRecord.from_dict({
        "arm": arm, "output_len": 99, "prefill_time": 5.0, "total_time": 9.0, "draft_time": 1.0,
        "verify_time": 1.0, "overhead_time": 1.0, "verify_rounds": 3, "drafted_tokens": 7,
        "draft_lengths": [4], "accept_lengths": [4], "error": "RuntimeError: boom"
    })  # fmt: skip


def _records() -> tuple[list[RequestRecord], list[RequestRecord]]:
    spec = [_spec_record(*case) for case in CASES] + [_error_record("spec")]
    baseline = [_baseline_record(s.prefill_time, s.output_len) for s in spec[:-1]] + [_error_record("baseline")]
    return spec, baseline


@pytest.mark.parametrize("calibrated", [True, False])
def test_cost_model_for_arm_predicts_a_run_that_follows_the_model(calibrated: bool) -> None:
    spec, baseline = _records()
    # calibration at twice the run's level: only its shape over widths is used
    verify_costs = {w: 2 * _verify_time(w) for w in range(1, 10)} if calibrated else None
    result = cost_model_for_arm(spec, baseline, verify_costs, gamma=4)
    measured = sum(r.total_time for r in baseline[:-1]) / sum(r.total_time for r in spec[:-1])
    assert result["measured_speedup"] == pytest.approx(measured, rel=1e-12)
    assert result["predicted_speedup"] == pytest.approx(measured, rel=1e-6)
    assert abs(result["prediction_error"]) < 1e-6
    assert result["t1"] == pytest.approx(T1)
    assert result["draft_step"] == pytest.approx(DRAFT)
    assert result["overhead"] == pytest.approx(OVERHEAD)
    assert result["prefill"] == pytest.approx(0.04)
    assert result["verify"]["3"] == pytest.approx(_verify_time(3))
    rounds = [pair for _, drafts, accepts in CASES for pair in zip(drafts, accepts, strict=True)]
    assert result["expected_tokens"] == pytest.approx(sum(n + 1 for _, n in rounds) / len(rounds))
    assert result["predicted_by_gamma"]["4"] == pytest.approx(result["predicted_speedup"])
    assert str(result["recommended_gamma"]) in result["predicted_by_gamma"]
    assert 0.0 < result["break_even_alpha"] < 1.0
    assert json.loads(json.dumps(result)) == result


def test_cost_model_for_arm_accepts_json_keys_and_needs_records() -> None:
    spec, baseline = _records()
    from_json = {str(w): _verify_time(w) for w in range(1, 10)}
    assert cost_model_for_arm(spec, baseline, from_json, 4)["prediction_error"] == pytest.approx(0.0, abs=1e-6)
    assert cost_model_for_arm([], baseline, None, 4) is None
    assert cost_model_for_arm([_error_record("spec")], baseline, None, 4) is None
    assert cost_model_for_arm(spec, [_error_record("baseline")], None, 4) is None


def test_calibrated_verify_dip_is_pooled_so_wider_never_costs_less() -> None:
    spec, baseline = _records()
    noisy = {w: _verify_time(w) for w in range(1, 10)}
    noisy[4], noisy[5] = noisy[5], noisy[4]  # V(4) > V(5): a timing dip
    verify = {int(w): v for w, v in cost_model_for_arm(spec, baseline, noisy, 4)["verify"].items()}
    assert all(verify[w] <= verify[w + 1] for w in range(1, 9))
    assert verify[4] == pytest.approx((noisy[4] + noisy[5]) / 2) == pytest.approx(verify[5])
    assert verify[3] == pytest.approx(noisy[3]) and verify[6] == pytest.approx(noisy[6])
