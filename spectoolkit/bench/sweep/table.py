"""``sweep_summary.csv``: one row per job of a sweep — its config axes, its status and its metrics.

A job directory is one with ``job.json`` (written by ``python -m spectoolkit``) or ``summary.json``,
up to :data:`SWEEP_DEPTH` levels below the sweep directory (dot-directories such as Hydra's
``.hydra`` and superseded results are skipped). Unfinished jobs get a row too, with their status and
whatever metrics exist, so the table can be read while the sweep runs. Metrics follow DESIGN §3:
``speedup`` is the primary arm's net throughput over the same run's baseline; ``alpha`` = accepted /
drafted; ``tokens_per_verify`` = E[N].
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from typing import Any

import yaml

from spectoolkit.bench.report.load import atomic_write, load_summary
from spectoolkit.bench.report.serving import load_serving, primary_arm
from spectoolkit.bench.sweep.jobs import JOB_FILE, read_job
from spectoolkit.errors import SpecToolkitError
from spectoolkit.metrics.summary_schema import BASELINE, ArmStats, Summary
from spectoolkit.metrics.summary_sections import CostModel, QuantQuality

SWEEP_CSV_NAME = "sweep_summary.csv"
SWEEP_DEPTH = 3  # job directories up to this many levels below a sweep directory
MARKERS = (JOB_FILE, "summary.json")
# What every row says about the job, whatever was swept (dotted paths into the resolved config).
DESCRIBE = ("model.name", "target.precision", "draft.kind", "draft.precision", "speculate.gamma", "kv.target",
            "kv.draft", "sampling.temperature", "workload.kind", "eval.kind")  # fmt: skip
METRICS = ("arm", "speedup", "predicted_speedup", "alpha", "tokens_per_verify", "rollback_rate", "net_throughput",
           "latency_p50", "latency_p95", "latency_p99", "ttft_p50", "exact_match", "exactness", "quant_kl",
           "quant_top1_agreement", "memory_delta_bytes", "errors", "complete")  # fmt: skip
JOB_COLUMNS = ("job", "status", "seconds", "config_hash", "overrides")


def _natural_key(path: Path) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.as_posix())]


def find_jobs(sweep_dir: Path, markers: tuple[str, ...] = MARKERS) -> list[Path]:
    """Directories holding one of ``markers`` 1..SWEEP_DEPTH levels below ``sweep_dir``, natural order."""
    sweep_dir = Path(sweep_dir)
    found = {
        p.parent
        for marker in markers
        for depth in range(1, SWEEP_DEPTH + 1)
        for p in sweep_dir.glob("*/" * depth + marker)
        if not any(part.startswith(".") for part in p.relative_to(sweep_dir).parts)
    }
    return sorted(found, key=lambda p: _natural_key(p.relative_to(sweep_dir)))


def overrides_of(job_dir: Path) -> list[str]:
    """The job's Hydra overrides (``.hydra/overrides.yaml``), [] when there are none."""
    path = Path(job_dir) / ".hydra" / "overrides.yaml"
    try:
        overrides = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        return []
    return [str(o) for o in overrides] if isinstance(overrides, list) else []


def axis_key(override: str) -> str | None:
    """``+draft=int4`` -> ``draft``; ``speculate.gamma=2`` -> ``speculate.gamma``; hydra.* -> None."""
    key = override.split("=", 1)[0].lstrip("+~")
    return None if not key or key.startswith("hydra") else key


def _resolved_config(job_dir: Path, job: dict[str, Any] | None) -> dict[str, Any]:
    if job and isinstance(job.get("config"), dict):
        return job["config"]
    try:
        loaded = yaml.safe_load((job_dir / ".hydra" / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _at_path(config: Any, keys: list[str]) -> Any:
    """``config[k1][k2]...`` or None when a level is missing or not a mapping (a saved config of any age)."""
    for key in keys:
        if not isinstance(config, dict):
            return None
        config = config.get(key)
    return config


def _config_value(config: dict[str, Any], key: str) -> Any:
    """The value at dotted ``key``; a config group (``draft``) reads as its precision or kind."""
    value = _at_path(config, key.split("."))
    if isinstance(value, dict):  # a group chosen by name, e.g. +draft=int4 -> {kind, precision, ...}
        kind, precision = value.get("kind"), value.get("precision")
        return precision if kind in (None, "model") else kind
    return value


def _metrics(summary: Summary) -> dict[str, Any]:
    arm = summary.primary_arm or BASELINE
    stats = summary.arms.get(arm) or ArmStats()
    quality = summary.quant_quality or QuantQuality()
    return {
        "arm": arm,
        "speedup": summary.speedup,
        "predicted_speedup": (summary.cost_model.get(arm) or CostModel()).predicted_speedup,
        "alpha": stats.acceptance_rate,
        "tokens_per_verify": stats.tokens_per_verify,
        "rollback_rate": stats.rollback_rate,
        "net_throughput": stats.net_throughput,
        "latency_p50": stats.latency.p50,
        "latency_p95": stats.latency.p95,
        "latency_p99": stats.latency.p99,
        "ttft_p50": stats.ttft.p50,
        "exact_match": summary.exact_match.get(arm) if arm != BASELINE else None,
        "exactness": summary.exactness.verdict if summary.exactness else None,
        "quant_kl": quality.kl_mean,
        "quant_top1_agreement": quality.top1_agreement,
        "memory_delta_bytes": summary.conditions.memory.memory_delta_bytes,
        "errors": summary.errors,
        "complete": summary.complete,
    }


def job_row(job_dir: Path, sweep_dir: Path) -> dict[str, Any]:
    """Everything the table says about one job (missing values are None)."""
    job = read_job(job_dir) or {}
    config = _resolved_config(job_dir, job)
    row: dict[str, Any] = {"job": job_dir.relative_to(sweep_dir).as_posix(), "status": job.get("status"),
                           "seconds": job.get("seconds"), "config_hash": job.get("config_hash"),
                           "overrides": " ".join(overrides_of(job_dir))}  # fmt: skip
    row.update({key: _config_value(config, key) for key in DESCRIBE})
    try:
        summary = load_summary(job_dir) if (job_dir / "summary.json").is_file() else None
    except SpecToolkitError:
        summary = None
    row.update(_metrics(summary) if summary else dict.fromkeys(METRICS))
    serving = load_serving(job_dir) if summary else None
    if summary and serving:  # a serving run has no batch-1 arms: its curves are the sweep report's serving part
        row["arm"] = primary_arm(summary, serving)
    if summary and row["speculate.gamma"] is None:  # no saved config: the primary arm says its γ
        stats = summary.arms.get(row["arm"])
        row["speculate.gamma"] = stats.gamma if stats else None
    if row["status"] is None and summary is not None:  # a run made without job.json (library use)
        row["status"] = "complete" if summary.complete else "incomplete"
    row["_config"], row["_summary"], row["_serving"] = config, summary, serving  # private: not CSV columns
    return row


def _split_override(override: str) -> tuple[str, Any]:
    """``+speculate.gamma=2`` -> ("speculate.gamma", 2): the value as Hydra's grammar would type it."""
    key, _, value = override.partition("=")
    try:
        return key.lstrip("+~"), yaml.safe_load(value)
    except yaml.YAMLError:
        return key.lstrip("+~"), value


def _first_set(*values: Any) -> Any:
    return next((value for value in values if value is not None), None)


def columns_for(axes: list[str]) -> list[str]:
    """CSV columns: the job, the swept axes, what describes every job, then the metrics."""
    return [*JOB_COLUMNS, *axes, *(key for key in DESCRIBE if key not in axes), *METRICS]


def sweep_rows(sweep_dir: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """(swept axes, rows) for every job below ``sweep_dir``; an axis is a key some job overrode.

    Each row also carries its job's summary (or None) under ``_summary`` and, for a serving run, its
    serving part under ``_serving``, read once for the table and the report.
    """
    sweep_dir = Path(sweep_dir)
    rows = [job_row(job_dir, sweep_dir) for job_dir in find_jobs(sweep_dir)]
    axes = sorted({key for row in rows for o in row["overrides"].split() if (key := axis_key(o))})
    for row in rows:
        config, literal = row.pop("_config"), dict(_split_override(o) for o in row["overrides"].split())
        row.update({axis: _first_set(_config_value(config, axis), literal.get(axis)) for axis in axes})
    return axes, rows


def write_sweep_csv(sweep_dir: Path) -> Path:
    """Write ``sweep_dir/sweep_summary.csv`` atomically (one row per job) and return its path."""
    return write_csv(sweep_dir, *sweep_rows(sweep_dir))


def write_csv(sweep_dir: Path, axes: list[str], rows: list[dict[str, Any]]) -> Path:
    """Write the rows of :func:`sweep_rows` as ``sweep_dir/sweep_summary.csv`` (atomically)."""
    if not rows:
        raise SpecToolkitError(f"no job (job.json or summary.json) in {sweep_dir} or up to {SWEEP_DEPTH} levels below")
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns_for(axes), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows({key: "" if value is None else value for key, value in row.items()} for row in rows)
    path = Path(sweep_dir) / SWEEP_CSV_NAME
    atomic_write(path, buffer.getvalue())
    return path
