"""The draft length k per verify round in the report (issue 16): how each drafting arm's policy spent its γ.

Reads summary.json's ``k_distribution`` (:mod:`spectoolkit.metrics.draft_lengths`): one table row per arm
over all its rounds, then one per task type (batch-1 runs) or load level (serving runs), and the stacked
bar plot ``k_distribution`` (``report.plots``). A summary without the section (a run from before
draft-length policies) gets no section at all.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from spectoolkit.bench.report.load import arm_policy, fmt, md_table
from spectoolkit.metrics.summary_schema import Summary
from spectoolkit.metrics.summary_sections import KDistribution

NOTE = (
    "k = the draft length the policy chose for a verify round (records before schema 4: the length proposed); "
    "k = 0 is a plain decode round (the policy chose not to draft, or the request had room for one token only); "
    "mean proposed < mean k where the drafter stopped early (n-gram miss, the confidence policy's stop)."
)


def _cells(dist: KDistribution) -> list[str]:
    counts = " / ".join(str(n) for n in dist.counts) or "n/a"
    return [fmt(dist.rounds, ".0f"), fmt(dist.mean_k, ".2f"), fmt(dist.zero_share, ".1%"),
            fmt(dist.mean_proposed, ".2f"), counts]  # fmt: skip


def k_rows(summary: Summary, by: str, label: Callable[[str], str] = str) -> list[list[str]]:
    """Rows (arm, policy, γ, source, group, rounds, mean k, k = 0 share, mean proposed, counts) per drafting arm:
    "all" first, then each group of ``by`` ("by_task_type" or "by_load_level")."""
    rows = []
    for arm, dist in summary.k_distribution.items():
        head = [arm, arm_policy(summary, arm) or "n/a", fmt(dist.gamma, ".0f"), dist.source or "n/a"]
        rows.append([*head, "all", *_cells(dist.overall)])
        rows += [[*head, label(key), *_cells(group)] for key, group in getattr(dist, by).items()]
    return rows


def k_section(summary: Summary, plots: dict[str, Path], by: str, group: str, label=str) -> list[str]:
    """The section "Draft length per round": the table of :func:`k_rows` (``group`` names the column of
    ``by``) and the plot; [] when the summary has no k_distribution."""
    if not summary.k_distribution:
        return []
    headers = ["arm", "policy", "γ (most per round)", "source", group, "rounds", "mean k", "k = 0 share",
               "mean proposed", "rounds at k = 0 / 1 / … / γ"]  # fmt: skip
    lines = ["## Draft length per round", "", NOTE, "", *md_table(headers, k_rows(summary, by, label))]
    return lines + ([f"![draft length per round](plots/{plots['k_distribution'].name})", ""]
                    if "k_distribution" in plots else [])  # fmt: skip
