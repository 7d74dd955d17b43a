"""Reading a finished run (summary.json as a typed ``Summary``, records.jsonl as ``RequestRecord``s), the
few notions the report derives from them, and the formatting helpers of every report.

Shared by the report, the checklist, the interpretation rules, the plots and the sweep report. The
loaders are tolerant (older summaries, nulls and corrupt fields read as None / empty), so nothing
here needs to check types.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spectoolkit.errors import SpecToolkitError
from spectoolkit.metrics.load_curves import ServingSummary
from spectoolkit.metrics.records import RequestRecord, read_records
from spectoolkit.metrics.summary_schema import Summary
from spectoolkit.metrics.tolerant import num

__all__ = ["num"]  # re-exported: the report's number check is the loaders'
REFERENCE_PRECISIONS = frozenset({"fp32", "bf16", "fp16", "float32", "bfloat16", "float16", "auto"})
Records = list[RequestRecord]


# ---- loading -------------------------------------------------------------------------------------


def load_summary(run_dir: Path) -> Summary:
    """summary.json of ``run_dir``; a missing, unreadable or non-object file is a user error."""
    path = Path(run_dir) / "summary.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise SpecToolkitError(f"no summary.json in {run_dir}") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecToolkitError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise SpecToolkitError(f"{path} is not a JSON object")
    return Summary.from_dict(raw)


def load_records(run_dir: Path) -> Records:
    """records.jsonl of ``run_dir`` (torn lines skipped), or [] when absent."""
    path = Path(run_dir) / "records.jsonl"
    try:
        return read_records(path) if path.is_file() else []
    except (OSError, UnicodeDecodeError):  # unreadable records: the checklist then says it could not verify
        return []


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


# ---- what the report derives ---------------------------------------------------------------------


def drafting_arms(summary: Summary) -> list[str]:
    """Arms with a drafter: configured in conditions.arms or measured, in run order."""
    names = [arm.name for arm in summary.conditions.arms if (arm.gamma or 0) > 0 or arm.drafter not in (None, "none")]
    for name, stats in summary.arms.items():
        if (stats.gamma or 0) > 0 or stats.draft not in (None, "none") or (stats.drafted_tokens or 0):
            names.append(name)
    return [name for i, name in enumerate(names) if name is not None and name not in names[:i]]


def arm_policy(summary: Summary, arm: str) -> str | None:
    """``arm``'s draft-length policy as the run recorded it (conditions.arms, else its cost model); None
    for a summary from before policies, whose drafting arms all drafted a fixed γ."""
    configured = next((a.policy for a in summary.conditions.arms if a.name == arm and a.policy), None)
    model = summary.cost_model.get(arm)
    return configured or (model.policy if model else None)


def is_fixed(summary: Summary, arm: str) -> bool:
    """Whether ``arm`` drafts a fixed γ each round (what a fixed-γ what-if of the cost model describes)."""
    return arm_policy(summary, arm) in (None, "fixed")


def sampling_mode(summary: Summary, records: Records) -> str | None:
    """The sampling mode: "greedy" (temperature 0), "sampling", or None when no temperature was recorded."""
    temperature = num(summary.conditions.sampling.get("temperature"))
    if temperature is None:
        temperature = next((r.temperature for r in records if r.temperature is not None), None)
    if temperature is None:
        return None
    return "greedy" if temperature == 0 else "sampling"


def is_quantized(precision: Any) -> bool:
    return isinstance(precision, str) and precision.lower() not in REFERENCE_PRECISIONS


def primary_arm(summary: Summary, serving: ServingSummary) -> str | None:
    """A serving run's drafting arm the headline is about: the summary's primary arm, else "spec", else the first."""
    arms = serving.drafting_arms
    named = (summary.primary_arm, summary.conditions.primary_arm, "spec")
    return next((name for name in named if name in arms), arms[0] if arms else None)


def primary_alpha(summary: Summary) -> tuple[str | None, float | None]:
    """The primary arm and its acceptance rate α (None when not measured)."""
    arm = summary.primary_arm
    stats = summary.arms.get(arm or "")
    return arm, stats.acceptance_rate if stats else None


# ---- formatting ----------------------------------------------------------------------------------


def fmt(value: Any, spec: str = ".3f", suffix: str = "") -> str:
    """``value`` formatted with ``spec`` + ``suffix``, or "n/a"."""
    number = num(value)
    return "n/a" if number is None else format(number, spec) + suffix


def speed(value: Any) -> str:
    """A speedup as "1.23×", or "n/a"."""
    return fmt(value, ".2f", "×")


def md_table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    """A Markdown table (None cells as "n/a", pipes escaped) followed by a blank line."""
    cell = lambda value: ("n/a" if value is None else str(value)).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows] + [""]
