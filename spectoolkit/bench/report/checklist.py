"""Pre-launch checklist of the run report (DESIGN §3), evaluated item by item.

Pure functions over the typed ``Summary`` (and the ``RequestRecord``s when present). A check returns a
``CheckItem`` (``report.check_item``) with its status, the number it rests on and, unless it passes or
cannot apply, the override or action that fixes or decides it. Nothing here formats Markdown or touches
files; the interpretation rules are in ``report.interpret``, the counting behind the baseline-noise and
α-per-task items in ``report.evidence``.

A serving run (issue 15) has its own list (``report.serving_checklist``). Both lists end with the rollout
items: cost per unit of throughput (``report.token_cost``), the alerts of alerts.yml and the canary share
(``report.alerts``). Missing keys (older summaries) and nulls never raise.

A FAIL is a finding about the machine, the workload or the code; an item the run did not evidence (a number
not recorded, too little measured, no records.jsonl) is INSUFFICIENT DATA and an input not given is NOT
SET — neither PASSes, so no launch decision rests on them, but neither is called a failure; an item that
cannot apply to this run (no drafter, sampling instead of greedy) is N/A.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from spectoolkit.bench.report.alerts import check_alerts, check_canary, derive_alerts
from spectoolkit.bench.report.check_item import (
    FAIL,
    INSUFFICIENT,
    NA,
    NO_RECORDS,
    NO_SUCCESS,
    NOT_SET,
    PASS,
    RERUN,
    CheckItem,
    caution,
)
from spectoolkit.bench.report.evidence import (
    MIN_DRAFTED,
    alpha_fix,
    evidence_text,
    relative_noise,
    task_evidence,
    worst_per_task,
)
from spectoolkit.bench.report.load import (
    Records,
    arm_policy,
    drafting_arms,
    fmt,
    is_fixed,
    num,
    primary_alpha,
    sampling_mode,
)
from spectoolkit.bench.report.token_cost import check_token_cost
from spectoolkit.metrics.summary import first_divergence as first_token_diff
from spectoolkit.metrics.summary import output_pairs
from spectoolkit.metrics.summary_schema import BASELINE, Summary
from spectoolkit.metrics.summary_sections import Exactness

# re-exported: the checklist's statuses live in report.check_item, MIN_DRAFTED in report.evidence
__all__ = ["CheckItem", "FAIL", "INSUFFICIENT", "MIN_DRAFTED", "NA", "NOT_SET", "PASS", "caution"]
NOISE_LIMIT = 0.05  # std / mean of baseline throughput over repeats (check_baseline_spread says why)
MIN_REPEATS = 3  # baseline repeats before their noise is estimated at all
SUGGESTED_REPEATS = 5  # bench.repeat's default
DIVERGENT_ROUNDING = "diverges by rounding"  # eval.exactness.DIVERGENT_ROUNDING (importing it loads torch)
EXACTNESS_RUN = "python -m spectoolkit +eval=exactness with this run's +target/+draft/kv/workload overrides"
DIVERGED_FIX = ("speculation changed an output the target alone does not reproduce (the Exactness section's "
                "replay): a bug in the verifier, the KV rollback or the drafter — reproduce with "
                f"{EXACTNESS_RUN} and file exactness.json")  # fmt: skip
ROUNDING_FIX = ("every divergence is the target's own rounding of a multi-row verify step, but in too many "
                "pairs: check it at an fp32 target and KV (+target=fp32 kv=fp32), and quote exactness only "
                "where it passes")  # fmt: skip
REPLAY_FIX = f"replay the divergence with the target alone ({EXACTNESS_RUN}): near-tie or bug"
SPLIT_TOLERANCE = 0.01  # prefill + draft + verify + overhead vs total time
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "random_seed")
STOCK_RATIO_LIMIT = 0.95  # our baseline tokens/s / stock transformers generate tokens/s


# ---- pre-launch checklist ------------------------------------------------------------------------


def check_baseline_spread(summary: Summary) -> CheckItem:
    """Baseline throughput reproducible over repeats: run-to-run noise (std / mean, ddof 1) ≤ NOISE_LIMIT.

    The statistic was the range, (max - min) / median ≤ 0.10. The range of n noisy samples grows with n
    (≈ 2.33 σ at 5 repeats, 3.08 σ at 10, 3.73 σ at 20 for normal noise): a fixed limit on it failed a
    machine more often the more repeats it ran (at σ = 0.043, 47% of 5-repeat runs, 99% of 20-repeat ones),
    so no bench.repeat could fix it, and it read only the two extreme repeats. The standard deviation over
    the mean estimates the machine's per-repeat noise at any repeat count (``evidence.relative_noise``).
    NOISE_LIMIT = 0.05 keeps the old limit's strictness at the default 5 repeats (0.10 / 2.33 ≈ 0.043) and
    means the mean of 5 repeats is known to about ±2% (one standard error).

    A FAIL here is a finding about the machine, not missing data: from 5 repeats the estimate's own error is
    about a third of the noise (normal noise), enough to call a machine well above the limit noisy, and more
    repeats would only measure that noise better, not lower it. So the fix is the machine (quiet, threads
    pinned), or more warm-up when it is the first repeat alone that is slow. Below MIN_REPEATS repeats the noise is not
    estimated: INSUFFICIENT DATA, with the bench.repeat that measures it.
    """
    name = "baseline reproducible"
    values = [v for v in summary.baseline_repeat_throughput if v is not None]
    configured = int(num(summary.conditions.bench.get("repeat")) or 0)
    spread = summary.baseline_spread
    if len(values) < MIN_REPEATS:
        of = f" of {configured}" if configured > len(values) else ""
        recorded = f" (recorded range {spread:.3f})" if spread is not None and len(values) < 2 else ""
        fix = (f"bench.repeat={SUGGESTED_REPEATS}" if configured < MIN_REPEATS else
               "the baseline's requests of some repeats failed (error_reasons): fix them and re-run")  # fmt: skip
        measured = f"{len(values)} baseline repeat(s) measured{of}"
        return CheckItem(name, INSUFFICIENT, f"{measured}{recorded}: its noise needs ≥ {MIN_REPEATS}", fix)
    noise = relative_noise(values)
    if noise is None:  # a mean throughput ≤ 0: nothing was timed
        return CheckItem(name, INSUFFICIENT, f"baseline tok/s per repeat: {values}", NO_SUCCESS)
    median = statistics.median(values)
    evidence = (f"noise {noise:.3f} (std / mean of baseline tok/s over {len(values)} repeats, limit "
                f"{NOISE_LIMIT:.2f}); range {(max(values) - min(values)) / median:.3f}")  # fmt: skip
    if noise <= NOISE_LIMIT:
        return CheckItem(name, PASS, evidence)
    return CheckItem(name, FAIL, evidence, _noise_fix(summary, values, median))


def _noise_fix(summary: Summary, values: list[float], median: float) -> str:
    """More warm-up when the first repeat alone is slow, else a quieter machine with pinned threads."""
    warmup = int(num(summary.conditions.bench.get("warmup")) or 0)
    rest = relative_noise(values[1:])
    if len(values) > MIN_REPEATS and values[0] == min(values) and rest is not None and rest <= NOISE_LIMIT:
        return (f"the first repeat alone is slow ({values[0]:.2f} vs median {median:.2f} tok/s; the others' noise "
                f"{rest:.3f}): more warm-up, bench.warmup={max(2 * warmup, warmup + 3)}")  # fmt: skip
    hardware = summary.conditions.hardware
    threads, cpus = hardware.get("torch_threads"), hardware.get("cpu_count")
    used = f" (this run: {threads} torch threads on {cpus} CPUs)" if threads is not None else ""
    return ("a quieter machine: nothing else running, a dedicated rather than shared VM, threads pinned to "
            f"physical cores (OMP_NUM_THREADS=<cores> taskset -c <cores> python -m spectoolkit ...){used}; more "
            "repeats measure the noise better but do not lower it")  # fmt: skip


def check_compat(summary: Summary, has_drafter: bool | None = None) -> CheckItem:
    """The drafter proposes ids of the target's vocabulary (conditions.compat); ``has_drafter`` None: the
    summary's arms say whether the run drafts. A run whose pair is incompatible stops before measuring, so an
    unchecked pair (servers the client cannot inspect, an older summary) is INSUFFICIENT DATA, not a FAIL."""
    name = "vocab/tokenizer checked"
    if not (drafting_arms(summary) if has_drafter is None else has_drafter):
        return CheckItem(name, NA, "no drafter (draft=none)")
    compat = summary.conditions.compat
    warnings = summary.conditions.compat_warnings
    tail = f"; warnings: {'; '.join(warnings)}" if warnings else ""
    check = "python -m spectoolkit.compat TARGET DRAFT on the two checkpoints (exit 0: compatible)"
    if compat is None:
        return CheckItem(name, INSUFFICIENT, "not recorded (no conditions.compat)" + tail, f"{RERUN}, or run {check}")
    if compat.get("checked") is True:
        return CheckItem(name, PASS, f"{compat.get('note') or 'no note'}{tail}")
    return CheckItem(name, INSUFFICIENT, f"not checked: {compat.get('note') or 'no note'}{tail}", f"run {check}")


def check_sampling_equal(records: Records) -> CheckItem:
    """Per (case, repeat), every arm used the same temperature, top-p, top-k and seed."""
    name = "sampling equal across arms"
    if not records:
        return CheckItem(name, INSUFFICIENT, "no records.jsonl: cannot verify", NO_RECORDS)
    groups: dict[tuple[Any, Any], dict[str, tuple[Any, ...]]] = defaultdict(dict)
    for record in records:
        groups[(record.case_id, record.repeat_idx)][str(record.arm)] = tuple(getattr(record, k) for k in SAMPLING_KEYS)
    shared = [found for found in groups.values() if len(found) > 1]
    if not shared:
        return CheckItem(name, NA, "one arm only: nothing to compare")
    bad = [(key, found) for key, found in groups.items() if len(set(found.values())) > 1]
    if not bad:
        return CheckItem(name, PASS, f"{len(shared)} (case, repeat) groups: all arms share {', '.join(SAMPLING_KEYS)}")
    (case, repeat), found = bad[0]
    example = "; ".join(f"{arm} {dict(zip(SAMPLING_KEYS, values, strict=True))}" for arm, values in found.items())
    fix = ("one run measures every arm with the same seed per (case, repeat): re-run into a fresh directory "
           "(resume=false), never merge records.jsonl of several runs; if it persists, file it with "
           "records.jsonl")  # fmt: skip
    return CheckItem(name, FAIL, f"{len(bad)} of {len(groups)} groups differ, e.g. {case} repeat {repeat}: {example}",
                     fix)  # fmt: skip


def check_alpha_per_task(summary: Summary, records: Records | None = None) -> CheckItem:
    """Each drafting arm drafted ≥ MIN_DRAFTED tokens in every task type, so its α there is meaningful.

    Too few is INSUFFICIENT DATA, never a FAIL: nothing measured is wrong, the workload is too small for
    the number. Under greedy decoding each prompt counts once (a repeat re-decodes the same tokens), so
    the built-in workload (one or two prompts per task type) cannot decide it at any bench.repeat; the
    item then says how many prompts of each short task type would, from its drafted tokens per request.
    """
    name = f"α per task type (≥ {MIN_DRAFTED} drafted)"
    arms = drafting_arms(summary)
    if not arms:
        return CheckItem(name, NA, "no drafter (draft=none)")
    if not summary.by_task_type:
        return CheckItem(name, INSUFFICIENT, "no per-task-type statistics", RERUN)
    records = records or []
    greedy = sampling_mode(summary, records) != "sampling"
    found = task_evidence(summary, records, arms, greedy)
    low = min(found, key=lambda item: item.drafted)
    counted = " (each prompt once: greedy repeats re-decode the same tokens)" if greedy else ""
    if low.drafted >= MIN_DRAFTED:
        return CheckItem(name, PASS, f"fewest drafted: {low.drafted:.0f} ({low.task}, {low.arm}) over "
                         f"{len(summary.by_task_type)} task types{counted}")  # fmt: skip
    short = worst_per_task([item for item in found if not item.enough])
    evidence = f"below {MIN_DRAFTED} drafted{counted}: " + "; ".join(evidence_text(item, greedy) for item in short)
    return CheckItem(name, INSUFFICIENT, evidence, alpha_fix(summary, records, found, greedy))


def check_time_split(summary: Summary) -> CheckItem:
    """prefill + draft + verify + overhead = total within SPLIT_TOLERANCE; drafting arms count draft time."""
    name = "draft and rollback time counted"
    arms = {a: s for a, s in summary.arms.items() if (s.total_time or 0) > 0}
    if not arms:
        return CheckItem(name, INSUFFICIENT, "no timed requests", NO_SUCCESS)
    worst, problems, unrecorded = 0.0, [], []
    for arm, stats in arms.items():
        split = stats.time_split
        if split is None:
            unrecorded.append(f"{arm}: time split not recorded")
            continue
        parts = sum(v or 0 for v in split.values())
        worst = max(worst, abs(parts - stats.total_time) / stats.total_time)
        if (stats.drafted_tokens or 0) > 0 and not split.get("draft"):
            problems.append(f"{arm}: draft time 0 with {stats.drafted_tokens} drafted tokens")
    if worst > SPLIT_TOLERANCE:
        problems.append(f"parts miss the total by {worst:.1%} (limit {SPLIT_TOLERANCE:.0%})")
    if problems:
        fix = ("the timers miss part of the wall time: a bug in the engine's timing — file it with summary.json and "
               "records.jsonl (the per-request prefill/draft/verify/overhead times show which part)")  # fmt: skip
        return CheckItem(name, FAIL, "; ".join(problems + unrecorded), fix)
    if unrecorded:
        return CheckItem(name, INSUFFICIENT, "; ".join(unrecorded), RERUN)
    return CheckItem(name, PASS, f"parts sum to total within {worst:.2%} for {len(arms)} arms (draft incl. rollback)")


def check_tail_latency(summary: Summary) -> CheckItem:
    """Request-level P95 and P99 latency are stated for every measured arm."""
    name = "P95/P99 stated"
    arms = {a: s for a, s in summary.arms.items() if (s.requests or 0) > 0}
    if not arms:
        return CheckItem(name, INSUFFICIENT, "no successful requests", NO_SUCCESS)
    parts = [f"{a} {fmt(s.latency.p95)}/{fmt(s.latency.p99)} s" for a, s in arms.items()]
    if all(s.latency.p95 is not None and s.latency.p99 is not None for s in arms.values()):
        return CheckItem(name, PASS, "P95/P99: " + ", ".join(parts))
    return CheckItem(name, INSUFFICIENT, "P95/P99: " + ", ".join(parts), RERUN)


def check_memory_delta(summary: Summary) -> CheckItem:
    """Peak memory of the primary arm minus the baseline's, draft weights and KV included."""
    name = "memory delta stated"
    delta = summary.conditions.memory.memory_delta_bytes
    if delta is not None:
        return CheckItem(name, PASS, f"memory delta {delta / 2**20:+.1f} MiB (weights + KV vs baseline)")
    if len(summary.arms) <= 1 and not drafting_arms(summary):
        return CheckItem(name, NA, "baseline only: nothing to compare")
    return CheckItem(name, INSUFFICIENT, "not recorded (no conditions.memory.memory_delta_bytes)", RERUN)


def check_exactness(summary: Summary, records: Records) -> CheckItem:
    """Greedy: every drafting arm's output equals its reference arm's (exact match 1.0); a divergence FAILs
    with what to run, an exact match not recorded is INSUFFICIENT DATA."""
    name = "exactness"
    arms = drafting_arms(summary)
    mode = sampling_mode(summary, records)
    if not arms:
        return CheckItem(name, NA, "no drafter (draft=none)")
    if mode == "sampling":
        return CheckItem(name, NA, "sampling: exactness is a distribution test, run in the quality eval")
    if mode is None:
        return CheckItem(name, INSUFFICIENT, "sampling temperature not recorded", RERUN)
    exact = summary.exact_match
    if not exact and "spec" in arms:
        exact = {"spec": summary.greedy_exact_match}
    values = {arm: exact.get(arm) for arm in arms}
    evidence = ", ".join(f"{arm} {fmt(value, '.1%')}" for arm, value in values.items())
    section = summary.exactness
    if section is not None and section.verdict:
        text = f"greedy exact match: {evidence}; " + exactness_text(section)
        if section.passed:
            return CheckItem(name, PASS, text)
        return CheckItem(name, FAIL, text, ROUNDING_FIX if section.verdict == DIVERGENT_ROUNDING else DIVERGED_FIX)
    diverged = [arm for arm, value in values.items() if value is not None and value < 1.0]
    for arm in diverged:
        stats = summary.arms.get(arm)
        reference = (stats.reference_arm if stats else None) or BASELINE
        if found := first_divergence(records, arm, reference):
            case, repeat, position = found
            evidence += (
                f"; first divergence of {arm} from {reference}: {case} repeat {repeat} at output token {position}"
                " (a logit near-tie there, or a bug: check the reference's top-2 margin)"
            )
    if diverged:
        return CheckItem(name, FAIL, f"greedy exact match: {evidence}", REPLAY_FIX)
    if any(value is None for value in values.values()):
        return CheckItem(name, INSUFFICIENT, f"greedy exact match: {evidence}", f"{NO_SUCCESS}; or {RERUN}")
    return CheckItem(name, PASS, f"greedy exact match: {evidence}")


def exactness_text(section: Exactness) -> str:
    """One line for the exactness section: verdict, counts and the first divergences with margins."""
    text = (f"verdict {section.verdict}: {section.identical} of {section.pairs} pairs identical, "
            f"{section.near_ties} near-tie, {section.unexplained} unexplained divergence(s)")  # fmt: skip
    if section.divergent_pairs is not None:
        text += f"; {section.divergent_pairs} of {section.pairs} pairs diverge ({fmt(section.divergent_share, '.0%')})"
    details = [
        f"{d.arm} {d.case_id} repeat {d.repeat_idx} token {d.position}: "
        f"{d.reference_token} vs {d.spec_token}, margin {fmt(d.margin, '.3g')} "
        f"(tie threshold {fmt(d.threshold, '.3g')}"
        + (f"; the target flips at width {d.flip_width}" if d.flip_width else "")
        + (f"; replayed round {d.replay_round} (width {d.replay_width}) emits {d.replayed_token}"
           if d.replay_round is not None else "")
        + f") → {d.classification}"
        for d in section.divergences[:3]
    ]  # fmt: skip
    return text + (" — " + "; ".join(details) if details else "")


def first_divergence(records: Records, arm: str, reference: str) -> tuple[Any, Any, int] | None:
    """(case_id, repeat_idx, output position) of the first record pair where ``arm``'s output differs."""
    for case_id, repeat_idx, ref, out in output_pairs(records, arm, reference):
        if ref != out:
            return case_id, repeat_idx, first_token_diff(ref, out)
    return None


def check_fallback(summary: Summary) -> CheckItem:
    """draft=none (the baseline arm) restores target-alone decoding; break-even α vs measured α."""
    name = "fallback switch (draft=none)"
    base = summary.arms.get(BASELINE)
    if not base or not base.requests:
        return CheckItem(name, INSUFFICIENT, "no measured baseline arm (target alone)",
                         f"every arm set measures the baseline: {NO_SUCCESS}")  # fmt: skip
    arm, alpha = primary_alpha(summary)
    tput = fmt(base.net_throughput, ".2f")
    text = f"draft=none = the baseline arm: {tput} tok/s over {base.requests} requests"
    if arm is None:
        return CheckItem(name, PASS, text)
    if not is_fixed(summary, arm):
        return CheckItem(name, PASS, text + f"; break-even α n/a for {arm} ({arm_policy(summary, arm)} policy: k "
                         f"varies per round), measured α {fmt(alpha)}")  # fmt: skip
    model = summary.cost_model.get(arm)
    even = model.break_even_alpha if model else None
    text += f"; break-even α {fmt(even)} vs measured α {fmt(alpha)} ({arm})"
    if even is not None and alpha is not None and alpha < even:
        text += ": α below break-even, the cost model predicts no gain here; draft=none is the fallback"
    return CheckItem(name, PASS, text)


def check_baseline_vs_stock(summary: Summary) -> CheckItem:
    """Our baseline decodes at least STOCK_RATIO_LIMIT × as fast as stock transformers ``generate``
    (a slow baseline inflates every speedup)."""
    name = "baseline at least as fast as stock transformers"
    check = summary.baseline_check
    if check is None:
        return CheckItem(name, NA, "not measured (bench.baseline_check=false, or a run older than the check)")
    if check.skipped:
        return CheckItem(name, NA, f"skipped: {check.skipped}")
    if check.error:
        return CheckItem(name, INSUFFICIENT, f"stock transformers run failed: {check.error}",
                         "fix the stock side's error (it is not our baseline's) and re-run")  # fmt: skip
    if check.ratio is None:
        return CheckItem(name, INSUFFICIENT, "baseline_check recorded without a ratio", RERUN)
    evidence = (
        (
            f"ours {fmt(check.baseline_tokens_per_s, '.2f')} tok/s vs stock transformers "
            f"{fmt(check.stock_tokens_per_s, '.2f')} tok/s (ratio {check.ratio:.3f}, limit {STOCK_RATIO_LIMIT:.2f})"
        )
        + (f"; {check.stock}" if check.stock else "")
        + _assisted_evidence(check)
    )
    if check.ratio >= STOCK_RATIO_LIMIT:
        return CheckItem(name, PASS, evidence)
    kernels = summary.conditions.software.get("kernels")
    fix = ("quote no speedup from this run: it is measured against a slow baseline. "
           + ("runtime.kernels=reference ran stock numerics: try runtime.kernels=auto; " if kernels == "reference"
              else "")
           + "else it is a slow path of our engine at this precision: file it with summary.json's "
           "baseline_check")  # fmt: skip
    return CheckItem(name, FAIL, evidence, fix)


def _assisted_evidence(check) -> str:
    """Stock assisted generation beside our speculative arm, when the run has a draft model (else "")."""
    if check.assisted_tokens_per_s and check.spec_tokens_per_s:
        return (
            f"; with the draft model: ours ({check.spec_arm}) {check.spec_tokens_per_s:.2f} tok/s vs stock assisted "
            f"generation {check.assisted_tokens_per_s:.2f} tok/s (ratio "
            f"{check.spec_tokens_per_s / check.assisted_tokens_per_s:.3f}; stock assisted / stock plain "
            f"{fmt(check.assisted_tokens_per_s / check.stock_tokens_per_s if check.stock_tokens_per_s else None)}); "
            f"stock draft: {check.assisted}"
        )
    return f"; {check.assisted_skipped}" if check.assisted_skipped else ""


def evaluate_checklist(summary: Summary, records: Records) -> list[CheckItem]:
    """Every pre-launch checklist item, in the order of the issue."""
    return [
        check_baseline_spread(summary),
        check_compat(summary),
        check_sampling_equal(records),
        check_alpha_per_task(summary, records),
        check_time_split(summary),
        check_tail_latency(summary),
        check_memory_delta(summary),
        check_exactness(summary, records),
        check_fallback(summary),
        check_baseline_vs_stock(summary),
        check_token_cost(summary),
        check_alerts(derive_alerts(summary, records)),
        check_canary(),
    ]
