"""The sweep report (``sweep_report.md``) and ``sweep_summary.csv`` of a sweep directory.

One row per job (``sweep.table``): its swept axes, status and headline metrics, linked to the
job's own report; then plots (``sweep.plots``): speedup vs γ per draft, α by task type, and
quality vs speed; then, for jobs of a serving run (issue 15), their throughput and speedup vs
concurrency (``report.serving``). Also ``report_path_for``: the report that fits a directory (a run's, or a sweep's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spectoolkit.bench.report.load import atomic_write, fmt, md_table, speed
from spectoolkit.bench.report.render import REPORT_NAME, write_report
from spectoolkit.bench.report.serving import sweep_serving_section
from spectoolkit.bench.report.serving_plots import plot_sweep_curves
from spectoolkit.bench.sweep import plots as sweep_plots
from spectoolkit.bench.sweep.table import SWEEP_CSV_NAME, SWEEP_DEPTH, axis_key, sweep_rows, write_csv
from spectoolkit.errors import SpecToolkitError
from spectoolkit.metrics.summary_schema import Summary

SWEEP_REPORT_NAME = "sweep_report.md"
METRIC_HEADERS = ["arm", "speedup", "predicted", "α", "E", "P95 s", "exact match", "exactness", "quant top-1"]


def _summaries(sweep_dir: Path, rows: list[dict[str, Any]]) -> dict[str, Summary]:
    """Readable summaries by job; each job's own report.md is written when missing."""
    found = {row["job"]: row["_summary"] for row in rows if row["_summary"] is not None}
    for job in found:
        if not (sweep_dir / job / REPORT_NAME).is_file():
            write_report(sweep_dir / job)
    return found


def varying(axes: list[str], rows: list[dict[str, Any]]) -> list[str]:
    """The swept axes whose value differs between jobs (all of them for a single job)."""
    if len(rows) < 2:
        return axes
    return [axis for axis in axes if len({str(row.get(axis)) for row in rows}) > 1]


def _common(axes: list[str], shown: list[str], rows: list[dict[str, Any]]) -> str:
    """``key=value`` of every override all jobs share (not a column of the table)."""
    return ", ".join(f"`{axis}={rows[0].get(axis)}`" for axis in axes if axis not in shown)


def _label(row: dict[str, Any], axes: list[str]) -> str:
    """The job's overrides of the shown axes, or its directory."""
    return " ".join(o for o in row["overrides"].split() if axis_key(o) in axes) or row["job"]


def _serving_lines(sweep_dir: Path, rows: list[dict[str, Any]], axes: list[str]) -> list[str]:
    """The serving jobs' load curves; [] without one (a classic sweep's report is unchanged)."""
    curves = {}
    for row in rows:
        if row.get("_serving") is not None:
            label = _label(row, axes)
            curves[label if label not in curves else row["job"]] = row["_serving"]
    if not curves:
        return []
    return sweep_serving_section(curves, plot_sweep_curves(curves, sweep_dir / "plots" / "serving_curves.png"))


def _table_row(row: dict[str, Any], axes: list[str], has_summary: bool) -> list[Any]:
    label = _label(row, axes)
    name = f"[{label}]({row['job']}/{REPORT_NAME})" if has_summary else label
    return [name, row["status"] or "n/a", *(row.get(axis) for axis in axes), row["arm"] or "n/a",
            speed(row["speedup"]), speed(row["predicted_speedup"]), fmt(row["alpha"]),
            fmt(row["tokens_per_verify"], ".2f"), fmt(row["latency_p95"]), fmt(row["exact_match"], ".1%"),
            row["exactness"] or "n/a", fmt(row["quant_top1_agreement"])]  # fmt: skip


def write_sweep_report(sweep_dir: Path) -> Path:
    """Write ``sweep_summary.csv`` and ``sweep_report.md`` (with plots) in ``sweep_dir``; returns the report."""
    sweep_dir = Path(sweep_dir)
    axes, rows = sweep_rows(sweep_dir) if sweep_dir.is_dir() else ([], [])
    if not rows:
        raise SpecToolkitError(f"no job (job.json or summary.json) in {sweep_dir} or up to {SWEEP_DEPTH} levels below")
    write_csv(sweep_dir, axes, rows)
    summaries = _summaries(sweep_dir, rows)
    plots_dir = sweep_dir / "plots"
    series = varying(axes, rows) if len(rows) > 1 else []
    figures = [
        ("speedup vs γ per draft", sweep_plots.plot_speedup_by_gamma(rows, series, plots_dir / "speedup_vs_gamma.png")),
        ("α by task type", sweep_plots.plot_alpha_by_task(
            sweep_plots.alpha_by_task(rows, summaries, series), plots_dir / "alpha_by_task.png")),
        ("quality vs speed", sweep_plots.plot_quality_vs_speed(rows, series, plots_dir / "quality_vs_speed.png")),
    ]  # fmt: skip
    counts = {status: sum(r["status"] == status for r in rows) for status in {r["status"] for r in rows}}
    status = ", ".join(f"{n} {s or 'unknown'}" for s, n in sorted(counts.items(), key=lambda kv: str(kv[0])))
    intro = (f"{len(rows)} jobs ({status}); each row: the job's primary arm vs its same-run baseline "
             f"(conditions: its report). All rows: [{SWEEP_CSV_NAME}]({SWEEP_CSV_NAME}).")  # fmt: skip
    shown = varying(axes, rows)
    headers = ["job", "status", *shown, *METRIC_HEADERS]
    table = md_table(headers, [_table_row(r, shown, r["job"] in summaries) for r in rows])
    common = _common(axes, shown, rows)
    lines = [f"# Sweep report: {sweep_dir.name}", "", intro, *([f"Every job: {common}."] if common else []), "", *table]
    lines += [f"![{title}](plots/{path.name})\n" for title, path in figures if path]
    lines += _serving_lines(sweep_dir, rows, shown)
    path = sweep_dir / SWEEP_REPORT_NAME
    atomic_write(path, "\n".join(lines).rstrip() + "\n")
    return path


def report_path_for(directory: Path) -> Path:
    """Write the report that fits ``directory`` and return its path: a run report when it holds
    summary.json, else a sweep report over the runs below it."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SpecToolkitError(f"{directory} does not exist or is not a directory")
    if (directory / "summary.json").is_file():
        return write_report(directory)
    return write_sweep_report(directory)
