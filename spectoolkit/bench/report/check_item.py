"""One line of a pre-launch checklist and its statuses (PASS / FAIL / N/A).

A leaf module: ``report.checklist`` re-exports it, and the modules that contribute checklist items
(``report.token_cost``, ``report.alerts``) import it without importing the checklist.
"""

from __future__ import annotations

from dataclasses import dataclass

PASS, FAIL, NA = "PASS", "FAIL", "N/A"


@dataclass(frozen=True)
class CheckItem:
    """One pre-launch checklist line: ``status`` is PASS, FAIL or N/A; ``evidence`` the numbers."""

    name: str
    status: str
    evidence: str
