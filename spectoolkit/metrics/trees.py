"""Token trees against chains (issue 19): what each drafting arm verified per round and what it kept.

For every drafting arm (chain or tree) over its successful records: the verify width (most rows one
verify forward scored: the largest nodes-per-round + 1), nodes verified per round, the tree depth
(a chain's depth is its length), the accepted depth per round (K: accepted drafts) and the
mean accepted length (K + 1, the tokens a round emits before EOS/room cuts), and the histogram of K.
A tree beats a chain of the same verify width when its accepted length is larger at a cost per round
no higher; the report puts them side by side (:mod:`spectoolkit.bench.report.trees`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from spectoolkit.metrics.records import RequestRecord


def tree_stats(records: Iterable[RequestRecord], drafting: Iterable[str]) -> dict[str, dict]:
    """{arm: {tree, rounds, verify_width, mean_nodes, mean_depth, mean_accepted, mean_accept_length,
    accepted_counts}} for the drafting arms that ran at least one round; {} when no arm drafted a tree."""
    ok = [r for r in records if not r.error]
    out: dict[str, dict] = {}
    for arm in drafting:
        mine = [r for r in ok if r.arm == arm and r.draft_lengths]
        if not mine:
            continue
        nodes = [n for r in mine for n in r.draft_lengths]
        accepted = [k for r in mine for k in r.accept_lengths]
        depths = [d for r in mine for d in (r.tree_depths or r.draft_lengths)]
        counts = Counter(accepted)
        out[arm] = {
            "tree": next((r.tree for r in mine if r.tree), None),
            "rounds": len(nodes),
            "verify_width": max(nodes) + 1,
            "mean_nodes": sum(nodes) / len(nodes),
            "mean_depth": sum(depths) / len(depths),
            "mean_accepted": sum(accepted) / len(accepted),
            "mean_accept_length": 1 + sum(accepted) / len(accepted),
            "accepted_counts": [counts.get(k, 0) for k in range(max(accepted, default=0) + 1)],
        }
    return out if any(stats["tree"] for stats in out.values()) else {}
