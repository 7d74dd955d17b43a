"""The sweep report (``sweep_report.md``): one row per run below a sweep directory, plus speedup vs γ.

Also ``report_path_for``: the report that fits a directory (a run's own, or the sweep's).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from spectoolkit.bench import plots as plotting
from spectoolkit.bench.report import REPORT_NAME, _first, _speed, _split, write_report
from spectoolkit.bench.summary_access import (
    BASELINE,
    Summary,
    arms_of,
    as_dict,
    atomic_write,
    dig,
    fmt,
    load_summary,
    md_table,
    num,
    primary_arm,
)
from spectoolkit.errors import SpecToolkitError

SWEEP_REPORT_NAME = "sweep_report.md"
SWEEP_DEPTH = 3  # run directories up to this many levels below a sweep directory
SWEEP_HEADERS = "run|arm|target precision|draft|γ|kv|speedup|α|E|predicted speedup|P95 s|P99 s|exact match|complete"


# ---- sweep ---------------------------------------------------------------------------------------


def _natural_key(path: Path) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.as_posix())]


def find_runs(sweep_dir: Path) -> list[Path]:
    """Run directories (with summary.json) 1..SWEEP_DEPTH levels below ``sweep_dir``, in natural order."""
    found = {
        p.parent
        for depth in range(1, SWEEP_DEPTH + 1)
        for p in Path(sweep_dir).glob("*/" * depth + "summary.json")
        if not any(part.startswith(".") for part in p.relative_to(sweep_dir).parts)
    }
    return sorted(found, key=lambda p: _natural_key(p.relative_to(sweep_dir)))


def run_label(run_dir: Path, sweep_dir: Path) -> str:
    """The run's Hydra overrides (``.hydra/overrides.yaml``) or its directory relative to the sweep."""
    path = run_dir / ".hydra" / "overrides.yaml"
    try:
        overrides = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        overrides = None
    if isinstance(overrides, list) and overrides:
        return " ".join(map(str, overrides))
    return run_dir.relative_to(sweep_dir).as_posix()


def _sweep_row(summary: Summary, label: str, link: str) -> list[Any]:
    arm = primary_arm(summary) or BASELINE
    stats, cond = arms_of(summary).get(arm, {}), as_dict(summary.get("conditions"))
    kv = f"{_first(dig(cond, 'kv', 'target'), 'n/a')}/{_first(dig(cond, 'kv', 'draft'), 'n/a')}"
    exact = dig(summary, "exact_match", arm) if arm != BASELINE else None
    return [f"[{label}]({link})", arm, _first(stats.get("target_precision"), dig(cond, "target", "precision")),
            _first(stats.get("draft"), dig(cond, "draft", "name")), _first(stats.get("gamma"), dig(cond, "gamma")),
            kv, _speed(summary.get("speedup")), fmt(stats.get("acceptance_rate")),
            fmt(stats.get("tokens_per_verify"), ".2f"),
            _speed(dig(summary, "cost_model", arm, "predicted_speedup")),
            fmt(dig(stats, "latency", "p95")), fmt(dig(stats, "latency", "p99")), fmt(exact, ".1%"),
            summary.get("complete")]  # fmt: skip


def write_sweep_report(sweep_dir: Path) -> Path:
    """Write ``sweep_dir/sweep_report.md``: one row per run (and each run's own report.md if missing)."""
    sweep_dir = Path(sweep_dir)
    runs = find_runs(sweep_dir) if sweep_dir.is_dir() else []
    if not runs:
        raise SpecToolkitError(f"no summary.json in {sweep_dir} or up to {SWEEP_DEPTH} levels below it")
    rows, points = [], []
    for run_dir in runs:
        label, rel = run_label(run_dir, sweep_dir), run_dir.relative_to(sweep_dir).as_posix()
        try:
            summary = load_summary(run_dir)
        except SpecToolkitError as exc:
            rows.append([label, *["n/a"] * 12, f"unreadable: {exc}"])
            continue
        if not (run_dir / REPORT_NAME).is_file():
            write_report(run_dir)
        rows.append(_sweep_row(summary, label, f"{rel}/{REPORT_NAME}"))
        stats = arms_of(summary).get(primary_arm(summary) or "", {})
        series = f"{stats.get('target_precision')} ← {stats.get('draft')}"
        points.append((series, num(stats.get("gamma")), num(summary.get("speedup"))))
    headers = _split(SWEEP_HEADERS)
    plot = plotting.plot_sweep_speedup_vs_gamma(points, sweep_dir / "plots" / "sweep_speedup_vs_gamma.png")
    intro = f"{len(runs)} runs; each row: the run's primary arm vs its same-run baseline (conditions: its report)."
    lines = [f"# Sweep report: {sweep_dir.name}", "", intro, "", *md_table(headers, rows)]
    if plot:
        lines += [f"![speedup vs gamma across runs](plots/{plot.name})", ""]
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
