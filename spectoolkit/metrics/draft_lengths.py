"""How a draft-length policy spent its γ: the distribution of k per verify round (issue 16).

k is what the policy (:mod:`spectoolkit.policy`) asked a round to draft, ``RequestRecord.chosen_lengths``
(record schema 4); a record written before has only ``draft_lengths`` (what the drafter proposed, at
most k), which stands in for it: ``source`` says which one an arm's numbers come from ("chosen_lengths",
"draft_lengths", or "mixed"). Per drafting arm, over its successful records, overall and per group (task
type; load level in a serving run):

- counts[k] = rounds that chose k, for k = 0..γ (γ: the arm's largest draft_len or k seen)
- mean_k = Σ k / rounds; zero_share = rounds at k = 0 / rounds (a plain decode round: the policy chose
  not to draft, or the request had room for one more token only, which caps any policy at 0)
- mean_proposed = Σ proposed / rounds (below mean_k where the drafter stopped early: n-gram misses, the
  confidence policy's draft stopping itself)

The JSON form of :class:`~spectoolkit.metrics.summary_sections.ArmKDistribution`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from spectoolkit.metrics.records import RequestRecord

Records = list[RequestRecord]


def chosen_of(record: RequestRecord) -> list[int]:
    """k per round of ``record``: ``chosen_lengths``, else (records before schema 4) ``draft_lengths``."""
    return list(record.chosen_lengths or record.draft_lengths)


def k_distribution(records: Records, gamma: int) -> dict[str, Any]:
    """counts [γ+1] of rounds at k = 0..γ, rounds, mean_k, zero_share and mean_proposed over ``records``."""
    ks = [k for record in records for k in chosen_of(record)]
    proposed = [d for record in records for d in record.draft_lengths]
    counts = [0] * (gamma + 1)
    for k in ks:
        counts[min(max(k, 0), gamma)] += 1
    rounds = len(ks)
    return {
        "rounds": rounds,
        "counts": counts,
        "mean_k": sum(ks) / rounds if rounds else None,
        "zero_share": counts[0] / rounds if rounds else None,
        "mean_proposed": sum(proposed) / len(proposed) if proposed else None,
    }


def _source(records: Records) -> str:
    chosen = [bool(record.chosen_lengths) for record in records]
    return "chosen_lengths" if all(chosen) else "mixed" if any(chosen) else "draft_lengths"


def _groups(records: Records, key: str) -> dict[str, Records]:
    """Records by the field ``key`` (records without it left out), in first-seen order."""
    groups: dict[str, Records] = defaultdict(list)
    for record in records:
        value = getattr(record, key)
        if value is not None:
            groups[str(value)].append(record)
    return dict(groups)


def arm_k_distribution(records: Records) -> dict[str, Any] | None:
    """One drafting arm's distribution of k: overall, by task type (sorted) and by load level (run
    order; empty in a batch-1 run). None when no successful record has a round."""
    with_rounds = [r for r in records if not r.error and (r.chosen_lengths or r.draft_lengths)]
    if not with_rounds:
        return None
    gamma = max(max((r.draft_len or 0) for r in with_rounds), max(k for r in with_rounds for k in chosen_of(r)))
    by_task = _groups(with_rounds, "task_type")
    return {
        "gamma": gamma,
        "source": _source(with_rounds),
        "overall": k_distribution(with_rounds, gamma),
        "by_task_type": {task: k_distribution(group, gamma) for task, group in sorted(by_task.items())},
        "by_load_level": {
            level: k_distribution(group, gamma) for level, group in _groups(with_rounds, "load_level").items()
        },
    }


def k_distributions(records: Records, drafting_arms: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``summary["k_distribution"]``: :func:`arm_k_distribution` of each drafting arm with rounds, in order."""
    by_arm: dict[str, Records] = defaultdict(list)
    for record in records:
        by_arm[str(record.arm)].append(record)
    found = {arm: arm_k_distribution(by_arm.get(arm, [])) for arm in drafting_arms}
    return {arm: dist for arm, dist in found.items() if dist is not None}
