"""PNG plots of the run report (matplotlib, Agg backend: no display needed).

Each function reads the typed ``Summary`` (or the records) and returns the written PNG path, or None when
there is nothing to plot. Figures are written to a temporary sibling and renamed, then closed.
Quantities follow DESIGN §3: speedup = arm / baseline net throughput, α = accepted / drafted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from spectoolkit.bench.report.load import Records, arm_policy, drafting_arms, is_fixed  # noqa: E402
from spectoolkit.metrics.records import RequestRecord  # noqa: E402
from spectoolkit.metrics.summary_schema import TIME_PARTS, Summary  # noqa: E402

STABILITY_MIN_RECORDS = 20


def save_png(fig: Any, path: Path) -> Path:
    """Write ``fig`` atomically as PNG and close it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.tmp.png")
        fig.tight_layout()
        fig.savefig(tmp, dpi=80, format="png")
        tmp.replace(path)
    finally:
        plt.close(fig)
    return path


def _gamma_points(summary: Summary) -> list[tuple[int, float, str]]:
    """(γ, measured speedup, arm) of every fixed-γ drafting arm with both."""
    points = []
    for arm, stats in summary.arms.items():
        gamma, speedup = stats.gamma, summary.speedups.get(arm)
        if gamma and speedup is not None and is_fixed(summary, arm):
            points.append((gamma, speedup, arm))
    return sorted(points)


def predicted_curve(summary: Summary) -> list[tuple[int, float]]:
    """The cost model's predicted speedup per γ for the primary arm, sorted by γ ([] for a non-fixed policy)."""
    model = summary.cost_model.get(summary.primary_arm or "")
    return sorted(model.predicted_by_gamma.items()) if model else []


def _variable_k_arms(summary: Summary) -> list[tuple[str, float]]:
    """(arm, measured speedup) of drafting arms whose policy varies k per round."""
    return [(arm, summary.speedups[arm]) for arm in drafting_arms(summary)
            if not is_fixed(summary, arm) and summary.speedups.get(arm) is not None]  # fmt: skip


def _exact_then_extrapolated(ax: Any, curve: list[tuple[int, float]], own: int | None, label: str) -> None:
    """``curve`` (γ, speedup) solid up to γ = ``own`` (exact truncation) and dotted in the same colour beyond
    it (extrapolated); all dashed, labelled plainly, when ``own`` is unknown."""
    if not curve:
        return
    if not own:
        ax.plot([g for g, _ in curve], [s for _, s in curve], "--o", markersize=4, label=label)
        return
    exact, beyond = [(g, s) for g, s in curve if g <= own], [(g, s) for g, s in curve if g >= own]
    color = None
    if exact:
        (line,) = ax.plot([g for g, _ in exact], [s for _, s in exact], "-o", markersize=4, label=f"{label} (exact)")
        color = line.get_color()
    if len(beyond) > 1 or not exact:
        ax.plot([g for g, _ in beyond], [s for _, s in beyond], ":o", markersize=4, markerfacecolor="none",
                color=color, label=f"{label} (extrapolated, not measured)")  # fmt: skip


def plot_speedup_vs_gamma(summary: Summary, plots_dir: Path) -> Path | None:
    """Measured speedup of each fixed-γ arm at its γ, the primary arm's predicted curve (dotted where it
    extrapolates beyond the arm's γ), and each variable-k arm's speedup as a horizontal line."""
    measured, predicted, variable = _gamma_points(summary), predicted_curve(summary), _variable_k_arms(summary)
    if not measured and not predicted and not variable:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    stats = summary.arms.get(summary.primary_arm or "")
    _exact_then_extrapolated(ax, predicted, stats.gamma if stats else None, f"predicted, {summary.primary_arm}")
    for arm, speedup in variable:
        label = f"{arm} ({arm_policy(summary, arm)} policy, measured)"
        ax.axhline(speedup, linestyle="-.", linewidth=1.2, color="tab:purple", label=label)
    if measured:
        ax.plot([g for g, _, _ in measured], [s for _, s, _ in measured], "s", markersize=9, label="measured")
        for gamma, speedup, arm in measured:
            ax.annotate(arm, (gamma, speedup), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set(xlabel="draft length γ", ylabel="speedup vs baseline (×)", title="Speedup vs γ")
    ax.legend()
    return save_png(fig, plots_dir / "speedup_vs_gamma.png")


def plot_acceptance_histogram(summary: Summary, plots_dir: Path) -> Path | None:
    """Share of verify rounds that accepted K = 0..γ drafts, per drafting arm."""
    arms = summary.arms
    hists = {arm: arms[arm].acceptance_histogram for arm in drafting_arms(summary) if arm in arms}
    hists = {arm: counts for arm, counts in hists.items() if sum(map(bool, counts))}
    if not hists:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(hists)
    for i, (arm, counts) in enumerate(hists.items()):
        total = sum(counts)
        ax.bar([k + i * width for k in range(len(counts))], [c / total for c in counts], width, label=arm)
    longest = max(len(counts) for counts in hists.values())
    ax.set_xticks([k + 0.4 - width / 2 for k in range(longest)], [str(k) for k in range(longest)])
    ax.set(xlabel="accepted drafts per round K", ylabel="share of rounds", title="Acceptance length")
    ax.legend()
    return save_png(fig, plots_dir / "acceptance_histogram.png")


def plot_latency_cdf(summary: Summary, plots_dir: Path) -> Path | None:
    """Empirical CDF of request latency per arm."""
    series = {arm: sorted(stats.latencies) for arm, stats in summary.arms.items()}
    series = {arm: values for arm, values in series.items() if values}
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, values in series.items():
        ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=arm)
    ax.set(xlabel="request latency (s)", ylabel="fraction of requests", title="Latency CDF")
    ax.legend()
    return save_png(fig, plots_dir / "latency_cdf.png")


def plot_alpha_by_task(summary: Summary, plots_dir: Path) -> Path | None:
    """Acceptance rate α per task type, one bar per drafting arm."""
    tasks = summary.by_task_type
    alphas = {
        arm: [group.arms[arm].acceptance_rate if arm in group.arms else None for group in tasks.values()]
        for arm in drafting_arms(summary)
    }
    alphas = {arm: values for arm, values in alphas.items() if any(v is not None for v in values)}
    if not alphas:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(alphas)
    for i, (arm, values) in enumerate(alphas.items()):
        ax.bar([t + i * width for t in range(len(values))], [v or 0 for v in values], width, label=arm)
    ax.set_xticks([t + 0.4 - width / 2 for t in range(len(tasks))], list(tasks))
    ax.set(ylabel="acceptance rate α", ylim=(0, 1), title="α by task type")
    ax.legend()
    return save_png(fig, plots_dir / "alpha_by_task.png")


def plot_time_split(summary: Summary, plots_dir: Path) -> Path | None:
    """Stacked prefill / draft / verify / overhead seconds per arm."""
    splits = {arm: stats.time_split for arm, stats in summary.arms.items()}
    splits = {arm: [s.get(p) or 0 for p in TIME_PARTS] for arm, s in splits.items() if s is not None}
    splits = {arm: parts for arm, parts in splits.items() if sum(parts) > 0}
    if not splits:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    bottoms = [0.0] * len(splits)
    for i, part in enumerate(TIME_PARTS):
        heights = [parts[i] for parts in splits.values()]
        ax.bar(list(splits), heights, bottom=bottoms, label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set(ylabel="seconds (sum over requests)", title="Time split")
    ax.legend(fontsize=8, loc="upper right", framealpha=0.7)
    return save_png(fig, plots_dir / "time_split.png")


def _rolling_ratio(numerators: list[float], denominators: list[float], window: int) -> list[float]:
    """sum(num) / sum(den) over the last ``window`` items at each index (NaN when den is 0)."""
    out = []
    for i in range(len(numerators)):
        lo = max(0, i - window + 1)
        den = sum(denominators[lo : i + 1])
        out.append(sum(numerators[lo : i + 1]) / den if den else float("nan"))
    return out


def plot_stability(records: Records, plots_dir: Path) -> Path | None:
    """Rolling α, rolling rollback rate and host RSS over the run, for drafting arms with ≥ 20 records."""
    by_arm: dict[str, list[RequestRecord]] = {}
    for record in records:
        if not record.error and (record.draft_len or 0) > 0:
            by_arm.setdefault(str(record.arm), []).append(record)
    by_arm = {arm: rows for arm, rows in by_arm.items() if len(rows) >= STABILITY_MIN_RECORDS}
    if not by_arm:
        return None
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    use_time = all(r.start_offset is not None for rows in by_arm.values() for r in rows)
    for arm, rows in by_arm.items():
        xs = [r.start_offset for r in rows] if use_time else list(range(len(rows)))
        window = max(5, len(rows) // 10)
        accepted, drafted, rollbacks, rounds = (
            [float(getattr(r, name) or 0) for r in rows]
            for name in ("accepted_tokens", "drafted_tokens", "rollback_count", "verify_rounds")
        )
        axes[0].plot(xs, _rolling_ratio(accepted, drafted, window), label=arm)
        axes[1].plot(xs, _rolling_ratio(rollbacks, rounds, window), label=arm)
        axes[2].plot(xs, [(r.host_rss or float("nan")) / 2**20 for r in rows], label=arm)
    axes[0].set(ylabel="rolling α", title="Stability over the run")
    axes[1].set(ylabel="rolling rollback rate")
    axes[2].set(ylabel="host RSS (MiB)", xlabel="seconds since measurement start" if use_time else "request index")
    axes[0].legend()
    return save_png(fig, plots_dir / "stability.png")


def plot_gamma_validation(summary: Summary, plots_dir: Path) -> Path | None:
    """A gamma sweep: the speedup each fixed arm's rounds predict at every measured γ' (solid up to its own
    γ: exact; dotted beyond: extrapolated) beside the measured speedups."""
    checks = [c for c in summary.gamma_validation if None not in (c.source_arm, c.gamma, c.predicted_speedup)]
    if not checks:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for source in dict.fromkeys(c.source_arm for c in checks):
        mine = [c for c in checks if c.source_arm == source]
        curve = sorted((c.gamma, c.predicted_speedup) for c in mine)
        _exact_then_extrapolated(ax, curve, mine[0].source_gamma, f"from {source}")
    measured = sorted({(c.gamma, c.measured_speedup) for c in checks if c.measured_speedup is not None})
    ax.plot([g for g, _ in measured], [s for _, s in measured], "ks", markersize=9, label="measured")
    ax.set_xticks(sorted({c.gamma for c in checks}))
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set(xlabel="draft length γ'", ylabel="speedup vs baseline (×)",
           title="Cost model vs the sweep (dotted: extrapolated)")  # fmt: skip
    ax.legend(fontsize=8)
    return save_png(fig, plots_dir / "gamma_validation.png")


def plot_k_distribution(summary: Summary, plots_dir: Path, by: str = "by_task_type", label=str) -> Path | None:
    """Share of verify rounds at each draft length k, one stacked bar per (drafting arm, group): ``by`` is
    "by_task_type" or "by_load_level" (an arm without groups gets one bar over all its rounds);
    ``label`` turns a group key into its axis text."""
    bars: dict[str, list[int]] = {}
    for arm, dist in summary.k_distribution.items():
        groups = getattr(dist, by) or {"all": dist.overall}
        for key, group in groups.items():
            if sum(group.counts):
                bars[f"{arm}\n{label(key) if key != 'all' else 'all'}"] = group.counts
    if not bars:
        return None
    top = max(len(counts) for counts in bars.values())
    colors = plt.get_cmap("viridis")([k / max(top - 1, 1) for k in range(top)])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(bars) + 2), 4.2))
    bottoms = [0.0] * len(bars)
    for k in range(top):
        shares = [counts[k] / sum(counts) if k < len(counts) else 0.0 for counts in bars.values()]
        ax.bar(list(bars), shares, bottom=bottoms, color=colors[k], label=f"k={k}")
        bottoms = [b + h for b, h in zip(bottoms, shares, strict=True)]
    ax.set(ylabel="share of verify rounds", ylim=(0, 1), title="Draft length k chosen per round")
    ax.tick_params(axis="x", labelsize=7, labelrotation=90 if len(bars) > 8 else 0)
    ax.legend(fontsize=7, ncol=max(1, top // 9 + 1), loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_png(fig, plots_dir / "k_distribution.png")


def run_plots(summary: Summary, records: Records, plots_dir: Path) -> dict[str, Path]:
    """Every run plot that has data, by name."""
    plots = {
        "speedup_vs_gamma": plot_speedup_vs_gamma(summary, plots_dir),
        "gamma_validation": plot_gamma_validation(summary, plots_dir),
        "k_distribution": plot_k_distribution(summary, plots_dir),
        "acceptance_histogram": plot_acceptance_histogram(summary, plots_dir),
        "latency_cdf": plot_latency_cdf(summary, plots_dir),
        "alpha_by_task": plot_alpha_by_task(summary, plots_dir),
        "time_split": plot_time_split(summary, plots_dir),
        "stability": plot_stability(records, plots_dir),
    }
    return {name: path for name, path in plots.items() if path is not None}
