"""Cost per unit of throughput in the report (bench.report.token_cost): the table of report.md, the checklist
item (PASS with the numbers when bench.cost_per_hour is given, NOT SET with the override that sets it when not:
no finding, so never a FAIL), batch-1 and serving runs, and summaries older than the section."""

from __future__ import annotations

from pathlib import Path

from spectoolkit.bench.report import checklist as cl
from spectoolkit.bench.report.render import render_report, write_report
from spectoolkit.bench.report.token_cost import SET_PRICE, UNPRICED, UNSET, check_serving_token_cost, check_token_cost
from spectoolkit.metrics.token_cost import batch_token_cost
from tests.bench.report.test_report import make_run, typed, typed_records, write_run
from tests.bench.report.test_serving_report import serving_summary, write_serving_run
from tests.bench.report.test_serving_report import typed as typed_serving

ITEM = "cost per unit of throughput"
ROW = f"| {ITEM} | **NOT SET** | {UNPRICED} | bench.cost_per_hour=<price of this machine per hour> |"


def _cost(tokens_per_s: float, cost_per_hour: float = 2.0) -> float:
    return cost_per_hour / (tokens_per_s * 3600) * 1e6


def _item(summary: dict, records: list) -> cl.CheckItem:
    return next(i for i in cl.evaluate_checklist(typed(summary), typed_records(records)) if i.name == ITEM)


def test_batch_report_has_the_cost_table_and_the_item_passes_with_the_numbers(tmp_path: Path) -> None:
    summary, records = make_run()  # baseline 25 tok/s, spec 31.25 tok/s, 2.0 per hour
    base, spec = _cost(25.0), _cost(31.25)
    text = write_report(write_run(tmp_path / "run", summary, records)).read_text(encoding="utf-8")
    section = text.split("## Cost per output token")[1].split("## Memory")[0]
    assert "At 2 per hour of this machine (bench.cost_per_hour)" in section
    assert f"| baseline | 25.00 | {base:.2f} | reference |" in section and f"{base:.2f}" == "22.22"
    assert f"| spec | 31.25 | {spec:.2f} | -20.0% vs baseline |" in section and f"{spec:.2f}" == "17.78"
    item = _item(summary, records)
    assert item.status == cl.PASS
    assert item.evidence == (
        "per 1M output tokens at 2 per hour of this machine, baseline vs spec: 22.22 vs 17.78 (-20.0%)"
    )


def test_four_groups_prices_the_primary_arm_against_its_own_reference() -> None:
    summary, records = make_run("four_groups")  # quant 30 tok/s, quant+spec 31.25 tok/s against quant
    item = _item(summary, records)
    assert item.status == cl.PASS and "quant vs quant+spec" in item.evidence
    assert f"{_cost(30.0):.2f} vs {_cost(31.25):.2f} ({30.0 / 31.25 - 1:+.1%})" in item.evidence


def test_without_a_price_the_item_is_not_set_with_the_override_and_no_caution() -> None:
    summary, records = make_run()
    summary["token_cost"] = batch_token_cost(None, summary["arms"])
    item = _item(summary, records)
    assert (item.status, item.evidence, item.fix) == (cl.NOT_SET, UNPRICED, SET_PRICE)
    assert item.fix == "bench.cost_per_hour=<price of this machine per hour>"
    text = render_report(typed(summary), typed_records(records), {})
    assert f"n/a: {UNSET} to price this run" in text and ROW in text
    assert "**Caution:**" not in text  # an input not given is no finding about the run
    assert f"**Not decided:** 1 pre-launch check(s) lack evidence: {ITEM} (NOT SET)" in text


def test_a_summary_older_than_the_section_still_renders_and_the_item_is_not_set() -> None:
    summary, records = make_run()
    del summary["token_cost"]
    del summary["conditions"]["bench"]["cost_per_hour"]
    assert typed(summary).token_cost is None
    text = render_report(typed(summary), typed_records(records), {})
    assert "## Cost per output token" in text and ROW in text
    assert check_token_cost(typed({})).status == cl.NOT_SET


def test_a_priced_run_without_measured_throughput_is_insufficient_data() -> None:
    summary, records = make_run()
    summary["token_cost"]["arms"]["spec"]["cost_per_million_output_tokens"] = None
    item = _item(summary, records)
    assert item.status == cl.INSUFFICIENT and "not measured" in item.evidence and "error_reasons" in item.fix


def test_a_baseline_only_run_passes_with_the_baseline_cost() -> None:
    summary, records = make_run("none")
    item = _item(summary, records)
    assert item.status == cl.PASS and f"baseline {_cost(25.0):.2f} (no speculative arm)" in item.evidence


def test_serving_report_has_the_cost_per_level_and_the_item_passes(tmp_path: Path) -> None:
    summary = serving_summary()  # baseline 10 tok/s and spec 14 tok/s at concurrency 1, ..., 2.0 per hour
    text = write_report(write_serving_run(tmp_path / "serve", summary)).read_text(encoding="utf-8")
    section = text.split("## Cost per output token")[1].split("## ")[0]
    assert f"| concurrency 1 | spec | 14.00 | {_cost(14.0):.2f} | {10 / 14 - 1:+.1%} vs baseline |" in section
    assert f"| concurrency 16 | baseline | 52.00 | {_cost(52.0):.2f} | reference |" in section
    item = check_serving_token_cost(*typed_serving(summary))
    assert item.status == cl.PASS
    assert item.evidence.startswith("per 1M output tokens at 2 per hour of this machine, baseline vs spec: ")
    assert f"concurrency 1: {_cost(10.0):.2f} vs {_cost(14.0):.2f} ({10 / 14 - 1:+.1%})" in item.evidence
    assert f"concurrency 16: {_cost(52.0):.2f} vs {_cost(52.0 * 0.85):.2f}" in item.evidence


def test_serving_without_a_price_is_not_set_and_renders_n_a(tmp_path: Path) -> None:
    summary = serving_summary()
    del summary["token_cost"]
    item = check_serving_token_cost(*typed_serving(summary))
    assert (item.status, item.evidence, item.fix) == (cl.NOT_SET, UNPRICED, SET_PRICE)
    text = write_report(write_serving_run(tmp_path / "serve", summary)).read_text(encoding="utf-8")
    assert f"n/a: {UNSET} to price this run" in text and ROW in text
    assert f"{ITEM} (NOT SET)" in text.split("**Not decided:**")[1].splitlines()[0]
