"""Summary statistics (DESIGN §3) on hand-made records whose every number is known in advance."""

from __future__ import annotations

import numpy as np
import pytest

from spectoolkit.bench.protocol.table import format_summary
from spectoolkit.metrics.records import RequestRecord
from spectoolkit.metrics.summary import greedy_exact_match, quantiles, summarize


def _record(case_id: str, arm: str, repeat_idx: int = 0, task_type: str = "code", **fields) -> RequestRecord:
    record = RequestRecord(
        case_id=case_id, task_type=task_type, repeat_idx=repeat_idx, arm=arm,
        drafter="ngram" if arm == "spec" else "none", target_precision="fp32", draft_precision=None,
        random_seed=0, temperature=0.0, top_p=1.0, top_k=0, draft_len=4 if arm == "spec" else 0,
    )  # fmt: skip
    for name, value in fields.items():
        setattr(record, name, value)
    return record


def _baseline(case_id: str, **fields) -> RequestRecord:
    # 10 tokens: the prefill emits the first, 9 decode steps the rest; 1 s -> 10 tok/s.
    values = dict(output_len=10, verify_rounds=9, total_time=1.0, ttft=0.1, verify_time=0.9, output_ids=[5] * 10)
    return _record(case_id, "baseline", **{**values, **fields})


def _spec(case_id: str, **fields) -> RequestRecord:
    # 10 tokens = 1 (prefill) + 3 rounds x (accepted + 1); 12 drafted, 6 accepted, 2 rounds rolled back.
    values = dict(
        output_len=10, verify_rounds=3, drafted_tokens=12, accepted_tokens=6, rollback_count=2,
        proposed_rounds=3, accept_lengths=[4, 2, 0], total_time=0.5, ttft=0.1, draft_time=0.2,
        verify_time=0.2, output_ids=[5] * 10,
    )  # fmt: skip
    return _record(case_id, "spec", **{**values, **fields})


@pytest.fixture
def records() -> list[RequestRecord]:
    return [
        _baseline("a", task_type="code"),
        _spec("a", task_type="code"),
        _baseline("b", task_type="chat", total_time=2.0),  # chat baseline: 5 tok/s
        _spec("b", task_type="chat", output_ids=[5] * 9 + [6]),  # diverges from its baseline
        # Errors: counted, never averaged in (they would add requests and a matching empty pair).
        _record("c", "baseline", task_type="code", error="line 3: malformed JSON"),
        _record("c", "spec", task_type="code", error="line 3: malformed JSON"),
    ]


def test_quantiles_match_numpy_linear() -> None:
    values = [float(v) for v in range(1, 101)]
    result = quantiles(values)
    assert result == pytest.approx({"p50": 50.5, "p95": 95.05, "p99": 99.01})
    assert result["p95"] == pytest.approx(float(np.percentile(values, 95)))
    assert quantiles([]) == {"p50": None, "p95": None, "p99": None}
    assert quantiles([3.0]) == {"p50": 3.0, "p95": 3.0, "p99": 3.0}


def test_latency_quantiles_are_over_requests_not_means_of_groups() -> None:
    # 90 code requests take 1..90 s and 10 chat requests 91..100 s: the overall p50 is 50.5, while
    # a mean of the two per-type medians would be (45.5 + 95.5) / 2 = 70.5.
    records = [_baseline(f"r{i}", task_type="code" if i <= 90 else "chat", total_time=float(i)) for i in range(1, 101)]
    summary = summarize(records, greedy=True)
    assert summary["arms"]["baseline"]["latency"] == pytest.approx({"p50": 50.5, "p95": 95.05, "p99": 99.01})
    assert summary["by_task_type"]["chat"]["arms"]["baseline"]["latency"]["p50"] == pytest.approx(95.5)
    assert summary["arms"]["baseline"]["ttft"] == pytest.approx({"p50": 0.1, "p95": 0.1, "p99": 0.1})


def test_arm_statistics(records: list[RequestRecord]) -> None:
    summary = summarize(records, greedy=True)
    base, spec = summary["arms"]["baseline"], summary["arms"]["spec"]
    assert (base["requests"], spec["requests"]) == (2, 2)
    assert (base["output_tokens"], spec["output_tokens"]) == (20, 20)
    assert spec["acceptance_rate"] == pytest.approx(12 / 24)
    assert base["acceptance_rate"] is None  # nothing drafted
    assert base["tokens_per_verify"] == pytest.approx(1.0)  # prefill counted: 20 / (18 + 2)
    assert spec["tokens_per_verify"] == pytest.approx(20 / (6 + 2))
    assert spec["rollback_rate"] == pytest.approx(4 / 6)
    assert spec["proposal_coverage"] == pytest.approx(1.0)
    assert base["net_throughput"] == pytest.approx(20 / 3.0)
    assert spec["net_throughput"] == pytest.approx(20 / 1.0)
    assert summary["speedup"] == pytest.approx((20 / 1.0) / (20 / 3.0))


def test_per_task_type_speedup(records: list[RequestRecord]) -> None:
    by_task = summarize(records, greedy=True)["by_task_type"]
    assert set(by_task) == {"code", "chat"}  # the errored case adds no group of its own stats
    assert by_task["code"]["speedups"]["spec"] == pytest.approx(2.0)  # 20 tok/s vs 10 tok/s
    assert by_task["chat"]["speedups"]["spec"] == pytest.approx(4.0)  # 20 tok/s vs 5 tok/s
    assert by_task["code"]["arms"]["spec"]["acceptance_rate"] == pytest.approx(0.5)


def test_errors_counted_and_excluded(records: list[RequestRecord]) -> None:
    summary = summarize(records, greedy=True)
    assert (summary["requests"], summary["errors"]) == (6, 2)
    assert summary["error_reasons"] == ["line 3: malformed JSON"]
    assert summary["complete"] is True
    assert summarize(records, greedy=True, complete=False)["complete"] is False


def test_greedy_exact_match_fraction(records: list[RequestRecord]) -> None:
    assert summarize(records, greedy=True)["greedy_exact_match"] == pytest.approx(0.5)
    assert summarize(records, greedy=False)["greedy_exact_match"] is None  # sampling: not expected equal
    assert greedy_exact_match([_baseline("a")]) is None  # no pairs
    # Pairs are matched by (case, repeat): a repeat's spec output is never compared to another repeat.
    pairs = [_baseline("a", repeat_idx=0), _spec("a", repeat_idx=1), _spec("a", repeat_idx=0)]
    assert greedy_exact_match(pairs) == 1.0


def test_baseline_only_has_no_speedup() -> None:
    summary = summarize([_baseline("a"), _baseline("b")], greedy=True)
    assert summary["speedup"] is None
    assert set(summary["arms"]) == {"baseline"}
    assert summary["greedy_exact_match"] is None
    assert summary["by_task_type"]["code"]["speedups"] == {}


def test_format_summary_shows_overall_speedup(records: list[RequestRecord]) -> None:
    text = format_summary(summarize(records, greedy=True))
    rows = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    assert "3.00x" in rows["spec"]  # overall: 20 tok/s over 6.67 tok/s
    assert "x" not in rows["baseline"].split()[3]  # the speedup column of the baseline is empty
    assert "2.00x" in rows["code/spec"] and "4.00x" in rows["chat/spec"]
    assert "greedy exact match: spec 50.0%" in text
    assert "errors: 2" in text


def test_format_summary_baseline_only() -> None:
    text = format_summary(summarize([_baseline("a")], greedy=True))
    arms = [line.split()[0] for line in text.splitlines()[1:] if not line.startswith("greedy")]
    assert arms == ["baseline", "code/baseline"]
    assert "greedy exact match: n/a" in text


def test_acceptance_distribution_and_time_split() -> None:
    # Two spec requests: rounds (drafted, accepted) = (4,4), (4,2), (4,0) and (2,1), (0,0).
    records = [
        _baseline("a", prefill_time=0.1, verify_time=0.9),
        _spec("a", draft_lengths=[4, 4, 4], accept_lengths=[4, 2, 0], prefill_time=0.1, overhead_time=0.0),
        _baseline("b", prefill_time=0.1, verify_time=0.9),
        _spec("b", verify_rounds=2, drafted_tokens=2, accepted_tokens=1, draft_lengths=[2, 0],
              accept_lengths=[1, 0], prefill_time=0.1, overhead_time=0.0),
    ]  # fmt: skip
    spec = summarize(records, greedy=True)["arms"]["spec"]
    assert spec["acceptance_histogram"] == [2, 1, 1, 0, 1]  # K = 0, 1, 2, 3, 4
    assert spec["prob_accept_at_least"] == pytest.approx([3 / 5, 2 / 5, 1 / 5, 1 / 5])
    # E[N] = 1 + sum Pr(K >= i) = mean tokens per round = (5 + 3 + 1 + 2 + 1) / 5
    assert 1 + sum(spec["prob_accept_at_least"]) == pytest.approx(12 / 5)
    assert spec["mean_accept_length"] == pytest.approx(1 + 7 / 5)
    assert spec["time_split"] == pytest.approx({"prefill": 0.2, "draft": 0.4, "verify": 0.4, "overhead": 0.0})
    assert spec["gamma"] == 4


def test_task_share_buckets_and_baseline_spread() -> None:
    records = [
        _baseline("a", task_type="code", input_len=100, output_len=10, repeat_idx=0, total_time=1.0),
        _baseline("b", task_type="chat", input_len=300, output_len=10, repeat_idx=0, total_time=1.0),
        _baseline("c", task_type="chat", input_len=3000, output_len=200, repeat_idx=1, total_time=10.0),
        _spec("a", task_type="code", input_len=100, output_len=10, repeat_idx=0),
    ]
    summary = summarize(records, greedy=True)
    assert summary["task_share"] == pytest.approx({"chat": 2 / 3, "code": 1 / 3})
    assert set(summary["by_input_len"]) == {"1-128", "129-512", ">2048"}
    assert summary["by_input_len"]["1-128"]["speedups"]["spec"] == pytest.approx(2.0)
    assert set(summary["by_output_len"]) == {"1-32", "129-512"}
    # Repeat 0: 20 tokens / 2 s = 10 tok/s; repeat 1: 200 / 10 = 20 tok/s; spread (20-10)/median(15).
    assert summary["baseline_repeat_throughput"] == pytest.approx([10.0, 20.0])
    assert summary["baseline_spread"] == pytest.approx(10 / 15)
    assert summarize(records[:2], greedy=True)["baseline_spread"] is None  # one repeat: no spread


def test_exact_match_per_drafting_arm() -> None:
    records = [_baseline("a"), _spec("a"), _record("a", "quant", output_ids=[7] * 10, output_len=10),
               _record("a", "quant+spec", output_ids=[7] * 10, output_len=10, draft_len=4)]  # fmt: skip
    arms = {"baseline": {"reference": None}, "quant": {"reference": None}, "spec": {"reference": "baseline"},
            "quant+spec": {"reference": "quant"}}  # fmt: skip
    summary = summarize(records, greedy=True, arms=arms, primary="quant+spec")
    assert summary["exact_match"] == {"spec": 1.0, "quant+spec": 1.0}  # each against its own target precision
    assert summary["greedy_exact_match"] == 1.0 and summary["primary_arm"] == "quant+spec"
    assert list(summary["arms"]) == ["baseline", "quant", "spec", "quant+spec"]
    assert summary["arms"]["quant+spec"]["reference_arm"] == "quant"
