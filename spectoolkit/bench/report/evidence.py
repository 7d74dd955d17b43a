"""How much a run measured for the checklist, and how much more would decide an item (``report.checklist``).

Two numbers the checklist rests on need more than a count:

- **run-to-run noise** of the baseline: the sample standard deviation / mean of its per-repeat throughput
  (``summary.baseline_repeat_throughput``), see :func:`relative_noise`;
- **drafted tokens per task type** behind each α, and how many more prompts (greedy) or requests
  (sampling) of that type reach ``MIN_DRAFTED`` at the drafted tokens per request measured there, see
  :func:`task_evidence` and :func:`alpha_fix`.

Under greedy decoding a repeat of a prompt re-decodes the same tokens: the target's output, and so what the
drafter is asked to predict, is identical, so repeats add no evidence about α and each prompt counts once
(its drafted tokens per request). Under sampling every repeat draws a new output (its seed depends on the
repeat), so every request counts. Pure functions over the typed summary and records; missing keys read as
nothing measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from spectoolkit.bench.report.load import Records, num
from spectoolkit.metrics.summary_schema import Summary

MIN_DRAFTED = 200  # drafted tokens per task type before its α is worth quoting
BUILTIN = "builtin"
DATASETS = ("humaneval", "sharegpt")  # workloads whose size is workload.num_prompts
DATASET_OF_TASK = {"code": "humaneval", "chat": "sharegpt"}  # the packaged workload of one task type


def relative_noise(values: Sequence[float]) -> float | None:
    """Sample standard deviation (ddof 1) / mean of ``values``; None below two values or a mean ≤ 0.

    Unlike the range (max - min), whose expected size grows with the number of samples (≈ 1.13 σ at 2,
    2.33 σ at 5, 3.08 σ at 10 for normal noise), this estimates σ / mean at any count (≈ 0.94 σ at 5),
    and every repeat counts, not just the two extremes.
    """
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    if mean <= 0:
        return None
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return math.sqrt(variance) / mean


@dataclass(frozen=True)
class TaskEvidence:
    """The drafted tokens behind one drafting arm's α on one task type."""

    task: str
    arm: str
    requests: int  # successful requests of the arm on this task type, every repeat
    prompts: int  # distinct prompts among them
    per_request: float | None  # drafted tokens per request; None: no successful request
    drafted: float  # drafted tokens that count as evidence (greedy: each prompt once)
    needed: int | None  # prompts (greedy) or requests (sampling) that reach MIN_DRAFTED; None: no estimate

    @property
    def enough(self) -> bool:
        return self.drafted >= MIN_DRAFTED


def _repeats(summary: Summary) -> int:
    configured = num(summary.conditions.bench.get("repeat"))
    return int(configured or len(summary.baseline_repeat_throughput) or 1)


def task_evidence(summary: Summary, records: Records, arms: list[str], greedy: bool) -> list[TaskEvidence]:
    """One entry per (task type, drafting arm) of ``summary.by_task_type``."""
    found = []
    for task, group in summary.by_task_type.items():
        for arm in arms:
            stats = group.arms.get(arm)
            requests = int(stats.requests or 0) if stats else 0
            drafted = float(stats.drafted_tokens or 0) if stats else 0.0
            cases = {r.case_id for r in records if r.arm == arm and r.task_type == task and not r.error}
            prompts = len(cases) or (max(1, round(requests / _repeats(summary))) if requests else 0)
            per_request = drafted / requests if requests else None
            counted = per_request * prompts if greedy and per_request is not None else drafted
            needed = math.ceil(MIN_DRAFTED / per_request) if per_request else None
            found.append(TaskEvidence(task, arm, requests, prompts, per_request, counted, needed))
    return found


def worst_per_task(items: list[TaskEvidence]) -> list[TaskEvidence]:
    """Per task type, the arm with the fewest counted drafted tokens (ties: the one needing the most), in order."""
    worst: dict[str, TaskEvidence] = {}
    for item in items:
        held = worst.get(item.task)
        if held is None or (item.drafted, -(item.needed or 0)) < (held.drafted, -(held.needed or 0)):
            worst[item.task] = item
    return list(worst.values())


def evidence_text(item: TaskEvidence, greedy: bool) -> str:
    """``qa 12 (spec: 2 prompt(s), 10 request(s), 6.0 drafted per request, ≈ 34 prompts reach 200)``."""
    if item.per_request is None:
        return f"{item.task} 0 ({item.arm}: no successful request)"
    if not item.per_request:
        return f"{item.task} 0 ({item.arm} drafted nothing on its {item.prompts} prompt(s): α undefined there)"
    unit = "prompts" if greedy else "requests"
    return (f"{item.task} {item.drafted:.0f} ({item.arm}: {item.prompts} prompt(s), {item.requests} request(s), "
            f"{item.per_request:.1f} drafted per request, ≈ {item.needed} {unit} reach {MIN_DRAFTED})")  # fmt: skip


def _workload_prompts(summary: Summary, records: Records, found: list[TaskEvidence]) -> int:
    """The run's distinct prompts: from the records, else workload.num_prompts, else summed per task type."""
    cases = {r.case_id for r in records if not r.error}
    configured = num(summary.conditions.workload.get("num_prompts"))
    return len(cases) or int(configured or 0) or sum(item.prompts for item in worst_per_task(found))


def alpha_fix(summary: Summary, records: Records, found: list[TaskEvidence], greedy: bool) -> str:
    """The override (or workload) that brings every task type of ``found`` to MIN_DRAFTED drafted tokens."""
    short = worst_per_task([item for item in found if not item.enough])
    estimable = [item for item in short if item.needed is not None and item.prompts]
    if not estimable:
        return ("a workload with other prompts of these task types: the drafter proposed nothing (or nothing "
                "succeeded) here, so this run cannot say how many would do")  # fmt: skip
    kind = summary.conditions.workload.get("kind")
    needs = ", ".join(f"{item.task} ≈ {item.needed}" for item in estimable)
    if not greedy:
        repeat = max(math.ceil(item.needed / item.prompts) for item in estimable)
        return (f"bench.repeat={repeat} (each repeat samples new outputs; requests needed: {needs}), or more prompts "
                "of these task types")  # fmt: skip
    scale = max(item.needed / item.prompts for item in estimable)
    total = _workload_prompts(summary, records, found)
    if kind in DATASETS and total:
        return f"workload.num_prompts={math.ceil(total * scale)} (prompts needed: {needs})"
    where = ("a JSONL workload (workload=jsonl workload.path=FILE)" if kind == BUILTIN else
             "the workload file (workload.path; workload.num_prompts=null reads every line)")  # fmt: skip
    packaged = [f"workload={DATASET_OF_TASK[item.task]} workload.num_prompts={item.needed} for {item.task}"
                for item in estimable if kind == BUILTIN and item.task in DATASET_OF_TASK]  # fmt: skip
    return (f"more prompts of these task types in {where}: {needs}"
            + (f" ({'; '.join(packaged)})" if packaged else "")
            + ". Greedy repeats re-decode the same tokens, so bench.repeat adds no evidence")  # fmt: skip
