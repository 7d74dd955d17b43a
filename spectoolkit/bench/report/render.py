"""The run report (``report.md`` + ``plots/``), from summary.json and records.jsonl.

Follows DESIGN §3 (metric definitions) and issue 4: the report never states a headline number
without the conditions it holds under (hardware, precisions, KV, γ, sampling, batch/concurrency,
workload, repeats); an incomplete run or one without a baseline gets no headline at all. The
checklist is in ``report.checklist``, the interpretation rules in ``report.interpret``, plots in
``report.plots``, the cost model section in ``report.cost``, the draft length per round in
``report.draft_lengths``, the cost per output token in ``report.token_cost``, the sweep report in
``bench.sweep.report``; a serving run's report in ``report.serving``. Every report also writes
``alerts.yml`` beside report.md (``report.alerts``).
Older summaries, nulls, baseline-only runs and runs without a successful request render "n/a".
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from spectoolkit.bench.report import plots as plotting
from spectoolkit.bench.report.alerts import write_alerts
from spectoolkit.bench.report.check_item import caution, checklist_table
from spectoolkit.bench.report.checklist import evaluate_checklist
from spectoolkit.bench.report.cost import cost_section
from spectoolkit.bench.report.draft_lengths import k_section
from spectoolkit.bench.report.interpret import interpret
from spectoolkit.bench.report.load import (
    Records,
    arm_policy,
    atomic_write,
    drafting_arms,
    fmt,
    load_records,
    load_summary,
    md_table,
    num,
    sampling_mode,
    speed,
)
from spectoolkit.bench.report.quality import exactness_section, quality_section
from spectoolkit.bench.report.serving import load_serving, render_serving_report
from spectoolkit.bench.report.serving_plots import serving_plots
from spectoolkit.bench.report.token_cost import token_cost_section
from spectoolkit.bench.report.trees import tree_section
from spectoolkit.metrics.records import RequestRecord
from spectoolkit.metrics.summary_schema import BASELINE, TIME_PARTS, ArmStats, GroupStats, Summary

REPORT_NAME = "report.md"


# ---- small formatting helpers --------------------------------------------------------------------


def _mib(value: Any, sign: str = "") -> str:
    return fmt(num(value) / 2**20 if num(value) is not None else None, sign + ".1f", " MiB")


def _image(plots: dict[str, Path], name: str, alt: str) -> list[str]:
    return [f"![{alt}](plots/{plots[name].name})", ""] if name in plots else []


def _first_known(*values: Any) -> Any:
    """The first value that is not None: the summary's, else the run conditions', else a record's."""
    return next((v for v in values if v is not None), None)


def _field(record: RequestRecord | None, name: str) -> Any:
    """``record.name``, or None without a record (a run with no records.jsonl)."""
    return getattr(record, name) if record is not None else None


# ---- headline and conditions ---------------------------------------------------------------------


def _sampling_text(summary: Summary, first: RequestRecord | None) -> str:
    sampling = summary.conditions.sampling
    values = [_first_known(sampling.get(key), _field(first, key)) for key in ("temperature", "top_p", "top_k")]
    mode = "greedy" if num(values[0]) == 0 else "sampling"
    return f"{mode} (temperature {fmt(values[0], 'g')}, top-p {fmt(values[1], 'g')}, top-k {fmt(values[2], 'g')})"


def conditions_text(summary: Summary, records: Records) -> str:
    """The conditions every number of the run holds under, as one inline sentence part."""
    cond = summary.conditions
    arm = summary.primary_arm or BASELINE
    stats = summary.arms.get(arm) or ArmStats()
    first = next((r for r in records if r.arm == arm), records[0] if records else None)
    hw = cond.hardware
    threads = f", {hw['torch_threads']} torch threads" if hw.get("torch_threads") is not None else ""
    device = (
        f"{_first_known(hw.get('gpu'), hw.get('device'), 'n/a')} ({_first_known(hw.get('cpu'), 'cpu n/a')}{threads})"
    )
    target = _first_known(stats.target_precision, cond.target.get("precision"), _field(first, "target_precision"))
    base = summary.arms.get(BASELINE)
    base_target = base.target_precision if base else None
    if base_target and target and base_target != target:
        target = f"{target} (baseline target {base_target})"
    draft_name = _first_known(stats.draft, cond.draft.get("name"), _field(first, "drafter"), "none")
    draft_precision = _first_known(cond.draft.get("precision"), _field(first, "draft_precision"), "n/a")
    kv = (
        f"{_first_known(cond.kv.get('target'), _field(first, 'kv_target'), 'n/a')}/"
        f"{_first_known(cond.kv.get('draft'), _field(first, 'kv_draft'), 'n/a')}"
    )
    gamma = _first_known(stats.gamma or None, cond.gamma, _field(first, "draft_len"), "n/a")
    policy = arm_policy(summary, arm) or cond.policy
    if policy not in (None, "fixed", "none"):
        gamma = f"{gamma} ({policy} policy: k ≤ γ chosen per round)"
    batch = _first_known(cond.batch_size, _field(first, "batch_size"), "n/a")
    concurrency = _first_known(cond.concurrency, _field(first, "concurrency"), "n/a")
    prompts = _first_known(cond.workload.get("num_prompts"), len({r.case_id for r in records}) or None, "n/a")
    repeats = _first_known(cond.bench.get("repeat"), len({r.repeat_idx for r in records}) or None, "n/a")
    return (
        f"hardware {device}, target {target or 'n/a'}, draft {draft_name} ({draft_precision}), KV target/draft {kv}, "
        f"γ={gamma}, {_sampling_text(summary, first)}, batch {batch}, concurrency {concurrency}, "
        f"workload {_first_known(cond.workload.get('kind'), 'n/a')} × {prompts} prompts, {repeats} repeats"
    )


def _no_headline_reason(summary: Summary) -> str | None:
    arms, arm = summary.arms, summary.primary_arm
    errors, reasons = summary.errors, "; ".join(summary.error_reasons[:3])
    if not any(s.requests for s in arms.values()):
        return f"no successful requests ({fmt(errors, '.0f')} errors{': ' + reasons if reasons else ''})"
    if summary.complete is not True:
        requests = summary.requests if summary.requests is not None else "n/a"
        return (
            f"the run is incomplete (complete: {summary.complete}, {requests} "
            f"requests recorded, {errors} errors): the numbers below are partial, do not quote them"
        )
    if arm is None and not drafting_arms(summary):
        return "draft=none: only the target-alone baseline was measured, so there is no speedup to state"
    if BASELINE not in arms:
        return "no baseline measured in this run: a speedup needs the same-run target-alone baseline"
    if arm not in arms or summary.speedup is None:
        return f"no speedup measured for the primary arm ({arm or 'none'})"
    return None


def headline(summary: Summary, records: Records) -> str:
    """The primary arm's speedup with its conditions inline, or why there is no headline."""
    conditions = conditions_text(summary, records)
    reason = _no_headline_reason(summary)
    if reason:
        return f"**No headline:** {reason}.\n\nConditions: {conditions}."
    arm = summary.primary_arm or ""
    stats, base = summary.arms[arm], summary.arms[BASELINE]
    if sampling_mode(summary, records) == "greedy":
        exact = f"greedy exact match {fmt(summary.exact_match.get(arm), '.1%')} vs `{stats.reference_arm}`"
    else:
        exact = "sampling: exactness is the quality eval's distribution test"
    return (
        f"**Headline:** `{arm}` decodes at **{speed(summary.speedup)}** the target-alone baseline's net "
        f"throughput ({fmt(stats.net_throughput, '.2f')} vs {fmt(base.net_throughput, '.2f')} tok/s, "
        f"α {fmt(stats.acceptance_rate)}, E {fmt(stats.tokens_per_verify, '.2f')}, {exact}) "
        f"under: {conditions}.{caution(evaluate_checklist(summary, records))}"
    )


# ---- sections ------------------------------------------------------------------------------------


CONDITION_KEYS = "hardware software target draft kv sampling gamma batch_size concurrency workload bench compat".split()
# Columns of the per-arm tables: (header, ArmStats value, format spec).
ARM_COLUMNS = (
    ("tok/s", lambda s: s.net_throughput, ".2f"),
    ("α", lambda s: s.acceptance_rate, ".3f"),
    ("E", lambda s: s.tokens_per_verify, ".2f"),
    ("rollback", lambda s: s.rollback_rate, ".3f"),
    ("coverage", lambda s: s.proposal_coverage, ".3f"),
    ("TTFT p50 s", lambda s: s.ttft.p50, ".3f"),
    ("TTFT p95 s", lambda s: s.ttft.p95, ".3f"),
    ("TTFT non-stream p50 s", lambda s: s.ttft_nonstreaming.p50, ".3f"),
    ("latency p50 s", lambda s: s.latency.p50, ".3f"),
    ("p95 s", lambda s: s.latency.p95, ".3f"),
    ("p99 s", lambda s: s.latency.p99, ".3f"),
)
GROUP_COLUMNS = (
    ("requests", lambda s: s.requests, ".0f"),
    ("drafted", lambda s: s.drafted_tokens, ".0f"),
    ("tok/s", lambda s: s.net_throughput, ".2f"),
    ("α", lambda s: s.acceptance_rate, ".3f"),
)
Columns = tuple[tuple[str, Callable[[ArmStats], Any], str], ...]


def _columns(stats: ArmStats, columns: Columns) -> list[str]:
    return [fmt(value(stats), spec) for _, value, spec in columns]


def _conditions_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    cond = summary.conditions
    rows = []
    for key in CONDITION_KEYS:
        value = getattr(cond, key)
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items() if not isinstance(v, dict | list)) or None
        rows.append([key, value])
    rows.append(["compat warnings", "; ".join(cond.compat_warnings) or "none"])
    if cond.warnings:
        rows.append(["config warnings", "; ".join(cond.warnings)])
    rows.append(["arms measured", ", ".join(summary.arms) or None])
    return ["## Conditions", "", *md_table(["condition", "value"], rows)]


def _exact_cell(summary: Summary, records: Records, arm: str) -> str:
    if arm not in drafting_arms(summary):
        return "reference" if arm == BASELINE else "—"
    if sampling_mode(summary, records) != "greedy":
        return "n/a (sampling)"
    return fmt(summary.exact_match.get(arm), ".1%")


def _acceptance_table(summary: Summary) -> list[str]:
    rows = [
        [arm, stats.gamma, fmt(stats.mean_accept_length, ".2f"),
         ", ".join(fmt(p) for p in stats.prob_accept_at_least) or "n/a"]
        for arm, stats in summary.arms.items() if arm in drafting_arms(summary)
    ]  # fmt: skip
    if not rows:
        return []
    headers = ["arm", "γ", "mean accept length", "Pr(K ≥ 1), …, Pr(K ≥ γ)"]
    return ["Acceptance per drafting arm (measured over all rounds):", "", *md_table(headers, rows)]


def _results_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    headers = ["arm", "target", "draft", "γ", "speedup", *(h for h, _, _ in ARM_COLUMNS), "exact match"]
    rows = [
        [arm, stats.target_precision, stats.draft, stats.gamma, speed(summary.speedups.get(arm)),
         *_columns(stats, ARM_COLUMNS), _exact_cell(summary, records, arm)]
        for arm, stats in summary.arms.items()
    ]  # fmt: skip
    note = "Request-level quantiles over all successful records; speedup = arm / baseline net throughput, same run."
    lines = ["## Results", "", note, "", *md_table(headers, rows)]
    configured = [arm.name for arm in summary.conditions.arms]
    missing = [name for name in configured if name is not None and name not in summary.arms]
    if missing:
        lines += [f"No successful requests in arm(s): {', '.join(missing)}.", ""]
    if summary.errors:
        reasons = "; ".join(summary.error_reasons) or "n/a"
        requests = summary.requests if summary.requests is not None else "n/a"
        lines += [f"Errors: {summary.errors} of {requests} requests ({reasons}).", ""]
    lines += _acceptance_table(summary)
    return lines + _image(plots, "latency_cdf", "latency CDF") + _image(plots, "acceptance_histogram", "acceptance")


def _group_rows(label: str, group: GroupStats, extra: list[Any]) -> list[list[Any]]:
    return [
        [label, *extra, arm, *_columns(stats, GROUP_COLUMNS), speed(group.speedups.get(arm))]
        for arm, stats in group.arms.items()
    ]


def _task_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    share = summary.task_share
    rows = [
        row
        for task, group in summary.by_task_type.items()
        for row in _group_rows(task, group, [fmt(share.get(task), ".1%")])
    ]
    headers = ["task type", "share of requests", "arm", *(h for h, _, _ in GROUP_COLUMNS), "speedup"]
    body = md_table(headers, rows) if rows else ["n/a: no per-task-type statistics.", ""]
    return ["## By task type", "", *body, *_image(plots, "alpha_by_task", "alpha by task type")]


def _length_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    lines = ["## By input and output length", ""]
    for groups, title in ((summary.by_input_len, "input"), (summary.by_output_len, "output")):
        rows = [row for bucket, group in groups.items() for row in _group_rows(bucket, group, [])]
        headers = [f"{title} tokens", "arm", *(h for h, _, _ in GROUP_COLUMNS), "speedup"]
        lines += md_table(headers, rows) if rows else [f"n/a: no {title}-length buckets.", ""]
    return lines


def _share(value: Any, total: float | None) -> str:
    return f"{fmt(value)} ({fmt(num(value) / total if total and num(value) is not None else None, '.1%')})"


def _time_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    rows = []
    for arm, stats in summary.arms.items():
        split, total = stats.time_split, stats.total_time
        parts = [split.get(part) if split is not None else None for part in TIME_PARTS]
        summed = sum(v or 0 for v in parts) if split is not None else None
        rows.append([arm, *(_share(v, total) for v in parts), fmt(summed), fmt(total)])
    headers = ["arm", "prefill s", "draft s (incl. rollback)", "verify s", "overhead s", "sum of parts s", "total s"]
    body = md_table(headers, rows) if rows else ["n/a: no timed requests.", ""]
    return ["## Time split", "", *body, *_image(plots, "time_split", "time split")]


def _gpu_peaks(records: Records) -> dict[str, float]:
    peaks: dict[str, float] = {}
    for record in records:
        if record.gpu_mem_peak is not None:
            arm = str(record.arm)
            peaks[arm] = max(peaks.get(arm, 0.0), float(record.gpu_mem_peak))
    return peaks


def _stream_floor(summary: Summary) -> list[str]:
    """T₁ against its bandwidth floor: the target's streamed bytes at the read bandwidth measured in the run."""
    memory, base = summary.conditions.memory, summary.arms.get(BASELINE)
    if memory.target_step_floor_ms is None:
        return []
    measured = ""
    if base is not None and base.net_throughput:
        per_token = 1000 / base.net_throughput
        measured = (f" The baseline took {per_token:.1f} ms per output token (prefill included), "
                    f"{per_token / memory.target_step_floor_ms:.2f}× that floor.")  # fmt: skip
    return [
        f"A target decode step streams {_mib(memory.target_streamed_bytes)} of weights; at the read bandwidth "
        f"measured in this process ({memory.stream_bandwidth_gbs:.1f} GB/s) that is a floor of "
        f"{memory.target_step_floor_ms:.1f} ms per step.{measured}",
        "",
    ]


def _memory_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    memory = summary.conditions.memory
    parts = {"target_weight_bytes": "target weights", "draft_weight_bytes": "draft weights",
             "target_kv_bytes": "target KV cache", "draft_kv_bytes": "draft KV cache"}  # fmt: skip
    rows = [[label, _mib(getattr(memory, key))] for key, label in parts.items()]
    rows.append(["memory delta (primary arm − baseline)", _mib(memory.memory_delta_bytes, "+")])
    if memory.target_streamed_bytes is not None:  # recorded since issue 55
        rows.append(["target weights streamed per decode step", _mib(memory.target_streamed_bytes)])
        rows.append(["draft weights streamed per draft step", _mib(memory.draft_streamed_bytes)])
    lines = ["## Memory", "", *md_table(["part", "size"], rows), *_stream_floor(summary)]
    if memory.arms:
        rows = [[arm, _mib(m.total_bytes), _mib(m.delta_bytes, "+")] for arm, m in memory.arms.items()]
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
    return checklist_table(evaluate_checklist(summary, records))


def _stability_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    return ["## Stability", "", *_image(plots, "stability", "stability")] if "stability" in plots else []


def _k_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    return k_section(summary, plots, "by_task_type", "task type")


SECTIONS = (_conditions_section, _results_section, _task_section, _k_section, tree_section, _length_section,
            _time_section, cost_section, token_cost_section, _memory_section, exactness_section, quality_section,
            _interpretation_section, _checklist_section, _stability_section)  # fmt: skip


def render_report(summary: Summary, records: Records, plots: dict[str, Path], title: str = "run") -> str:
    """report.md text: headline, then every section; ``plots`` maps plot name -> PNG path in plots/."""
    lines = [f"# Run report: {title}", "", headline(summary, records), ""]
    for section in SECTIONS:
        lines += section(summary, records, plots)
    return "\n".join(lines).rstrip() + "\n"


def write_report(run_dir: Path) -> Path:
    """Write ``run_dir/report.md`` and ``run_dir/alerts.yml`` (atomically) and the plots in ``run_dir/plots/``;
    returns the report path.

    A serving run (``mode: serving``, issue 15) gets the serving report (``report.serving``) instead: it
    has no batch-1 arms, so the sections above do not apply to it."""
    run_dir = Path(run_dir)
    summary, records = load_summary(run_dir), load_records(run_dir)
    serving = load_serving(run_dir)
    if serving is not None:
        plots = serving_plots(serving, run_dir / "plots", summary)
        text = render_serving_report(summary, serving, records, plots, run_dir.name)
    else:
        plots = plotting.run_plots(summary, records, run_dir / "plots")
        text = render_report(summary, records, plots, run_dir.name)
    path = run_dir / REPORT_NAME
    atomic_write(path, text)
    write_alerts(run_dir, summary, records, serving)
    return path
