"""Cost per unit of throughput in the run report: the cost of 1M output tokens per arm (batch-1 runs) or per
arm and load level (serving runs), read from summary.json's ``token_cost``
(:mod:`spectoolkit.metrics.token_cost`), and its checklist item.

The price is ``bench.cost_per_hour``, per hour of this machine, in whatever currency it was given. A run
without it, or a summary written before it existed, renders "n/a" and its item is NOT SET with the override
that sets it: an input the user did not give is no finding about the run. A price without a measured output
throughput is INSUFFICIENT DATA.
"""

from __future__ import annotations

from pathlib import Path

from spectoolkit.bench.report.check_item import INSUFFICIENT, NO_SUCCESS, NOT_SET, PASS, CheckItem
from spectoolkit.bench.report.load import Records, fmt, md_table, primary_arm
from spectoolkit.metrics.load_curves import ServingSummary
from spectoolkit.metrics.summary_schema import BASELINE, Summary
from spectoolkit.metrics.summary_sections import TokenCostEntry

ITEM = "cost per unit of throughput"
SET_PRICE = "bench.cost_per_hour=<price of this machine per hour>"  # the override of a NOT SET item
UNSET = f"set {SET_PRICE}"
UNPRICED = "bench.cost_per_hour not given: the run is not priced"
FORMULA = "cost per 1M output tokens = bench.cost_per_hour / (output tok/s × 3600) × 1e6"
TITLE = "## Cost per output token"
MAX_LEVELS_SHOWN = 6  # the checklist's evidence of a serving run


def money(value: float | None) -> str:
    """A cost: two decimals from 1 up, three significant digits below; "n/a" when None."""
    if value is None:
        return "n/a"
    return f"{value:,.2f}" if abs(value) >= 1 else f"{value:.3g}"


def price(summary: Summary) -> float | None:
    """``bench.cost_per_hour`` of the run, None when not given (or the summary is older than it)."""
    return summary.token_cost.cost_per_hour if summary.token_cost is not None else None


def _change(entry: TokenCostEntry | None) -> str:
    if entry is None:
        return "n/a"
    return "reference" if entry.reference is None else f"{fmt(entry.change, '+.1%')} vs {entry.reference}"


def _note(cost_per_hour: float, throughput: str) -> str:
    return f"At {cost_per_hour:g} per hour of this machine (bench.cost_per_hour): {FORMULA}, {throughput}."


def token_cost_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    """A batch-1 run: arm, output tok/s, cost per 1M output tokens, change vs the arm's reference."""
    cost_per_hour = price(summary)
    if cost_per_hour is None or summary.token_cost is None:
        return [TITLE, "", f"n/a: {UNSET} to price this run ({FORMULA}).", ""]
    entries = summary.token_cost.arms
    rows = [[arm, fmt(e.output_throughput, ".2f"), money(e.cost_per_million_output_tokens), _change(e)]
            for arm, e in entries.items()]  # fmt: skip
    note = _note(cost_per_hour, "output tok/s = the arm's net throughput (drafting and rollback included)")
    body = md_table(["arm", "output tok/s", "cost per 1M output tokens", "vs reference"], rows) if rows else [
        "n/a: no arm's output throughput measured.", ""]  # fmt: skip
    return [TITLE, "", note, "", *body]


def _level_entry(summary: Summary, arm: str, key: str) -> TokenCostEntry | None:
    by_level = summary.token_cost.by_level.get(arm) if summary.token_cost is not None else None
    return (by_level or {}).get(key)


def serving_token_cost_section(
    summary: Summary, serving: ServingSummary, records: Records, plots: dict[str, Path]
) -> list[str]:
    """A serving run: per load level and arm, output tok/s, cost per 1M output tokens, change vs the baseline."""
    cost_per_hour = price(summary)
    if cost_per_hour is None:
        return [TITLE, "", f"n/a: {UNSET} to price this run ({FORMULA}).", ""]
    rows = []
    for level in serving.levels:
        for arm in serving.arms:
            entry = _level_entry(summary, arm, level.key)
            if entry is not None:
                rows.append([level.label, arm, fmt(entry.output_throughput, ".2f"),
                             money(entry.cost_per_million_output_tokens), _change(entry)])  # fmt: skip
    note = _note(cost_per_hour, "output tok/s = the level's output throughput (median over repeats)")
    body = md_table(["load", "arm", "output tok/s", "cost per 1M output tokens", "vs reference"], rows) if rows else [
        "n/a: no load level's output throughput measured.", ""]  # fmt: skip
    return [TITLE, "", note, "", *body]


def _pair_text(reference: TokenCostEntry | None, entry: TokenCostEntry | None) -> str:
    mine = entry.cost_per_million_output_tokens if entry else None
    theirs = reference.cost_per_million_output_tokens if reference else None
    return f"{money(theirs)} vs {money(mine)} ({fmt(entry.change if entry else None, '+.1%')})"


def check_token_cost(summary: Summary) -> CheckItem:
    """PASS with the cost per 1M output tokens of the primary arm's reference vs the primary arm (batch-1);
    NOT SET without a price, INSUFFICIENT DATA without the throughput it divides."""
    cost_per_hour = price(summary)
    if cost_per_hour is None or summary.token_cost is None:
        return CheckItem(ITEM, NOT_SET, UNPRICED, SET_PRICE)
    entries = summary.token_cost.arms
    arm = summary.primary_arm if summary.primary_arm in entries else None
    unit = f"per 1M output tokens at {cost_per_hour:g} per hour of this machine"
    if arm is None:
        base = entries.get(BASELINE)
        cost = base.cost_per_million_output_tokens if base else None
        if cost is None:
            return CheckItem(ITEM, INSUFFICIENT, f"bench.cost_per_hour={cost_per_hour:g}, but no output throughput "
                             "measured", NO_SUCCESS)  # fmt: skip
        return CheckItem(ITEM, PASS, f"{unit}: {BASELINE} {money(cost)} (no speculative arm)")
    entry = entries[arm]
    reference = entry.reference or BASELINE
    theirs = entries.get(reference)
    if entry.cost_per_million_output_tokens is None or theirs is None or theirs.cost_per_million_output_tokens is None:
        return CheckItem(ITEM, INSUFFICIENT, f"bench.cost_per_hour={cost_per_hour:g}, but the output throughput of "
                         f"{arm} or {reference} was not measured", NO_SUCCESS)  # fmt: skip
    return CheckItem(ITEM, PASS, f"{unit}, {reference} vs {arm}: {_pair_text(theirs, entry)}")


def check_serving_token_cost(summary: Summary, serving: ServingSummary) -> CheckItem:
    """PASS with the cost per 1M output tokens of the baseline vs the primary arm at each load level; NOT SET
    without a price, INSUFFICIENT DATA when no level measured the throughput it divides."""
    cost_per_hour = price(summary)
    if cost_per_hour is None:
        return CheckItem(ITEM, NOT_SET, UNPRICED, SET_PRICE)
    arm = primary_arm(summary, serving)
    shown = arm or BASELINE
    parts, references = [], []
    for level in serving.levels:
        entry = _level_entry(summary, shown, level.key)
        if entry is None or entry.cost_per_million_output_tokens is None:
            continue
        reference = _level_entry(summary, entry.reference, level.key) if entry.reference else None
        text = _pair_text(reference, entry) if arm else money(entry.cost_per_million_output_tokens)
        parts.append(f"{level.label}: {text}")
        references.append(entry.reference or BASELINE)
    if not parts:
        return CheckItem(ITEM, INSUFFICIENT, f"bench.cost_per_hour={cost_per_hour:g}, but no output throughput of "
                         f"{shown} was measured at any load level", NO_SUCCESS)  # fmt: skip
    more = "; …" if len(parts) > MAX_LEVELS_SHOWN else ""
    who = f"{references[0]} vs {arm}" if arm else f"{BASELINE} (no speculative arm)"
    head = f"per 1M output tokens at {cost_per_hour:g} per hour of this machine, {who}"
    return CheckItem(ITEM, PASS, f"{head}: " + "; ".join(parts[:MAX_LEVELS_SHOWN]) + more)
