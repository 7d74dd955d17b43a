"""PNG plots of a serving run (issue 15 item 7, DESIGN §6): the load curves, matplotlib Agg as ``report.plots``.

Concurrency levels (closed loop) go on a log2 x axis: throughput per arm with its knee and saturation
marked, speedup with the 1.0 line and the crossover marked, TTFT and TPOT P99 (with the SLOs when
given). Open-loop levels get their own plot: throughput vs offered rate. Marks follow the definitions
of :mod:`spectoolkit.metrics.load_curves`. Each function returns the PNG path, or None without data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spectoolkit.bench.report.plots import plot_k_distribution, plt, save_png
from spectoolkit.metrics.load_curves import RATE, ServingSummary, curve_marks, points
from spectoolkit.metrics.summary_schema import Summary
from spectoolkit.metrics.tolerant import num


def _log2_axis(ax: Any, levels: list[float]) -> None:
    """A log2 x axis ticked at the measured concurrency levels."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [f"{x:g}" for x in levels])
    ax.minorticks_off()


def _mark(ax: Any, curve: list[tuple[float, float]], level: float | None, text: str, style: str, color: Any) -> None:
    """Mark the curve's point at ``level`` (when there is one) with ``style`` and a label."""
    y = dict(curve).get(level) if level is not None else None
    if y is None:
        return
    ax.plot([level], [y], style, color=color, markersize=11, markerfacecolor="none", markeredgewidth=2)
    ax.annotate(text, (level, y), textcoords="offset points", xytext=(6, -12), fontsize=8, color=color)


def _curves(serving: ServingSummary, arms, metric: str) -> dict[str, list[tuple[float, float]]]:
    """Each arm's (concurrency, ``metric``) points, arms without any left out."""
    curves = {arm: points(*serving.curve(arm, metric)) for arm in arms}
    return {arm: curve for arm, curve in curves.items() if curve}


def plot_throughput_vs_concurrency(serving: ServingSummary, plots_dir: Path) -> Path | None:
    """Output tok/s vs concurrency per arm, knee (▽) and saturation (□) marked."""
    curves = _curves(serving, serving.arms, "output_throughput")
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for arm, curve in curves.items():
        (line,) = ax.plot([x for x, _ in curve], [y for _, y in curve], "-o", label=arm)
        marks = curve_marks(serving, arm)
        _mark(ax, curve, marks.knee, f"knee {arm}", "v", line.get_color())
        _mark(ax, curve, marks.saturation, f"saturation {arm}", "s", line.get_color())
    _log2_axis(ax, sorted({x for curve in curves.values() for x, _ in curve}))
    ax.set(xlabel="concurrency (clients)", ylabel="output tokens/s", title="Throughput vs concurrency")
    ax.legend(fontsize=8)
    return save_png(fig, plots_dir / "throughput_vs_concurrency.png")


def plot_speedup_vs_concurrency(serving: ServingSummary, plots_dir: Path) -> Path | None:
    """Speedup vs concurrency per drafting arm, the 1.0 line, and the crossover (speculation stops paying)."""
    curves = _curves(serving, serving.drafting_arms, "speedup")
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for arm, curve in curves.items():
        (line,) = ax.plot([x for x, _ in curve], [y for _, y in curve], "-o", label=arm)
        cross = curve_marks(serving, arm).crossover
        if cross is not None:
            ax.axvline(cross, color=line.get_color(), linestyle=":", linewidth=1.2)
            _mark(ax, curve, cross, f"stops paying ({arm})", "x", line.get_color())
    ax.axhline(1.0, color="grey", linewidth=1)
    _log2_axis(ax, sorted({x for curve in curves.values() for x, _ in curve}))
    ax.set(xlabel="concurrency (clients)", ylabel="speedup vs baseline (×)", title="Speedup vs concurrency")
    ax.legend(fontsize=8)
    return save_png(fig, plots_dir / "speedup_vs_concurrency.png")


def plot_latency_vs_concurrency(serving: ServingSummary, plots_dir: Path) -> Path | None:
    """TTFT P99 and TPOT P99 (ms) vs concurrency per arm, the SLO as a dashed line when given."""
    panels = (("ttft_p99", "TTFT P99 (ms)", "slo_ttft_ms"), ("tpot_p99", "TPOT P99 (ms)", "slo_tpot_ms"))
    curves = {metric: {arm: points(*serving.curve(arm, metric)) for arm in serving.arms} for metric, _, _ in panels}
    if not any(curve for by_arm in curves.values() for curve in by_arm.values()):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (metric, label, slo_key) in zip(axes, panels, strict=True):
        for arm, curve in curves[metric].items():
            if curve:
                ax.plot([x for x, _ in curve], [y * 1e3 for _, y in curve], "-o", label=arm)
        slo = num(serving.serve.get(slo_key))
        if slo is not None:
            ax.axhline(slo, color="red", linestyle="--", linewidth=1, label=f"serve.{slo_key}")
        levels = sorted({x for curve in curves[metric].values() for x, _ in curve})
        if levels:
            _log2_axis(ax, levels)
            ax.legend(fontsize=8)
        ax.set(xlabel="concurrency (clients)", ylabel=label, title=f"{label.split(' (')[0]} vs concurrency")
        ax.set_ylim(bottom=0)
    return save_png(fig, plots_dir / "latency_vs_concurrency.png")


def plot_throughput_vs_rate(serving: ServingSummary, plots_dir: Path) -> Path | None:
    """Open loop: output tok/s and served requests/s vs offered rate per arm (served = offered: the diagonal)."""
    if not serving.of_kind(RATE):
        return None
    fig, (tokens_ax, requests_ax) = plt.subplots(1, 2, figsize=(10, 4))
    drawn = False
    for arm in serving.arms:
        tokens = points(*serving.curve(arm, "output_throughput", RATE))
        served = points(*serving.curve(arm, "request_throughput", RATE))
        if tokens:
            tokens_ax.plot([x for x, _ in tokens], [y for _, y in tokens], "-o", label=arm)
        if served:
            requests_ax.plot([x for x, _ in served], [y for _, y in served], "-o", label=arm)
        drawn = drawn or bool(tokens or served)
    if not drawn:
        plt.close(fig)
        return None
    rates = [float(level.value) for level in serving.of_kind(RATE) if level.value is not None]
    requests_ax.plot(rates, rates, color="grey", linestyle="--", linewidth=1, label="served = offered")
    tokens_ax.set(xlabel="offered rate (requests/s)", ylabel="output tokens/s", title="Throughput vs offered rate")
    requests_ax.set(xlabel="offered rate (requests/s)", ylabel="served requests/s", title="Served vs offered rate")
    tokens_ax.legend(fontsize=8)
    requests_ax.legend(fontsize=8)
    return save_png(fig, plots_dir / "throughput_vs_rate.png")


def serving_plots(serving: ServingSummary, plots_dir: Path, summary: Summary | None = None) -> dict[str, Path]:
    """Every serving plot that has data, by name (the report links them by these names); with ``summary``,
    also the draft length k per round of each drafting arm per load level."""
    by_level = plot_k_distribution(summary, plots_dir, "by_load_level", serving.label_of) if summary else None
    plots = {
        "throughput_vs_concurrency": plot_throughput_vs_concurrency(serving, plots_dir),
        "speedup_vs_concurrency": plot_speedup_vs_concurrency(serving, plots_dir),
        "latency_vs_concurrency": plot_latency_vs_concurrency(serving, plots_dir),
        "throughput_vs_rate": plot_throughput_vs_rate(serving, plots_dir),
        "k_distribution": by_level,
    }
    return {name: path for name, path in plots.items() if path is not None}


def plot_sweep_curves(curves: dict[str, ServingSummary], path: Path) -> Path | None:
    """A sweep's serving jobs: throughput (every arm) and speedup (drafting arms) vs concurrency, one line
    per (job label, arm); None when no job measured a concurrency level."""
    lines = {
        (label, arm, metric): points(*serving.curve(arm, metric))
        for label, serving in curves.items()
        for arm in serving.arms
        for metric in ("output_throughput", "speedup")
        if metric == "output_throughput" or arm in serving.drafting_arms
    }
    lines = {key: curve for key, curve in lines.items() if curve}
    if not lines:
        return None
    fig, (tput_ax, speed_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    for (label, arm, metric), curve in lines.items():
        ax = tput_ax if metric == "output_throughput" else speed_ax
        ax.plot([x for x, _ in curve], [y for _, y in curve], "-o", label=f"{label}: {arm}")
    speed_ax.axhline(1.0, color="grey", linewidth=1)
    panels = ((tput_ax, "output_throughput", "output tokens/s", "Throughput vs concurrency"),
              (speed_ax, "speedup", "speedup vs same-run baseline (×)", "Speedup vs concurrency"))  # fmt: skip
    for ax, metric, ylabel, title in panels:
        levels = sorted({x for (_, _, m), curve in lines.items() if m == metric for x, _ in curve})
        if levels:
            _log2_axis(ax, levels)
            ax.legend(fontsize=7)
        ax.set(xlabel="concurrency (clients)", ylabel=ylabel, title=title)
    return save_png(fig, path)
