"""One line of a pre-launch checklist, its statuses, and the note a report's headline gives them.

A check either decides or says why it cannot:

- PASS / FAIL: decided. A FAIL is a *finding* about the machine, the workload or the code (the baseline
  is noisy, an output diverged, speculation never pays), never the absence of a number;
- NOT SET: an input the user did not give (``bench.cost_per_hour``): nothing was measured wrong;
- INSUFFICIENT DATA: the run measured too little to decide (too few drafted tokens per task type, one
  repeat, a summary older than the number), with how much more would decide it;
- N/A: the item cannot apply to this run (no drafter, sampling instead of greedy, a deployment choice).

Every FAIL, NOT SET and INSUFFICIENT DATA carries ``fix``: the override or action that would make the
item PASS, or decide it. Below every checklist module (it imports only ``report.load``): ``report.checklist``
re-exports it, and the modules that contribute items (``report.token_cost``, ``report.alerts``) and render
them (``report.render``, ``report.serving``) import it without importing the checklist.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from spectoolkit.bench.report.load import md_table

PASS, FAIL, NA = "PASS", "FAIL", "N/A"
NOT_SET, INSUFFICIENT = "NOT SET", "INSUFFICIENT DATA"
UNDECIDED = (NOT_SET, INSUFFICIENT)  # evidence missing: neither a PASS nor a finding
STATUSES = (PASS, FAIL, NOT_SET, INSUFFICIENT, NA)
NEEDS_FIX = (FAIL, NOT_SET, INSUFFICIENT)
# Fixes several checks share: a number an older summary lacks, records.jsonl missing, no request succeeded.
RERUN = "re-run with the current spectoolkit, which records it"
NO_RECORDS = "put the run's records.jsonl back beside summary.json, or re-run"
NO_SUCCESS = "no request succeeded: fix what the run's error_reasons say (summary.json) and re-run"


@dataclass(frozen=True)
class CheckItem:
    """One pre-launch checklist line: ``status`` one of STATUSES, ``evidence`` the numbers it rests on,
    ``fix`` the override or action that passes or decides it (required for FAIL, NOT SET, INSUFFICIENT DATA).
    """

    name: str
    status: str
    evidence: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"checklist status {self.status!r} is not one of {', '.join(STATUSES)}")
        if self.status in NEEDS_FIX and not self.fix:
            raise ValueError(f"checklist item {self.name!r} is {self.status} without a fix")


def caution(items: Iterable[CheckItem]) -> str:
    """The headline's note: the FAILs (findings) counted apart from the items not decided; "" when neither."""
    items = list(items)
    failed = [item.name for item in items if item.status == FAIL]
    undecided = [f"{item.name} ({item.status})" for item in items if item.status in UNDECIDED]
    parts = []
    if failed:
        parts.append(f"**Caution:** {len(failed)} pre-launch check(s) FAIL: {'; '.join(failed)}.")
    if undecided:
        parts.append(f"**Not decided:** {len(undecided)} pre-launch check(s) lack evidence: {'; '.join(undecided)} "
                     "— the checklist says what decides each.")  # fmt: skip
    return "".join(f"\n\n{part}" for part in parts)


def checklist_table(items: Iterable[CheckItem]) -> list[str]:
    """The checklist section of a report: item, status, evidence and what to do (FAIL and undecided items)."""
    rows = [[item.name, f"**{item.status}**", item.evidence, item.fix] for item in items]
    return ["## Pre-launch checklist", "", *md_table(["item", "status", "evidence", "what to do"], rows)]
