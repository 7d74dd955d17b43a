"""Pre-launch checklist of a serving run (issue 15), item by item (statuses: ``report.check_item``).

Tails stated per load level, P99 TTFT/TPOT against ``serve.slo_ttft_ms``/``serve.slo_tpot_ms`` (only when
given), exactness under batching, then the rollout items the batch-1 list ends with too: cost per unit of
throughput (``report.token_cost``), the alerts of alerts.yml and the canary share (``report.alerts``). A
level over an SLO FAILs with the load to hold; a number not measured is INSUFFICIENT DATA. Missing keys
and nulls never raise.
"""

from __future__ import annotations

from spectoolkit.bench.report.alerts import check_alerts, check_canary, derive_alerts
from spectoolkit.bench.report.check_item import FAIL, INSUFFICIENT, NA, NO_SUCCESS, PASS, RERUN, CheckItem
from spectoolkit.bench.report.checklist import check_compat
from spectoolkit.bench.report.load import Records, fmt, num, sampling_mode
from spectoolkit.bench.report.token_cost import check_serving_token_cost
from spectoolkit.metrics.load_curves import CONCURRENCY, RATE, ServingSummary, meets_up_to
from spectoolkit.metrics.summary_schema import BASELINE, Summary

SLOS = (("TTFT", "ttft_p99", "slo_ttft_ms"), ("TPOT", "tpot_p99", "slo_tpot_ms"))  # (name, LevelStats field, serve key)


def check_serving_tails(serving: ServingSummary) -> CheckItem:
    """Request-level P95 and P99 latency are stated for every arm at every load level it ran."""
    name = "P95/P99 stated at every load level"
    cells = [(arm, level.label, serving.stats(arm, level.key)) for arm in serving.arms for level in serving.levels]
    cells = [(arm, label, stats) for arm, label, stats in cells if (stats.num_requests or 0) > 0]
    if not cells:
        return CheckItem(name, INSUFFICIENT, "no load level with a successful request", NO_SUCCESS)
    missing = [f"{arm} {label}" for arm, label, s in cells if s.latency_p95 is None or s.latency_p99 is None]
    if missing:
        return CheckItem(name, INSUFFICIENT, f"not stated for {len(missing)} of {len(cells)}: "
                         f"{', '.join(missing[:4])}", RERUN)  # fmt: skip
    return CheckItem(name, PASS, f"stated for {len(cells)} (arm, level) pairs")


def _ms(seconds: float | None) -> str:
    return fmt(seconds * 1e3 if seconds is not None else None, ".1f")


def _slo_evidence(
    serving: ServingSummary, arm: str, metric: str, limit_s: float
) -> tuple[str, list[str], bool, dict[str, float | None]]:
    """(evidence for ``arm``, its levels without the metric, whether every measured level meets the limit,
    the highest level of each kind up to which it meets it)."""
    parts, missing, ok, tops = [], [], True, {}
    for kind in (CONCURRENCY, RATE):
        levels, values = serving.curve(arm, metric, kind)
        if not levels:
            continue
        missing += [f"{arm} {lv.label}" for lv, v in zip(serving.of_kind(kind), values, strict=True) if v is None]
        if all(v is None for v in values):
            parts.append(f"not measured at any {kind} level")
            continue
        ok = ok and all(v <= limit_s for v in values if v is not None)
        top = tops[kind] = meets_up_to(levels, values, limit_s)
        unit = " req/s" if kind == RATE else ""
        meets = f"meets it up to {kind} {top:g}{unit}" if top is not None else f"meets it at no {kind} level"
        shown = ", ".join(f"{x:g}: {_ms(v)}" for x, v in zip(levels, values, strict=True))
        parts.append(f"{meets} (p99 ms by {kind}: {shown})")
    return f"{arm} " + "; ".join(parts), missing, ok, tops


def _slo_fix(serving: ServingSummary, name: str, tops: dict[str, dict[str, float | None]]) -> str:
    """Where to hold the load: speculation capped where only it misses the SLO, else the concurrency every
    arm meets it up to (``tops``: per arm, the highest level of each kind that meets it)."""
    key = f"serve.slo_{name.lower()}_ms"
    met = {arm: found[CONCURRENCY] for arm, found in tops.items() if CONCURRENCY in found}
    if not met:
        return f"hold the request rate below the first rate that misses it, or relax {key}"
    slower = f"a faster machine or a smaller model, or relax {key}"
    if BASELINE in met and met[BASELINE] is None:
        return f"even the target alone misses it at the lowest concurrency: {slower}"
    base = met.get(BASELINE)
    spec = [met[arm] or 0 for arm in met if arm in serving.drafting_arms]
    if base is not None and spec and min(spec) < base:
        return (f"serve.spec_max_batch={min(spec):g}: speculation off above it, where the target alone meets it "
                f"(up to concurrency {base:g}); more replicas beyond")  # fmt: skip
    if any(top is None for top in met.values()):
        return f"it is missed even at the lowest concurrency: {slower}"
    lowest = min(top for top in met.values() if top is not None)
    return f"keep each replica at or below concurrency {lowest:g} (every arm meets it up to there); add replicas"


def check_slo(serving: ServingSummary, name: str, metric: str, slo_ms: float) -> CheckItem:
    """``metric`` (a P99, seconds) ≤ ``slo_ms`` at every load level of every arm; evidence: the highest
    level up to which each arm meets it (``load_curves.meets_up_to``) and the P99 per level. A measured level
    over the SLO FAILs with the load to hold; levels only unmeasured are INSUFFICIENT DATA."""
    item = f"{name} P99 ≤ serve.slo_{name.lower()}_ms ({slo_ms:g} ms) at every level"
    evidence, missing, ok, tops = [], [], True, {}
    for arm in serving.arms:
        text, absent, arm_ok, tops[arm] = _slo_evidence(serving, arm, metric, slo_ms / 1e3)
        evidence.append(text)
        missing += absent
        ok = ok and arm_ok
    if not evidence:
        return CheckItem(item, INSUFFICIENT, "no load level measured", NO_SUCCESS)
    text = "; ".join(evidence) + (f"; not measured: {', '.join(missing[:4])}" if missing else "")
    if not ok:
        return CheckItem(item, FAIL, text, _slo_fix(serving, name, tops))
    if missing:
        return CheckItem(item, INSUFFICIENT, text, NO_SUCCESS)
    return CheckItem(item, PASS, text)


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
        return CheckItem(name, INSUFFICIENT, "sampling temperature not recorded", RERUN)
    exactness = serving.exactness
    if exactness is None:
        return CheckItem(name, INSUFFICIENT, "not checked: no serving_exactness in summary.json", RERUN)
    reference = exactness.reference or "the batch-1 reference"
    if not exactness.checked:
        return CheckItem(name, INSUFFICIENT, f"no request compared with {reference}", NO_SUCCESS)
    if exactness.divergent and exactness.verdict == "exact up to near-ties":
        text = f"{exactness.checked} checked against {reference}: exact up to near-ties, {_divergence_text(serving)}"
        return CheckItem(name, PASS, text + " (serve.batch_invariant=true makes outputs identical)")
    if exactness.divergent:
        fix = ("serve.batch_invariant=true computes every row as a decode step would (outputs identical, at a "
               "measured cost); a divergence on our CPU kernels, row-invariant by construction, is a bug: file "
               "the case with summary.json")  # fmt: skip
        return CheckItem(name, FAIL, f"{exactness.checked} checked against {reference}, {_divergence_text(serving)}",
                         fix)  # fmt: skip
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
