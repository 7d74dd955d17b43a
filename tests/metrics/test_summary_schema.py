"""The typed summary: summarize's JSON read back field for field, schema versions, older shapes, and
corrupt or partial summaries read as None / empty instead of raising."""

from __future__ import annotations

import dataclasses
import json

import pytest

from spectoolkit.metrics.records import RequestRecord
from spectoolkit.metrics.summary import cost_models, summarize
from spectoolkit.metrics.summary_schema import SUMMARY_SCHEMA_VERSION, ArmStats, GroupStats, Quantiles, Summary
from spectoolkit.metrics.summary_sections import CostModel


def _record(case_id: str, arm: str, repeat_idx: int, **fields) -> RequestRecord:
    spec = arm == "spec"
    record = RequestRecord(
        case_id=case_id, task_type="code" if case_id == "a" else "chat", repeat_idx=repeat_idx, arm=arm,
        drafter="ngram" if spec else "none", target_precision="fp32", draft_precision=None, random_seed=0,
        temperature=0.0, top_p=1.0, top_k=0, draft_len=4 if spec else 0, input_len=100, output_len=10,
        output_ids=[5] * 10, ttft=0.1, ttft_nonstreaming=0.9, prefill_time=0.1, overhead_time=0.0,
    )  # fmt: skip
    timing = (
        dict(verify_rounds=3, drafted_tokens=12, accepted_tokens=6, rollback_count=2, proposed_rounds=3,
             accept_lengths=[4, 2, 0], draft_lengths=[4, 4, 4], total_time=0.5, draft_time=0.2, verify_time=0.2)
        if spec else dict(verify_rounds=9, total_time=1.0 + 0.1 * repeat_idx, verify_time=0.9)
    )  # fmt: skip
    return dataclasses.replace(record, **{**timing, **fields})


def _payload() -> dict:
    """summarize + cost model, through JSON as summary.json holds it."""
    records = [_record(case, arm, repeat) for repeat in (0, 1) for case in "ab" for arm in ("baseline", "spec")]
    arms = {"baseline": {"reference": None, "gamma": 0}, "spec": {"reference": "baseline", "gamma": 4}}
    summary = summarize(records, greedy=True, arms=arms, primary="spec")
    summary["cost_model"] = cost_models(records, arms, {})
    return json.loads(json.dumps(summary))


def test_summary_json_carries_its_schema_version_first() -> None:
    payload = _payload()
    assert next(iter(payload)) == "schema_version" and payload["schema_version"] == SUMMARY_SCHEMA_VERSION
    assert Summary.from_dict(payload).schema_version == SUMMARY_SCHEMA_VERSION
    assert Summary.from_dict({k: v for k, v in payload.items() if k != "schema_version"}).schema_version == 1


def test_every_statistic_summarize_writes_reads_back_by_attribute() -> None:
    payload = _payload()
    summary = Summary.from_dict(payload)
    for name, arm in payload["arms"].items():
        assert dataclasses.asdict(summary.arms[name]) == arm  # no key of ArmStats lost or renamed
    for task, group in payload["by_task_type"].items():
        read = dataclasses.asdict(summary.by_task_type[task])
        assert read["speedups"] == group["speedups"]
        assert {arm: {**stats, "reference_arm": None} for arm, stats in group["arms"].items()} == read["arms"]
    spec = summary.arms["spec"]
    assert spec.net_throughput == payload["arms"]["spec"]["net_throughput"] == pytest.approx(20.0)
    assert spec.latency == Quantiles(0.5, 0.5, 0.5) and spec.reference_arm == "baseline"
    assert summary.speedup == summary.speedups["spec"] and summary.primary_arm == "spec"
    assert summary.exact_match == {"spec": 1.0} and summary.complete is True and summary.errors == 0
    assert summary.task_share == payload["task_share"] and summary.by_input_len["1-128"].arms["spec"].requests == 4
    model, raw = summary.cost_model["spec"], payload["cost_model"]["spec"]
    assert {f.name for f in dataclasses.fields(CostModel)} == set(raw)
    assert model.verify == {int(width): seconds for width, seconds in raw["verify"].items()}
    assert model.predicted_by_gamma[4] == raw["predicted_by_gamma"]["4"] and model.t1 == raw["t1"]


def test_corrupt_or_partial_summaries_read_as_none_not_exceptions() -> None:
    for raw in ({}, [], None, "summary", {"complete": True}):
        summary = Summary.from_dict(raw)
        assert (summary.arms, summary.speedups, summary.primary_arm, summary.speedup) == ({}, {}, None, None)
        assert summary.conditions.memory.memory_delta_bytes is None and summary.exactness is None
    corrupt = {
        "complete": "yes", "requests": 2.5, "errors": "none", "speedup": "fast", "speedups": {"spec": "x"},
        "error_reasons": "boom", "arms": {"spec": {"requests": "many", "latency": [1, 2], "time_split": 4,
                                                    "net_throughput": float("inf")}, "bad": 3},
        "by_task_type": {"code": 7}, "cost_model": {"spec": 3, "quant": {"verify": {"x": 1, "2": "y", "3": 0.5}}},
        "exactness": "exact", "quant_quality": ["kl"], "conditions": {"memory": 5, "arms": [1, {"name": 2}],
                                                                      "sampling": "greedy", "gamma": "4"},
    }  # fmt: skip
    summary = Summary.from_dict(corrupt)
    assert (summary.complete, summary.requests, summary.errors, summary.speedup) == (None, None, None, None)
    assert summary.speedups == {"spec": None} and summary.error_reasons == []
    assert set(summary.arms) == {"spec"} and summary.arms["spec"] == ArmStats()
    assert summary.by_task_type == {"code": GroupStats()}  # the task is still listed, with nothing in it
    assert summary.cost_model["spec"] == CostModel() and summary.cost_model["quant"].verify == {3: 0.5}
    assert summary.exactness is None and summary.quant_quality is None
    assert summary.conditions.sampling == {} and summary.conditions.gamma is None
    assert [arm.name for arm in summary.conditions.arms] == [None]  # non-objects dropped, a bad name is None


def test_older_shapes_read_as_today() -> None:
    stats = dataclasses.asdict(ArmStats(requests=3, net_throughput=10.0, gamma=4))
    legacy = {"complete": True, "speedup": 0.71, "spec": stats, "baseline": {**stats, "gamma": 0},
              "by_task_type": {"code": {"spec": stats, "speedup": 0.71}}}  # fmt: skip
    summary = Summary.from_dict(legacy)
    assert set(summary.arms) == {"spec", "baseline"} and summary.speedups == {"spec": 0.71}
    assert summary.primary_arm == "spec"  # no primary_arm key: "spec" because it was measured
    assert summary.by_task_type["code"].arms["spec"].requests == 3 and summary.by_task_type["code"].speedups
    assert Summary.from_dict({**legacy, "primary_arm": None}).primary_arm is None  # written as "no primary arm"
    del stats["draft"]
    assert ArmStats.from_dict({**stats, "drafter": "ngram"}).draft == "ngram"  # the drafter's older key
