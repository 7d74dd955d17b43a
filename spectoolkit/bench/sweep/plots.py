"""PNG plots of a sweep (``sweep_report.md``), drawn from the rows of ``sweep_summary.csv``.

A *series* is a combination of every swept axis except γ (e.g. ``target=int4 draft=ngram``), so
"speedup vs γ per draft" has one line per series. Quantities follow DESIGN §3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spectoolkit.bench.report.load import num
from spectoolkit.bench.report.plots import plt, save_png
from spectoolkit.metrics.summary_schema import Summary

GAMMA = "speculate.gamma"
FLOAT_PRECISIONS = ("fp32", "bf16", "fp16")


def series_label(row: dict[str, Any], axes: list[str]) -> str:
    """The row's swept values other than γ (``target=int4 draft=ngram``), or its target ← draft."""
    parts = [f"{axis.split('.')[-1] if '.' in axis else axis}={row.get(axis)}" for axis in axes if axis != GAMMA]
    if parts:
        return " ".join(parts)
    draft = row.get("draft.kind") if row.get("draft.kind") != "model" else row.get("draft.precision")
    return f"{row.get('target.precision')} ← {draft}"


def plot_speedup_by_gamma(rows: list[dict[str, Any]], axes: list[str], path: Path) -> Path | None:
    """Measured speedup vs γ, one line per series; None unless γ takes two values."""
    points = [(series_label(r, axes), num(r.get(GAMMA)), num(r.get("speedup"))) for r in rows]
    points = [(label, g, s) for label, g, s in points if g is not None and s is not None]
    if len({g for _, g, _ in points}) < 2:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in sorted({label for label, _, _ in points}):
        series = sorted((g, s) for name, g, s in points if name == label)
        ax.plot([g for g, _ in series], [s for _, s in series], "-o", label=label)
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_xticks(sorted({g for _, g, _ in points}))
    ax.set(xlabel="draft length γ", ylabel="speedup vs same-run baseline (×)", title="Speedup vs γ per draft")
    ax.legend(fontsize=7)
    return save_png(fig, path)


def alpha_by_task(
    rows: list[dict[str, Any]], summaries: dict[str, Summary], axes: list[str]
) -> dict[str, dict[str, float]]:
    """{series: {task type: α}} pooled over the series' jobs (accepted / drafted tokens of the primary arm)."""
    pooled: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        summary, arm = summaries.get(row["job"]), row.get("arm")
        for task, group in (summary.by_task_type if summary else {}).items():
            stats = group.arms.get(arm)
            drafted, accepted = (stats.drafted_tokens, stats.accepted_tokens) if stats else (None, None)
            if drafted:
                sums = pooled.setdefault(series_label(row, axes), {}).setdefault(task, [0.0, 0.0])
                sums[0], sums[1] = sums[0] + (accepted or 0), sums[1] + drafted
    return {label: {task: a / d for task, (a, d) in tasks.items()} for label, tasks in pooled.items()}


def plot_alpha_by_task(alphas: dict[str, dict[str, float]], path: Path) -> Path | None:
    """Grouped bars: α per task type, one bar per series."""
    tasks = sorted({task for values in alphas.values() for task in values})
    if not tasks:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(alphas)
    for i, (label, values) in enumerate(sorted(alphas.items())):
        ax.bar([t + i * width for t in range(len(tasks))], [values.get(task, 0) for task in tasks], width, label=label)
    ax.set_xticks([t + 0.4 - width / 2 for t in range(len(tasks))], tasks)
    ax.set(ylabel="acceptance rate α", ylim=(0, 1), title="α by task type")
    ax.legend(fontsize=7)
    return save_png(fig, path)


def quality_of(row: dict[str, Any]) -> float | None:
    """Top-1 agreement of the target with its float reference; 1 for a float target (it is one)."""
    measured = num(row.get("quant_top1_agreement"))
    if measured is not None:
        return measured
    return 1.0 if row.get("target.precision") in FLOAT_PRECISIONS else None


def plot_quality_vs_speed(rows: list[dict[str, Any]], axes: list[str], path: Path) -> Path | None:
    """Each job at (speedup, quality), one colour per series, γ written beside the point; the upper right wins."""
    points = [(series_label(r, axes), num(r.get("speedup")), quality_of(r), r.get(GAMMA)) for r in rows]
    points = [p for p in points if p[1] is not None and p[2] is not None]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in sorted({p[0] for p in points}):
        series = [p for p in points if p[0] == label]
        ax.plot([p[1] for p in series], [p[2] for p in series], "o", label=label)
        for _, speedup, quality, gamma in series:
            if gamma is not None:
                ax.annotate(f"γ={gamma}", (speedup, quality), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axvline(1.0, color="grey", linewidth=1)
    ax.set(xlabel="speedup vs same-run baseline (×)", ylabel="top-1 agreement with float reference",
           title="Quality vs speed (float target = 1; greedy outputs are exact)")  # fmt: skip
    ax.legend(fontsize=7)
    return save_png(fig, path)
