"""The distribution of the draft length k per round (metrics.draft_lengths) in batch-1 and serving
summaries: counts, mean k, the k = 0 share, the fallback to draft_lengths for older records, typed reading."""

from __future__ import annotations

import dataclasses
import json

import pytest

from spectoolkit.bench.load.plan import Level
from spectoolkit.bench.load.summary import serving_summary
from spectoolkit.metrics.draft_lengths import arm_k_distribution, chosen_of, k_distribution
from spectoolkit.metrics.records import RequestRecord
from spectoolkit.metrics.summary import summarize
from spectoolkit.metrics.summary_schema import Summary
from spectoolkit.metrics.summary_sections import ArmKDistribution, KDistribution
from tests.metrics.sweep_records import ARMS, sweep_records


def _record(arm: str = "spec-adaptive", task: str = "code", **fields) -> RequestRecord:
    values = dict(case_id="c", task_type=task, repeat_idx=0, arm=arm, drafter="ngram", target_precision="fp32",
                  draft_precision=None, random_seed=0, temperature=0.0, top_p=1.0, top_k=0, draft_len=4)  # fmt: skip
    return RequestRecord(**{**values, **fields})


def test_counts_mean_and_zero_share_of_the_chosen_k() -> None:
    records = [
        _record(chosen_lengths=[4, 0, 3, 0], draft_lengths=[4, 0, 2, 0], accept_lengths=[4, 0, 1, 0]),
        _record(task="chat", chosen_lengths=[1, 4], draft_lengths=[1, 3], accept_lengths=[1, 3]),
    ]
    dist = k_distribution(records, 4)
    assert dist == {"rounds": 6, "counts": [2, 1, 0, 1, 2], "mean_k": pytest.approx(12 / 6),
                    "zero_share": pytest.approx(2 / 6), "mean_proposed": pytest.approx(10 / 6)}  # fmt: skip
    arm = arm_k_distribution(records)
    assert arm["gamma"] == 4 and arm["source"] == "chosen_lengths" and arm["overall"] == dist
    assert list(arm["by_task_type"]) == ["chat", "code"]  # sorted, as by_task_type of the summary
    assert arm["by_task_type"]["chat"]["counts"] == [0, 1, 0, 0, 1] and arm["by_load_level"] == {}


def test_records_before_chosen_lengths_fall_back_to_the_proposed_length() -> None:
    old = _record(draft_lengths=[4, 2, 0], accept_lengths=[1, 2, 0])  # record schema < 4: no chosen_lengths
    assert chosen_of(old) == [4, 2, 0]
    assert arm_k_distribution([old])["source"] == "draft_lengths"
    new = _record(chosen_lengths=[4], draft_lengths=[3], accept_lengths=[3])
    assert arm_k_distribution([old, new])["source"] == "mixed"
    assert arm_k_distribution([old, new])["overall"]["counts"] == [1, 0, 1, 0, 2]


def test_errors_and_arms_without_rounds_are_left_out() -> None:
    broken = _record(chosen_lengths=[1, 1, 1], draft_lengths=[1, 1, 1], error="RuntimeError: boom")
    assert arm_k_distribution([broken]) is None and arm_k_distribution([_record()]) is None
    big = _record(draft_len=2, chosen_lengths=[6], draft_lengths=[6], accept_lengths=[0])
    assert arm_k_distribution([big])["gamma"] == 6  # γ covers every k seen


def test_summarize_gives_each_drafting_arm_its_distribution() -> None:
    summary = json.loads(json.dumps(summarize(sweep_records(), greedy=True, arms=ARMS, primary="spec-g4")))
    section = summary["k_distribution"]
    assert list(section) == ["spec-g1", "spec-g2", "spec-g4", "spec-adaptive"]  # drafting arms, run order
    adaptive = section["spec-adaptive"]
    # per request: 22 rounds, k = 0 in 8, k = 3 in 4 (2 proposed), k = 4 in 10; two requests
    assert adaptive["overall"]["counts"] == [16, 0, 0, 8, 20] and adaptive["overall"]["rounds"] == 44
    assert adaptive["overall"]["zero_share"] == pytest.approx(16 / 44)
    assert adaptive["overall"]["mean_k"] == pytest.approx((8 * 3 + 20 * 4) / 44)
    assert adaptive["overall"]["mean_proposed"] == pytest.approx((8 * 2 + 20 * 4) / 44)
    assert set(adaptive["by_task_type"]) == {"code", "chat"} and adaptive["by_task_type"]["code"]["rounds"] == 22
    assert section["spec-g2"]["overall"]["counts"] == [0, 0, 56] and section["spec-g2"]["gamma"] == 2
    typed = Summary.from_dict(summary).k_distribution
    for arm, raw in section.items():
        assert dataclasses.asdict(typed[arm]) == raw  # every key read back by attribute
    assert typed["spec-adaptive"].by_task_type["chat"].mean_k == pytest.approx(104 / 44)


def test_an_old_or_corrupt_section_reads_as_empty() -> None:
    assert Summary.from_dict({"complete": True}).k_distribution == {}
    read = Summary.from_dict({"k_distribution": {"spec": 3, "x": {"overall": [1], "by_load_level": {"4": "y"}}}})
    assert read.k_distribution["spec"] == ArmKDistribution()
    assert read.k_distribution["x"].overall == KDistribution() and read.k_distribution["x"].by_load_level == {
        "4": KDistribution()
    }


def _serving(arm: str, level: str, chosen: list[int], proposed: list[int]) -> RequestRecord:
    return _record(arm=arm, load_level=level, chosen_lengths=chosen, draft_lengths=proposed,
                   accept_lengths=[0] * len(proposed), output_len=len(proposed) + 1, arrival_offset=0.0,
                   total_time=1.0)  # fmt: skip


def test_serving_summary_gives_the_distribution_per_load_level_in_run_order() -> None:
    levels = [Level("1", "concurrency", 1), Level("8", "concurrency", 8), Level("rate=2", "rate", 2.0)]
    records = [
        _serving("spec-adaptive", "8", [0, 0, 2], [0, 0, 2]),  # written first, but level 8 comes after 1
        _serving("spec-adaptive", "1", [4, 4], [4, 3]),
        _serving("spec-adaptive", "rate=2", [1], [1]),
        _serving("spec", "1", [4, 4], [4, 4]),
        _serving("baseline", "1", [], []),
    ]
    arms = {"baseline": None, "spec": "baseline", "spec-adaptive": "baseline"}
    section = serving_summary(records, levels, arms, {}, None, greedy=False)["k_distribution"]
    assert list(section) == ["spec", "spec-adaptive"]
    adaptive = section["spec-adaptive"]
    assert list(adaptive["by_load_level"]) == ["1", "8", "rate=2"]
    assert adaptive["by_load_level"]["8"]["zero_share"] == pytest.approx(2 / 3)
    assert adaptive["by_load_level"]["1"]["mean_k"] == 4.0 and adaptive["by_load_level"]["1"]["mean_proposed"] == 3.5
    assert adaptive["overall"]["counts"] == [2, 1, 1, 0, 2]
    assert Summary.from_dict({"mode": "serving", **{"k_distribution": section}}).k_distribution[
        "spec-adaptive"
    ].by_load_level["8"].counts == [2, 0, 1, 0, 0]
