"""summary["serving"] on hand-built records: throughput per run window, speedup per repeat pair then the
median, request-level quantiles, pooled ITL, α by task, step statistics and greedy exactness."""

from __future__ import annotations

import numpy as np
import pytest

from spectoolkit.bench.load.plan import Level
from spectoolkit.bench.load.summary import StepTotals, references_from_level, run_rates, serving_summary
from spectoolkit.metrics.records import RequestRecord
from spectoolkit.serving.api import StepStats

LEVELS = [Level("1", "concurrency", 1), Level("4", "concurrency", 4)]
ARMS = {"baseline": None, "spec": "baseline"}
REFERENCES = {"a": [1, 2, 3], "b": [4, 5, 6]}


def _rec(arm: str, level: str, repeat: int, case: str, arrival: float, total: float, **fields) -> RequestRecord:
    values = dict(
        case_id=case, task_type="code" if case == "a" else "chat", repeat_idx=repeat, arm=arm, drafter="none",
        target_precision="fp32", draft_precision=None, random_seed=0, temperature=0.0, top_p=1.0, top_k=0,
        draft_len=4 if arm == "spec" else 0, load_level=level, arrival_offset=arrival, total_time=total,
        output_len=10, output_ids=REFERENCES[case], ttft=0.1, tpot=0.01,
    )  # fmt: skip
    return RequestRecord(**{**values, **fields})


def _spec(repeat: int, case: str, arrival: float, total: float, **fields) -> RequestRecord:
    accepted = 6 if case == "a" else 2
    counters = dict(drafted_tokens=8, accepted_tokens=accepted, draft_lengths=[4, 4], accept_lengths=[3, 3])
    return _rec("spec", "4", repeat, case, arrival, total, **{**counters, **fields})


RECORDS = [
    # baseline at level 4: repeat 0 spans 0..2 s (20 tokens: 10 tok/s), repeat 1 spans 0..4 s (5 tok/s)
    _rec("baseline", "4", 0, "a", 0.0, 2.0, ttft=0.2, token_offsets=[0.2, 0.3, 0.5]),
    _rec("baseline", "4", 0, "b", 0.5, 1.5, ttft=0.4, tpot=0.03, preemptions=2),
    _rec("baseline", "4", 0, "b", None, None, output_len=0, output_ids=[], error="prompt too long"),
    _rec("baseline", "4", 1, "a", 0.0, 4.0, ttft=0.6),
    _rec("baseline", "4", 1, "b", 1.0, 1.0, ttft=0.8, tpot=0.05),
    # spec at level 4: 20 tok/s in both repeats -> speedups 2.0 and 4.0, median 3.0 (not 20 / 7.5)
    _spec(0, "a", 0.0, 1.0, token_offsets=[0.1, 0.1, 0.4]),
    _spec(0, "b", 0.0, 1.0, output_ids=[4, 5, 9]),  # diverges at position 2
    _spec(1, "a", 0.0, 1.0),
    _spec(1, "b", 0.5, 0.5),
    # level 1: one request per arm and repeat
    _rec("baseline", "1", 0, "a", 0.0, 1.0),
    _rec("spec", "1", 0, "a", 0.0, 0.5),
]


def _stats(reserved: int, speculating: bool, batch: int) -> StepStats:
    return StepStats(0, batch, batch, 0, reserved, reserved, 0, 0, speculating, 0.01, 0.0, 0)


def _steps() -> dict[tuple[str, str, int], StepTotals]:
    steps = {("spec", "4", 0): StepTotals(), ("spec", "4", 1): StepTotals()}
    for stats in (_stats(8, True, 2), _stats(12, True, 3), _stats(0, False, 4)):
        steps[("spec", "4", 0)].add(stats)
    steps[("spec", "4", 1)].add(_stats(4, True, 1))
    return steps


@pytest.fixture(scope="module")
def summary() -> dict:
    return serving_summary(RECORDS, LEVELS, ARMS, _steps(), REFERENCES, greedy=True)


def test_levels_and_layout(summary) -> None:
    assert summary["serving_levels"] == [
        {"key": "1", "kind": "concurrency", "value": 1}, {"key": "4", "kind": "concurrency", "value": 4},
    ]  # fmt: skip
    assert list(summary["serving"]) == ["baseline", "spec"]
    assert list(summary["serving"]["spec"]) == ["1", "4"]


def test_throughput_per_run_window_then_median(summary) -> None:
    base = summary["serving"]["baseline"]["4"]
    assert base["output_throughput_by_repeat"] == {"0": pytest.approx(10.0), "1": pytest.approx(5.0)}
    assert base["output_throughput"] == pytest.approx(7.5)
    assert base["request_throughput"] == pytest.approx(0.75)  # 2 / 2 s and 2 / 4 s
    assert base["mean_in_flight"] == pytest.approx(np.median([(2.0 + 1.5) / 2, (4.0 + 1.0) / 4]))
    assert run_rates([])["output_throughput"] is None


def test_speedup_is_per_repeat_pair_then_median(summary) -> None:
    assert summary["serving"]["spec"]["4"]["output_throughput"] == pytest.approx(20.0)
    assert summary["serving"]["spec"]["4"]["speedup"] == pytest.approx(3.0)
    assert summary["serving"]["spec"]["1"]["speedup"] == pytest.approx(2.0)
    assert summary["serving"]["baseline"]["4"]["speedup"] is None


def test_speedup_range_is_the_least_and_greatest_repeat(summary) -> None:
    spec = summary["serving"]["spec"]
    assert (spec["4"]["speedup_low"], spec["4"]["speedup_high"]) == (pytest.approx(2.0), pytest.approx(4.0))
    assert spec["1"]["speedup_low"] == spec["1"]["speedup_high"] == pytest.approx(2.0)  # one repeat
    assert summary["serving"]["baseline"]["4"]["speedup_low"] is None


def test_request_level_quantiles_and_pooled_itl(summary) -> None:
    base = summary["serving"]["baseline"]["4"]
    ttfts, tpots, latencies = [0.2, 0.4, 0.6, 0.8], [0.01, 0.03, 0.01, 0.05], [2.0, 1.5, 4.0, 1.0]
    assert base["ttft_p50"] == pytest.approx(np.percentile(ttfts, 50))
    assert base["ttft_p99"] == pytest.approx(np.percentile(ttfts, 99))
    assert base["tpot_p50"] == pytest.approx(np.percentile(tpots, 50))
    assert base["tpot_p99"] == pytest.approx(np.percentile(tpots, 99))
    assert base["latency_p95"] == pytest.approx(np.percentile(latencies, 95))
    assert base["latency_p99"] == pytest.approx(np.percentile(latencies, 99))
    assert base["itl_p50"] == pytest.approx(0.15)  # gaps 0.1, 0.2 (one request has token offsets)
    spec = summary["serving"]["spec"]["4"]
    assert spec["itl_p50"] == pytest.approx(0.3)  # 0.1, 0.1 is one delivery: a single gap of 0.3


def test_counts_acceptance_and_by_task(summary) -> None:
    base, spec = summary["serving"]["baseline"]["4"], summary["serving"]["spec"]["4"]
    assert (base["num_requests"], base["errors"], base["preemptions"]) == (5, 1, 2)
    assert base["acceptance_rate"] is None and base["mean_accept_length"] is None
    assert spec["acceptance_rate"] == pytest.approx(16 / 32)
    assert spec["mean_accept_length"] == pytest.approx(1 + 16 / 8)  # 8 rounds with drafts
    assert spec["by_task"] == {
        "chat": {"acceptance_rate": pytest.approx(4 / 16), "mean_accept_length": pytest.approx(1 + 4 / 4),
                 "num_requests": 2},
        "code": {"acceptance_rate": pytest.approx(12 / 16), "mean_accept_length": pytest.approx(1 + 12 / 4),
                 "num_requests": 2},
    }  # fmt: skip
    assert base["by_task"]["chat"]["num_requests"] == 3  # the error record counts as a request


def test_step_statistics(summary) -> None:
    spec, base = summary["serving"]["spec"]["4"], summary["serving"]["baseline"]["4"]
    assert spec["peak_temp_kv_tokens"] == 12
    assert spec["speculating_share"] == pytest.approx(3 / 4)
    assert spec["mean_batch_size"] == pytest.approx((2 + 3 + 4 + 1) / 4)
    assert (base["peak_temp_kv_tokens"], base["speculating_share"], base["mean_batch_size"]) == (None, None, None)


def test_greedy_exactness_against_the_batch_1_reference(summary) -> None:
    assert summary["serving"]["spec"]["4"]["exact_match"] == pytest.approx(3 / 4)
    assert summary["serving"]["baseline"]["4"]["exact_match"] == 1.0
    exactness = summary["serving_exactness"]
    assert exactness["reference"] == "baseline at concurrency 1"
    assert exactness["checked"] == 10  # every successful record
    assert exactness["divergent"] == [{"arm": "spec", "level": "4", "case_id": "b", "repeat": 0, "position": 2}]


def test_sampling_has_no_exactness() -> None:
    summary = serving_summary(RECORDS, LEVELS, ARMS, {}, REFERENCES, greedy=False)
    assert summary["serving_exactness"] is None
    assert summary["serving"]["spec"]["4"]["exact_match"] is None


def test_references_from_level_1() -> None:
    records = [_rec("baseline", "1", 1, "a", 0.0, 1.0, output_ids=[7]), _rec("baseline", "1", 0, "a", 0.0, 1.0),
               _rec("baseline", "4", 0, "b", 0.0, 1.0), _rec("spec", "1", 0, "b", 0.0, 1.0)]  # fmt: skip
    assert references_from_level(records, "baseline") == {"a": [1, 2, 3]}  # the first repeat's


def test_the_policys_expectation_is_totalled_against_the_measurement():
    """Issue 57: over the steps where the policy predicted (no prefill chunk), predicted / measured tokens, target
    seconds (at the width run) and draft seconds, and the tokens per second it expected and got."""
    totals = StepTotals()
    predicted = dict(predicted_tokens=6.0, predicted_target_seconds=0.12, predicted_actual_seconds=0.10,
                     predicted_draft_seconds=0.02, acceptance_estimates=[[0.9], [0.8]], prior_strength=5.0)  # fmt: skip
    for emitted in (4, 6):
        totals.add(StepStats(0, 2, 4, 0, 2, 2, 0, 0, True, 0.15, 0.03, 0, emitted_tokens=emitted, **predicted))
    totals.add(StepStats(0, 2, 40, 36, 0, 0, 0, 0, True, 0.9, 0.0, 0, emitted_tokens=1, **predicted))  # a prefill
    totals.add(StepStats(0, 2, 2, 0, 0, 0, 0, 0, False, 0.05, 0.0, 0, emitted_tokens=2))  # nothing predicted
    stats = serving_summary([_rec("spec", "4", 0, "a", 0.0, 1.0)], [Level("4", "concurrency", 4.0)], {"spec": None},
                            {("spec", "4", 0): totals}, None, True)["serving"]["spec"]["4"]  # fmt: skip
    assert stats["policy_tokens_ratio"] == pytest.approx(12 / 10)
    assert stats["policy_target_ratio"] == pytest.approx(0.20 / 0.24)  # step_time - draft_time: 0.12 twice
    assert stats["policy_draft_ratio"] == pytest.approx(0.04 / 0.06)
    assert stats["policy_predicted_rate"] == pytest.approx(12 / 0.28)
    assert stats["policy_measured_rate"] == pytest.approx(10 / 0.30)


def test_a_sampling_mix_gets_speedup_per_mode_and_only_its_greedy_requests_checked() -> None:
    """One run window per arm: the baseline's 0..4 s, the spec arm's 0..2 s; per mode, its share of the tokens."""
    records = [
        _rec("baseline", "4", 0, "a", 0.0, 4.0),  # greedy, 10 tokens
        _rec("baseline", "4", 0, "b", 0.0, 4.0, temperature=0.7, output_ids=[7, 7, 7], output_len=30),
        _spec(0, "a", 0.0, 2.0),
        _spec(0, "b", 0.0, 2.0, temperature=0.7, output_ids=[8, 8, 8], output_len=10),
    ]
    summary = serving_summary(records, [LEVELS[1]], ARMS, {}, REFERENCES, greedy=True)
    spec = summary["serving"]["spec"]["4"]
    assert spec["requests_by_mode"] == {"greedy": 1, "T=0.7": 1}
    # greedy: 10 tok / 2 s vs 10 tok / 4 s -> 2.0; T=0.7: 10 / 2 vs 30 / 4 -> 0.667
    assert spec["speedup_by_mode"] == pytest.approx({"T=0.7": 5 / 7.5, "greedy": 2.0})
    assert spec["acceptance_by_mode"] == {"T=0.7": 2 / 8, "greedy": 6 / 8}
    assert summary["serving_exactness"]["checked"] == 2 and not summary["serving_exactness"]["divergent"]
