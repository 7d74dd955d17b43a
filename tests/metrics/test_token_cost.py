"""Cost per 1M output tokens (metrics.token_cost): the formula, the batch-1 and serving sections of summary.json
built from measured throughputs, and the typed reader (older summaries without the section, corrupt fields)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from spectoolkit.metrics.records import RequestRecord
from spectoolkit.metrics.summary import summarize
from spectoolkit.metrics.summary_schema import Summary
from spectoolkit.metrics.token_cost import batch_token_cost, cost_per_million_tokens, serving_token_cost

PRICE = 3.6  # per hour of this machine: 3.6 / 3600 s = 0.001 per second


def _formula(cost_per_hour: float, tokens_per_s: float) -> float:
    return cost_per_hour / (tokens_per_s * 3600) * 1e6


def _record(case_id: str, arm: str, output_len: int, total_time: float) -> RequestRecord:
    spec = arm == "spec"
    return RequestRecord(
        case_id=case_id, task_type="chat", repeat_idx=0, arm=arm, drafter="ngram" if spec else "none",
        target_precision="fp32", draft_precision=None, random_seed=0, temperature=0.0, top_p=1.0, top_k=0,
        draft_len=4 if spec else 0, output_len=output_len, total_time=total_time, output_ids=[1] * output_len,
        drafted_tokens=8 if spec else 0, accepted_tokens=6 if spec else 0, verify_rounds=2 if spec else output_len,
    )  # fmt: skip


def test_cost_per_million_tokens_is_the_formula() -> None:
    assert cost_per_million_tokens(PRICE, 1000.0) == pytest.approx(1.0)  # 0.001 per s / 1000 tok/s × 1e6
    assert cost_per_million_tokens(2.0, 25.0) == pytest.approx(_formula(2.0, 25.0)) == pytest.approx(22.2222, 1e-4)
    for rate in (None, 0.0, -5.0, math.nan, math.inf, True):
        assert cost_per_million_tokens(2.0, rate) is None, rate
    assert cost_per_million_tokens(None, 25.0) is None


def test_batch_cost_from_a_summary_built_by_the_real_aggregation() -> None:
    """Each arm's cost rests on its net throughput (output tokens / total time); change = cost / reference's − 1."""
    records = [_record(c, "baseline", 40, 2.0) for c in "ab"] + [_record(c, "spec", 40, 1.25) for c in "ab"]
    summary = summarize(records, greedy=True, arms={"baseline": {"reference": None}, "spec": {"reference": "baseline"}})
    section = json.loads(json.dumps(batch_token_cost(PRICE, summary["arms"])))
    assert section["cost_per_hour"] == PRICE and section["by_level"] == {}
    base, spec = section["arms"]["baseline"], section["arms"]["spec"]
    assert base["output_throughput"] == pytest.approx(20.0) and spec["output_throughput"] == pytest.approx(32.0)
    assert base["cost_per_million_output_tokens"] == pytest.approx(_formula(PRICE, 20.0)) == pytest.approx(50.0)
    assert spec["cost_per_million_output_tokens"] == pytest.approx(_formula(PRICE, 32.0)) == pytest.approx(31.25)
    assert base["reference"] is None and base["change"] is None
    assert spec["reference"] == "baseline" and spec["change"] == pytest.approx(31.25 / 50.0 - 1)  # -37.5%


def test_no_price_no_cost_and_an_unmeasured_arm_is_null() -> None:
    arms = {"baseline": {"net_throughput": 20.0, "reference_arm": None},
            "spec": {"net_throughput": None, "reference_arm": "baseline"}}  # fmt: skip
    assert batch_token_cost(None, arms) == {"cost_per_hour": None, "arms": {}, "by_level": {}}
    spec = batch_token_cost(PRICE, arms)["arms"]["spec"]
    assert spec["cost_per_million_output_tokens"] is None and spec["change"] is None


def test_serving_cost_per_arm_and_level() -> None:
    serving = {"baseline": {"1": {"output_throughput": 10.0}, "8": {"output_throughput": 50.0}},
               "spec": {"1": {"output_throughput": 14.0}, "8": {"output_throughput": None}}}  # fmt: skip
    section = serving_token_cost(PRICE, serving, {"baseline": None, "spec": "baseline"})
    assert section["arms"] == {} and list(section["by_level"]) == ["baseline", "spec"]
    spec1 = section["by_level"]["spec"]["1"]
    assert spec1["cost_per_million_output_tokens"] == pytest.approx(_formula(PRICE, 14.0))
    assert spec1["change"] == pytest.approx(10.0 / 14.0 - 1)
    assert section["by_level"]["baseline"]["8"]["cost_per_million_output_tokens"] == pytest.approx(20.0)
    assert section["by_level"]["spec"]["8"]["cost_per_million_output_tokens"] is None
    assert serving_token_cost(None, serving, {})["by_level"] == {}


def test_typed_summary_reads_the_section_and_older_summaries_without_it() -> None:
    arms = {"baseline": {"net_throughput": 20.0, "reference_arm": None}}
    summary = Summary.from_dict({"token_cost": batch_token_cost(PRICE, arms)})
    assert summary.token_cost is not None and summary.token_cost.cost_per_hour == PRICE
    assert summary.token_cost.arms["baseline"].cost_per_million_output_tokens == pytest.approx(50.0)
    assert Summary.from_dict({"arms": {}}).token_cost is None  # a summary from before bench.cost_per_hour
    corrupt = Summary.from_dict({"token_cost": {"cost_per_hour": "two", "arms": [], "by_level": {"spec": 3}}})
    assert corrupt.token_cost is not None and corrupt.token_cost.cost_per_hour is None
    assert corrupt.token_cost.arms == {} and dataclasses.asdict(corrupt.token_cost)["by_level"] == {"spec": None}
