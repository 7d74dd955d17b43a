"""Plain-text summary table printed at the end of a run (the full data is in summary.json)."""

from __future__ import annotations

from typing import Any

_COLUMNS = ("arm", "reqs", "tok/s", "speedup", "accept", "tok/verify", "rollback", "ttft p50", "lat p50",
            "lat p95", "lat p99")  # fmt: skip


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _row(label: str, arm: str, stats: dict[str, Any], speedup: float | None) -> list[str]:
    return [
        f"{label}{arm}", str(stats["requests"]), _fmt(stats["net_throughput"], ".2f"),
        _fmt(speedup, ".2f") + ("x" if speedup is not None else ""), _fmt(stats["acceptance_rate"]),
        _fmt(stats["tokens_per_verify"], ".2f"), _fmt(stats["rollback_rate"]),
        _fmt(stats["ttft"]["p50"]), _fmt(stats["latency"]["p50"]), _fmt(stats["latency"]["p95"]),
        _fmt(stats["latency"]["p99"]),
    ]  # fmt: skip


def _rows(label: str, group: dict[str, Any], speedup: float | None) -> list[list[str]]:
    return [_row(label, arm, group[arm], speedup if arm == "spec" else None) for arm in ("baseline", "spec")
            if arm in group]  # fmt: skip


def format_summary(summary: dict[str, Any]) -> str:
    """Overall rows per arm, then per task type; then exactness, errors and conditions."""
    rows = _rows("", summary["arms"], summary["speedup"])
    for task, group in summary["by_task_type"].items():
        rows += _rows(f"{task}/", group, group.get("speedup"))
    widths = [max(len(col), *(len(r[i]) for r in rows)) for i, col in enumerate(_COLUMNS)]
    lines = ["  ".join(col.rjust(w) for col, w in zip(_COLUMNS, widths, strict=True))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    cond = summary.get("conditions", {})
    exact = summary.get("greedy_exact_match")
    lines.append(
        f"greedy exact match: {_fmt(exact, '.1%') if exact is not None else 'n/a (sampling or no spec arm)'}"
        f" | errors: {summary['errors']} | complete: {summary['complete']}"
    )
    if cond:
        draft = cond["draft"]
        lines.append(
            f"target {cond['target']['precision']} | draft {draft['name']} | gamma {cond['gamma']} | "
            f"temperature {cond['sampling']['temperature']} | {cond['hardware']['device']} "
            f"({cond['hardware']['cpu']}, {cond['hardware']['torch_threads']} threads) | batch 1"
        )
    return "\n".join(lines)
