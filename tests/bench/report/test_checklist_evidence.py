"""Findings apart from missing evidence in the pre-launch checklist (bench.report.check_item, .evidence, .checklist).

The baseline-noise statistic against numpy and against the range it replaced (whose size grows with the
repeat count), the warm-up hint, α per task type counted per prompt under greedy decoding with the number of
prompts (or repeats, when sampling) that would decide it, and the rule that every FAIL, NOT SET and
INSUFFICIENT DATA line carries what to do.
"""

from __future__ import annotations

from statistics import NormalDist
from typing import Any

import numpy as np
import pytest

from spectoolkit.bench.report import checklist as cl
from spectoolkit.bench.report.check_item import CheckItem, caution
from spectoolkit.bench.report.evidence import relative_noise
from tests.bench.report.test_report import _stats, make_run, typed


def _machine(noise: float, repeats: int, tput: float = 25.0) -> list[float]:
    """Per-repeat throughputs of a machine with normal noise ``noise`` × mean: the normal quantiles, spread evenly."""
    return [tput * (1 + noise * NormalDist().inv_cdf((i + 0.5) / repeats)) for i in range(repeats)]


def _spread_item(values: list[float], warmup: int = 1) -> CheckItem:
    summary, _ = make_run()
    summary["baseline_repeat_throughput"] = values
    summary["conditions"]["bench"].update(repeat=len(values), warmup=warmup)
    return cl.check_baseline_spread(typed(summary))


@pytest.mark.parametrize("values", [[25.0, 25.5, 24.8], [10.0, 30.0], _machine(0.07, 12), [1.0, 1.0, 1.0, 1.0]])
def test_relative_noise_is_numpys_sample_std_over_the_mean(values: list[float]) -> None:
    assert relative_noise(values) == pytest.approx(np.std(values, ddof=1) / np.mean(values), rel=1e-12)
    assert relative_noise([25.0]) is None and relative_noise([]) is None


@pytest.mark.parametrize("repeats", [5, 10, 20])
def test_the_verdict_on_a_machine_does_not_depend_on_how_many_repeats_measured_it(repeats: int) -> None:
    """3.5% noise passes and 8% fails at every repeat count; the old range ≤ 0.10 failed the 3.5% machine from
    10 repeats on (its range grows with the count), so more repeats could never have fixed it."""
    quiet, noisy = _machine(0.035, repeats), _machine(0.08, repeats)
    assert _spread_item(quiet).status == cl.PASS and _spread_item(noisy).status == cl.FAIL
    old_range = (max(quiet) - min(quiet)) / float(np.median(quiet))
    assert (old_range > 0.10) == (repeats >= 10)


def test_a_noisy_machine_fails_with_the_machine_as_its_fix() -> None:
    item = _spread_item([22.0, 28.0, 25.0, 21.0, 29.0])
    assert item.status == cl.FAIL
    assert item.evidence == "noise 0.141 (std / mean of baseline tok/s over 5 repeats, limit 0.05); range 0.320"
    assert "a quieter machine" in item.fix and "OMP_NUM_THREADS=<cores> taskset -c <cores>" in item.fix
    assert "(this run: 2 torch threads on 2 CPUs)" in item.fix


def test_a_slow_first_repeat_alone_fails_with_more_warm_up() -> None:
    item = _spread_item([20.0, 25.0, 25.2, 24.9, 25.1], warmup=1)
    assert item.status == cl.FAIL
    assert item.fix.startswith("the first repeat alone is slow (20.00 vs median 25.00 tok/s; the others' noise 0.005)")
    assert item.fix.endswith("more warm-up, bench.warmup=4")
    assert "bench.warmup" not in _spread_item([25.0, 20.0, 25.2, 24.9, 25.1]).fix  # the slow one is not the first


def test_too_few_repeats_are_insufficient_data_with_what_measures_the_noise() -> None:
    item = _spread_item([25.0, 27.0])
    assert (item.status, item.fix) == (cl.INSUFFICIENT, "bench.repeat=5")
    summary, _ = make_run()
    summary["baseline_repeat_throughput"] = [25.0, 27.0]
    summary["conditions"]["bench"]["repeat"] = 5  # three repeats lost every baseline request
    item = cl.check_baseline_spread(typed(summary))
    assert item.status == cl.INSUFFICIENT and item.evidence.startswith("2 baseline repeat(s) measured of 5")
    assert "failed" in item.fix


# ---- α per task type -----------------------------------------------------------------------------


def _tasks(kind: str, temperature: float, tasks: dict[str, tuple[int, int]], repeats: int = 5) -> dict[str, Any]:
    """A run of workload ``kind`` whose spec arm drafted ``drafted`` tokens over ``requests`` per task type."""
    summary, _ = make_run(temperature=temperature, repeats=repeats)
    summary["conditions"]["workload"] = {"kind": kind, "num_prompts": None}
    summary["by_task_type"] = {
        task: {"arms": {"baseline": _stats(25.0, requests),
                        "spec": _stats(30.0, requests, gamma=4, draft="ngram", alpha=0.5, drafted=drafted)}}
        for task, (requests, drafted) in tasks.items()
    }  # fmt: skip
    return summary


BUILTIN = {"chat": (5, 130), "qa": (10, 60), "code": (5, 1500)}  # (requests, drafted) over 5 repeats


def test_builtin_greedy_counts_each_prompt_once_and_names_the_prompts_that_would_decide() -> None:
    """The default command's shape: 1–2 prompts per type, repeated 5×. Greedy repeats re-decode the same tokens,
    so qa has 12 drafted tokens of evidence (6 per request × 2 prompts), not 60, and no bench.repeat helps."""
    item = cl.check_alpha_per_task(typed(_tasks("builtin", 0.0, BUILTIN)), [])
    assert item.status == cl.INSUFFICIENT
    assert item.evidence == (
        "below 200 drafted (each prompt once: greedy repeats re-decode the same tokens): "
        "chat 26 (spec: 1 prompt(s), 5 request(s), 26.0 drafted per request, ≈ 8 prompts reach 200); "
        "qa 12 (spec: 2 prompt(s), 10 request(s), 6.0 drafted per request, ≈ 34 prompts reach 200)"
    )
    assert item.fix == (
        "more prompts of these task types in a JSONL workload (workload=jsonl workload.path=FILE): chat ≈ 8, "
        "qa ≈ 34 (workload=sharegpt workload.num_prompts=8 for chat). Greedy repeats re-decode the same tokens, "
        "so bench.repeat adds no evidence"
    )


def test_sampling_counts_every_request_and_names_the_repeats_that_would_decide() -> None:
    item = cl.check_alpha_per_task(typed(_tasks("builtin", 0.7, BUILTIN)), [])
    assert item.status == cl.INSUFFICIENT and "qa 60 (spec: 2 prompt(s), 10 request(s)" in item.evidence
    # qa: 6 per request → 34 requests → 17 repeats of its 2 prompts; chat: 26 per request → 8 requests → 8 repeats
    assert item.fix.startswith("bench.repeat=17 (each repeat samples new outputs; requests needed: chat ≈ 8, qa ≈ 34)")
    enough = _tasks("builtin", 0.7, {"chat": (20, 520), "qa": (40, 240)}, repeats=20)  # 20 repeats of sampling
    assert cl.check_alpha_per_task(typed(enough), []).status == cl.PASS


def test_a_dataset_workload_names_its_num_prompts_and_a_type_without_drafts_cannot_be_estimated() -> None:
    item = cl.check_alpha_per_task(typed(_tasks("humaneval", 0.0, {"code": (8, 80)}, repeats=1)), [])
    assert item.status == cl.INSUFFICIENT and item.fix == "workload.num_prompts=20 (prompts needed: code ≈ 20)"
    item = cl.check_alpha_per_task(typed(_tasks("humaneval", 0.0, {"code": (8, 0)}, repeats=1)), [])
    assert item.status == cl.INSUFFICIENT and "spec drafted nothing on its 8 prompt(s)" in item.evidence
    assert item.fix.startswith("a workload with other prompts of these task types")


# ---- statuses and the headline -------------------------------------------------------------------


@pytest.mark.parametrize("status", [cl.FAIL, cl.NOT_SET, cl.INSUFFICIENT])
def test_a_fail_or_undecided_item_without_a_fix_cannot_be_made(status: str) -> None:
    with pytest.raises(ValueError, match="without a fix"):
        CheckItem("x", status, "evidence")
    assert CheckItem("x", status, "evidence", "do this").fix == "do this"
    with pytest.raises(ValueError, match="not one of"):
        CheckItem("x", "MAYBE", "evidence")


def test_caution_counts_fails_and_names_undecided_items_apart() -> None:
    items = [CheckItem("a", cl.PASS, ""), CheckItem("b", cl.NA, ""), CheckItem("c", cl.NOT_SET, "", "set it")]
    assert caution(items[:2]) == ""
    assert caution(items) == ("\n\n**Not decided:** 1 pre-launch check(s) lack evidence: c (NOT SET) — the checklist "
                              "says what decides each.")  # fmt: skip
    items.append(CheckItem("d", cl.FAIL, "", "fix it"))
    assert caution(items).startswith("\n\n**Caution:** 1 pre-launch check(s) FAIL: d.\n\n**Not decided:** 1 ")


def test_the_rounding_verdict_the_checklist_names_is_the_exactness_evals() -> None:
    from spectoolkit.eval.exactness import DIVERGENT_ROUNDING

    assert cl.DIVERGENT_ROUNDING == DIVERGENT_ROUNDING
    summary, records = make_run()
    summary["exactness"] = {"verdict": DIVERGENT_ROUNDING, "passed": False, "pairs": 12, "identical": 9,
                            "near_ties": 3, "unexplained": 0, "divergences": []}  # fmt: skip
    item = cl.check_exactness(typed(summary), [])
    assert item.status == cl.FAIL and item.fix == cl.ROUNDING_FIX
    summary["exactness"].update(verdict="unexplained divergence", unexplained=1)
    assert cl.check_exactness(typed(summary), []).fix == cl.DIVERGED_FIX
