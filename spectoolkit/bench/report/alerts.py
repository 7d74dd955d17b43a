"""``alerts.yml``: Prometheus alerting rules whose thresholds come from the run, written beside report.md.

The rules read metric names that both vLLM and spectoolkit's OpenAI server (``spectoolkit.server.metrics``)
export, so one file watches either:

- **acceptance below break-even**: accepted / drafted draft tokens over 5 minutes below the primary
  speculative arm's ``break_even_alpha`` (the cost model, DESIGN §1): below it speculation is predicted to
  be slower than the target alone, and ``draft=none`` is the fallback;
- **rollback above its measured P95**: the rejected share of draft tokens, 1 − accepted / drafted (what the
  token counters give; not the summary's per-round ``rollback_rate``), above the P95 of that share over the
  primary arm's requests that drafted (records.jsonl; numpy linear interpolation, every load level pooled
  in a serving run): the traffic no longer looks like what was measured;
- **TPOT P99 above the SLO**, only when ``serve.slo_tpot_ms`` is given.

A threshold that cannot be derived (no drafting arm, no break-even α, no records) leaves its rule out and
the file says why in a comment; the file always parses. :func:`derive_alerts` is pure (the checklist uses
it too), :func:`write_alerts` writes the file atomically. The checklist items are :func:`check_alerts`
and :func:`check_canary`: a rule left out because the run measured that speculation never pays is a
finding (FAIL); one left out for want of a number (a serving run has no cost model, a variable-k policy
has no break-even α, no records) is INSUFFICIENT DATA with the run that would derive it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from spectoolkit.bench.report.check_item import FAIL, INSUFFICIENT, NA, NO_RECORDS, PASS, RERUN, CheckItem
from spectoolkit.bench.report.load import (
    Records,
    arm_policy,
    atomic_write,
    drafting_arms,
    fmt,
    is_fixed,
    num,
    primary_arm,
)
from spectoolkit.metrics.load_curves import ServingSummary
from spectoolkit.metrics.summary import quantiles
from spectoolkit.metrics.summary_schema import Summary

ALERTS_NAME = "alerts.yml"
GROUP = "spectoolkit-speculation"
WINDOW = "5m"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTED = "vllm:spec_decode_num_draft_tokens_total"
TPOT_BUCKETS = "vllm:request_time_per_output_token_seconds_bucket"
ACCEPTANCE_EXPR = f"sum(rate({ACCEPTED}[{WINDOW}])) / sum(rate({DRAFTED}[{WINDOW}]))"
TPOT_P99_EXPR = f"histogram_quantile(0.99, sum by (le) (rate({TPOT_BUCKETS}[{WINDOW}])))"
ACCEPTANCE, ROLLBACK = "SpeculativeAcceptanceBelowBreakEven", "SpeculativeRollbackAboveP95"
TPOT = "TimePerOutputTokenP99AboveSLO"


@dataclass(frozen=True)
class AlertRule:
    """One Prometheus alerting rule; ``threshold`` is the run's number in ``expr``."""

    alert: str
    expr: str
    threshold: float
    duration: str  # Prometheus ``for``: how long the condition must hold before the alert fires
    severity: str
    summary: str
    description: str

    def as_json(self) -> dict[str, Any]:
        """The rule as Prometheus reads it."""
        return {"alert": self.alert, "expr": self.expr, "for": self.duration, "labels": {"severity": self.severity},
                "annotations": {"summary": self.summary, "description": self.description}}  # fmt: skip


@dataclass(frozen=True)
class LeftOut:
    """A rule that could not be derived: why, what would derive it, and whether the why is a finding."""

    alert: str
    why: str
    fix: str  # the run or override that derives it (or, for a finding, what to do instead)
    finding: bool = False  # True: the run measured the reason (speculation never pays), not a missing number


@dataclass(frozen=True)
class AlertPlan:
    """The rules derived from one run, and each rule left out with its reason."""

    arm: str | None  # the primary speculative arm the thresholds come from
    rules: tuple[AlertRule, ...] = ()
    left_out: tuple[LeftOut, ...] = ()
    drafts: bool = True  # False: no arm of the run drafts (draft=none), speculation alerts do not apply

    def rule(self, name: str) -> AlertRule | None:
        return next((rule for rule in self.rules if rule.alert == name), None)

    def missing(self, name: str) -> LeftOut | None:
        return next((item for item in self.left_out if item.alert == name), None)

    def why(self, name: str) -> str | None:
        item = self.missing(name)
        return item.why if item else None


Derived = AlertRule | LeftOut


def per_request_rollback(records: Records, arm: str) -> list[float]:
    """1 − accepted / drafted of every successful request of ``arm`` that drafted a token."""
    return [1 - r.accepted_tokens / r.drafted_tokens for r in records
            if r.arm == arm and not r.error and (r.drafted_tokens or 0) > 0]  # fmt: skip


def _measured_alpha(summary: Summary, records: Records, arm: str) -> float | None:
    """Accepted / drafted over the arm's successful records, else the summary's acceptance rate."""
    mine = [r for r in records if r.arm == arm and not r.error]
    drafted = sum(r.drafted_tokens or 0 for r in mine)
    if drafted:
        return sum(r.accepted_tokens or 0 for r in mine) / drafted
    stats = summary.arms.get(arm)
    return stats.acceptance_rate if stats else None


def _drafting(summary: Summary, serving: ServingSummary | None) -> list[str]:
    """The arms that draft: configured or measured (batch-1), or measured at a load level (serving)."""
    found = drafting_arms(summary) + (serving.drafting_arms if serving else [])
    return list(dict.fromkeys(found))


def _break_even(summary: Summary, arm: str, serving: ServingSummary | None) -> float | LeftOut:
    """The arm's break-even α, or why there is none."""
    model = summary.cost_model.get(arm)
    if model is None and serving is not None:
        return LeftOut(ACCEPTANCE, "no break-even α: a serving run has no cost model; a batch-1 run of this "
                       "configuration (serve.enabled=false) derives it", "run this configuration batch-1 "
                       "(serve.enabled=false) and take the acceptance rule of its alerts.yml")  # fmt: skip
    if model is None:
        return LeftOut(ACCEPTANCE, f"no break-even α: summary.json has no cost model for {arm} (no reference arm or "
                       "no measured rounds)", f"{RERUN}; an arm whose requests drafted no round has none")  # fmt: skip
    if not is_fixed(summary, arm):
        return LeftOut(ACCEPTANCE, f"no break-even α: {arm} uses the {arm_policy(summary, arm)} policy (k varies "
                       "per round)", "a fixed-γ run of this drafter (speculate.policy=fixed) measures the break-even α "
                       "to alert on")  # fmt: skip
    if model.break_even_alpha is None:
        return LeftOut(ACCEPTANCE, f"no break-even α for {arm}: even α = 1 does not pay at its measured costs, "
                       "speculation cannot beat the target alone on this machine (keep draft=none)",
                       "keep draft=none on this machine, or a cheaper drafter (the cost model section shows the "
                       "draft and verify costs that decide it)", finding=True)  # fmt: skip
    return model.break_even_alpha


def _acceptance_rule(summary: Summary, arm: str, even: float, alpha: float | None, where: str) -> AlertRule:
    stats = summary.arms.get(arm)
    gamma = stats.gamma if stats and stats.gamma else summary.conditions.gamma
    description = (
        f"Draft-token acceptance (accepted / drafted, {WINDOW}) is below {even:.4f}, the break-even α of arm {arm} "
        f"(γ={gamma if gamma is not None else 'n/a'}) measured in run {where}: there speculation is predicted to "
        f"be slower than the target alone. Measured α {fmt(alpha, '.4f')}, break-even α {even:.4f}"
        f"{' (speculation pays at any acceptance: this rule cannot fire)' if even <= 0 else ''}, measured "
        f"speedup {fmt(summary.speedups.get(arm), '.2f', '×')}. Fall back to draft=none until acceptance recovers."
    )
    return AlertRule(ACCEPTANCE, f"{ACCEPTANCE_EXPR} < {even:.4f}", even, "10m", "warning",
                     "Speculative decoding acceptance below break-even", description)  # fmt: skip


def _rollback_rule(records: Records, arm: str, alpha: float | None, even: float | None, where: str) -> Derived:
    if not records:
        return LeftOut(ROLLBACK, "no records.jsonl: the per-request rollback P95 needs the run's records",
                       NO_RECORDS)  # fmt: skip
    shares = per_request_rollback(records, arm)
    if not shares:
        return LeftOut(ROLLBACK, f"no successful request of {arm} drafted a token: no rollback share to take a P95 "
                       "of", "a workload the drafter proposes on (its coverage is in the results table)")  # fmt: skip
    q = quantiles(shares, (50, 95))
    p95 = q["p95"] or 0.0
    description = (
        f"The rejected share of draft tokens (1 − accepted / drafted, {WINDOW}) is above {p95:.4f}, the P95 of "
        f"that share over {len(shares)} requests of arm {arm} that drafted in run {where} (median "
        f"{fmt(q['p50'], '.4f')}, measured α {fmt(alpha, '.4f')}, break-even α {fmt(even, '.4f')}): the traffic "
        "drafts worse than the measured workload did; re-check the speedup on it."
    )
    expr = f"1 - ({ACCEPTANCE_EXPR}) > {p95:.4f}"
    return AlertRule(ROLLBACK, expr, p95, "10m", "info", "Speculative decoding rollback above its measured P95",
                     description)  # fmt: skip


def _tpot_measured(serving: ServingSummary | None, arm: str | None) -> str:
    if serving is None or arm is None:
        return "TPOT is not measured by a batch-1 run"
    cells = [(level.label, serving.stats(arm, level.key).tpot_p99) for level in serving.levels]
    shown = [f"{label} {value * 1e3:.1f} ms" for label, value in cells if value is not None]
    return f"measured TPOT P99 of {arm}: " + (", ".join(shown) if shown else "n/a")


def _tpot_rule(summary: Summary, serving: ServingSummary | None, arm: str | None, where: str) -> Derived:
    serve = serving.serve if serving is not None else summary.conditions.serve
    slo_ms = num(serve.get("slo_tpot_ms"))
    if slo_ms is None or slo_ms <= 0:
        return LeftOut(TPOT, "serve.slo_tpot_ms is not set: no TPOT target to alert on", "serve.slo_tpot_ms=<ms>")
    seconds = slo_ms / 1e3
    description = (f"TPOT P99 ({WINDOW}) is above serve.slo_tpot_ms = {slo_ms:g} ms ({seconds:g} s), the SLO of "
                   f"run {where}; {_tpot_measured(serving, arm)}.")  # fmt: skip
    return AlertRule(TPOT, f"{TPOT_P99_EXPR} > {seconds:g}", seconds, "5m", "critical",
                     "Time per output token P99 above the SLO", description)  # fmt: skip


def derive_alerts(
    summary: Summary, records: Records, serving: ServingSummary | None = None, run_dir: str = "this run"
) -> AlertPlan:
    """The rules of alerts.yml for a run (``serving``: a serving run's part of summary.json)."""
    drafting = _drafting(summary, serving)
    named = primary_arm(summary, serving) if serving is not None else summary.primary_arm
    arm = named if named in drafting else None
    if arm is None:
        why = (f"the primary arm ({named or 'none'}) does not draft" if drafting else
               "no speculative arm in this run (draft=none): nothing drafts, nothing to alert on")  # fmt: skip
        fix = f"{RERUN} (it names the primary speculative arm)" if drafting else "+draft=<drafter>"
        found: list[Derived] = [LeftOut(ACCEPTANCE, why, fix), LeftOut(ROLLBACK, why, fix)]
    else:
        alpha = _measured_alpha(summary, records, arm)
        even = _break_even(summary, arm, serving)
        threshold = even if isinstance(even, float) else None
        found = [
            _acceptance_rule(summary, arm, even, alpha, run_dir) if isinstance(even, float) else even,
            _rollback_rule(records, arm, alpha, threshold, run_dir),
        ]
    found.append(_tpot_rule(summary, serving, arm, run_dir))
    rules = tuple(item for item in found if isinstance(item, AlertRule))
    left_out = tuple(item for item in found if isinstance(item, LeftOut))
    return AlertPlan(arm, rules, left_out, drafts=bool(drafting))


def _comment(text: str) -> str:
    return "# " + " ".join(text.split())  # one line: a newline in a path must not end the comment


def render_alerts(plan: AlertPlan, run_dir: str) -> str:
    """alerts.yml text: comments (source, rules left out and why), then the rule group."""
    header = [
        f"Prometheus alerting rules written by spectoolkit beside report.md; thresholds measured in run {run_dir}"
        f" (primary speculative arm: {plan.arm or 'none'}).",
        f"Load with rule_files: [{ALERTS_NAME}]. Metric names are vLLM's; spectoolkit's OpenAI server exports them.",
        *(f"Left out: {item.alert}: {item.why}." for item in plan.left_out),
    ]
    doc = {"groups": [{"name": GROUP, "rules": [rule.as_json() for rule in plan.rules]}]}
    body = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, default_flow_style=False, width=10_000)
    return "\n".join(_comment(line) for line in header) + "\n" + body


def write_alerts(run_dir: Path, summary: Summary, records: Records, serving: ServingSummary | None = None) -> Path:
    """Write ``run_dir/alerts.yml`` atomically; returns its path."""
    run_dir = Path(run_dir)
    where = str(run_dir.resolve())
    path = run_dir / ALERTS_NAME
    atomic_write(path, render_alerts(derive_alerts(summary, records, serving, where), where))
    return path


# ---- checklist items -----------------------------------------------------------------------------


def _threshold_text(plan: AlertPlan) -> str:
    parts = []
    if rule := plan.rule(ACCEPTANCE):
        parts.append(f"acceptance < {rule.threshold:.4f} (break-even α of {plan.arm})")
    if rule := plan.rule(ROLLBACK):
        parts.append(f"rejected draft share > {rule.threshold:.4f} (P95 over {plan.arm}'s requests)")
    if rule := plan.rule(TPOT):
        parts.append(f"TPOT P99 > {rule.threshold * 1e3:g} ms (serve.slo_tpot_ms)")
    return ", ".join(parts)


def check_alerts(plan: AlertPlan) -> CheckItem:
    """PASS when alerts.yml has both the acceptance and the rollback rule; N/A when nothing drafts. A rule left
    out because the run found speculation never pays FAILs; one left out for want of a number is INSUFFICIENT
    DATA. Either way the item says what would derive (or replace) each missing rule."""
    name = "alerts on acceptance and rollback"
    if not plan.drafts:
        return CheckItem(name, NA, f"no drafter (draft=none): {ALERTS_NAME} has no speculation rules to set")
    missing = [item for alert in (ACCEPTANCE, ROLLBACK) if (item := plan.missing(alert)) is not None]
    shown = _threshold_text(plan)
    if not missing:
        return CheckItem(name, PASS, f"{ALERTS_NAME}: {shown}")
    evidence = "; ".join(f"{item.alert} left out: {item.why}" for item in missing)
    fix = "; ".join(f"{item.alert}: {item.fix}" for item in missing)
    status = FAIL if any(item.finding for item in missing) else INSUFFICIENT
    return CheckItem(name, status, evidence + (f" (alerts.yml has: {shown})" if shown else ""), fix)


def check_canary() -> CheckItem:
    """A deployment choice no benchmark can evidence."""
    return CheckItem("canary share", NA, "a deployment choice: route a canary share of traffic to the speculative "
                     f"arm and watch {ALERTS_NAME} before full rollout")  # fmt: skip
