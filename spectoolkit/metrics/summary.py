"""Aggregate per-request records into the run summary (DESIGN §3 definitions).

Conventions, over all successful records of an arm (never means of per-request means):
- acceptance_rate = accepted draft tokens / drafted tokens
- tokens_per_verify (E) = output tokens / target forwards, the prefill counted as one forward,
  so the baseline is exactly 1.0
- rollback_rate = rounds with >= 1 rejected draft / rounds; proposal_coverage = rounds with >= 1
  proposed token / rounds
- net_throughput = output tokens / total wall time; speedup = spec / baseline net throughput
- latency and TTFT quantiles are request-level (numpy linear interpolation over all records)
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

ARMS = ("baseline", "spec")


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def quantiles(values: list[float], qs: tuple[int, ...] = (50, 95, 99)) -> dict[str, float | None]:
    """Request-level quantiles ``p50``/``p95``/``p99`` of ``values`` (None when empty)."""
    if not values:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": float(np.percentile(values, q)) for q in qs}


def arm_stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Statistics of one arm's successful records."""
    total = lambda key: sum(r[key] or 0 for r in records)  # noqa: E731
    output_tokens = total("output_len")
    rounds = total("verify_rounds")
    return {
        "requests": len(records),
        "output_tokens": output_tokens,
        "drafted_tokens": total("drafted_tokens"),
        "accepted_tokens": total("accepted_tokens"),
        "acceptance_rate": _ratio(total("accepted_tokens"), total("drafted_tokens")),
        "tokens_per_verify": _ratio(output_tokens, rounds + len(records)),
        "rollback_rate": _ratio(total("rollback_count"), rounds),
        "proposal_coverage": _ratio(total("proposed_rounds"), rounds),
        "net_throughput": _ratio(output_tokens, total("total_time")),
        "total_time": total("total_time"),
        "draft_time": total("draft_time"),
        "verify_time": total("verify_time"),
        "ttft": quantiles([r["ttft"] for r in records]),
        "latency": quantiles([r["total_time"] for r in records]),
    }


def _group_stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    by_arm = defaultdict(list)
    for record in records:
        by_arm[record["arm"]].append(record)
    stats = {arm: arm_stats(by_arm[arm]) for arm in ARMS if by_arm[arm]}
    if "baseline" in stats and "spec" in stats:
        base, spec = stats["baseline"]["net_throughput"], stats["spec"]["net_throughput"]
        stats["speedup"] = _ratio(spec, base) if spec is not None else None
    return stats


def greedy_exact_match(records: list[dict[str, Any]]) -> float | None:
    """Fraction of (case, repeat) pairs whose spec output_ids equal the baseline's (None: no pairs)."""
    outputs: dict[tuple[str, int], dict[str, list[int]]] = defaultdict(dict)
    for record in records:
        outputs[(record["case_id"], record["repeat_idx"])][record["arm"]] = record["output_ids"]
    pairs = [arms for arms in outputs.values() if set(ARMS) <= set(arms)]
    if not pairs:
        return None
    return sum(arms["baseline"] == arms["spec"] for arms in pairs) / len(pairs)


def summarize(records: list[dict[str, Any]], greedy: bool, complete: bool = True) -> dict[str, Any]:
    """The summary.json payload (without run conditions, which the runner adds)."""
    ok = [r for r in records if not r.get("error")]
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in ok:
        by_task[record["task_type"]].append(record)
    overall = _group_stats(ok)
    return {
        "complete": complete,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_reasons": sorted({r["error"] for r in records if r.get("error")})[:20],
        "speedup": overall.pop("speedup", None),
        "greedy_exact_match": greedy_exact_match(ok) if greedy else None,
        "arms": overall,
        "by_task_type": {task: _group_stats(group) for task, group in sorted(by_task.items())},
    }
