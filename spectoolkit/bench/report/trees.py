"""The report's "Token trees vs chains" section (issue 19), from summary.json's ``trees``.

One row per drafting arm of a run that drafted token trees: the tree (or "chain"), the verify width,
nodes and depth per round, the accepted length, tokens per verify and the speedup over its reference.
With ``bench.arms=tree_chain`` the chain arm drafts γ = max_nodes, so both verify the same number of
rows per round and the comparison is at equal verify width. A summary without trees gets no section.
"""

from __future__ import annotations

from pathlib import Path

from spectoolkit.bench.report.load import fmt, md_table
from spectoolkit.metrics.summary_schema import Summary

NOTE = (
    "verify width = rows one verify forward scores (nodes + 1); accepted length = accepted drafts per round + 1 "
    "(the tokens a round emits before an EOS or max_new_tokens cut); a tree wins at equal verify width when its "
    "accepted length is longer and its speedup at least the chain's."
)


def tree_section(summary: Summary, records, plots: dict[str, Path]) -> list[str]:
    if not summary.trees:
        return []
    headers = ["arm", "tree", "verify width", "rounds", "nodes / round", "depth / round", "accepted length",
               "E (tok/verify)", "speedup", "rounds at K = 0 / 1 / …"]  # fmt: skip
    rows = []
    for arm, stats in summary.trees.items():
        arm_stats = summary.arms.get(arm)
        rows.append([
            arm, stats.tree or "chain", fmt(stats.verify_width, ".0f"), fmt(stats.rounds, ".0f"),
            fmt(stats.mean_nodes, ".2f"), fmt(stats.mean_depth, ".2f"), fmt(stats.mean_accept_length, ".3f"),
            fmt(arm_stats.tokens_per_verify if arm_stats else None, ".3f"), fmt(summary.speedups.get(arm), ".3f"),
            " / ".join(map(str, stats.accepted_counts)) or "n/a",
        ])  # fmt: skip
    return ["## Token trees vs chains", "", NOTE, "", *md_table(headers, rows)]
