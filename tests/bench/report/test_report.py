"""Run and sweep reports (spectoolkit.bench.report.render), checklist and rules (bench.report.checklist), plots, CLI.

Synthetic summary.json / records.jsonl following the summary schema of issue 4: a complete 2-arm run,
four_groups, gamma_sweep, draft=none, incomplete, no successful request, and sampling runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spectoolkit.bench.report import checklist as cl
from spectoolkit.bench.report import plots
from spectoolkit.bench.report.interpret import interpret
from spectoolkit.bench.report.render import render_report, write_report
from spectoolkit.bench.sweep.report import report_path_for, write_sweep_report
from spectoolkit.errors import SpecToolkitError
from spectoolkit.metrics.records import RequestRecord
from spectoolkit.metrics.summary_schema import Summary
from spectoolkit.metrics.token_cost import batch_token_cost

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TASKS = ("chat", "code")
SECTIONS = ("## Conditions", "## Results", "## By task type", "## By input and output length", "## Time split",
            "## Cost model", "## Cost per output token", "## Memory", "## Interpretation",
            "## Pre-launch checklist")  # fmt: skip
COST_PER_HOUR = 2.0  # bench.cost_per_hour of the synthetic runs


def _stats(tput: float, requests: int = 12, gamma: int = 0, draft: str = "none", target: str = "fp32",
           alpha: float | None = None, ttft: float = 0.30, lat: tuple[float, float, float] = (2.0, 2.4, 2.5),
           drafted: int = 0, reference: str | None = None) -> dict[str, Any]:  # fmt: skip
    """ArmStats whose time split sums exactly to total_time."""
    output_tokens = requests * 96
    total = output_tokens / tput
    draft_time = 0.25 * total if gamma else 0.0
    split = {"prefill": 0.1 * total, "draft": draft_time, "verify": 0.85 * total - draft_time, "overhead": 0.05 * total}
    hist = [2, 1, 1, 1, 5] if gamma else []
    rounds = sum(hist)
    return {
        "requests": requests, "output_tokens": output_tokens, "drafted_tokens": drafted,
        "accepted_tokens": int(drafted * (alpha or 0)), "acceptance_rate": alpha,
        "tokens_per_verify": 3.4 if gamma else 1.0, "rollback_rate": 0.3 if gamma else None,
        "proposal_coverage": 1.0 if gamma else None, "net_throughput": tput, "total_time": total,
        "target_precision": target, "draft": draft, "gamma": gamma, "reference_arm": reference, "time_split": split,
        "acceptance_histogram": hist, "mean_accept_length": 3.2 if gamma else None,
        "prob_accept_at_least": [sum(hist[i:]) / rounds for i in range(1, len(hist))] if gamma else [],
        "ttft": {"p50": ttft, "p95": ttft + 0.02, "p99": ttft + 0.03},
        "ttft_nonstreaming": {"p50": lat[0], "p95": lat[1], "p99": lat[2]},
        "latency": {"p50": lat[0], "p95": lat[1], "p99": lat[2]},
        "latencies": [lat[0] + (lat[2] - lat[0]) * i / (requests - 1) for i in range(requests)],
    }  # fmt: skip


def _arm_specs(kind: str) -> dict[str, dict[str, Any]]:
    """name -> _stats kwargs, per arm layout of the schema."""
    spec = {"gamma": 4, "draft": "model-rtn-int4", "reference": "baseline"}
    if kind == "four_groups":
        return {
            "baseline": {"target": "bf16"},
            "quant": {"target": "int4", "tput": 30.0},
            "spec": {**spec, "target": "bf16"},
            "quant+spec": {**spec, "target": "int4", "reference": "quant"},
        }
    if kind == "gamma_sweep":
        return {"baseline": {}, **{f"spec-g{g}": {**spec, "gamma": g} for g in (1, 2, 4, 8)}}
    if kind == "none":
        return {"baseline": {}}
    return {"baseline": {}, "spec": spec}  # fmt: skip


def _arms(kind: str, speedup: float, requests: int, alpha: float, drafted: int, ttft: float) -> dict[str, Any]:
    arms = {}
    for name, kwargs in _arm_specs(kind).items():
        kwargs = dict(kwargs)
        tput = kwargs.pop("tput", 25.0 * speedup if kwargs.get("gamma") else 25.0)
        extra = {"alpha": alpha, "drafted": drafted, "ttft": ttft - 0.01, "lat": (1.8, 2.1, 2.2)} if kwargs.get(
            "gamma") else {"ttft": ttft}  # fmt: skip
        arms[name] = _stats(tput, requests, **kwargs, **extra)
    return arms


def _group(arms: dict[str, Any]) -> dict[str, Any]:
    base = arms.get("baseline", {}).get("net_throughput")
    return {"arms": arms, "speedups": {a: s["net_throughput"] / base for a, s in arms.items() if a != "baseline"}}


BASE_TIMING = {"drafted_tokens": 0, "accepted_tokens": 0, "verify_rounds": 95, "rollback_count": 0,
               "proposed_rounds": 0, "total_time": 2.0, "ttft_nonstreaming": 2.0, "prefill_time": 0.2,
               "draft_time": 0.0, "verify_time": 1.7, "overhead_time": 0.1, "accept_lengths": [],
               "draft_lengths": []}  # fmt: skip


def _spec_timing(case: int) -> dict[str, Any]:
    """10 rounds of γ=4 drafts, 30 of 40 accepted (α 0.75); the time split sums to the total."""
    accept_lengths = [4, 4, 3, 2, 4, 0, 4, 1 + case % 2, 4, 4 - case % 2]
    return {"drafted_tokens": 40, "accepted_tokens": sum(accept_lengths), "verify_rounds": 10,
            "rollback_count": sum(n < 4 for n in accept_lengths), "proposed_rounds": 10, "total_time": 1.6,
            "ttft_nonstreaming": 1.6, "prefill_time": 0.2, "draft_time": 0.4, "verify_time": 0.9,
            "overhead_time": 0.1, "accept_lengths": accept_lengths, "draft_lengths": [4] * 10}  # fmt: skip


def _records(arms: dict[str, Any], cases: int, repeats: int, temperature: float) -> list[dict[str, Any]]:
    records, offset = [], 0.0
    for repeat in range(repeats):
        for case in range(cases):
            for arm, stats in arms.items():
                offset += 0.5
                records.append({
                    "case_id": f"case/{case}", "task_type": TASKS[case % 2], "repeat_idx": repeat, "arm": arm,
                    "drafter": stats["draft"], "target_precision": stats["target_precision"],
                    "draft_precision": "rtn-int4", "kv_target": "auto", "kv_draft": "auto",
                    "random_seed": 1000 * repeat + case, "temperature": temperature,
                    "top_p": 0.9 if temperature else 1.0, "top_k": 50 if temperature else 0,
                    "draft_len": stats["gamma"], "batch_size": 1, "concurrency": 1, "input_len": 200,
                    "output_len": 96, "error": None, **(_spec_timing(case) if stats["gamma"] else BASE_TIMING),
                    "gpu_mem_peak": None, "host_rss": 2**30 + int(offset * 2**20), "start_offset": offset,
                    "output_ids": [1, 2, 3], "ttft": 0.3,
                })  # fmt: skip
    return records


def make_run(kind: str = "standard", speedup: float = 1.25, temperature: float = 0.0, repeats: int = 3,
             cases: int = 4, alpha: float = 0.75, drafted: int = 1200,
             ttft: float = 0.30) -> tuple[dict, list]:  # fmt: skip
    """(summary, records) of a complete run of ``kind``: standard | four_groups | gamma_sweep | none.

    ``drafted``: tokens per drafting arm, half per task type; under greedy decoding each of a task type's
    ``cases // 2`` prompts counts once, so the default's 100 per request × 2 prompts just reaches α's 200."""
    arms = _arms(kind, speedup, cases * repeats, alpha, drafted, ttft)
    per_task = {task: _group(_arms(kind, speedup, cases * repeats // 2, alpha, drafted // 2, ttft)) for task in TASKS}
    drafting = [a for a, s in arms.items() if s["gamma"]]
    primary = {"standard": "spec", "four_groups": "quant+spec", "gamma_sweep": "spec-g4"}.get(kind)
    greedy = temperature == 0
    speedups = _group(arms)["speedups"]
    cost = {a: {"t1": 0.033, "draft_step": 0.008, "verify": {"1": 0.033, "5": 0.062}, "overhead": 0.002,
                "round_cost": 0.096, "expected_tokens": 3.4, "predicted_decode_speedup": 1.17,
                "predicted_speedup": 1.05 * speedups[a], "measured_speedup": speedups[a], "prediction_error": 0.05,
                "break_even_alpha": 0.55, "recommended_gamma": 4,
                "predicted_by_gamma": {"1": 1.1, "2": 1.2, "4": 1.3, "8": 1.2}} for a in drafting}  # fmt: skip
    summary = {
        "complete": True, "requests": len(arms) * cases * repeats, "errors": 0, "error_reasons": [],
        "primary_arm": primary, "speedup": _group(arms)["speedups"].get(primary) if primary else None,
        **_group(arms), "greedy_exact_match": 1.0 if greedy and primary else None,
        "exact_match": {a: 1.0 for a in drafting} if greedy else {}, "by_task_type": per_task,
        "task_share": {task: 0.5 for task in TASKS}, "by_input_len": {"129-512": _group(arms)},
        "by_output_len": {"33-128": _group(arms)}, "baseline_repeat_throughput": [25.0, 25.5, 24.8][:repeats],
        "baseline_spread": 0.03 if repeats > 1 else None, "cost_model": cost,
        "quant_quality": {"reference": "bf16", "quantized": "int4", "kl_mean": 0.11, "top1_agreement": 0.89,
                          "ppl_ref": 3.6, "ppl_quant": 3.98, "ppl_delta": 0.38, "positions": 379, "texts": 8}
        if kind == "four_groups" else None,
        "baseline_check": {"stock_tokens_per_s": 24.0, "baseline_tokens_per_s": 25.0, "ratio": 25.0 / 24.0,
                           "prompts": 3, "max_new_tokens": 32, "stock": "transformers 5.24.0 generate, sdpa, fp32"},
        "token_cost": batch_token_cost(COST_PER_HOUR, arms),
        "conditions": {
            "hardware": {"device": "cpu", "cpu": "AMD EPYC", "cpu_count": 2, "torch_threads": 2},
            "software": {"torch": "2.13.0", "transformers": "5.24.0", "python": "3.11.7"},
            "target": {"path": "/m", "precision": "bf16" if kind == "four_groups" else "fp32", "group_size": 64},
            "draft": {"kind": "none" if kind == "none" else "model", "name": "none" if kind == "none"
                      else "model-rtn-int4", "path": "/m", "precision": None if kind == "none" else "rtn-int4"},
            "kv": {"target": "auto", "draft": "auto"},
            "compat": {"checked": kind != "none", "note": "self-draft: the draft is the target checkpoint"},
            "arms": [{"name": a, "target_precision": s["target_precision"], "drafter": s["draft"], "gamma": s["gamma"],
                      "reference": s["reference_arm"]} for a, s in arms.items()],
            "primary_arm": primary, "sampling": {"temperature": temperature, "top_p": 0.9 if temperature else 1.0,
                                                 "top_k": 50 if temperature else 0, "seed": 0},
            "gamma": 0 if kind == "none" else 4, "batch_size": 1, "concurrency": 1,
            "workload": {"kind": "humaneval", "num_prompts": cases, "max_new_tokens": 96},
            "bench": {"warmup": 1, "repeat": repeats, "arms": kind, "cost_per_hour": COST_PER_HOUR},
            "memory": {"target_weight_bytes": 117 * 2**20, "draft_weight_bytes": 0 if kind == "none" else 60 * 2**20,
                       "target_kv_bytes": 11 * 2**20, "draft_kv_bytes": 0 if kind == "none" else 11 * 2**20,
                       "memory_delta_bytes": 0 if kind == "none" else 71 * 2**20},
            "compat_warnings": [],
        },
    }  # fmt: skip
    return summary, _records(arms, cases, repeats, temperature)


def write_run(run_dir: Path, summary: dict, records: list, torn: bool = True) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    lines = [json.dumps(r) for r in records] + (['{"case_id": "torn'] if torn else [])
    (run_dir / "records.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return run_dir


def typed(summary: dict) -> Summary:
    """The summary as the report reads it (tests build and edit plain JSON, then hand it over)."""
    return Summary.from_dict(summary)


def typed_records(records: list[dict]) -> list[RequestRecord]:
    return [RequestRecord.from_dict(record) for record in records]


def checklist(summary: dict, records: list) -> list[cl.CheckItem]:
    return cl.evaluate_checklist(typed(summary), typed_records(records))


def statuses(summary: dict, records: list) -> dict[str, str]:
    return {item.name.split(" (")[0]: item.status for item in checklist(summary, records)}


def gated(summary: dict, records: list) -> set[str]:
    """The statuses of every item a benchmark can evidence (the canary share is a deployment choice: N/A)."""
    found = statuses(summary, records)
    assert found.pop("canary share") == "N/A"
    return set(found.values())


def applies(summary: dict) -> dict[str, bool]:
    return {finding.rule: finding.applies for finding in interpret(typed(summary))}


def assert_png(path: Path) -> None:
    assert path.is_file() and path.read_bytes()[:8] == PNG_SIGNATURE, path


# ---- run report ----------------------------------------------------------------------------------


def test_standard_report_has_headline_with_conditions_sections_and_plots(tmp_path):
    run_dir = write_run(tmp_path / "run", *make_run())
    path = write_report(run_dir)
    text = path.read_text(encoding="utf-8")
    assert path == run_dir / "report.md" and not list(run_dir.glob(".*tmp*"))
    headline = next(line for line in text.splitlines() if line.startswith("**Headline:**"))
    for part in ("`spec`", "**1.25×**", "cpu (AMD EPYC, 2 torch threads)", "target fp32",
                 "draft model-rtn-int4 (rtn-int4)", "KV target/draft auto/auto", "γ=4",
                 "greedy (temperature 0, top-p 1, top-k 0)", "batch 1, concurrency 1", "humaneval × 4 prompts",
                 "3 repeats", "greedy exact match 100.0%"):  # fmt: skip
        assert part in headline, part
    for section in SECTIONS:
        assert section in text, section
    assert "## Quantization quality" not in text and "## Stability" not in text and "**Caution:**" not in text
    for name in ("speedup_vs_gamma", "acceptance_histogram", "latency_cdf", "alpha_by_task", "time_split"):
        assert_png(run_dir / "plots" / f"{name}.png")
        assert f"](plots/{name}.png)" in text
    assert not (run_dir / "plots" / "stability.png").exists()
    assert "| spec | fp32 | model-rtn-int4 | 4 | 1.25× | 31.25 | 0.750 |" in text  # Results row
    assert "Predicted speedup per γ (spec, from its own rounds at γ=4)" in text
    assert "| 8 | 1.20× (best beyond the measured range: predicted, not measured) | extrapolation: " in text
    assert "| 4 | 1.30× (recommended) | exact (truncated measured rounds) |" in text
    assert ("| spec | 33.00 | 8.00 | 62.00 | 2.00 | 96.00 | 3.40 | 1.17× | 1.31× | 1.25× | +5.0% | 0.550 | "
            "4: 1.30× (of 1–4) | 8: 1.20× (predicted, not measured) |") in text  # fmt: skip
    assert "| draft KV cache | 11.0 MiB |" in text and "+71.0 MiB" in text


def test_report_of_a_summary_built_by_the_real_aggregation(tmp_path):
    """Contract: metrics.summary + metrics.cost_model output renders with numbers, not n/a."""
    from spectoolkit.metrics.summary import cost_models, summarize

    template, records = make_run(cases=10)  # 5 prompts per task type × 40 drafted: α per task type decides
    arm_info = {"baseline": {"reference": None, "gamma": 0}, "spec": {"reference": "baseline", "gamma": 4}}
    summary = summarize(typed_records(records), greedy=True, arms=arm_info, primary="spec")
    summary["cost_model"] = cost_models(typed_records(records), arm_info, {"spec": {1: 0.02, 5: 0.03}})
    summary["conditions"] = template["conditions"]
    summary["baseline_check"] = template["baseline_check"]
    summary["token_cost"] = batch_token_cost(COST_PER_HOUR, summary["arms"])
    text = write_report(write_run(tmp_path / "run", summary, records)).read_text(encoding="utf-8")
    assert "**Headline:** `spec` decodes at **1.25×**" in text
    cost_section = text.split("## Cost model")[1].split("## Memory")[0]
    cost_row = next(line for line in cost_section.splitlines() if line.startswith("| spec |"))
    assert "n/a" not in cost_row and "| 28.42 |" in cost_row  # V(5) = 0.03 s scaled by T₁ / V(1)
    assert gated(summary, records) == {"PASS"}, checklist(summary, records)


NOISY = [22.0, 28.0, 25.0, 21.0, 29.0]  # baseline tok/s per repeat: noise 0.141, no repeat alone to blame


def test_headline_carries_a_caution_when_a_check_fails(tmp_path):
    summary, records = make_run()
    summary["baseline_repeat_throughput"] = NOISY
    text = render_report(typed(summary), typed_records(records), {})
    assert "**Headline:**" in text and "**Caution:** 1 pre-launch check(s) FAIL: baseline reproducible." in text
    assert "**Not decided:**" not in text
    row = next(line for line in text.splitlines() if line.startswith("| baseline reproducible | **FAIL** |"))
    assert row.endswith("more repeats measure the noise better but do not lower it |")


def test_headline_counts_only_findings_and_names_the_undecided_apart():
    """The default command's two undecided items (no price, a workload too small for α per task type) are not
    counted as FAILs: no caution, a "not decided" line naming them, each row saying what decides it."""
    summary, records = make_run(drafted=600)  # 50 per request × 2 prompts per task type: 100 of 200
    summary["token_cost"] = batch_token_cost(None, summary["arms"])
    text = render_report(typed(summary), typed_records(records), {})
    assert "**Caution:**" not in text
    assert ("**Not decided:** 2 pre-launch check(s) lack evidence: α per task type (≥ 200 drafted) (INSUFFICIENT "
            "DATA); cost per unit of throughput (NOT SET) — the checklist says what decides each.") in text  # fmt: skip
    assert "| item | status | evidence | what to do |" in text
    row = next(line for line in text.splitlines() if line.startswith("| α per task type (≥ 200 drafted) |"))
    assert "| **INSUFFICIENT DATA** | below 200 drafted (each prompt once" in row
    assert "workload.num_prompts=8 (prompts needed: chat ≈ 4, code ≈ 4) |" in row  # humaneval × 4 prompts now
    summary["baseline_repeat_throughput"] = NOISY
    text = render_report(typed(summary), typed_records(records), {})
    assert "**Caution:** 1 pre-launch check(s) FAIL: baseline reproducible.\n\n**Not decided:** 2 pre-launch" in text


def test_four_groups_report_shows_every_arm_and_quantization_quality(tmp_path):
    summary, records = make_run("four_groups")
    text = write_report(write_run(tmp_path / "run", summary, records)).read_text(encoding="utf-8")
    for arm in ("baseline", "quant", "spec", "quant+spec"):
        assert f"| {arm} |" in text
    assert "target int4 (baseline target bf16)" in text
    assert "## Quantization quality" in text and "| kl_mean | 0.11 |" in text
    assert applies(summary)["quantized target"]
    assert "exactness is against the int4 target" in text


def test_gamma_sweep_plots_measured_points_and_every_arm(tmp_path):
    summary, records = make_run("gamma_sweep")
    run_dir = write_run(tmp_path / "run", summary, records)
    text = write_report(run_dir).read_text(encoding="utf-8")
    assert_png(run_dir / "plots" / "speedup_vs_gamma.png")
    assert [p[0] for p in plots._gamma_points(typed(summary))] == [1, 2, 4, 8]
    assert "**Headline:** `spec-g4`" in text and all(f"| spec-g{g} |" in text for g in (1, 2, 4, 8))


def test_draft_none_run_has_no_headline_and_renders_na(tmp_path):
    summary, records = make_run("none")
    text = write_report(write_run(tmp_path / "run", summary, records)).read_text(encoding="utf-8")
    assert "**No headline:** draft=none" in text and "**Headline:**" not in text
    assert "n/a: no cost model" in text
    assert statuses(summary, records) == {
        "baseline reproducible": "PASS", "vocab/tokenizer checked": "N/A", "sampling equal across arms": "N/A",
        "α per task type": "N/A", "draft and rollback time counted": "PASS", "P95/P99 stated": "PASS",
        "memory delta stated": "PASS", "exactness": "N/A", "fallback switch": "PASS",
        "baseline at least as fast as stock transformers": "PASS", "cost per unit of throughput": "PASS",
        "alerts on acceptance and rollback": "N/A", "canary share": "N/A",
    }  # fmt: skip


def test_incomplete_run_says_so_instead_of_a_headline(tmp_path):
    summary, records = make_run()
    summary["complete"] = False
    text = write_report(write_run(tmp_path / "run", summary, records)).read_text(encoding="utf-8")
    assert "**No headline:** the run is incomplete" in text and "**Headline:**" not in text
    assert "Conditions: hardware cpu" in text


def test_greedy_divergence_fails_exactness_and_names_the_first_divergence():
    summary, records = make_run("four_groups")
    summary["exact_match"]["quant+spec"] = 0.875
    diverged = next(r for r in records if r["arm"] == "quant+spec" and r["case_id"] == "case/2")
    diverged["output_ids"] = [1, 2, 9]
    item = next(i for i in checklist(summary, records) if i.name == "exactness")
    assert item.status == "FAIL"
    assert "quant+spec 87.5%" in item.evidence
    assert "first divergence of quant+spec from quant: case/2 repeat 0 at output token 2" in item.evidence
    assert cl.first_divergence(typed_records(records), "spec", "baseline") is None


def test_near_tie_divergence_passes_exactness_and_is_shown(tmp_path):
    summary, records = make_run("four_groups")
    summary["exact_match"]["quant+spec"] = 0.875
    tie = {"arm": "quant+spec", "case_id": "case/2", "repeat_idx": 0, "position": 25, "reference_token": 29,
           "spec_token": 731, "margin": 0.0304, "threshold": 0.1, "classification": "near_tie"}  # fmt: skip
    summary["exactness"] = {"verdict": "exact up to near-ties", "passed": True, "pairs": 24, "identical": 23,
                            "near_ties": 1, "unexplained": 0, "divergences": [tie],
                            "arms": {"quant+spec": {"verdict": "exact up to near-ties", "pairs": 12, "identical": 11,
                                                    "near_ties": 1, "unexplained": 0, "threshold": 0.1}}}  # fmt: skip
    item = next(i for i in checklist(summary, records) if i.name == "exactness")
    assert item.status == "PASS" and "1 near-tie, 0 unexplained" in item.evidence and "margin 0.0304" in item.evidence
    text = write_report(write_run(tmp_path / "run", summary, records)).read_text(encoding="utf-8")
    assert "**Verdict: exact up to near-ties**" in text
    assert "| quant+spec | case/2 | 0 | 25 | 29 | 731 | 0.0304 | — | near_tie |" in text
    summary["exactness"].update(verdict="unexplained divergence", passed=False, unexplained=1)
    assert next(i for i in checklist(summary, records) if i.name == "exactness").status == "FAIL"


def test_run_without_successful_records_does_not_crash(tmp_path):
    summary, records = make_run()
    for record in records:
        record.update(error="prompt longer than the context", total_time=None, ttft=None)
    empty = {"arms": {}, "speedups": {}}
    summary.update(arms={}, speedups={}, speedup=None, exact_match={"spec": None}, by_task_type={}, task_share={},
                   by_input_len={}, by_output_len={}, baseline_repeat_throughput=[], baseline_spread=None,
                   cost_model={}, errors=len(records), error_reasons=["prompt longer than the context"])  # fmt: skip
    summary["by_task_type"] = {"code": empty}
    run_dir = write_run(tmp_path / "run", summary, records)
    text = write_report(run_dir).read_text(encoding="utf-8")
    assert "**No headline:** no successful requests (24 errors: prompt longer than the context)" in text
    assert "No successful requests in arm(s): baseline, spec." in text
    assert statuses(summary, records)["exactness"] == "INSUFFICIENT DATA"  # nothing decoded: no finding
    assert "FAIL" not in set(statuses(summary, records).values())
    assert "![" not in text and not (run_dir / "plots").exists()  # nothing to plot, nothing embedded


def test_sampling_run_states_sampling_and_skips_exactness(tmp_path):
    summary, records = make_run(temperature=0.7)
    text = write_report(write_run(tmp_path / "run", summary, records)).read_text(encoding="utf-8")
    assert "sampling (temperature 0.7, top-p 0.9, top-k 50)" in text
    assert "n/a (sampling)" in text and "exactness is the quality eval's distribution test" in text
    assert statuses(summary, records)["exactness"] == "N/A"


def _null_leaves(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _null_leaves(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_null_leaves(v) for v in value]
    return None


@pytest.mark.parametrize("kind", ["standard", "four_groups", "gamma_sweep", "none"])
def test_report_survives_nulls_and_missing_keys(tmp_path, kind):
    summary, records = make_run(kind)
    variants = [_null_leaves(summary), {}, {"complete": True, "speedup": 1.1}]
    variants += [{k: v for k, v in summary.items() if k != key} for key in summary]
    legacy = {
        "complete": True,
        "speedup": 0.71,
        "greedy_exact_match": 0.0,
        "conditions": summary["conditions"],
        "by_task_type": {"code": {"baseline": _stats(40.0), "spec": _stats(28.4, gamma=4), "speedup": 0.71}},
    }
    variants.append(legacy)  # issue-2 layout: arms at the top of each task group
    for variant in variants:
        text = render_report(typed(variant), [], {})
        assert "## Pre-launch checklist" in text
        cl.evaluate_checklist(typed(variant), typed_records(_null_leaves(records)))
    plots.run_plots(typed(_null_leaves(summary)), typed_records(_null_leaves(records)), tmp_path / "plots")
    assert "| spec |" in render_report(typed(legacy), [], {})


# ---- checklist -----------------------------------------------------------------------------------


def test_checklist_all_pass_on_a_clean_greedy_run():
    summary, records = make_run()
    assert gated(summary, records) == {"PASS"}
    evidence = {item.name: item.evidence for item in checklist(summary, records)}
    assert evidence["baseline reproducible"] == (
        "noise 0.014 (std / mean of baseline tok/s over 3 repeats, limit 0.05); range 0.028"
    )
    assert evidence["α per task type (≥ 200 drafted)"] == (
        "fewest drafted: 200 (chat, spec) over 2 task types (each prompt once: greedy repeats re-decode the same "
        "tokens)"
    )
    assert all(not item.fix for item in checklist(summary, records))
    assert "break-even α 0.550 vs measured α 0.750 (spec)" in evidence["fallback switch (draft=none)"]


def _set(summary: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        summary = summary[key]
    summary[path[-1]] = value


@pytest.mark.parametrize(
    ("item", "path", "value", "status", "fix"),
    [
        ("baseline reproducible", ("baseline_repeat_throughput",), NOISY, "FAIL", "taskset"),
        ("exactness", ("exact_match", "spec"), 0.9, "FAIL", "+eval=exactness"),
        ("draft and rollback time counted", ("arms", "spec", "time_split", "overhead"), 5.0, "FAIL", "timing"),
        ("draft and rollback time counted", ("arms", "spec", "time_split", "draft"), 0.0, "FAIL", "timing"),
        ("vocab/tokenizer checked", ("conditions", "compat", "checked"), False, "INSUFFICIENT DATA",
         "python -m spectoolkit.compat TARGET DRAFT"),
        ("α per task type", ("by_task_type", "code", "arms", "spec", "drafted_tokens"), 450, "INSUFFICIENT DATA",
         "workload.num_prompts=6 (prompts needed: code ≈ 3)"),
        ("P95/P99 stated", ("arms", "spec", "latency", "p99"), None, "INSUFFICIENT DATA", "re-run"),
        ("memory delta stated", ("conditions", "memory", "memory_delta_bytes"), None, "INSUFFICIENT DATA", "re-run"),
    ],
)  # fmt: skip
def test_checklist_item_fails_on_a_finding_and_is_undecided_without_evidence(item, path, value, status, fix):
    """Bad evidence FAILs, missing evidence is INSUFFICIENT DATA; either way the item says what to do."""
    summary, records = make_run()
    _set(summary, path, value)
    result = statuses(summary, records)
    assert result[item] == status
    assert sum(found != "PASS" for name, found in result.items() if name != "canary share") == 1
    found = next(i for i in checklist(summary, records) if i.name.split(" (")[0] == item)
    assert fix in found.fix, found


def test_unequal_seeds_across_arms_fail_sampling_check():
    summary, records = make_run()
    next(r for r in records if r["arm"] == "spec" and r["case_id"] == "case/1")["random_seed"] += 1
    item = cl.check_sampling_equal(typed_records(records))
    assert item.status == "FAIL" and "1 of 12 groups differ" in item.evidence and "case/1" in item.evidence
    assert "resume=false" in item.fix
    assert cl.check_sampling_equal([]).status == "INSUFFICIENT DATA"


def test_one_repeat_leaves_reproducibility_undecided_and_no_baseline_leaves_the_fallback_undecided():
    summary, records = make_run(repeats=1)
    item = cl.check_baseline_spread(typed(summary))
    assert (item.status, item.fix) == ("INSUFFICIENT DATA", "bench.repeat=5")
    assert item.evidence == "1 baseline repeat(s) measured: its noise needs ≥ 3"
    del summary["arms"]["baseline"]
    assert cl.check_fallback(typed(summary)).status == "INSUFFICIENT DATA"


def test_fallback_evidence_flags_alpha_below_break_even():
    summary, _ = make_run(alpha=0.4)
    assert "α below break-even" in cl.check_fallback(typed(summary)).evidence


@pytest.mark.parametrize(("ratio", "status"), [(0.5, "FAIL"), (0.949, "FAIL"), (0.95, "PASS"), (1.1, "PASS")])
def test_baseline_vs_stock_fails_below_the_ratio_limit(ratio, status):
    summary, records = make_run()
    summary["baseline_check"].update(stock_tokens_per_s=20.0, baseline_tokens_per_s=20.0 * ratio, ratio=ratio)
    item = cl.check_baseline_vs_stock(typed(summary))
    assert item.status == status, item
    assert ("quote no speedup from this run" in item.fix) == (status == "FAIL")
    assert f"ours {20.0 * ratio:.2f} tok/s vs stock transformers 20.00 tok/s (ratio {ratio:.3f}, limit 0.95)" in (
        item.evidence
    )
    assert statuses(summary, records)["baseline at least as fast as stock transformers"] == status
    if status == "FAIL":  # the headline's caution names it
        assert "baseline at least as fast as stock transformers" in render_report(typed(summary), [], {})


@pytest.mark.parametrize(
    ("section", "status", "words"),
    [
        (None, "N/A", "bench.baseline_check=false"),
        ({"skipped": "rtn-int4 is our own format"}, "N/A", "skipped: rtn-int4 is our own format"),
        ({"error": "OutOfMemoryError: CUDA out of memory"}, "INSUFFICIENT DATA", "failed: OutOfMemoryError"),
        ({"stock_tokens_per_s": 20.0}, "INSUFFICIENT DATA", "without a ratio"),
    ],
)
def test_baseline_vs_stock_absent_skipped_or_failed(section, status, words):
    summary, _ = make_run()
    summary["baseline_check"] = section
    if section is None:
        del summary["baseline_check"]
    item = cl.check_baseline_vs_stock(typed(summary))
    assert item.status == status and words in item.evidence, item


# ---- interpretation rules ------------------------------------------------------------------------


def _tweak(summary: dict, rule: str) -> None:
    """Make exactly ``rule``'s condition hold on a standard run."""
    arms, spec = summary["arms"], summary["arms"]["spec"]
    if rule == "TTFT up, throughput up":
        spec["ttft"]["p50"] = arms["baseline"]["ttft"]["p50"] + 0.05
    elif rule == "speedup below 1":
        summary["speedup"], spec["acceptance_rate"] = 0.9, 0.5
        summary["cost_model"]["spec"]["measured_speedup"] = summary["cost_model"]["spec"]["predicted_speedup"] = 0.9
    elif rule == "α high, speedup below 1":
        _tweak(summary, "speedup below 1")
        spec["acceptance_rate"] = 0.95
    elif rule == "α differs across task types":
        summary["by_task_type"]["code"]["arms"]["spec"]["acceptance_rate"] = 0.95
    elif rule == "tail risk":
        spec["latency"]["p99"] = arms["baseline"]["latency"]["p99"] + 1.0
    elif rule == "cost model vs measurement":
        summary["cost_model"]["spec"]["predicted_speedup"] = 1.6
    elif rule == "quantized target":
        spec["target_precision"] = "rtn-int4"


RULES = ("TTFT up, throughput up", "speedup below 1", "α high, speedup below 1", "α differs across task types",
         "tail risk", "cost model vs measurement", "quantized target")  # fmt: skip


@pytest.mark.parametrize("rule", RULES)
def test_rule_fires_exactly_when_its_condition_holds(rule):
    summary, _ = make_run()
    assert not any(applies(summary).values()), applies(summary)
    _tweak(summary, rule)
    fired = {name for name, hit in applies(summary).items() if hit}
    expected = {rule, "speedup below 1"} if rule == "α high, speedup below 1" else {rule}
    assert fired == expected


def test_rules_stay_quiet_when_only_part_of_their_condition_holds():
    summary, _ = make_run()
    summary["arms"]["spec"]["latency"].update(p50=2.2, p99=3.0)  # slower everywhere: not a tail risk
    summary["arms"]["spec"]["ttft"]["p50"] = 0.4  # TTFT up ...
    summary["by_task_type"]["code"]["arms"]["spec"]["acceptance_rate"] = 0.89  # gap 0.14
    summary["cost_model"]["spec"]["predicted_speedup"] = 1.4  # +12%
    assert applies(summary)["TTFT up, throughput up"]
    summary["speedup"] = summary["cost_model"]["spec"]["measured_speedup"] = 0.9  # ... but throughput down (> 5%)
    fired = {name for name, hit in applies(summary).items() if hit}
    assert fired == {"speedup below 1", "α high, speedup below 1", "cost model vs measurement"}
    summary["cost_model"]["spec"]["predicted_speedup"] = 1.03  # +14.4%
    assert not applies(summary)["cost model vs measurement"]


def test_rule_texts_carry_their_numbers():
    summary, _ = make_run()
    _tweak(summary, "α high, speedup below 1")
    text = next(f.text for f in interpret(typed(summary)) if f.rule == "α high, speedup below 1")
    assert "α 0.950" in text and "0.90×" in text and "D·γ/T₁ = 0.97 (8.0 ms × 4 / 33.0 ms)" in text
    summary, _ = make_run()
    _tweak(summary, "cost model vs measurement")
    text = next(f.text for f in interpret(typed(summary)) if f.rule == "cost model vs measurement")
    assert "predicted 1.60× vs measured 1.25× (error +28.0%" in text and "more repeats" in text


# ---- plots ---------------------------------------------------------------------------------------


def test_stability_plot_needs_twenty_drafting_records(tmp_path):
    summary, records = make_run(cases=6, repeats=4)
    assert_png(plots.plot_stability(typed_records(records), tmp_path))
    text = write_report(write_run(tmp_path / "long", summary, records)).read_text(encoding="utf-8")
    assert "## Stability" in text and "![stability](plots/stability.png)" in text
    _, short = make_run()
    assert plots.plot_stability(typed_records(short), tmp_path / "short") is None


def test_plots_return_none_without_data(tmp_path):
    summary, _ = make_run("none")
    assert plots.plot_speedup_vs_gamma(typed(summary), tmp_path) is None
    assert plots.plot_acceptance_histogram(typed(summary), tmp_path) is None
    assert plots.plot_alpha_by_task(typed(summary), tmp_path) is None


# ---- sweep, dispatch, CLI ------------------------------------------------------------------------


def _sweep(tmp_path: Path) -> Path:
    sweep = tmp_path / "multirun"
    for job, gamma in enumerate((2, 4)):
        summary, records = make_run()
        summary["arms"]["spec"]["gamma"] = gamma
        summary["speedup"] = 1.1 + 0.1 * job
        run_dir = write_run(sweep / "2026-11-30" / "12-00-00" / str(job), summary, records)
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "overrides.yaml").write_text(f"- speculate.gamma={gamma}\n- +draft=rtn-int4\n")
    return sweep


def test_sweep_report_has_a_row_per_run_and_a_gamma_plot(tmp_path):
    sweep = _sweep(tmp_path)
    write_run(sweep / "2026-11-30" / "12-00-00" / "10", *make_run("none"))  # no overrides: its directory names it
    path = write_sweep_report(sweep)
    text = path.read_text(encoding="utf-8")
    assert path == sweep / "sweep_report.md"
    assert "| job | status | draft | speculate.gamma | arm | speedup |" in text
    rows = [line for line in text.splitlines() if line.startswith("| [")]
    assert len(rows) == 3
    assert rows[0].startswith("| [speculate.gamma=2 +draft=rtn-int4](2026-11-30/12-00-00/0/report.md) | complete |")
    assert "| rtn-int4 | 2 | spec | 1.10× |" in rows[0]
    assert "| 1.20× |" in rows[1] and rows[2].startswith("| [2026-11-30/12-00-00/10]")
    assert_png(sweep / "plots" / "speedup_vs_gamma.png")
    assert (sweep / "sweep_summary.csv").is_file()
    assert all((sweep / "2026-11-30" / "12-00-00" / job / "report.md").is_file() for job in ("0", "1", "10"))


def test_report_path_for_dispatches_and_rejects_empty_dirs(tmp_path):
    run_dir = write_run(tmp_path / "run", *make_run())
    assert report_path_for(run_dir) == run_dir / "report.md"
    assert report_path_for(_sweep(tmp_path)).name == "sweep_report.md"
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(SpecToolkitError):
            report_path_for(bad)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spectoolkit.report", *args], capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_cli_writes_report_and_prints_its_path(tmp_path):
    run_dir = write_run(tmp_path / "run", *make_run(), torn=False)
    result = _cli(str(run_dir))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(run_dir / "report.md")


def test_cli_error_is_one_line_without_traceback(tmp_path):
    for bad in ("/nonexistent", str(tmp_path)):
        result = _cli(bad)
        assert result.returncode == 1
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
        assert "Traceback" not in result.stderr and "point it at a run directory with summary.json" in lines[0]
