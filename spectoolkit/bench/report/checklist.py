"""Pre-launch checklist of the run report (DESIGN §3), evaluated item by item.

Pure functions over the typed ``Summary`` (and the ``RequestRecord``s when present). A check returns a
``CheckItem`` with PASS / FAIL / N/A and the number it rests on. Nothing here formats Markdown or
touches files; the interpretation rules are in ``report.interpret``.

A serving run (issue 15) has its own list, :func:`evaluate_serving_checklist`: tails stated per load
level, P99 TTFT/TPOT against ``serve.slo_ttft_ms``/``serve.slo_tpot_ms`` (only when given), exactness
under batching. Both lists end with the rollout items: cost per unit of throughput (``report.token_cost``),
the alerts of alerts.yml and the canary share (``report.alerts``). Missing keys (older summaries) and
nulls never raise. An item that cannot be evidenced FAILs (a launch decision must not rest on it); an
item that cannot apply to this run (one repeat, no drafter, sampling instead of greedy) is N/A.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from spectoolkit.bench.report.alerts import check_alerts, check_canary, derive_alerts
from spectoolkit.bench.report.check_item import FAIL, NA, PASS, CheckItem
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
from spectoolkit.bench.report.token_cost import check_serving_token_cost, check_token_cost
from spectoolkit.metrics.load_curves import CONCURRENCY, RATE, ServingSummary, meets_up_to
from spectoolkit.metrics.summary import first_divergence as first_token_diff
from spectoolkit.metrics.summary import output_pairs
from spectoolkit.metrics.summary_schema import BASELINE, Summary
from spectoolkit.metrics.summary_sections import Exactness

__all__ = ["CheckItem", "FAIL", "NA", "PASS"]  # re-exported: the checklist's statuses live in report.check_item
SPREAD_LIMIT = 0.10  # (max - min) / median of baseline throughput over repeats
MIN_DRAFTED = 200  # drafted tokens per task type before its α is worth quoting
SPLIT_TOLERANCE = 0.01  # prefill + draft + verify + overhead vs total time
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "random_seed")
STOCK_RATIO_LIMIT = 0.95  # our baseline tokens/s / stock transformers generate tokens/s


# ---- pre-launch checklist ------------------------------------------------------------------------


def check_baseline_spread(summary: Summary) -> CheckItem:
    """Baseline throughput reproducible over repeats: (max - min) / median ≤ SPREAD_LIMIT."""
    name = "baseline reproducible"
    repeats = summary.baseline_repeat_throughput
    spread = summary.baseline_spread
    configured = num(summary.conditions.bench.get("repeat"))
    if len(repeats) < 2 and (configured or 0) <= 1 and spread is None:
        return CheckItem(name, NA, f"{max(len(repeats), int(configured or 0))} repeat: no spread to measure")
    if spread is None:
        return CheckItem(name, FAIL, f"spread not measured ({len(repeats)} baseline repeats recorded)")
    status = PASS if spread <= SPREAD_LIMIT else FAIL
    return CheckItem(name, status, f"spread {spread:.3f} over {len(repeats)} repeats (limit {SPREAD_LIMIT:.2f})")


def check_compat(summary: Summary, has_drafter: bool | None = None) -> CheckItem:
    """The drafter proposes ids of the target's vocabulary (conditions.compat); ``has_drafter`` None: the
    summary's arms say whether the run drafts."""
    name = "vocab/tokenizer checked"
    if not (drafting_arms(summary) if has_drafter is None else has_drafter):
        return CheckItem(name, NA, "no drafter (draft=none)")
    compat = summary.conditions.compat
    warnings = summary.conditions.compat_warnings
    tail = f"; warnings: {'; '.join(warnings)}" if warnings else ""
    if compat is None:
        return CheckItem(name, FAIL, "not recorded (no conditions.compat)" + tail)
    status = PASS if compat.get("checked") is True else FAIL
    return CheckItem(name, status, f"{compat.get('note') or 'no note'}{tail}")


def check_sampling_equal(records: Records) -> CheckItem:
    """Per (case, repeat), every arm used the same temperature, top-p, top-k and seed."""
    name = "sampling equal across arms"
    if not records:
        return CheckItem(name, FAIL, "no records.jsonl: cannot verify")
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
    return CheckItem(name, FAIL, f"{len(bad)} of {len(groups)} groups differ, e.g. {case} repeat {repeat}: {example}")


def check_alpha_per_task(summary: Summary) -> CheckItem:
    """Each drafting arm drafted ≥ MIN_DRAFTED tokens in every task type, so its α there is meaningful."""
    name = f"α per task type (≥ {MIN_DRAFTED} drafted)"
    arms = drafting_arms(summary)
    if not arms:
        return CheckItem(name, NA, "no drafter (draft=none)")
    tasks = summary.by_task_type
    if not tasks:
        return CheckItem(name, FAIL, "no per-task-type statistics")
    counts = {
        (task, arm): (group.arms[arm].drafted_tokens or 0) if arm in group.arms else 0
        for task, group in tasks.items()
        for arm in arms
    }
    (task, arm), low = min(counts.items(), key=lambda item: item[1])
    status = PASS if low >= MIN_DRAFTED else FAIL
    return CheckItem(name, status, f"fewest drafted: {int(low)} ({task}, {arm}) over {len(tasks)} task types")


def check_time_split(summary: Summary) -> CheckItem:
    """prefill + draft + verify + overhead = total within SPLIT_TOLERANCE; drafting arms count draft time."""
    name = "draft and rollback time counted"
    arms = {a: s for a, s in summary.arms.items() if (s.total_time or 0) > 0}
    if not arms:
        return CheckItem(name, FAIL, "no timed requests")
    worst, problems = 0.0, []
    for arm, stats in arms.items():
        split = stats.time_split
        if split is None:
            problems.append(f"{arm}: time split not recorded")
            continue
        parts = sum(v or 0 for v in split.values())
        worst = max(worst, abs(parts - stats.total_time) / stats.total_time)
        if (stats.drafted_tokens or 0) > 0 and not split.get("draft"):
            problems.append(f"{arm}: draft time 0 with {stats.drafted_tokens} drafted tokens")
    if worst > SPLIT_TOLERANCE:
        problems.append(f"parts miss the total by {worst:.1%} (limit {SPLIT_TOLERANCE:.0%})")
    if problems:
        return CheckItem(name, FAIL, "; ".join(problems))
    return CheckItem(name, PASS, f"parts sum to total within {worst:.2%} for {len(arms)} arms (draft incl. rollback)")


def check_tail_latency(summary: Summary) -> CheckItem:
    """Request-level P95 and P99 latency are stated for every measured arm."""
    name = "P95/P99 stated"
    arms = {a: s for a, s in summary.arms.items() if (s.requests or 0) > 0}
    if not arms:
        return CheckItem(name, FAIL, "no successful requests")
    parts = [f"{a} {fmt(s.latency.p95)}/{fmt(s.latency.p99)} s" for a, s in arms.items()]
    stated = all(s.latency.p95 is not None and s.latency.p99 is not None for s in arms.values())
    return CheckItem(name, PASS if stated else FAIL, "P95/P99: " + ", ".join(parts))


def check_memory_delta(summary: Summary) -> CheckItem:
    """Peak memory of the primary arm minus the baseline's, draft weights and KV included."""
    name = "memory delta stated"
    delta = summary.conditions.memory.memory_delta_bytes
    if delta is not None:
        return CheckItem(name, PASS, f"memory delta {delta / 2**20:+.1f} MiB (weights + KV vs baseline)")
    if len(summary.arms) <= 1 and not drafting_arms(summary):
        return CheckItem(name, NA, "baseline only: nothing to compare")
    return CheckItem(name, FAIL, "not recorded (no conditions.memory.memory_delta_bytes)")


def check_exactness(summary: Summary, records: Records) -> CheckItem:
    """Greedy: every drafting arm's output equals its reference arm's (exact match 1.0)."""
    name = "exactness"
    arms = drafting_arms(summary)
    mode = sampling_mode(summary, records)
    if not arms:
        return CheckItem(name, NA, "no drafter (draft=none)")
    if mode == "sampling":
        return CheckItem(name, NA, "sampling: exactness is a distribution test, run in the quality eval")
    if mode is None:
        return CheckItem(name, FAIL, "sampling temperature not recorded")
    exact = summary.exact_match
    if not exact and "spec" in arms:
        exact = {"spec": summary.greedy_exact_match}
    values = {arm: exact.get(arm) for arm in arms}
    evidence = ", ".join(f"{arm} {fmt(value, '.1%')}" for arm, value in values.items())
    ok = all(value == 1.0 for value in values.values())
    section = summary.exactness
    if section is not None and section.verdict:
        return CheckItem(name, PASS if section.passed else FAIL, f"greedy exact match: {evidence}; "
                         + exactness_text(section))  # fmt: skip
    for arm in [arm for arm, value in values.items() if value is not None and value < 1.0]:
        stats = summary.arms.get(arm)
        reference = (stats.reference_arm if stats else None) or BASELINE
        if found := first_divergence(records, arm, reference):
            case, repeat, position = found
            evidence += (
                f"; first divergence of {arm} from {reference}: {case} repeat {repeat} at output token {position}"
                " (a logit near-tie there, or a bug: check the reference's top-2 margin)"
            )
    return CheckItem(name, PASS if ok else FAIL, f"greedy exact match: {evidence}")


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
        return CheckItem(name, FAIL, "no measured baseline arm (target alone)")
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
        return CheckItem(name, FAIL, f"stock transformers run failed: {check.error}")
    if check.ratio is None:
        return CheckItem(name, FAIL, "baseline_check recorded without a ratio")
    status = PASS if check.ratio >= STOCK_RATIO_LIMIT else FAIL
    evidence = (
        f"ours {fmt(check.baseline_tokens_per_s, '.2f')} tok/s vs stock transformers "
        f"{fmt(check.stock_tokens_per_s, '.2f')} tok/s (ratio {check.ratio:.3f}, limit {STOCK_RATIO_LIMIT:.2f})"
    )
    return CheckItem(name, status, evidence + (f"; {check.stock}" if check.stock else ""))


def evaluate_checklist(summary: Summary, records: Records) -> list[CheckItem]:
    """Every pre-launch checklist item, in the order of the issue."""
    return [
        check_baseline_spread(summary),
        check_compat(summary),
        check_sampling_equal(records),
        check_alpha_per_task(summary),
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


# ---- serving runs (issue 15) ---------------------------------------------------------------------

SLOS = (("TTFT", "ttft_p99", "slo_ttft_ms"), ("TPOT", "tpot_p99", "slo_tpot_ms"))  # (name, LevelStats field, serve key)


def check_serving_tails(serving: ServingSummary) -> CheckItem:
    """Request-level P95 and P99 latency are stated for every arm at every load level it ran."""
    name = "P95/P99 stated at every load level"
    cells = [(arm, level.label, serving.stats(arm, level.key)) for arm in serving.arms for level in serving.levels]
    cells = [(arm, label, stats) for arm, label, stats in cells if (stats.num_requests or 0) > 0]
    if not cells:
        return CheckItem(name, FAIL, "no load level with a successful request")
    missing = [f"{arm} {label}" for arm, label, s in cells if s.latency_p95 is None or s.latency_p99 is None]
    if missing:
        return CheckItem(name, FAIL, f"not stated for {len(missing)} of {len(cells)}: {', '.join(missing[:4])}")
    return CheckItem(name, PASS, f"stated for {len(cells)} (arm, level) pairs")


def _ms(seconds: float | None) -> str:
    return fmt(seconds * 1e3 if seconds is not None else None, ".1f")


def _slo_evidence(serving: ServingSummary, arm: str, metric: str, limit_s: float) -> tuple[str, list[str], bool]:
    """(evidence for ``arm``, its levels without the metric, whether every measured level meets the limit)."""
    parts, missing, ok = [], [], True
    for kind in (CONCURRENCY, RATE):
        levels, values = serving.curve(arm, metric, kind)
        if not levels:
            continue
        missing += [f"{arm} {lv.label}" for lv, v in zip(serving.of_kind(kind), values, strict=True) if v is None]
        if all(v is None for v in values):
            parts.append(f"not measured at any {kind} level")
            continue
        ok = ok and all(v <= limit_s for v in values if v is not None)
        top = meets_up_to(levels, values, limit_s)
        unit = " req/s" if kind == RATE else ""
        meets = f"meets it up to {kind} {top:g}{unit}" if top is not None else f"meets it at no {kind} level"
        shown = ", ".join(f"{x:g}: {_ms(v)}" for x, v in zip(levels, values, strict=True))
        parts.append(f"{meets} (p99 ms by {kind}: {shown})")
    return f"{arm} " + "; ".join(parts), missing, ok


def check_slo(serving: ServingSummary, name: str, metric: str, slo_ms: float) -> CheckItem:
    """``metric`` (a P99, seconds) ≤ ``slo_ms`` at every load level of every arm; evidence: the highest
    level up to which each arm meets it (``load_curves.meets_up_to``) and the P99 per level."""
    item = f"{name} P99 ≤ serve.slo_{name.lower()}_ms ({slo_ms:g} ms) at every level"
    evidence, missing, ok = [], [], True
    for arm in serving.arms:
        text, absent, arm_ok = _slo_evidence(serving, arm, metric, slo_ms / 1e3)
        evidence.append(text)
        missing += absent
        ok = ok and arm_ok
    if not evidence:
        return CheckItem(item, FAIL, "no load level measured")
    tail = f"; not measured: {', '.join(missing[:4])}" if missing else ""
    return CheckItem(item, PASS if ok and not missing else FAIL, "; ".join(evidence) + tail)


def _divergence_text(serving: ServingSummary) -> str:
    exactness = serving.exactness
    found = exactness.divergent if exactness else []
    listed = [f"{d.arm} at {serving.label_of(d.level)}: {d.case_id} token {d.position}{_class_text(d)}"
              for d in found[:3]]  # fmt: skip
    return f"{len(found)} divergent: " + "; ".join(listed) + ("; …" if len(found) > 3 else "")


def _class_text(divergence) -> str:
    if divergence.classification is None:
        return ""
    margin = "n/a" if divergence.margin is None else f"{divergence.margin:.2g}"
    return f" ({divergence.classification}, margin {margin})"


def check_exact_under_batching(serving: ServingSummary, mode: str | None) -> CheckItem:
    """Greedy: every request at every load level equals its batch-1 target-alone output (serving_exactness)."""
    name = "exact under batching"
    if mode == "sampling":
        return CheckItem(name, NA, "sampling: the per-request distribution test of the quality eval applies")
    if mode is None:
        return CheckItem(name, FAIL, "sampling temperature not recorded")
    exactness = serving.exactness
    if exactness is None:
        return CheckItem(name, FAIL, "not checked: no serving_exactness in summary.json")
    reference = exactness.reference or "the batch-1 reference"
    if not exactness.checked:
        return CheckItem(name, FAIL, f"no request compared with {reference}")
    if exactness.divergent and exactness.verdict == "exact up to near-ties":
        text = f"{exactness.checked} checked against {reference}: exact up to near-ties, {_divergence_text(serving)}"
        return CheckItem(name, PASS, text + " (serve.batch_invariant=true makes outputs identical)")
    if exactness.divergent:
        return CheckItem(name, FAIL, f"{exactness.checked} checked against {reference}, {_divergence_text(serving)}")
    return CheckItem(name, PASS, f"{exactness.checked} requests at every level equal {reference}, token for token")


def evaluate_serving_checklist(summary: Summary, serving: ServingSummary, records: Records) -> list[CheckItem]:
    """The checklist of a serving run: compat, tails per level, the SLOs given in ``serve``, exactness."""
    items = [check_compat(summary, bool(serving.drafting_arms)), check_serving_tails(serving)]
    for name, metric, key in SLOS:
        slo = num(serving.serve.get(key))
        if slo is not None:
            items.append(check_slo(serving, name, metric, slo))
    return items + [
        check_exact_under_batching(serving, sampling_mode(summary, records)),
        check_serving_token_cost(summary, serving),
        check_alerts(derive_alerts(summary, records, serving)),
        check_canary(),
    ]
