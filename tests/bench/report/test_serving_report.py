"""The serving report (bench.report.serving), its plots, checklist items and rules, and the sweep's serving part.

Hand-built ``mode: serving`` summaries as issue 15 item 7 describes them: spec pays at concurrency 1–4
and stops at 8–16 (crossover 8), a saturating baseline (knee 4, saturation 8), SLO items, nulls
everywhere, an open-loop (rate-only) run, and a sweep with a serving and a classic job.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from typing import Any

from spectoolkit.bench.report import checklist as cl
from spectoolkit.bench.report.interpret import interpret_serving
from spectoolkit.bench.report.render import write_report
from spectoolkit.bench.report.serving import spec_max_batch_advice
from spectoolkit.bench.report.serving_checklist import evaluate_serving_checklist
from spectoolkit.bench.sweep.report import write_sweep_report
from spectoolkit.metrics.load_curves import ServingSummary
from spectoolkit.metrics.records import RequestRecord
from spectoolkit.metrics.summary_schema import Summary
from spectoolkit.metrics.token_cost import serving_token_cost

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CONCURRENCY = (1, 2, 4, 8, 16)
BASE_TPUT = (10.0, 19.0, 34.0, 50.0, 52.0)  # gains 1.9, 1.79, 1.47 per doubling: knee 4; 0.95 × 52 = 49.4: saturation 8
SPEEDUPS = (1.4, 1.3, 1.1, 0.92, 0.85)  # pays at 1–4, stops from 8
BASE_TTFT_P99 = (0.05, 0.08, 0.12, 0.25, 0.40)  # seconds: within 200 ms up to concurrency 4
PRE_SCHEMA_RUN = Path(__file__).parent / "data" / "pre_schema_run"
TTFT_ITEM = "TTFT P99 ≤ serve.slo_ttft_ms (200 ms) at every level"
COST_PER_HOUR = 2.0  # bench.cost_per_hour of the synthetic runs


def _stats(tput: float | None, speedup: float | None, ttft_p99: float | None, drafting: bool) -> dict[str, Any]:
    tasks = {"code": (0.8, 3.4), "chat": (0.5, 2.1)} if drafting else {}
    by_task = {task: {"acceptance_rate": alpha, "mean_accept_length": length, "num_requests": 6}
               for task, (alpha, length) in tasks.items()}  # fmt: skip
    return {
        "output_throughput": tput, "request_throughput": tput / 64 if tput else None, "ttft_p50": 0.03,
        "ttft_p99": ttft_p99, "tpot_p50": 0.018 if drafting else 0.022, "tpot_p99": 0.03, "itl_p50": 0.02,
        "itl_p99": 0.05, "latency_p95": 1.5, "latency_p99": 1.8, "mean_batch_size": 3.2,
        "acceptance_rate": 0.65 if drafting else None, "mean_accept_length": 2.8 if drafting else None,
        "peak_temp_kv_tokens": 64 if drafting else 0, "speculating_share": 0.75 if drafting else None,
        "preemptions": 0, "errors": 0, "num_requests": 12, "speedup": speedup,
        "exact_match": 1.0 if drafting else None, "by_task": by_task,
    }  # fmt: skip


def serving_summary(concurrency: tuple[int, ...] = CONCURRENCY, rates: tuple[float, ...] = (),
                    serve: dict[str, Any] | None = None, temperature: float = 0.0,
                    divergent: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """A complete serving summary: baseline and spec at every level (rates reuse the first curve points)."""
    levels = [{"key": str(n), "kind": "concurrency", "value": n} for n in concurrency]
    levels += [{"key": f"rate={r:g}", "kind": "rate", "value": r} for r in rates]
    serving: dict[str, dict[str, Any]] = {"baseline": {}, "spec": {}}
    for i, level in enumerate(levels):
        j = i % len(CONCURRENCY)
        tput, ttft = BASE_TPUT[j], BASE_TTFT_P99[j]
        serving["baseline"][level["key"]] = _stats(tput, None, ttft, drafting=False)
        serving["spec"][level["key"]] = _stats(tput * SPEEDUPS[j], SPEEDUPS[j], ttft * 0.9, drafting=True)
    checked = 2 * len(levels) * 12
    return {
        "mode": "serving", "complete": True, "serving_levels": levels, "serving": serving,
        "serving_exactness": {"reference": "baseline at batch 1", "divergent": divergent or [], "checked": checked},
        "serve": {"spec_max_batch": None, "max_num_tokens": 256, "batch_invariant": False, **(serve or {})},
        "token_cost": serving_token_cost(COST_PER_HOUR, serving, {"baseline": None, "spec": "baseline"}),
        "conditions": {
            "hardware": {"device": "cpu", "cpu": "AMD EPYC"}, "target": {"precision": "fp32"},
            "draft": {"kind": "ngram", "name": "ngram", "precision": None}, "kv": {"target": "auto", "draft": "auto"},
            "compat": {"checked": True, "note": "n-gram lookup proposes the target's own ids"},
            "sampling": {"temperature": temperature, "top_p": 1.0, "top_k": 0}, "gamma": 4,
            "workload": {"kind": "mixed", "num_prompts": 12}, "bench": {"repeat": 1, "cost_per_hour": COST_PER_HOUR},
        },
    }  # fmt: skip


def write_serving_run(run_dir: Path, summary: dict[str, Any]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    return run_dir


def typed(summary: dict[str, Any]) -> tuple[Summary, ServingSummary]:
    serving = ServingSummary.from_dict(summary)
    assert serving is not None
    return Summary.from_dict(summary), serving


def checklist(summary: dict[str, Any], records: list[RequestRecord] | None = None) -> dict[str, cl.CheckItem]:
    return {item.name: item for item in evaluate_serving_checklist(*typed(summary), records or [])}


def _row(text: str, *cells: str) -> str:
    """The report line of a table row starting with ``cells``."""
    prefix = "| " + " | ".join(cells) + " |"
    return next(line for line in text.splitlines() if line.startswith(prefix))


# ---- the report ----------------------------------------------------------------------------------


def test_report_has_the_table_curves_crossover_advice_and_plots(tmp_path: Path) -> None:
    summary = serving_summary(serve={"slo_ttft_ms": 200, "slo_tpot_ms": 50})
    run = write_serving_run(tmp_path / "serve-run", summary)
    text = write_report(run).read_text(encoding="utf-8")
    assert text.startswith("# Serving report: serve-run")
    headline = next(line for line in text.splitlines() if line.startswith("**Headline:**"))
    assert "**1.40×** the baseline's output throughput at concurrency 1 (14.00 vs 10.00 tok/s)" in headline
    assert "**0.85×** at concurrency 16" in headline and "set `serve.spec_max_batch=4`" in headline
    assert "greedy" in headline and "load levels concurrency 1, 2, 4, 8, 16" in headline
    assert "## Batch-1" not in text and "## Cost model" not in text and "## Time split" not in text
    spec8 = _row(text, "concurrency 8", "spec")
    assert "| 0.92× |" in spec8 and "| 46.00 |" in spec8 and "| 100.0% |" in spec8 and "| 225.0 |" in spec8
    assert "| reference |" in _row(text, "concurrency 8", "baseline")
    assert "| spec | 4 | 8 | 46.00 at 8 | 8 | 4 |" in text  # knee, saturation, peak, crossover, last paying
    assert "| baseline | 4 | 8 | 52.00 at 16 | — | — |" in text
    assert "speculation stops paying from concurrency 8 (0.92×, below 1× at every higher level): set " \
           "`serve.spec_max_batch=4` (this run: serve.spec_max_batch=None)." in text  # fmt: skip
    assert "| concurrency 4 | code | 0.800 | 3.40 | 6 |" in text  # α by task type per level
    assert "120 checked, 0 divergent." in text
    assert "**applies** — speedup falls as concurrency rises (spec): speedup 1.40× at concurrency 1 → 0.85× at 16" \
        in text  # fmt: skip
    assert "**applies** — TTFT up, throughput up under load (baseline)" in text
    assert "batch jobs, not interactive" in text
    assert "**applies** — TPOT better, throughput worse (spec): at concurrency 8 (TPOT p50 18.0 vs 22.0 ms" in text
    for name in ("throughput_vs_concurrency", "speedup_vs_concurrency", "latency_vs_concurrency"):
        assert f"(plots/{name}.png)" in text
        assert (run / "plots" / f"{name}.png").read_bytes().startswith(PNG_SIGNATURE)
    assert not (run / "plots" / "throughput_vs_rate.png").exists()


def test_slo_items_pass_and_fail_with_the_highest_level_meeting_them() -> None:
    items = checklist(serving_summary(serve={"slo_ttft_ms": 200, "slo_tpot_ms": 50}))
    ttft = items[TTFT_ITEM]
    assert ttft.status == cl.FAIL
    assert "baseline meets it up to concurrency 4 (p99 ms by concurrency: 1: 50.0, 2: 80.0, 4: 120.0, 8: 250.0" in (
        ttft.evidence
    )
    assert "spec meets it up to concurrency 4 (p99 ms by concurrency: 1: 45.0" in ttft.evidence  # 225 ms at 8
    assert ttft.fix == "keep each replica at or below concurrency 4 (every arm meets it up to there); add replicas"
    tpot = items["TPOT P99 ≤ serve.slo_tpot_ms (50 ms) at every level"]
    assert tpot.status == cl.PASS and "meets it up to concurrency 16" in tpot.evidence
    loose = checklist(serving_summary(serve={"slo_ttft_ms": 1000}))
    assert loose["TTFT P99 ≤ serve.slo_ttft_ms (1000 ms) at every level"].status == cl.PASS
    assert items["P95/P99 stated at every load level"].status == cl.PASS
    assert items["vocab/tokenizer checked"].status == cl.PASS


def test_an_slo_only_speculation_misses_fails_with_the_spec_cap_that_keeps_it() -> None:
    summary = serving_summary(serve={"slo_ttft_ms": 200})
    summary["serving"]["spec"]["4"]["ttft_p99"] = 0.3  # the baseline meets it up to 4, spec only up to 2
    item = checklist(summary)[TTFT_ITEM]
    assert item.status == cl.FAIL and "spec meets it up to concurrency 2" in item.evidence
    assert item.fix.startswith("serve.spec_max_batch=2: speculation off above it, where the target alone meets it "
                               "(up to concurrency 4)")  # fmt: skip
    for level in map(str, CONCURRENCY):
        summary["serving"]["baseline"][level]["ttft_p99"] = 0.5
    item = checklist(summary)[TTFT_ITEM]
    assert item.status == cl.FAIL and item.fix.startswith("even the target alone misses it at the lowest concurrency")


def test_slo_items_are_absent_without_an_slo() -> None:
    names = list(checklist(serving_summary()))
    assert names == [
        "vocab/tokenizer checked",
        "P95/P99 stated at every load level",
        "exact under batching",
        "cost per unit of throughput",
        "alerts on acceptance and rollback",
        "canary share",
    ]


def test_exact_under_batching_passes_fails_and_is_na_when_sampling(tmp_path: Path) -> None:
    assert checklist(serving_summary())["exact under batching"].status == cl.PASS
    divergent = [{"arm": "spec", "level": "8", "case_id": "humaneval/3", "position": 17}]
    item = checklist(serving_summary(divergent=divergent))["exact under batching"]
    assert item.status == cl.FAIL and "spec at concurrency 8: humaneval/3 token 17" in item.evidence
    assert item.fix.startswith("serve.batch_invariant=true")
    sampled = serving_summary(temperature=0.7)
    sampled["serving_exactness"] = None
    assert checklist(sampled)["exact under batching"].status == cl.NA
    unchecked = serving_summary()
    del unchecked["serving_exactness"]
    assert checklist(unchecked)["exact under batching"].status == cl.INSUFFICIENT
    text = write_report(write_serving_run(tmp_path / "div", serving_summary(divergent=divergent))).read_text()
    assert "| spec | concurrency 8 | humaneval/3 | 17 |" in text and "1 divergent." in text
    # the divergence is a finding; a serving run has no cost model, so its alerts item lacks a number, no finding
    headline = next(line for line in text.splitlines() if line.startswith("**Caution:**"))
    assert headline == "**Caution:** 1 pre-launch check(s) FAIL: exact under batching."
    assert ("**Not decided:** 1 pre-launch check(s) lack evidence: alerts on acceptance and rollback (INSUFFICIENT "
            "DATA) — the checklist says what decides each.") in text  # fmt: skip


def test_a_run_where_speculation_always_pays_gets_no_cap_and_no_falling_rule() -> None:
    summary = serving_summary()
    for i, key in enumerate(map(str, CONCURRENCY)):
        summary["serving"]["spec"][key]["speedup"] = (1.3, 1.35, 1.3, 1.32, 1.3)[i]
    findings = {f.rule: f for f in interpret_serving(typed(summary)[1])}
    assert findings["speedup falls as concurrency rises (spec)"].applies is False
    assert findings["TPOT better, throughput worse (spec)"].applies is False
    assert "still pays at the highest concurrency measured (16)" in spec_max_batch_advice(typed(summary)[1], "spec")


def test_nulls_everywhere_render_n_a(tmp_path: Path) -> None:
    summary = serving_summary(rates=(0.5,), serve={"slo_ttft_ms": 200, "slo_tpot_ms": 50})
    for by_level in summary["serving"].values():
        for key in by_level:
            by_level[key] = dict.fromkeys(by_level[key])
    summary["serving_exactness"] = {"reference": None, "divergent": None, "checked": None}
    summary["conditions"] = None
    text = write_report(write_serving_run(tmp_path / "nulls", summary)).read_text(encoding="utf-8")
    assert "**No headline:** no load level with a successful request (0 errors)." in text
    assert "| concurrency 4 | spec | n/a | n/a | n/a | n/a |" in text
    assert "| spec | n/a | n/a | n/a | n/a | n/a |" in text
    assert "n/a: no per-task-type acceptance in the serving summary." in text
    items = checklist(summary)
    ttft = items[TTFT_ITEM]
    assert ttft.status == cl.INSUFFICIENT and "not measured at any concurrency level" in ttft.evidence
    assert items["P95/P99 stated at every load level"].status == cl.INSUFFICIENT
    assert all(not f.applies for f in interpret_serving(typed(summary)[1]))
    assert not (tmp_path / "nulls" / "plots").exists() or not list((tmp_path / "nulls" / "plots").iterdir())


def test_empty_serving_sections_render(tmp_path: Path) -> None:
    text = write_report(write_serving_run(tmp_path / "empty", {"mode": "serving"})).read_text(encoding="utf-8")
    assert "**No headline:**" in text and "n/a: no load level measured." in text
    assert "Not checked: no serving_exactness in summary.json." in text


def test_rate_only_run_plots_throughput_vs_offered_rate(tmp_path: Path) -> None:
    run = write_serving_run(tmp_path / "open-loop", serving_summary(concurrency=(), rates=(0.5, 1.0, 2.0)))
    text = write_report(run).read_text(encoding="utf-8")
    headline = next(line for line in text.splitlines() if line.startswith("**Headline:**"))
    assert "**1.40×** the baseline's output throughput at rate 0.5 req/s" in headline
    assert "**1.10×** at rate 2 req/s (open loop only: no concurrency crossover)" in headline
    assert "No concurrency (closed-loop) level measured" in text and "| rate 1 req/s | spec |" in text
    assert (run / "plots" / "throughput_vs_rate.png").read_bytes().startswith(PNG_SIGNATURE)
    assert "(plots/throughput_vs_rate.png)" in text
    assert not (run / "plots" / "throughput_vs_concurrency.png").exists()


def test_baseline_only_and_incomplete_runs_get_no_headline(tmp_path: Path) -> None:
    baseline_only = serving_summary()
    del baseline_only["serving"]["spec"]
    text = write_report(write_serving_run(tmp_path / "base", baseline_only)).read_text(encoding="utf-8")
    assert "**No headline:** only the target-alone baseline was measured (draft=none)" in text
    assert "| baseline | 4 | 8 | 52.00 at 16 | — | — |" in text
    incomplete = {**serving_summary(), "complete": False}
    text = write_report(write_serving_run(tmp_path / "part", incomplete)).read_text(encoding="utf-8")
    assert "**No headline:** the run is incomplete (complete: False)" in text


# ---- the sweep -----------------------------------------------------------------------------------


def test_sweep_report_shows_serving_curves_and_leaves_classic_jobs_alone(tmp_path: Path) -> None:
    classic = tmp_path / "classic"
    shutil.copytree(PRE_SCHEMA_RUN, classic / "0")
    before = write_sweep_report(classic).read_text(encoding="utf-8")
    assert "Serving under load" not in before and not (classic / "plots" / "serving_curves.png").exists()
    sweep = tmp_path / "sweep"
    shutil.copytree(PRE_SCHEMA_RUN, sweep / "0")
    write_serving_run(sweep / "1", serving_summary())
    text = write_sweep_report(sweep).read_text(encoding="utf-8")
    classic_row = next(line for line in before.splitlines() if line.startswith("| [0](0/report.md)"))
    assert classic_row in text.splitlines()
    assert "## Serving under load" in text and "| 1 | 8 | spec | 46.00 | 0.92× | 225.0 | 30.0 |" in text
    assert "| 1 | spec | 4 | 8 | speculation stops paying from concurrency 8" in text
    assert (sweep / "plots" / "serving_curves.png").read_bytes().startswith(PNG_SIGNATURE)
    assert (sweep / "1" / "report.md").read_text(encoding="utf-8").startswith("# Serving report: 1")
    rows = {row["job"]: row for row in csv.DictReader((sweep / "sweep_summary.csv").open(encoding="utf-8"))}
    assert rows["1"]["arm"] == "spec" and rows["0"]["arm"] == "quant+spec"


def test_near_tie_divergences_pass_as_exact_up_to_near_ties_and_unexplained_ones_fail(tmp_path: Path) -> None:
    tie = {"arm": "spec", "level": "8", "case_id": "qa/1", "position": 5, "classification": "near_tie",
           "margin": 2e-4, "threshold": 1e-3, "reference_token": 11, "token": 12}  # fmt: skip
    summary = serving_summary(divergent=[tie])
    summary["serving_exactness"].update(verdict="exact up to near-ties", near_ties=1, unexplained=0)
    item = checklist(summary)["exact under batching"]
    assert item.status == cl.PASS and "near_tie, margin 0.0002" in item.evidence
    text = write_report(write_serving_run(tmp_path / "tie", summary)).read_text()
    assert "| spec | concurrency 8 | qa/1 | 5 | 11 | 12 | 0.0002 | 0.001 | near_tie |" in text
    assert "Verdict: **exact up to near-ties** (1 near-tie, 0 unexplained)." in text
    summary["serving_exactness"].update(verdict="unexplained divergence", near_ties=0, unexplained=1)
    summary["serving_exactness"]["divergent"][0]["classification"] = "unexplained"
    assert checklist(summary)["exact under batching"].status == cl.FAIL


def test_a_sampling_mix_run_shows_speedup_per_sampling_mode(tmp_path: Path) -> None:
    summary = serving_summary(concurrency=(1, 8), serve={"sampling_mix": [0.0, 0.7]})
    for arm in ("baseline", "spec"):
        for stats in summary["serving"][arm].values():
            stats["requests_by_mode"] = {"greedy": 6, "T=0.7": 6}
    summary["serving"]["spec"]["8"] |= {"speedup_by_mode": {"greedy": 1.25, "T=0.7": 0.9},
                                        "acceptance_by_mode": {"greedy": 0.8, "T=0.7": 0.4}}  # fmt: skip
    text = write_report(write_serving_run(tmp_path / "mix", summary)).read_text(encoding="utf-8")
    assert "## Speedup per sampling mode" in text
    assert "| concurrency 8 | spec | greedy | 6 | 0.800 | 1.25× |" in text
    assert "| concurrency 8 | spec | T=0.7 | 6 | 0.400 | 0.90× |" in text
    assert "| concurrency 1 | spec | T=0.7 | 6 | n/a | n/a |" in text


def test_a_run_of_one_sampling_mode_has_no_per_mode_section(tmp_path: Path) -> None:
    text = write_report(write_serving_run(tmp_path / "one", serving_summary())).read_text(encoding="utf-8")
    assert "## Speedup per sampling mode" not in text


def test_a_speedup_shows_the_range_of_its_repeats(tmp_path: Path) -> None:
    summary = serving_summary(concurrency=(1, 8))
    summary["serving"]["spec"]["1"] |= {"speedup_low": 1.31, "speedup_high": 1.52}
    summary["serving"]["spec"]["8"] |= {"speedup_low": 1.3, "speedup_high": 1.3}  # one repeat, or equal ones
    text = write_report(write_serving_run(tmp_path / "range", summary)).read_text(encoding="utf-8")
    assert "| 1.40× (1.31–1.52×) |" in _row(text, "concurrency 1", "spec")
    assert "| 1.30× |" in _row(text, "concurrency 8", "spec")
    headline = next(line for line in text.splitlines() if line.startswith("**Headline:**"))
    assert "**1.40×** (repeats 1.31–1.52×) the baseline's output throughput at concurrency 1" in headline
    assert "**1.30×** at concurrency 8" in headline
