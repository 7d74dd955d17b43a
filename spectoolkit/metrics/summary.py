"""Aggregate per-request records into the run summary (DESIGN §3 definitions).

Conventions, over all successful records of an arm (never means of per-request means):
- acceptance_rate = accepted draft tokens / drafted tokens
- tokens_per_verify (E) = output tokens / target forwards, the prefill counted as one forward,
  so a target-alone arm is exactly 1.0
- mean_accept_length = 1 + accepted / rounds (vLLM's convention: tokens per verify round)
- rollback_rate = rounds with >= 1 rejected draft / rounds; proposal_coverage = rounds with >= 1
  proposed token / rounds
- acceptance_histogram[k] = rounds that accepted exactly k drafts; prob_accept_at_least[i-1] =
  Pr(K >= i) over all rounds (a round that drafted fewer than i tokens counts as K < i)
- net_throughput = output tokens / total wall time; speedup = arm / "baseline" net throughput
- latency and TTFT quantiles are request-level (numpy linear interpolation over all records)
- k_distribution: per drafting arm, verify rounds by the draft length k its policy chose, overall and
  per task type (:mod:`spectoolkit.metrics.draft_lengths`)
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from spectoolkit.metrics.cost_model import FIXED, acceptance_histogram, cost_model_for_arm, prob_accept_at_least
from spectoolkit.metrics.draft_lengths import k_distributions
from spectoolkit.metrics.gamma_validation import widen_recommendations
from spectoolkit.metrics.records import RequestRecord, rounds_of
from spectoolkit.metrics.summary_schema import (
    BASELINE,
    SUMMARY_SCHEMA_VERSION,
    TIME_PARTS,
    ArmStats,
    GroupStats,
    Quantiles,
)
from spectoolkit.metrics.trees import tree_stats

INPUT_BUCKETS = ((1, 128), (129, 512), (513, 2048), (2049, None))
OUTPUT_BUCKETS = ((1, 32), (33, 128), (129, 512), (513, None))
Records = list[RequestRecord]


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def quantiles(values: list[float | None], qs: tuple[int, ...] = (50, 95, 99)) -> dict[str, float | None]:
    """Request-level quantiles ``p50``/``p95``/``p99`` of ``values`` (None when empty)."""
    values = [v for v in values if v is not None]
    if not values:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": float(np.percentile(values, q)) for q in qs}


def _total(records: Records, name: str) -> float:
    return sum(getattr(record, name) or 0 for record in records)


def arm_stats(records: Records) -> ArmStats:
    """Statistics of one arm's successful records."""
    output_tokens, rounds = _total(records, "output_len"), _total(records, "verify_rounds")
    drafted, accepted, total_time = (
        _total(records, name) for name in ("drafted_tokens", "accepted_tokens", "total_time")
    )
    gamma = max((r.draft_len or 0 for r in records), default=0)
    pairs = rounds_of(records)
    first = records[0] if records else None
    return ArmStats(
        requests=len(records),
        target_precision=first.target_precision if first else None,
        draft=first.drafter if first else "none",
        gamma=gamma,
        output_tokens=output_tokens,
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        acceptance_rate=_ratio(accepted, drafted),
        tokens_per_verify=_ratio(output_tokens, rounds + len(records)),
        mean_accept_length=1 + accepted / rounds if rounds and gamma else None,
        rollback_rate=_ratio(_total(records, "rollback_count"), rounds),
        proposal_coverage=_ratio(_total(records, "proposed_rounds"), rounds),
        net_throughput=_ratio(output_tokens, total_time),
        total_time=total_time,
        time_split={part: _total(records, f"{part}_time") for part in TIME_PARTS},
        acceptance_histogram=acceptance_histogram(pairs, gamma) if gamma else [],
        prob_accept_at_least=prob_accept_at_least(pairs, gamma) if gamma else [],
        ttft=Quantiles(**quantiles([r.ttft for r in records])),
        ttft_nonstreaming=Quantiles(**quantiles([r.ttft_nonstreaming for r in records])),
        latency=Quantiles(**quantiles([r.total_time for r in records])),
        latencies=sorted(r.total_time for r in records if r.total_time is not None),
    )


def _by_arm(records: Records) -> dict[str | None, Records]:
    by_arm: dict[str | None, Records] = defaultdict(list)
    for record in records:
        by_arm[record.arm].append(record)
    return by_arm


def group_stats(records: Records, arm_names: list[str]) -> GroupStats:
    """Per-arm statistics of ``records`` and each arm's speedup against the baseline arm."""
    by_arm = _by_arm(records)
    arms = {name: arm_stats(by_arm[name]) for name in arm_names if by_arm.get(name)}
    base = arms[BASELINE].net_throughput if BASELINE in arms else None
    speedups = {
        name: _ratio(stats.net_throughput, base) if stats.net_throughput is not None else None
        for name, stats in arms.items() if name != BASELINE and base
    }  # fmt: skip
    return GroupStats(arms=arms, speedups=speedups)


def output_pairs(
    records: Records, arm: str, reference: str
) -> list[tuple[str | None, int | None, list[int], list[int]]]:
    """(case_id, repeat_idx, reference output_ids, ``arm`` output_ids) for every (case, repeat) both
    arms finished, in the order of ``arm``'s records. Error records are skipped."""
    usable = [r for r in records if not r.error]
    references = {(r.case_id, r.repeat_idx): r.output_ids for r in usable if r.arm == reference}
    return [(r.case_id, r.repeat_idx, references[(r.case_id, r.repeat_idx)], r.output_ids) for r in usable
            if r.arm == arm and (r.case_id, r.repeat_idx) in references]  # fmt: skip


def first_divergence(reference: list[int], output: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter end), or None."""
    for index, (a, b) in enumerate(zip(reference, output, strict=False)):
        if a != b:
            return index
    return None if len(reference) == len(output) else min(len(reference), len(output))


def exact_match(records: Records, arm: str, reference: str) -> float | None:
    """Fraction of (case, repeat) pairs whose ``arm`` output_ids equal ``reference``'s (None: no pairs)."""
    pairs = output_pairs(records, arm, reference)
    if not pairs:
        return None
    return sum(ref == out for _, _, ref, out in pairs) / len(pairs)


def greedy_exact_match(records: Records, arm: str = "spec", reference: str = BASELINE) -> float | None:
    """Fraction of (case, repeat) pairs whose spec output equals the baseline's (None: no pairs)."""
    return exact_match(records, arm, reference)


def _group_json(group: GroupStats) -> dict[str, Any]:
    """A task-type or length group as summary.json holds it: its arms leave out ``reference_arm``
    (the run's arms say it)."""
    out = dataclasses.asdict(group)
    for stats in out["arms"].values():
        del stats["reference_arm"]
    return out


def _bucket_label(low: int, high: int | None) -> str:
    return f"{low}-{high}" if high else f">{low - 1}"


def _bucketed(records: Records, name: str, buckets, arm_names: list[str]) -> dict[str, dict[str, Any]]:
    """Group stats per length bucket of the record field ``name`` (only buckets with records)."""
    out = {}
    for low, high in buckets:
        inside = [r for r in records if (getattr(r, name) or 0) >= low and (high is None or getattr(r, name) <= high)]
        if inside:
            out[_bucket_label(low, high)] = _group_json(group_stats(inside, arm_names))
    return out


def _grouped(records: Records, key: Callable[[RequestRecord], str], arm_names: list[str]) -> dict[str, dict[str, Any]]:
    groups: dict[str, Records] = defaultdict(list)
    for record in records:
        groups[key(record)].append(record)
    return {name: _group_json(group_stats(group, arm_names)) for name, group in sorted(groups.items())}


def _baseline_repeats(records: Records) -> tuple[list[float], float | None]:
    """Baseline net throughput per repeat and its spread (max - min) / median (None: < 2 repeats)."""
    by_repeat: dict[int, Records] = defaultdict(list)
    for record in records:
        if record.arm == BASELINE:
            by_repeat[record.repeat_idx].append(record)
    values = [arm_stats(group).net_throughput for _, group in sorted(by_repeat.items())]
    values = [v for v in values if v is not None]
    spread = (max(values) - min(values)) / float(np.median(values)) if len(values) >= 2 else None
    return values, spread


def summarize(
    records: Records,
    greedy: bool,
    complete: bool = True,
    arms: dict[str, dict[str, Any]] | None = None,
    primary: str | None = "spec",
) -> dict[str, Any]:
    """The summary.json payload (without cost model and run conditions, which the runner adds): the
    JSON form of :class:`~spectoolkit.metrics.summary_schema.Summary`, ``schema_version`` first.

    ``arms`` maps arm name -> {"reference": target-alone arm with the same target or None, ...} in
    run order; by default the arms found in the records, "spec" referring to "baseline".
    """
    ok = [r for r in records if not r.error]
    arms = arms or {name: {"reference": None if name == BASELINE else BASELINE} for name in _by_arm(records)}
    names = list(arms)
    overall = group_stats(ok, names)
    for name, stats in overall.arms.items():
        stats.reference_arm = arms[name].get("reference")
    drafting = {name: info["reference"] for name, info in arms.items() if info.get("reference")}
    exact = {name: exact_match(ok, name, ref) for name, ref in drafting.items()} if greedy else {}
    baseline_ok = [r for r in ok if r.arm == BASELINE]
    tasks = defaultdict(int)
    for record in baseline_ok:
        tasks[record.task_type] += 1
    repeat_throughput, spread = _baseline_repeats(ok)
    overall_json = dataclasses.asdict(overall)
    return {
        "schema_version": SUMMARY_SCHEMA_VERSION,
        "complete": complete,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_reasons": sorted({r.error for r in records if r.error})[:20],
        "primary_arm": primary if primary in arms else None,
        "speedup": overall.speedups.get(primary) if primary else None,
        "speedups": overall_json["speedups"],
        "greedy_exact_match": exact.get(primary) if greedy and primary else None,
        "exact_match": exact,
        "arms": overall_json["arms"],
        "by_task_type": _grouped(ok, lambda r: r.task_type, names),
        "task_share": {task: count / len(baseline_ok) for task, count in sorted(tasks.items())},
        "by_input_len": _bucketed(ok, "input_len", INPUT_BUCKETS, names),
        "by_output_len": _bucketed(ok, "output_len", OUTPUT_BUCKETS, names),
        "baseline_repeat_throughput": repeat_throughput,
        "baseline_spread": spread,
        "k_distribution": k_distributions(ok, drafting),
        "trees": tree_stats(ok, drafting),
    }


def cost_models(
    records: Records, arms: dict[str, dict[str, Any]], verify_costs: dict[str, dict[int, float]]
) -> dict[str, Any]:
    """The cost model (DESIGN §1) of every drafting arm, fed by its records and its reference's.

    ``arms`` maps arm name -> {"reference", "gamma", "policy" (default "fixed")}. In a gamma sweep (fixed
    arms sharing a reference) each fixed arm's recommended_gamma covers the sweep's measured range
    (:func:`~spectoolkit.metrics.gamma_validation.widen_recommendations`).
    """
    ok = _by_arm([r for r in records if not r.error])
    out = {}
    for name, info in arms.items():
        if info.get("reference") and info.get("gamma"):
            result = cost_model_for_arm(ok.get(name, []), ok.get(info["reference"], []), verify_costs.get(name),
                                        info["gamma"], info.get("policy", FIXED))  # fmt: skip
            if result is not None:
                out[name] = {**result, "recommended_source": name if result["recommended_gamma"] is not None else None}
    widen_recommendations(out, arms)
    return out
