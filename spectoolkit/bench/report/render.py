"""The run report (``report.md`` + ``plots/``), from summary.json and records.jsonl.

Follows DESIGN §3 (metric definitions) and issue 4: the report never states a headline number
without the conditions it holds under (hardware, precisions, KV, γ, sampling, batch/concurrency,
workload, repeats); an incomplete run or one without a baseline gets no headline at all. The
checklist is in ``report.checklist``, the interpretation rules in ``report.interpret``, plots in
``report.plots``, the sweep report in ``bench.sweep.report``.
Older summaries, nulls, baseline-only runs and runs without a successful request render "n/a".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spectoolkit.bench.report import plots as plotting
from spectoolkit.bench.report.checklist import FAIL, evaluate_checklist
from spectoolkit.bench.report.interpret import interpret
from spectoolkit.bench.report.load import (
    BASELINE,
    Records,
    Summary,
    arms_of,
    as_dict,
    as_list,
    atomic_write,
    dig,
    drafting_arms,
    fmt,
    hashable,
    load_records,
    load_summary,
    md_table,
    num,
    primary_arm,
    sampling_mode,
    speed,
    speedups_of,
)
from spectoolkit.bench.report.quality import exactness_section, quality_section

REPORT_NAME = "report.md"
COST_HEADERS = (
    "arm|T₁ ms|D per step ms|V(γ+1) ms|C ms|round ms|E[N]|predicted decode|predicted request|measured|"
    "error|break-even α|recommended γ"
)


# ---- small formatting helpers --------------------------------------------------------------------


def _split(headers: str) -> list[str]:
    return headers.split("|")


def _mib(value: Any, sign: str = "") -> str:
    return fmt(num(value) / 2**20 if num(value) is not None else None, sign + ".1f", " MiB")


def _image(plots: dict[str, Path], name: str, alt: str) -> list[str]:
    return [f"![{alt}](plots/{plots[name].name})", ""] if name in plots else []


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


# ---- headline and conditions ---------------------------------------------------------------------


def _sampling_text(summary: Summary, first: dict[str, Any]) -> str:
    sampling = as_dict(dig(summary, "conditions", "sampling"))
    values = [_first(dig(sampling, key), first.get(key)) for key in ("temperature", "top_p", "top_k")]
    mode = "greedy" if num(values[0]) == 0 else "sampling"
    return f"{mode} (temperature {fmt(values[0], 'g')}, top-p {fmt(values[1], 'g')}, top-k {fmt(values[2], 'g')})"


def conditions_text(summary: Summary, records: Records) -> str:
    """The conditions every number of the run holds under, as one inline sentence part."""
    cond = as_dict(summary.get("conditions"))
    arm = primary_arm(summary) or BASELINE
    stats = arms_of(summary).get(arm, {})
    first = next((r for r in records if r.get("arm") == arm), records[0] if records else {})
    hw = as_dict(cond.get("hardware"))
    threads = f", {hw['torch_threads']} torch threads" if dig(hw, "torch_threads") is not None else ""
    device = f"{_first(dig(hw, 'gpu'), dig(hw, 'device'), 'n/a')} ({_first(dig(hw, 'cpu'), 'cpu n/a')}{threads})"
    target = _first(stats.get("target_precision"), dig(cond, "target", "precision"), first.get("target_precision"))
    base_target = dig(arms_of(summary).get(BASELINE), "target_precision")
    if base_target and target and base_target != target:
        target = f"{target} (baseline target {base_target})"
    draft_name = _first(stats.get("draft"), dig(cond, "draft", "name"), first.get("drafter"), "none")
    draft = f"{draft_name} ({_first(dig(cond, 'draft', 'precision'), first.get('draft_precision'), 'n/a')})"
    kv = (
        f"{_first(dig(cond, 'kv', 'target'), first.get('kv_target'), 'n/a')}/"
        f"{_first(dig(cond, 'kv', 'draft'), first.get('kv_draft'), 'n/a')}"
    )
    gamma = _first(stats.get("gamma") or None, dig(cond, "gamma"), first.get("draft_len"), "n/a")
    batch = _first(cond.get("batch_size"), first.get("batch_size"), "n/a")
    concurrency = _first(cond.get("concurrency"), first.get("concurrency"), "n/a")
    prompts = _first(
        dig(cond, "workload", "num_prompts"), len({hashable(r.get("case_id")) for r in records}) or None, "n/a"
    )
    repeats = _first(dig(cond, "bench", "repeat"), len({hashable(r.get("repeat_idx")) for r in records}) or None, "n/a")
    return (
        f"hardware {device}, target {target or 'n/a'}, draft {draft}, KV target/draft {kv}, γ={gamma}, "
        f"{_sampling_text(summary, first)}, batch {batch}, concurrency {concurrency}, "
        f"workload {_first(dig(cond, 'workload', 'kind'), 'n/a')} × {prompts} prompts, {repeats} repeats"
    )


def _no_headline_reason(summary: Summary) -> str | None:
    arms, arm = arms_of(summary), primary_arm(summary)
    errors, reasons = summary.get("errors"), "; ".join(map(str, as_list(summary.get("error_reasons"))[:3]))
    if not any(num(s.get("requests")) for s in arms.values()):
        return f"no successful requests ({fmt(errors, '.0f')} errors{': ' + reasons if reasons else ''})"
    if summary.get("complete") is not True:
        return (
            f"the run is incomplete (complete: {summary.get('complete')}, {summary.get('requests', 'n/a')} "
            f"requests recorded, {errors} errors): the numbers below are partial, do not quote them"
        )
    if arm is None and not drafting_arms(summary):
        return "draft=none: only the target-alone baseline was measured, so there is no speedup to state"
    if BASELINE not in arms:
        return "no baseline measured in this run: a speedup needs the same-run target-alone baseline"
    if arm not in arms or num(summary.get("speedup")) is None:
        return f"no speedup measured for the primary arm ({arm or 'none'})"
    return None


def headline(summary: Summary, records: Records) -> str:
    """The primary arm's speedup with its conditions inline, or why there is no headline."""
    conditions = conditions_text(summary, records)
    reason = _no_headline_reason(summary)
    if reason:
        return f"**No headline:** {reason}.\n\nConditions: {conditions}."
    arm = primary_arm(summary) or ""
    stats, base = arms_of(summary)[arm], arms_of(summary)[BASELINE]
    if sampling_mode(summary, records) == "greedy":
        exact = f"greedy exact match {fmt(dig(summary, 'exact_match', arm), '.1%')} vs `{stats.get('reference_arm')}`"
    else:
        exact = "sampling: exactness is the quality eval's distribution test"
    failed = [item.name for item in evaluate_checklist(summary, records) if item.status == FAIL]
    caution = f"\n\n**Caution:** {len(failed)} pre-launch check(s) FAIL: {'; '.join(failed)}." if failed else ""
    return (
        f"**Headline:** `{arm}` decodes at **{speed(summary['speedup'])}** the target-alone baseline's net "
        f"throughput ({fmt(stats.get('net_throughput'), '.2f')} vs {fmt(base.get('net_throughput'), '.2f')} tok/s, "
        f"α {fmt(stats.get('acceptance_rate'))}, E {fmt(stats.get('tokens_per_verify'), '.2f')}, {exact}) "
        f"under: {conditions}.{caution}"
    )


# ---- sections ------------------------------------------------------------------------------------


CONDITION_KEYS = "hardware software target draft kv sampling gamma batch_size concurrency workload bench compat".split()
# Columns of the per-arm tables: (header, ArmStats key path, format spec).
ARM_COLUMNS = (
    ("tok/s", ("net_throughput",), ".2f"),
    ("α", ("acceptance_rate",), ".3f"),
    ("E", ("tokens_per_verify",), ".2f"),
    ("rollback", ("rollback_rate",), ".3f"),
    ("coverage", ("proposal_coverage",), ".3f"),
    ("TTFT p50 s", ("ttft", "p50"), ".3f"),
    ("TTFT p95 s", ("ttft", "p95"), ".3f"),
    ("TTFT non-stream p50 s", ("ttft_nonstreaming", "p50"), ".3f"),
    ("latency p50 s", ("latency", "p50"), ".3f"),
    ("p95 s", ("latency", "p95"), ".3f"),
    ("p99 s", ("latency", "p99"), ".3f"),
)
GROUP_COLUMNS = (
    ("requests", ("requests",), ".0f"),
    ("drafted", ("drafted_tokens",), ".0f"),
    ("tok/s", ("net_throughput",), ".2f"),
    ("α", ("acceptance_rate",), ".3f"),
)


def _columns(stats: Any, columns: tuple[tuple[str, tuple[str, ...], str], ...]) -> list[str]:
    return [fmt(dig(stats, *path), spec) for _, path, spec in columns]


def _conditions_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    cond = as_dict(summary.get("conditions"))
    rows = []
    for key in CONDITION_KEYS:
        value = cond.get(key)
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items() if not isinstance(v, dict | list)) or None
        rows.append([key, value])
    rows.append(["compat warnings", "; ".join(map(str, as_list(cond.get("compat_warnings")))) or "none"])
    rows.append(["arms measured", ", ".join(map(str, arms_of(summary))) or None])
    return ["## Conditions", "", *md_table(["condition", "value"], rows)]


def _exact_cell(summary: Summary, records: Records, arm: str) -> str:
    if arm not in drafting_arms(summary):
        return "reference" if arm == BASELINE else "—"
    if sampling_mode(summary, records) != "greedy":
        return "n/a (sampling)"
    return fmt(dig(summary, "exact_match", arm), ".1%")


def _acceptance_table(summary: Summary) -> list[str]:
    rows = [
        [arm, stats.get("gamma"), fmt(stats.get("mean_accept_length"), ".2f"),
         ", ".join(fmt(p) for p in as_list(stats.get("prob_accept_at_least"))) or "n/a"]
        for arm, stats in arms_of(summary).items() if arm in drafting_arms(summary)
    ]  # fmt: skip
    if not rows:
        return []
    headers = ["arm", "γ", "mean accept length", "Pr(K ≥ 1), …, Pr(K ≥ γ)"]
    return ["Acceptance per drafting arm (measured over all rounds):", "", *md_table(headers, rows)]


def _results_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    headers = ["arm", "target", "draft", "γ", "speedup", *(h for h, _, _ in ARM_COLUMNS), "exact match"]
    speedups, arms = speedups_of(summary), arms_of(summary)
    rows = [
        [arm, stats.get("target_precision"), stats.get("draft"), stats.get("gamma"), speed(speedups.get(arm)),
         *_columns(stats, ARM_COLUMNS), _exact_cell(summary, records, arm)]
        for arm, stats in arms.items()
    ]  # fmt: skip
    note = "Request-level quantiles over all successful records; speedup = arm / baseline net throughput, same run."
    lines = ["## Results", "", note, "", *md_table(headers, rows)]
    configured = [hashable(dig(a, "name")) for a in as_list(dig(summary, "conditions", "arms"))]
    missing = [str(name) for name in configured if name is not None and name not in arms]
    if missing:
        lines += [f"No successful requests in arm(s): {', '.join(missing)}.", ""]
    if summary.get("errors"):
        reasons = "; ".join(map(str, as_list(summary.get("error_reasons")))) or "n/a"
        lines += [f"Errors: {summary['errors']} of {summary.get('requests', 'n/a')} requests ({reasons}).", ""]
    lines += _acceptance_table(summary)
    return lines + _image(plots, "latency_cdf", "latency CDF") + _image(plots, "acceptance_histogram", "acceptance")


def _group_rows(label: str, group: Any, extra: list[Any]) -> list[list[Any]]:
    speedups = speedups_of(group)
    return [
        [label, *extra, arm, *_columns(stats, GROUP_COLUMNS), speed(speedups.get(arm))]
        for arm, stats in arms_of(group).items()
    ]


def _task_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    tasks = as_dict(summary.get("by_task_type"))
    share = as_dict(summary.get("task_share"))
    rows = [row for task, group in tasks.items() for row in _group_rows(task, group, [fmt(share.get(task), ".1%")])]
    headers = ["task type", "share of requests", "arm", *(h for h, _, _ in GROUP_COLUMNS), "speedup"]
    body = md_table(headers, rows) if rows else ["n/a: no per-task-type statistics.", ""]
    return ["## By task type", "", *body, *_image(plots, "alpha_by_task", "alpha by task type")]


def _length_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    lines = ["## By input and output length", ""]
    for key, title in (("by_input_len", "input"), ("by_output_len", "output")):
        groups = as_dict(summary.get(key))
        rows = [row for bucket, group in groups.items() for row in _group_rows(bucket, group, [])]
        headers = [f"{title} tokens", "arm", *(h for h, _, _ in GROUP_COLUMNS), "speedup"]
        lines += md_table(headers, rows) if rows else [f"n/a: no {title}-length buckets.", ""]
    return lines


def _share(value: Any, total: float | None) -> str:
    return f"{fmt(value)} ({fmt(num(value) / total if total and num(value) is not None else None, '.1%')})"


def _time_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    rows = []
    for arm, stats in arms_of(summary).items():
        split, total = stats.get("time_split"), num(stats.get("total_time"))
        parts = [dig(split, part) for part in plotting.TIME_PARTS]
        summed = sum(num(v) or 0 for v in parts) if isinstance(split, dict) else None
        rows.append([arm, *(_share(v, total) for v in parts), fmt(summed), fmt(total)])
    headers = ["arm", "prefill s", "draft s (incl. rollback)", "verify s", "overhead s", "sum of parts s", "total s"]
    body = md_table(headers, rows) if rows else ["n/a: no timed requests.", ""]
    return ["## Time split", "", *body, *_image(plots, "time_split", "time split")]


def _verify_at(model: Any, width: int | None) -> Any:
    """V(width) from the cost model's width -> seconds table (JSON: str keys)."""
    verify = dig(model, "verify")
    return dig(verify, str(width)) if isinstance(verify, dict) and width else None


def _cost_row(summary: Summary, arm: str, model: Any) -> list[Any]:
    predicted, measured = num(dig(model, "predicted_speedup")), num(dig(model, "measured_speedup"))
    measured = measured if measured is not None else num(speedups_of(summary).get(arm))
    error = _first(num(dig(model, "prediction_error")), predicted / measured - 1 if predicted and measured else None)
    gamma = num(dig(arms_of(summary).get(arm), "gamma"))
    verify = _verify_at(model, int(gamma) + 1 if gamma else None)
    times = [dig(model, "t1"), dig(model, "draft_step"), verify, dig(model, "overhead"), dig(model, "round_cost")]
    return [arm, *(fmt(num(t) * 1e3 if num(t) is not None else None, ".2f") for t in times),
            fmt(dig(model, "expected_tokens"), ".2f"), speed(dig(model, "predicted_decode_speedup")),
            speed(predicted), speed(measured), fmt(error, "+.1%"), fmt(dig(model, "break_even_alpha")),
            dig(model, "recommended_gamma")]  # fmt: skip


def _cost_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    models = as_dict(summary.get("cost_model"))
    note = (
        "Speedup ≈ E[N]·T₁ / (D·γ + V(γ+1) + C) (DESIGN §1), T₁ per target step, D per draft step, V and C per "
        "round; the request prediction adds the prefill both arms pay; error = predicted / measured − 1."
    )
    lines = ["## Cost model", "", note, ""]
    headers = _split(COST_HEADERS)
    rows = [_cost_row(summary, arm, model) for arm, model in models.items()]
    lines += md_table(headers, rows) if rows else ["n/a: no cost model in summary.json (no drafting arm).", ""]
    curve = plotting.predicted_curve(summary)
    if curve:
        lines += [f"Predicted speedup per γ ({primary_arm(summary)}):", ""]
        best = dig(summary, "cost_model", primary_arm(summary) or "", "recommended_gamma")
        rows = [[g, speed(s) + (" (recommended)" if g == best else "")] for g, s in curve]
        lines += md_table(["γ", "predicted speedup"], rows)
    return lines + _image(plots, "speedup_vs_gamma", "speedup vs gamma")


def _gpu_peaks(records: Records) -> dict[str, float]:
    peaks: dict[str, float] = {}
    for record in records:
        value = num(record.get("gpu_mem_peak"))
        if value is not None:
            peaks[str(record.get("arm"))] = max(peaks.get(str(record.get("arm")), 0.0), value)
    return peaks


def _memory_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    memory = as_dict(dig(summary, "conditions", "memory"))
    parts = {"target_weight_bytes": "target weights", "draft_weight_bytes": "draft weights",
             "target_kv_bytes": "target KV cache", "draft_kv_bytes": "draft KV cache"}  # fmt: skip
    rows = [[label, _mib(dig(memory, key))] for key, label in parts.items()]
    rows.append(["memory delta (primary arm − baseline)", _mib(dig(memory, "memory_delta_bytes"), "+")])
    lines = ["## Memory", "", *md_table(["part", "size"], rows)]
    per_arm = dig(memory, "arms")
    if isinstance(per_arm, dict) and per_arm:
        rows = [[arm, _mib(dig(m, "total_bytes")), _mib(dig(m, "delta_bytes"), "+")] for arm, m in per_arm.items()]
        lines += md_table(["arm", "weights + KV", "delta vs baseline"], rows)
    peaks = _gpu_peaks(records)
    if peaks:
        rows = [
            [arm, _mib(peak), _mib(peak - peaks[BASELINE] if BASELINE in peaks else None, "+")]
            for arm, peak in peaks.items()
        ]
        lines += md_table(["arm", "gpu_mem_peak", "delta vs baseline"], rows)
    else:
        lines += ["gpu_mem_peak: not recorded (no accelerator).", ""]
    return lines


def _interpretation_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    lines = ["## Interpretation", ""]
    for finding in interpret(summary):
        lines.append(f"- **{'applies' if finding.applies else 'does not apply'}** — {finding.rule}: {finding.text}")
    return lines + [""]


def _checklist_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    rows = [[item.name, f"**{item.status}**", item.evidence] for item in evaluate_checklist(summary, records)]
    return ["## Pre-launch checklist", "", *md_table(["item", "status", "evidence"], rows)]


def _stability_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    return ["## Stability", "", *_image(plots, "stability", "stability")] if "stability" in plots else []


SECTIONS = (_conditions_section, _results_section, _task_section, _length_section, _time_section, _cost_section,
            _memory_section, exactness_section, quality_section, _interpretation_section, _checklist_section,
            _stability_section)  # fmt: skip


def render_report(summary: Summary, records: Records, plots: dict[str, Path], title: str = "run") -> str:
    """report.md text: headline, then every section; ``plots`` maps plot name -> PNG path in plots/."""
    lines = [f"# Run report: {title}", "", headline(summary, records), ""]
    for section in SECTIONS:
        lines += section(summary, records, plots)
    return "\n".join(lines).rstrip() + "\n"


def write_report(run_dir: Path) -> Path:
    """Write ``run_dir/report.md`` (atomically) and its plots in ``run_dir/plots/``; returns the report path."""
    run_dir = Path(run_dir)
    summary, records = load_summary(run_dir), load_records(run_dir)
    plots = plotting.run_plots(summary, records, run_dir / "plots")
    path = run_dir / REPORT_NAME
    atomic_write(path, render_report(summary, records, plots, run_dir.name))
    return path
