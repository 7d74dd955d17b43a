"""Records of a gamma sweep whose every time follows the cost model (DESIGN §1) exactly.

Arms baseline, spec-g1, spec-g2, spec-g4 and spec-adaptive; two requests per arm of 71 output tokens
(70 after the prefill's). spec-g4 alternates rounds (4, 4) and (4, 1); spec-g2 alternates (2, 2) and
(2, 1), the distribution spec-g4's rounds truncate to at γ'=2; spec-g1 always (1, 1), what both
truncate to at γ'=1. So every truncation prediction equals the measured speedup of the arm run at γ',
and the extrapolations differ by amounts computed by hand in the tests. spec-adaptive records the k
its policy chose (``chosen_lengths``): 22 rounds, k = 0 in 8, k = 3 in 4 (2 proposed), k = 4 in 10.
"""

from __future__ import annotations

from spectoolkit.metrics.records import RequestRecord

T1, DRAFT, OVERHEAD = 0.010, 0.001, 0.0005
PREFILLS = (0.02, 0.04)
OUTPUT_LEN = 71
TASKS = ("code", "chat")
ROUNDS = {  # arm -> (drafted k, accepted K) per round of one request: 70 tokens after the prefill's
    "spec-g4": [(4, 4), (4, 1)] * 10,
    "spec-g2": [(2, 2), (2, 1)] * 14,
    "spec-g1": [(1, 1)] * 35,
    "spec-adaptive": [(4, 4), (0, 0), (2, 2), (4, 4), (0, 0)] * 4 + [(4, 4), (4, 4)],
}
# The adaptive policy's k per round: where it chose 3 the drafter proposed 2 (an early stop).
CHOSEN = {"spec-adaptive": [4, 0, 3, 4, 0] * 4 + [4, 4]}
ARMS = {
    "baseline": {"reference": None, "gamma": 0, "policy": "none"},
    "spec-g1": {"reference": "baseline", "gamma": 1, "policy": "fixed"},
    "spec-g2": {"reference": "baseline", "gamma": 2, "policy": "fixed"},
    "spec-g4": {"reference": "baseline", "gamma": 4, "policy": "fixed"},
    "spec-adaptive": {"reference": "baseline", "gamma": 4, "policy": "adaptive"},
}


def verify_time(width: int) -> float:
    return T1 + 0.001 * (width - 1)  # linear, V(1) = T₁


def round_cost(drafted: int) -> float:
    return DRAFT * drafted + verify_time(drafted + 1) + OVERHEAD


def _record(arm: str, case: int, **fields) -> RequestRecord:
    return RequestRecord(
        case_id=f"case/{case}", task_type=TASKS[case], repeat_idx=0, arm=arm, drafter="none" if arm == "baseline"
        else "ngram", target_precision="fp32", draft_precision=None, random_seed=case, temperature=0.0, top_p=1.0,
        top_k=0, draft_len=ARMS[arm]["gamma"], output_len=OUTPUT_LEN, prefill_time=PREFILLS[case],
        output_ids=[7] * OUTPUT_LEN, **fields,
    )  # fmt: skip


def baseline_record(case: int) -> RequestRecord:
    decode = (OUTPUT_LEN - 1) * T1
    return _record("baseline", case, verify_rounds=OUTPUT_LEN - 1, total_time=PREFILLS[case] + decode,
                   verify_time=decode, draft_time=0.0, overhead_time=0.0)  # fmt: skip


def spec_record(arm: str, case: int) -> RequestRecord:
    rounds = ROUNDS[arm]
    assert sum(accepted + 1 for _, accepted in rounds) == OUTPUT_LEN - 1
    draft = DRAFT * sum(k for k, _ in rounds)
    verify = sum(verify_time(k + 1) for k, _ in rounds)
    overhead = OVERHEAD * len(rounds)
    return _record(
        arm, case, verify_rounds=len(rounds), drafted_tokens=sum(k for k, _ in rounds),
        accepted_tokens=sum(n for _, n in rounds), rollback_count=sum(n < k for k, n in rounds),
        proposed_rounds=sum(k > 0 for k, _ in rounds), total_time=PREFILLS[case] + draft + verify + overhead,
        draft_time=draft, verify_time=verify, overhead_time=overhead, draft_lengths=[k for k, _ in rounds],
        accept_lengths=[n for _, n in rounds], chosen_lengths=CHOSEN.get(arm, [ARMS[arm]["gamma"]] * len(rounds)),
    )  # fmt: skip


def sweep_records() -> list[RequestRecord]:
    return [baseline_record(case) if arm == "baseline" else spec_record(arm, case) for case in (0, 1) for arm in ARMS]


def verify_costs() -> dict[str, dict[int, float]]:
    """Calibrated V(w) for every drafting arm (the same target: the same table)."""
    return {arm: {w: verify_time(w) for w in range(1, 10)} for arm in ARMS if arm != "baseline"}


def predicted(expected_tokens: float, mean_round_cost: float) -> float:
    """The whole-request speedup the cost model predicts for these requests (mean prefill, 71 tokens)."""
    prefill, steps = sum(PREFILLS) / len(PREFILLS), OUTPUT_LEN - 1
    return (prefill + steps * T1) / (prefill + steps / expected_tokens * mean_round_cost)


def measured(arm: str) -> float:
    """Net throughput of ``arm`` over the baseline's: the same tokens, so total baseline time / total arm time."""
    base = sum(baseline_record(case).total_time for case in (0, 1))
    return base / sum(spec_record(arm, case).total_time for case in (0, 1))
