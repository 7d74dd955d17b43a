"""The report of a serving run (issue 15 item 7, DESIGN §6): load curves in place of the batch-1 sections.

A summary.json with ``mode: serving`` has no batch-1 ``arms``; ``render.write_report`` hands it here.
Sections: a headline (the primary drafting arm's speedup at the lowest and highest load, where
speculation stops paying and the ``serve.spec_max_batch`` to set), conditions, level × arm results, speedup
per sampling mode (a ``serve.sampling_mix`` run),
scheduler facts per level, load curves (knee, saturation, crossover: :mod:`spectoolkit.metrics.load_curves`),
the cost per output token per level (``report.token_cost``),
α by task type per level, the draft length k per round per level (``report.draft_lengths``), exactness
under batching, interpretation (``report.interpret``) and the serving checklist (``report.checklist``).
Any metric may be None: it renders "n/a". The sweep report's part for serving jobs is
:func:`sweep_serving_section`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spectoolkit.bench.report.check_item import caution, checklist_table
from spectoolkit.bench.report.draft_lengths import k_section
from spectoolkit.bench.report.interpret import interpret_serving
from spectoolkit.bench.report.load import Records, fmt, md_table, num, primary_arm, sampling_mode, speed
from spectoolkit.bench.report.serving_checklist import evaluate_serving_checklist
from spectoolkit.bench.report.token_cost import serving_token_cost_section
from spectoolkit.metrics.load_curves import (
    CONCURRENCY,
    KNEE_GAIN,
    RATE,
    SATURATION_SHARE,
    LevelStats,
    ServingLevel,
    ServingSummary,
    curve_marks,
    points,
)
from spectoolkit.metrics.summary_schema import BASELINE, Summary

Plots = dict[str, Path]
SERVE_KNOBS = ("spec_max_batch", "max_num_tokens", "batch_invariant")  # serve settings the headline states


def load_serving(run_dir: Path) -> ServingSummary | None:
    """The serving part of ``run_dir/summary.json``; None when it is not a serving run or cannot be read."""
    try:
        raw = json.loads((Path(run_dir) / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return ServingSummary.from_dict(raw)


# ---- formatting helpers --------------------------------------------------------------------------


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _ms(seconds: float | None) -> str:
    return fmt(seconds * 1e3 if seconds is not None else None, ".1f")


def _level(value: float | None, kind: str = CONCURRENCY) -> str:
    return "n/a" if value is None else f"{value:g}" + (" req/s" if kind == RATE else "")


def _image(plots: Plots, name: str, alt: str) -> list[str]:
    return [f"![{alt}](plots/{plots[name].name})", ""] if name in plots else []


def _levels_text(serving: ServingSummary) -> str:
    parts = [f"{kind} {', '.join(_level(lv.value) for lv in serving.of_kind(kind))}"
             for kind in (CONCURRENCY, RATE) if serving.of_kind(kind)]  # fmt: skip
    return "; ".join(parts) + (" req/s" if serving.of_kind(RATE) else "") if parts else "none"


# ---- headline and conditions ---------------------------------------------------------------------


def _group(values: dict[str, Any], name_keys: tuple[str, ...], detail: str) -> str:
    """``name (detail)`` of a conditions group, e.g. ``model-rtn-int4 (rtn-int4)`` for the draft."""
    return f"{_first(*(values.get(k) for k in name_keys), 'n/a')} ({_first(values.get(detail), 'n/a')})"


def serving_conditions_text(summary: Summary, serving: ServingSummary) -> str:
    """The conditions every number of the serving run holds under, as one inline sentence part."""
    cond, serve = summary.conditions, serving.serve
    temperature = num(cond.sampling.get("temperature"))
    mode = "n/a" if temperature is None else "greedy" if temperature == 0 else f"sampling (temperature {temperature:g})"
    kv = f"{_first(cond.kv.get('target'), 'n/a')}/{_first(cond.kv.get('draft'), 'n/a')}"
    workload = f"{_first(cond.workload.get('kind'), 'n/a')} × {_first(cond.workload.get('num_prompts'), 'n/a')} prompts"
    knobs = ", ".join(f"serve.{key}={serve.get(key)}" for key in SERVE_KNOBS)
    if cond.backend.get("kind") not in (None, "local"):  # the servers' own scheduler settings apply, not ours
        knobs = f"on servers ({cond.backend['kind']}): {servers_text(cond.servers)}"
    target = _first(cond.target.get("precision"), "n/a")
    return (
        f"hardware {_group(cond.hardware, ('gpu', 'device'), 'cpu')}, target {target}, "
        f"draft {_group(cond.draft, ('name', 'kind'), 'precision')}, KV target/draft {kv}, "
        f"γ={_first(cond.gamma, 'n/a')}, {mode}, workload {workload}, "
        f"{_first(cond.bench.get('repeat'), 'n/a')} repeats, load levels {_levels_text(serving)}, {knobs}"
    )


def servers_text(servers: dict[str, Any]) -> str:
    """arm at URL (engine version, model) for each server the run measured."""
    parts = []
    for arm, report in servers.items():
        report = report if isinstance(report, dict) else {}
        info = report.get("info") if isinstance(report.get("info"), dict) else {}
        version = report.get("version") if isinstance(report.get("version"), dict) else {}
        engine = info.get("engine") or ("vllm" if version else "server")
        models = [card.get("id") for card in report.get("models", []) if isinstance(card, dict)]
        parts.append(f"{arm} at {report.get('url', 'n/a')} ({engine} {version.get('version', '')}".rstrip()
                     + f", model {', '.join(map(str, models)) or 'n/a'})")  # fmt: skip
    return "; ".join(parts) or "n/a"


def spec_max_batch_advice(serving: ServingSummary, arm: str) -> str:
    """Where ``arm`` stops paying over the concurrency levels, and the ``serve.spec_max_batch`` to set."""
    curve = dict(points(*serving.curve(arm, "speedup")))
    if not curve:
        return "no speedup measured at a concurrency level: no serve.spec_max_batch advice"
    marks = curve_marks(serving, arm)
    if marks.crossover is None:
        return f"speculation still pays at the highest concurrency measured ({max(curve):g}): no cap needed up to it"
    at = f"{curve[marks.crossover]:.2f}×"
    if marks.last_paying is None:
        off = "keep it off (`draft=none`, or `serve.spec_max_batch=0`)"
        return f"speculation pays at no concurrency measured ({at} at concurrency {marks.crossover:g}): {off}"
    stop = f"speculation stops paying from concurrency {marks.crossover:g} ({at}, below 1× at every higher level)"
    return f"{stop}: set `serve.spec_max_batch={marks.last_paying:g}`"


def _no_headline_reason(summary: Summary, serving: ServingSummary, arm: str | None) -> str | None:
    cells = [stats for by_level in serving.arms.values() for stats in by_level.values()]
    if not any((stats.num_requests or 0) > 0 for stats in cells):
        errors = sum(stats.errors or 0 for stats in cells)
        return f"no load level with a successful request ({errors} errors)"
    if summary.complete is not True:
        return f"the run is incomplete (complete: {summary.complete}): the numbers below are partial, do not quote them"
    if BASELINE not in serving.arms:
        return "no baseline measured in this run: a speedup needs the same-run target-alone baseline at each level"
    if arm is None:
        return "only the target-alone baseline was measured (draft=none): the curves below have no speedup"
    if not any(serving.speedup(arm, level.key) is not None for level in serving.levels):
        return f"no speedup measured for `{arm}` at any load level"
    return None


def serving_headline(summary: Summary, serving: ServingSummary, records: Records) -> str:
    """The primary arm's speedup at the lowest and highest load and where it stops paying, or why not."""
    conditions, arm = serving_conditions_text(summary, serving), primary_arm(summary, serving)
    reason = _no_headline_reason(summary, serving, arm)
    if reason or arm is None:
        return f"**No headline:** {reason}.\n\nConditions: {conditions}."
    by_kind = [[lv for lv in serving.of_kind(kind) if serving.speedup(arm, lv.key) is not None]
               for kind in (CONCURRENCY, RATE)]  # fmt: skip
    levels = by_kind[0] or by_kind[1]
    low, high = levels[0], levels[-1]
    spec, base = serving.stats(arm, low.key).output_throughput, serving.stats(BASELINE, low.key).output_throughput

    def spread(level: ServingLevel) -> str:
        return _repeats_range(serving.stats(arm, level.key), "repeats ")

    text = (f"`{arm}` reaches **{speed(serving.speedup(arm, low.key))}**{spread(low)} the baseline's output "
            f"throughput at {low.label} ({fmt(spec, '.2f')} vs {fmt(base, '.2f')} tok/s)")  # fmt: skip
    if high is not low:
        text += f" and **{speed(serving.speedup(arm, high.key))}**{spread(high)} at {high.label}"
    text += f"; {spec_max_batch_advice(serving, arm)}" if by_kind[0] else " (open loop only: no concurrency crossover)"
    return f"**Headline:** {text}, under: {conditions}.{caution(evaluate_serving_checklist(summary, serving, records))}"


# ---- sections ------------------------------------------------------------------------------------

Section = Callable[[Summary, ServingSummary, Records, Plots], list[str]]
# Columns of the level × arm tables: (header, LevelStats -> cell text).
RESULT_COLUMNS: tuple[tuple[str, Callable[[LevelStats], str]], ...] = (
    ("requests", lambda s: fmt(s.num_requests, ".0f")),
    ("output tok/s", lambda s: fmt(s.output_throughput, ".2f")),
    ("req/s", lambda s: fmt(s.request_throughput, ".3f")),
    ("TTFT p50 ms", lambda s: _ms(s.ttft_p50)),
    ("TTFT p99 ms", lambda s: _ms(s.ttft_p99)),
    ("TPOT p50 ms", lambda s: _ms(s.tpot_p50)),
    ("TPOT p99 ms", lambda s: _ms(s.tpot_p99)),
    ("latency p99 s", lambda s: fmt(s.latency_p99)),
    ("mean batch", lambda s: fmt(s.mean_batch_size, ".2f")),
    ("α", lambda s: fmt(s.acceptance_rate)),
    ("mean accept length", lambda s: fmt(s.mean_accept_length, ".2f")),
)
SCHEDULER_COLUMNS: tuple[tuple[str, Callable[[LevelStats], str]], ...] = (
    ("ITL p50 ms", lambda s: _ms(s.itl_p50)),
    ("ITL p99 ms", lambda s: _ms(s.itl_p99)),
    ("latency p95 s", lambda s: fmt(s.latency_p95)),
    ("speculating share", lambda s: fmt(s.speculating_share, ".1%")),
    ("policy tok/s predicted", lambda s: fmt(s.policy_predicted_rate, ".2f")),
    ("policy tok/s measured", lambda s: fmt(s.policy_measured_rate, ".2f")),
    ("policy tokens pred/meas", lambda s: fmt(s.policy_tokens_ratio, ".3f")),
    ("policy T_B pred/meas", lambda s: fmt(s.policy_target_ratio, ".3f")),
    ("policy draft pred/meas", lambda s: fmt(s.policy_draft_ratio, ".3f")),
    ("peak temp KV tokens", lambda s: fmt(s.peak_temp_kv_tokens, ".0f")),
    ("preemptions", lambda s: fmt(s.preemptions, ".0f")),
    ("errors", lambda s: fmt(s.errors, ".0f")),
)
CONDITION_KEYS = "hardware software target draft kv sampling gamma workload bench compat".split()


def _measured(serving: ServingSummary) -> list[tuple[ServingLevel, str]]:
    """(level, arm) pairs in run order, arms in summary order, where the arm has an entry at the level."""
    return [(level, arm) for level in serving.levels for arm in serving.arms if level.key in serving.arms[arm]]


def _flat(value: Any) -> Any:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items() if not isinstance(v, dict | list)) or None
    return value


def _conditions_section(summary: Summary, serving: ServingSummary, records: Records, plots: Plots) -> list[str]:
    rows = [[key, _flat(getattr(summary.conditions, key))] for key in CONDITION_KEYS]
    rows += [["serve", _flat(serving.serve)], ["load levels", _levels_text(serving)],
             ["arms measured", ", ".join(serving.arms) or None]]  # fmt: skip
    if summary.conditions.backend.get("kind") not in (None, "local"):
        backend = summary.conditions.backend
        rows += [["backend", backend.get("kind")], ["servers", servers_text(summary.conditions.servers)]]
    return ["## Conditions", "", *md_table(["condition", "value"], rows)]


def _modes_section(summary: Summary, serving: ServingSummary, records: Records, plots: Plots) -> list[str]:
    """Speedup per sampling mode (``serve.sampling_mix``: greedy and sampled requests in one batch); nothing for a
    run whose requests all sampled alike."""
    modes = {mode for arm in serving.arms for level in serving.levels
             for mode in serving.stats(arm, level.key).requests_by_mode}  # fmt: skip
    if len(modes) < 2:
        return []
    rows = []
    for level, arm in _measured(serving):
        if arm == BASELINE:
            continue
        stats = serving.stats(arm, level.key)
        for mode in sorted(stats.requests_by_mode):
            rows.append([level.label, arm, mode, fmt(stats.requests_by_mode.get(mode), ".0f"),
                         fmt(stats.acceptance_by_mode.get(mode)), speed(stats.speedup_by_mode.get(mode))])  # fmt: skip
    note = ("The requests of a level took the temperatures of `serve.sampling_mix` in turn, in one batch; per mode, "
            "speedup = that mode's output tokens per second of the run's window / the baseline's (same requests, "
            "same window), median over repeats; α = accepted / drafted drafts of that mode's requests.")  # fmt: skip
    headers = ["load", "arm", "sampling", "requests", "α", "speedup"]
    return ["## Speedup per sampling mode", "", note, "", *(md_table(headers, rows) if rows else ["n/a", ""])]


def _repeats_range(stats: LevelStats, label: str = "") -> str:
    """The range after a speedup, " (0.98–1.10×)": the least and greatest per-repeat speedup; "" where one repeat
    (or equal ones)."""
    low, high = stats.speedup_low, stats.speedup_high
    if low is None or high is None or speed(low) == speed(high):
        return ""
    return f" ({label}{low:.2f}–{speed(high)})"


def _speedup_cell(serving: ServingSummary, arm: str, key: str) -> str:
    """The arm's speedup at level ``key`` with its repeats' range: "1.04× (0.98–1.10×)"."""
    return speed(serving.speedup(arm, key)) + _repeats_range(serving.stats(arm, key))


def _exact_cell(stats: LevelStats, mode: str | None) -> str:
    return "n/a (sampling)" if mode == "sampling" else fmt(stats.exact_match, ".1%")


def _results_section(summary: Summary, serving: ServingSummary, records: Records, plots: Plots) -> list[str]:
    mode = sampling_mode(summary, records)
    headers = ["load", "arm", *(h for h, _ in RESULT_COLUMNS[:3]), "speedup", *(h for h, _ in RESULT_COLUMNS[3:]),
               "exact match"]  # fmt: skip
    rows = []
    for level, arm in _measured(serving):
        stats = serving.stats(arm, level.key)
        cells = [cell(stats) for _, cell in RESULT_COLUMNS]
        speedup = "reference" if arm == BASELINE else _speedup_cell(serving, arm, level.key)
        rows.append([level.label, arm, *cells[:3], speedup, *cells[3:], _exact_cell(stats, mode)])
    note = ("Per load level and arm; speedup = output throughput / the baseline's at the same level (same "
            "request sequence, same time window), the median over repeats, in brackets the least and greatest "
            "repeat (a range that spans 1× did not tell the arm from the baseline in this run: more "
            "`bench.repeat`); quantiles over the level's requests; exact match vs the batch-1 reference.")  # fmt: skip
    body = md_table(headers, rows) if rows else ["n/a: no load level measured.", ""]
    sched = [[level.label, arm, *(cell(serving.stats(arm, level.key)) for _, cell in SCHEDULER_COLUMNS)]
             for level, arm in _measured(serving)]  # fmt: skip
    lines = ["## Results per load level", "", note, "", *body]
    if sched:
        lines += ["Scheduler and tails:", "", *md_table(["load", "arm", *(h for h, _ in SCHEDULER_COLUMNS)], sched)]
    return lines + _image(plots, "latency_vs_concurrency", "TTFT and TPOT P99 vs concurrency")


def _peak(serving: ServingSummary, arm: str) -> str:
    curve = points(*serving.curve(arm, "output_throughput"))
    if not curve:
        return "n/a"
    level, value = max(curve, key=lambda point: point[1])
    return f"{value:.2f} at {level:g}"


def _curves_section(summary: Summary, serving: ServingSummary, records: Records, plots: Plots) -> list[str]:
    lines = ["## Load curves", ""]
    if not serving.of_kind(CONCURRENCY):
        lines += ["No concurrency (closed-loop) level measured: knee, saturation and crossover are defined over "
                  "concurrency levels.", ""]  # fmt: skip
        return lines + _image(plots, "throughput_vs_rate", "throughput vs offered rate")
    note = (f"Over the concurrency levels (`spectoolkit.metrics.load_curves`): knee = the lower level of the first "
            f"doubling of load whose throughput gain is below {KNEE_GAIN}× (sublinear from there); saturation = the "
            f"lowest level within {SATURATION_SHARE:.0%} of the maximum throughput, confirmed by a higher level; "
            "crossover = the first level from which speedup < 1 at every higher level.")  # fmt: skip
    rows = []
    for arm in serving.arms:
        marks = curve_marks(serving, arm)
        speculation = [_level(marks.crossover), _level(marks.last_paying)] if arm != BASELINE else ["—", "—"]
        rows.append([arm, _level(marks.knee), _level(marks.saturation), _peak(serving, arm), *speculation])
    headers = ["arm", "knee", "saturation", "peak tok/s (at)", "stops paying from", "last level that pays"]
    lines += [note, "", *md_table(headers, rows)]
    current = serving.serve.get("spec_max_batch")
    lines += [f"- `{arm}`: {spec_max_batch_advice(serving, arm)} (this run: serve.spec_max_batch={current})."
              for arm in serving.drafting_arms]  # fmt: skip
    lines += [""] if serving.drafting_arms else []
    for name, alt in (("throughput_vs_concurrency", "throughput vs concurrency"),
                      ("speedup_vs_concurrency", "speedup vs concurrency"),
                      ("throughput_vs_rate", "throughput vs offered rate")):  # fmt: skip
        lines += _image(plots, name, alt)
    return lines


def _task_section(summary: Summary, serving: ServingSummary, records: Records, plots: Plots) -> list[str]:
    arms = serving.drafting_arms
    rows = []
    for level in serving.levels:
        tasks = dict.fromkeys(task for arm in arms for task in serving.stats(arm, level.key).by_task)
        for task in tasks:
            cells = [serving.stats(arm, level.key).by_task.get(task) for arm in arms]
            rows.append([level.label, task, *(value for c in cells for value in (
                fmt(c.acceptance_rate) if c else "n/a", fmt(c.mean_accept_length, ".2f") if c else "n/a",
                fmt(c.num_requests, ".0f") if c else "n/a"))])  # fmt: skip
    headers = ["load", "task type", *(f"{h} ({arm})" for arm in arms for h in ("α", "mean accept length", "requests"))]
    body = md_table(headers, rows) if rows else ["n/a: no per-task-type acceptance in the serving summary.", ""]
    return ["## Acceptance by task type per load level", "", *body]


def _exactness_section(summary: Summary, serving: ServingSummary, records: Records, plots: Plots) -> list[str]:
    lines = ["## Exactness under batching", ""]
    invariant = serving.serve.get("batch_invariant")
    if sampling_mode(summary, records) == "sampling":
        return lines + ["Sampling: token identity does not apply; each request's distribution is the target's "
                        "(per-request seeded generators; the quality eval's distribution test).", ""]  # fmt: skip
    exactness = serving.exactness
    if exactness is None:
        return lines + ["Not checked: no serving_exactness in summary.json.", ""]
    reference = exactness.reference or "the batch-1 reference"
    found = exactness.divergent
    lines += [f"Greedy: every request's output at every load level compared with its batch-1 target-alone output "
              f"(`{reference}`), serve.batch_invariant={invariant}: {fmt(exactness.checked, '.0f')} checked, "
              f"{len(found)} divergent.", ""]  # fmt: skip
    if found:
        rows = [
            [
                d.arm,
                serving.label_of(d.level),
                d.case_id,
                d.position,
                d.reference_token,
                d.token,
                fmt(d.margin, ".3g"),
                fmt(d.threshold, ".3g"),
                d.classification or "not replayed",
            ]
            for d in found
        ]
        lines += md_table(["arm", "load level", "case", "first differing output token", "reference token", "token",
                           "target-alone top-2 margin", "near-tie threshold", "class"], rows)  # fmt: skip
        if exactness.verdict:
            lines += [f"Verdict: **{exactness.verdict}** ({exactness.near_ties} near-tie, "
                      f"{exactness.unexplained} unexplained).", ""]  # fmt: skip
        lines += ["A divergence under batching is a kernel whose per-row result depends on the batch, or a bug: it "
                  "must be reproduced by replaying the step with the target alone (DESIGN §6); `serve.batch_invariant="
                  "true` must make it disappear.", ""]  # fmt: skip
    return lines


def _interpretation_section(summary: Summary, serving: ServingSummary, records: Records, plots: Plots) -> list[str]:
    lines = ["## Interpretation", ""]
    for finding in interpret_serving(serving):
        lines.append(f"- **{'applies' if finding.applies else 'does not apply'}** — {finding.rule}: {finding.text}")
    return lines + [""]


def _checklist_section(summary: Summary, serving: ServingSummary, records: Records, plots: Plots) -> list[str]:
    return checklist_table(evaluate_serving_checklist(summary, serving, records))


def _k_section(summary: Summary, serving: ServingSummary, records: Records, plots: Plots) -> list[str]:
    return k_section(summary, plots, "by_load_level", "load level", serving.label_of)


SERVING_SECTIONS: tuple[Section, ...] = (_conditions_section, _results_section, _modes_section, _curves_section,
                                         serving_token_cost_section, _task_section, _k_section, _exactness_section,
                                         _interpretation_section, _checklist_section)  # fmt: skip


def render_serving_report(
    summary: Summary, serving: ServingSummary, records: Records, plots: Plots, title: str = "run"
) -> str:
    """report.md text of a serving run; ``plots`` maps plot name -> PNG path in plots/."""
    lines = [f"# Serving report: {title}", "", serving_headline(summary, serving, records), ""]
    for section in SERVING_SECTIONS:
        lines += section(summary, serving, records, plots)
    return "\n".join(lines).rstrip() + "\n"


# ---- the sweep report's part ---------------------------------------------------------------------


def sweep_serving_section(curves: dict[str, ServingSummary], plot: Path | None) -> list[str]:
    """Markdown for the serving jobs of a sweep (``curves``: job label -> its serving part): throughput and
    speedup per concurrency level and arm, then each arm's knee, saturation and crossover."""
    rows, marks_rows = [], []
    for label, serving in curves.items():
        for level in serving.of_kind(CONCURRENCY):
            for arm in [arm for arm in serving.arms if level.key in serving.arms[arm]]:
                stats = serving.stats(arm, level.key)
                speedup = "reference" if arm == BASELINE else speed(serving.speedup(arm, level.key))
                rows.append([label, _level(level.value), arm, fmt(stats.output_throughput, ".2f"), speedup,
                             _ms(stats.ttft_p99), _ms(stats.tpot_p99)])  # fmt: skip
        for arm in serving.arms:
            marks = curve_marks(serving, arm)
            advice = spec_max_batch_advice(serving, arm) if arm != BASELINE else "—"
            marks_rows.append([label, arm, _level(marks.knee), _level(marks.saturation), advice])
    lines = ["## Serving under load", "", "Jobs with `mode: serving`: throughput and speedup vs concurrency "
             "(closed loop; each job's report has its rate levels too).", ""]  # fmt: skip
    headers = ["job", "concurrency", "arm", "output tok/s", "speedup", "TTFT p99 ms", "TPOT p99 ms"]
    lines += md_table(headers, rows) if rows else ["n/a: no concurrency level measured.", ""]
    lines += md_table(["job", "arm", "knee", "saturation", "where speculation stops paying"], marks_rows)
    return lines + ([f"![serving curves](plots/{plot.name})", ""] if plot else [])
