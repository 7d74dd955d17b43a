"""Cost per unit of throughput: what one million output tokens cost on the machine a run measured.

    cost per 1M output tokens = cost_per_hour / (output tokens/s × 3600) × 1e6

``cost_per_hour`` is ``bench.cost_per_hour``, the price of one hour of this machine (any currency). The
throughput is the one the run measured: a batch-1 arm's ``net_throughput`` (output tokens / total wall time,
drafting and rollback included), a serving level's ``output_throughput`` (output tokens / the level's
window, median over repeats). ``change`` = the arm's cost / its reference arm's − 1 (negative: cheaper),
which is reference throughput / arm throughput − 1.

``summary.json["token_cost"]`` (:class:`~spectoolkit.metrics.summary_sections.TokenCost`)::

    {"cost_per_hour": float | null,
     "arms": {arm: entry},                      # batch-1 runs
     "by_level": {arm: {level key: entry}}}     # serving runs
    entry = {"output_throughput", "cost_per_million_output_tokens", "reference", "change"}

Without a price both maps are empty. A leaf module (no spectoolkit imports).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

SECONDS_PER_HOUR = 3600.0
TOKENS_PER_UNIT = 1e6  # the cost is quoted per this many output tokens


def _rate(value: Any) -> float | None:
    """A usable throughput: a finite number > 0 (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        return None
    return float(value)


def cost_per_million_tokens(cost_per_hour: float | None, tokens_per_s: float | None) -> float | None:
    """cost_per_hour / (tokens_per_s × 3600) × 1e6; None without a price or a throughput > 0."""
    rate = _rate(tokens_per_s)
    if cost_per_hour is None or rate is None:
        return None
    return cost_per_hour / (rate * SECONDS_PER_HOUR) * TOKENS_PER_UNIT


def cost_entry(
    cost_per_hour: float, throughput: Any, reference: str | None, reference_throughput: Any
) -> dict[str, Any]:
    """One entry: the throughput it rests on, the cost per 1M output tokens and the change vs ``reference``."""
    cost = cost_per_million_tokens(cost_per_hour, throughput)
    reference_cost = cost_per_million_tokens(cost_per_hour, reference_throughput) if reference else None
    return {
        "output_throughput": _rate(throughput),
        "cost_per_million_output_tokens": cost,
        "reference": reference,
        "change": cost / reference_cost - 1 if cost is not None and reference_cost else None,
    }


def batch_token_cost(cost_per_hour: float | None, arms: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``token_cost`` of a batch-1 run from summary.json's ``arms`` (each with ``net_throughput`` and
    ``reference_arm``)."""
    out: dict[str, Any] = {"cost_per_hour": cost_per_hour, "arms": {}, "by_level": {}}
    if cost_per_hour is None:
        return out
    for name, stats in arms.items():
        reference = stats.get("reference_arm")
        reference_tput = arms.get(reference, {}).get("net_throughput") if reference else None
        out["arms"][name] = cost_entry(cost_per_hour, stats.get("net_throughput"), reference, reference_tput)
    return out


def serving_token_cost(
    cost_per_hour: float | None,
    serving: Mapping[str, Mapping[str, Mapping[str, Any]]],
    references: Mapping[str, str | None],
) -> dict[str, Any]:
    """``token_cost`` of a serving run from ``serving[arm][level key]`` (each with ``output_throughput``);
    ``references`` maps each arm to its reference arm (None: target alone)."""
    out: dict[str, Any] = {"cost_per_hour": cost_per_hour, "arms": {}, "by_level": {}}
    if cost_per_hour is None:
        return out
    for arm, by_level in serving.items():
        reference = references.get(arm)
        theirs = serving.get(reference, {}) if reference else {}
        out["by_level"][arm] = {
            key: cost_entry(cost_per_hour, stats.get("output_throughput"), reference,
                            theirs.get(key, {}).get("output_throughput"))
            for key, stats in by_level.items()
        }  # fmt: skip
    return out
