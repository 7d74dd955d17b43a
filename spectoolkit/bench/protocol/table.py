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


def _rows(label: str, group: dict[str, Any]) -> list[list[str]]:
    return [_row(label, arm, stats, group["speedups"].get(arm)) for arm, stats in group["arms"].items()]


def _gamma_text(model: dict[str, Any]) -> str:
    """The recommended γ (measured range only) and, labelled, the best extrapolated γ beyond it."""
    if model.get("policy") not in (None, "fixed"):
        return f"recommended gamma n/a ({model['policy']} policy: k varies per round)"
    top = model.get("measured_gamma_max")
    text = f"recommended gamma {model.get('recommended_gamma')}" + (f" (of 1-{top})" if top is not None else "")
    if model.get("extrapolated_gamma") is not None:
        text += (f" | beyond: gamma {model['extrapolated_gamma']} {_fmt(model.get('extrapolated_speedup'), '.2f')}x"
                 " (extrapolation: predicted, not measured)")  # fmt: skip
    return text


def _cost_line(summary: dict[str, Any]) -> str | None:
    model = (summary.get("cost_model") or {}).get(summary.get("primary_arm") or "")
    if not model:
        return None
    return (
        f"cost model ({summary['primary_arm']}): predicted {_fmt(model['predicted_speedup'], '.2f')}x vs measured "
        f"{_fmt(model['measured_speedup'], '.2f')}x | break-even alpha {_fmt(model['break_even_alpha'], '.2f')}"
        f" | {_gamma_text(model)}"
    )


def format_summary(summary: dict[str, Any]) -> str:
    """Overall rows per arm, then per task type; then exactness, cost model, errors and conditions."""
    rows = _rows("", summary)
    for task, group in summary["by_task_type"].items():
        rows += _rows(f"{task}/", group)
    widths = [max(len(col), *(len(r[i]) for r in rows)) for i, col in enumerate(_COLUMNS)] if rows else []
    lines = ["  ".join(col.rjust(w) for col, w in zip(_COLUMNS, widths, strict=True))] if rows else []
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    exact = summary.get("exact_match") or {}
    exact_text = (
        ", ".join(f"{arm} {_fmt(value, '.1%')}" for arm, value in exact.items()) or "n/a (sampling, or no drafting arm)"
    )
    lines.append(f"greedy exact match: {exact_text} | errors: {summary['errors']} | complete: {summary['complete']}")
    if cost := _cost_line(summary):
        lines.append(cost)
    cond = summary.get("conditions", {})
    if cond:
        draft = cond["draft"]
        lines.append(
            f"target {cond['target']['precision']} | draft {draft['name']} | gamma {cond['gamma']} | "
            f"temperature {cond['sampling']['temperature']} | {cond['hardware']['device']} "
            f"({cond['hardware']['cpu']}, {cond['hardware']['torch_threads']} threads) | batch 1"
        )
    return "\n".join(lines)
