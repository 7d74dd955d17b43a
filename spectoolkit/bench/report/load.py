"""Reading a finished run: summary.json and records.jsonl, and tolerant accessors over them.

Shared by the report, the checklist, the interpretation rules and the plots. Missing keys (older
summaries), nulls and corrupt fields never raise: accessors return None / {} / [] instead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from spectoolkit.errors import SpecToolkitError
from spectoolkit.metrics.records import read_records

BASELINE = "baseline"
REFERENCE_PRECISIONS = frozenset({"fp32", "bf16", "fp16", "float32", "bfloat16", "float16", "auto"})
Summary = dict[str, Any]
Records = list[dict[str, Any]]


# ---- loading -------------------------------------------------------------------------------------


def load_summary(run_dir: Path) -> Summary:
    """summary.json of ``run_dir`` as a dict; a missing or unreadable file is a user error."""
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise SpecToolkitError(f"no summary.json in {run_dir}") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecToolkitError(f"cannot read {path}: {exc}") from exc
    if not isinstance(summary, dict):
        raise SpecToolkitError(f"{path} is not a JSON object")
    return summary


def load_records(run_dir: Path) -> Records:
    """records.jsonl of ``run_dir`` (torn lines skipped), or [] when absent."""
    path = Path(run_dir) / "records.jsonl"
    try:
        return [r for r in read_records(path) if isinstance(r, dict)] if path.is_file() else []
    except (OSError, UnicodeDecodeError):  # unreadable records: the checklist then says it could not verify
        return []


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


# ---- tolerant accessors --------------------------------------------------------------------------


def dig(data: Any, *keys: Any) -> Any:
    """``data[k1][k2]...`` or None when any level is missing or not a mapping."""
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def hashable(value: Any) -> Any:
    """``value`` itself when it can be a set member or dict key, else its repr (a corrupt record field)."""
    return value if isinstance(value, str | int | float | None) else repr(value)


def num(value: Any) -> float | None:
    """``value`` as a finite float, else None (bools, strings and NaN are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def fmt(value: Any, spec: str = ".3f", suffix: str = "") -> str:
    """``value`` formatted with ``spec`` + ``suffix``, or "n/a"."""
    number = num(value)
    return "n/a" if number is None else format(number, spec) + suffix


def speed(value: Any) -> str:
    """A speedup as "1.23×", or "n/a"."""
    return fmt(value, ".2f", "×")


def arms_of(group: Any) -> dict[str, dict[str, Any]]:
    """ArmStats per arm of a summary or a group; older summaries kept arms at the top of a group."""
    arms = dig(group, "arms")
    if isinstance(arms, dict):
        return {name: stats for name, stats in arms.items() if isinstance(stats, dict)}
    if not isinstance(group, dict):
        return {}
    return {name: stats for name, stats in group.items() if isinstance(stats, dict) and "requests" in stats}


def speedups_of(group: Any) -> dict[str, float | None]:
    """Speedup per non-baseline arm (older summaries: one ``speedup`` for "spec")."""
    speedups = dig(group, "speedups")
    if isinstance(speedups, dict):
        return speedups
    legacy = dig(group, "speedup")
    return {"spec": legacy} if num(legacy) is not None else {}


def primary_arm(summary: Summary) -> str | None:
    """The arm the headline is about (older summaries: "spec" when it was measured)."""
    if "primary_arm" in summary:
        return summary["primary_arm"] if isinstance(summary["primary_arm"], str) else None
    return "spec" if "spec" in arms_of(summary) else None


def drafting_arms(summary: Summary) -> list[str]:
    """Arms with a drafter: configured in conditions.arms or measured, in run order."""
    names = [
        arm.get("name")
        for arm in as_list(dig(summary, "conditions", "arms"))
        if isinstance(arm, dict) and ((num(arm.get("gamma")) or 0) > 0 or arm.get("drafter") not in (None, "none"))
    ]
    for name, stats in arms_of(summary).items():
        draft = stats.get("draft", stats.get("drafter"))
        if (num(stats.get("gamma")) or 0) > 0 or draft not in (None, "none") or (num(stats.get("drafted_tokens")) or 0):
            names.append(name)
    return [name for i, name in enumerate(names) if isinstance(name, str) and name not in names[:i]]


def sampling_mode(summary: Summary, records: Records) -> str | None:
    """The sampling mode: "greedy" (temperature 0), "sampling", or None when no temperature was recorded."""
    temperature = num(dig(summary, "conditions", "sampling", "temperature"))
    if temperature is None:
        temperature = next((num(r.get("temperature")) for r in records if num(r.get("temperature")) is not None), None)
    if temperature is None:
        return None
    return "greedy" if temperature == 0 else "sampling"


def is_quantized(precision: Any) -> bool:
    return isinstance(precision, str) and precision.lower() not in REFERENCE_PRECISIONS


def primary_alpha(summary: Summary) -> tuple[str | None, float | None]:
    """The primary arm and its acceptance rate α (None when not measured)."""
    arm = primary_arm(summary)
    return arm, num(dig(arms_of(summary).get(arm or ""), "acceptance_rate"))


def md_table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    """A Markdown table (None cells as "n/a", pipes escaped) followed by a blank line."""
    cell = lambda value: ("n/a" if value is None else str(value)).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows] + [""]
