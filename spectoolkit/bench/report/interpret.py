"""Interpretation rules of the run report (DESIGN §1 and §3): each rule says whether it applies, with its numbers.

Pure functions over the typed ``Summary`` (serving runs, DESIGN §6: over the ``ServingSummary`` of
:mod:`spectoolkit.metrics.load_curves`, curves over the concurrency levels); nothing here formats
Markdown or touches files.

A rule's premise holds only materially: "up", "down", "better", "worse" and "below 1" mean by more than
:data:`MATERIAL_CHANGE` of the reference value (TTFT p50 0.307 → 0.307 s is not "TTFT up"), so a rule
never fires on equal numbers or on run-to-run noise; the other rules compare against their own named
thresholds.
"""

from __future__ import annotations

from dataclasses import dataclass

from spectoolkit.bench.report.load import fmt, is_quantized, primary_alpha
from spectoolkit.metrics.load_curves import CONCURRENCY, ServingSummary, falls_with_load, growth, points
from spectoolkit.metrics.summary_schema import BASELINE, ArmStats, Quantiles, Summary
from spectoolkit.metrics.summary_sections import CostModel

ALPHA_GAP = 0.15  # α spread across task types that justifies per-task-type enablement
HIGH_ALPHA = 0.7
MODEL_ERROR_LIMIT = 0.15  # |predicted - measured| / measured speedup
LOAD_GROWTH = 1.5  # low → high load: TTFT p99 and throughput both grow by more than this
MATERIAL_CHANGE = 0.05  # "up"/"down": beyond ±5% of the reference value (a CPU's run-to-run noise is a few %)
MARGIN = f"margin ±{MATERIAL_CHANGE:.0%}"


@dataclass(frozen=True)
class Finding:
    """One interpretation rule evaluated on the data: whether it ``applies`` and why."""

    rule: str
    applies: bool
    text: str


# ---- interpretation rules ------------------------------------------------------------------------


def _up(value: float, reference: float) -> bool:
    """``value`` is materially above ``reference``: by more than MATERIAL_CHANGE of it."""
    return value > reference * (1 + MATERIAL_CHANGE)


def _down(value: float, reference: float) -> bool:
    """``value`` is materially below ``reference``: by more than MATERIAL_CHANGE of it."""
    return value < reference * (1 - MATERIAL_CHANGE)


def _verdict(rule: str, applies: bool, numbers: str, advice: str) -> Finding:
    """A rule's finding: the numbers, plus the advice when the rule applies."""
    return Finding(rule, True, f"{numbers}: {advice}") if applies else Finding(rule, False, numbers)


def _quantile(stats: ArmStats | None, key: str, quantile: str) -> float | None:
    """``stats.key.quantile`` (e.g. latency.p99), None without the arm."""
    quantiles: Quantiles | None = getattr(stats, key) if stats is not None else None
    return getattr(quantiles, quantile) if quantiles is not None else None


def _primary_vs_baseline(summary: Summary, key: str, quantile: str) -> tuple[float | None, float | None]:
    """``key`` ("ttft" or "latency") at ``quantile`` of the primary arm and of the baseline."""
    arms = summary.arms
    return _quantile(arms.get(summary.primary_arm or ""), key, quantile), _quantile(arms.get(BASELINE), key, quantile)


def _primary_cost_model(summary: Summary) -> CostModel:
    return summary.cost_model.get(summary.primary_arm or "") or CostModel()


def rule_ttft_vs_throughput(summary: Summary) -> Finding:
    """TTFT up and throughput up (each beyond MATERIAL_CHANGE) ⇒ suits batch jobs, not interactive use."""
    rule = "TTFT up, throughput up"
    spec, base = _primary_vs_baseline(summary, "ttft", "p50")
    speedup = summary.speedup
    if None in (spec, base, speedup):
        return Finding(rule, False, "n/a: TTFT p50 or speedup not measured")
    numbers = f"TTFT p50 {base:.3f} → {spec:.3f} s, throughput {speedup:.2f}× ({MARGIN})"
    return _verdict(
        rule,
        _up(spec, base) and _up(speedup, 1.0),
        numbers,
        "suits batch jobs, not interactive use where the first token matters",
    )


def rule_keep_off(summary: Summary) -> Finding:
    """Speedup materially below 1 ⇒ keep speculation off (draft=none)."""
    rule = "speedup below 1"
    speedup = summary.speedup
    if speedup is None:
        return Finding(rule, False, "n/a: no measured speedup")
    numbers, advice = f"speedup {speedup:.2f}× ({MARGIN})", "keep speculation off (draft=none) for this setup"
    return _verdict(rule, _down(speedup, 1.0), numbers, advice)


def rule_draft_too_expensive(summary: Summary) -> Finding:
    """α high but speedup materially below 1 ⇒ the draft costs too much relative to T₁ (D·γ/T₁)."""
    rule = "α high, speedup below 1"
    arm, alpha = primary_alpha(summary)
    speedup = summary.speedup
    if alpha is None or speedup is None:
        return Finding(rule, False, "n/a: α or speedup not measured")
    model = _primary_cost_model(summary)
    draft, t1 = model.draft_step, model.t1
    stats = summary.arms.get(arm or "")
    gamma = (stats.gamma if stats else None) or summary.conditions.gamma
    ratio = draft * gamma / t1 if None not in (draft, t1, gamma) and t1 else None
    cost = f"D·γ/T₁ = {fmt(ratio, '.2f')}" + (
        f" ({draft * 1e3:.1f} ms × {gamma:g} / {t1 * 1e3:.1f} ms)" if ratio else ""
    )
    numbers = f"α {alpha:.3f} (high: ≥ {HIGH_ALPHA}), speedup {speedup:.2f}× ({MARGIN}), {cost}"
    advice = "the draft is too expensive relative to T₁; use a cheaper draft or a smaller γ"
    return _verdict(rule, alpha >= HIGH_ALPHA and _down(speedup, 1.0), numbers, advice)


def rule_alpha_by_task(summary: Summary) -> Finding:
    """α differs by more than ALPHA_GAP across task types ⇒ enable speculation per task type."""
    rule = "α differs across task types"
    arm = summary.primary_arm or ""
    alphas = {
        task: group.arms[arm].acceptance_rate if arm in group.arms else None
        for task, group in summary.by_task_type.items()
    }
    alphas = {task: value for task, value in alphas.items() if value is not None}
    if len(alphas) < 2:
        return Finding(rule, False, f"n/a: α measured for {len(alphas)} task type(s)")
    low, high = min(alphas, key=alphas.get), max(alphas, key=alphas.get)
    gap = alphas[high] - alphas[low]
    numbers = f"α {alphas[low]:.3f} ({low}) to {alphas[high]:.3f} ({high}), gap {gap:.3f} (threshold {ALPHA_GAP})"
    return _verdict(rule, gap > ALPHA_GAP, numbers, "enable speculation per task type")


def rule_tail_risk(summary: Summary) -> Finding:
    """P99 materially worse than baseline while P50 materially better ⇒ tail risk."""
    rule = "tail risk"
    p50, base50 = _primary_vs_baseline(summary, "latency", "p50")
    p99, base99 = _primary_vs_baseline(summary, "latency", "p99")
    if None in (p50, base50, p99, base99):
        return Finding(rule, False, "n/a: latency quantiles not measured for the primary arm and baseline")
    numbers = f"P50 {base50:.3f} → {p50:.3f} s, P99 {base99:.3f} → {p99:.3f} s ({MARGIN})"
    return _verdict(
        rule,
        _up(p99, base99) and _down(p50, base50),
        numbers,
        "the typical request is faster but the slowest are slower (tail risk)",
    )


def rule_cost_model_error(summary: Summary) -> Finding:
    """Predicted vs measured speedup off by > MODEL_ERROR_LIMIT ⇒ unsteady machine or workload."""
    rule = "cost model vs measurement"
    model = _primary_cost_model(summary)
    predicted = model.predicted_speedup
    measured = model.measured_speedup if model.measured_speedup is not None else summary.speedup
    if predicted is None or not measured:
        return Finding(rule, False, "n/a: no predicted or measured speedup")
    error = (predicted - measured) / measured
    numbers = (
        f"predicted {predicted:.2f}× vs measured {measured:.2f}× (error {error:+.1%}, limit ±{MODEL_ERROR_LIMIT:.0%})"
    )
    return _verdict(
        rule, abs(error) > MODEL_ERROR_LIMIT, numbers, "unsteady machine or workload; rerun with more repeats"
    )


def rule_gamma_extrapolation(summary: Summary) -> Finding:
    """A gamma sweep's extrapolated predictions (γ' above the source arm's γ) off by > MODEL_ERROR_LIMIT ⇒
    trust the measured range (recommended_gamma), not extrapolated_gamma."""
    rule = "cost model beyond the measured γ"
    checks = [c for c in summary.gamma_validation if c.error is not None]
    extrapolated = [c for c in checks if c.kind == "extrapolation"]
    if not extrapolated:
        return Finding(rule, False, "n/a: no gamma sweep prediction above its source arm's γ")
    worst = max(extrapolated, key=lambda c: abs(c.error))
    exact = [abs(c.error) for c in checks if c.kind == "truncation"]
    numbers = (
        f"worst extrapolation {worst.error:+.1%} ({worst.source_arm} at γ'={worst.gamma} vs {worst.arm}); "
        f"worst exact truncation {fmt(max(exact, default=None), '.1%')} (limit ±{MODEL_ERROR_LIMIT:.0%})"
    )
    advice = ("predictions beyond a measured γ are not to be trusted here: choose γ from the measured range "
              "(recommended γ), not the extrapolated one")  # fmt: skip
    return _verdict(rule, abs(worst.error) > MODEL_ERROR_LIMIT, numbers, advice)


def rule_quantized_target(summary: Summary) -> Finding:
    """Quantized target ⇒ exactness holds against the quantized target; its loss is reported apart."""
    rule = "quantized target"
    stats = summary.arms.get(summary.primary_arm or "")
    precision = (stats.target_precision if stats else None) or summary.conditions.target.get("precision")
    if not is_quantized(precision):
        return Finding(rule, False, f"target precision {precision or 'n/a'}")
    quality = summary.quant_quality
    loss = (
        f"KL {fmt(quality.kl_mean, '.4f')}, top-1 agreement {fmt(quality.top1_agreement)}, "
        f"perplexity Δ {fmt(quality.ppl_delta, '+.3f')} vs {quality.reference or 'the reference'}"
        if quality is not None
        else "not measured in this run"
    )
    return Finding(
        rule,
        True,
        f"target is {precision}: exactness is against the {precision} target; "
        f"its loss vs the reference (Quantization quality): {loss}",
    )


def interpret(summary: Summary) -> list[Finding]:
    """Every interpretation rule evaluated on ``summary``."""
    rules = (rule_ttft_vs_throughput, rule_keep_off, rule_draft_too_expensive, rule_alpha_by_task, rule_tail_risk,
             rule_cost_model_error, rule_gamma_extrapolation, rule_quantized_target)  # fmt: skip
    return [rule(summary) for rule in rules]


# ---- serving runs (DESIGN §6) --------------------------------------------------------------------


def _span(levels: list[float], values: list[float | None]) -> str:
    """First and last measured point, e.g. ``1.40× at concurrency 1 → 0.80× at 16``."""
    curve = points(levels, values)
    (low, first), (high, last) = curve[0], curve[-1]
    return f"{first:.2f}× at concurrency {low:g} → {last:.2f}× at {high:g}"


def rule_speedup_falls_with_load(serving: ServingSummary, arm: str) -> Finding:
    """Speedup falling (up to noise) as concurrency rises ⇒ the bottleneck moved to compute/scheduling."""
    rule = f"speedup falls as concurrency rises ({arm})"
    levels, speedups = serving.curve(arm, "speedup")
    falls = falls_with_load(levels, speedups)
    if falls is None:
        return Finding(rule, False, "n/a: speedup measured at fewer than two concurrency levels")
    advice = "the bottleneck moved to compute/scheduling; speculate at low load only (serve.spec_max_batch)"
    return _verdict(rule, falls, f"speedup {_span(levels, speedups)}", advice)


def rule_ttft_and_throughput_up_with_load(serving: ServingSummary, arm: str) -> Finding:
    """From the lowest to the highest concurrency, TTFT p99 and throughput both × > LOAD_GROWTH ⇒ batch jobs."""
    rule = f"TTFT up, throughput up under load ({arm})"
    levels, ttfts = serving.curve(arm, "ttft_p99")
    _, throughputs = serving.curve(arm, "output_throughput")
    both = [(x, t, y) for x, t, y in zip(levels, ttfts, throughputs, strict=True) if t is not None and y is not None]
    xs = [x for x, _, _ in both]
    ttft_growth, tput_growth = growth(xs, [t for _, t, _ in both]), growth(xs, [y for _, _, y in both])
    if ttft_growth is None or tput_growth is None:
        return Finding(rule, False, "n/a: TTFT p99 and throughput measured together at fewer than two levels")
    numbers = (f"concurrency {xs[0]:g} → {xs[-1]:g}: TTFT p99 ×{ttft_growth:.2f}, output throughput "
               f"×{tput_growth:.2f} (threshold ×{LOAD_GROWTH} each)")  # fmt: skip
    advice = "batch jobs, not interactive: the extra throughput is paid for in waiting for the first token"
    return _verdict(rule, ttft_growth > LOAD_GROWTH and tput_growth > LOAD_GROWTH, numbers, advice)


def rule_tpot_better_throughput_worse(serving: ServingSummary, arm: str) -> Finding:
    """At some concurrency the arm's TPOT p50 beats the baseline's while its throughput is below it (both beyond
    MATERIAL_CHANGE)."""
    rule = f"TPOT better, throughput worse ({arm})"
    hits, measured = [], 0
    for level in serving.of_kind(CONCURRENCY):
        tpot, base = serving.stats(arm, level.key).tpot_p50, serving.stats(BASELINE, level.key).tpot_p50
        speedup = serving.speedup(arm, level.key)
        if None in (tpot, base, speedup):
            continue
        measured += 1
        if _down(tpot, base) and _down(speedup, 1.0):
            hits.append(f"{level.value:g} (TPOT p50 {tpot * 1e3:.1f} vs {base * 1e3:.1f} ms, {speedup:.2f}×)")
    if not measured:
        return Finding(rule, False, "n/a: TPOT p50 and speedup not measured at any concurrency level")
    if not hits:
        return Finding(rule, False, f"at none of {measured} concurrency levels ({MARGIN})")
    advice = ("each request streams faster while the machine serves fewer tokens: judge by throughput at "
              "the load you serve")  # fmt: skip
    return _verdict(rule, True, "at concurrency " + ", ".join(hits), advice)


def interpret_serving(serving: ServingSummary) -> list[Finding]:
    """Every serving rule: speedup and TPOT rules per drafting arm, the TTFT/throughput rule per arm."""
    findings = [rule(serving, arm) for arm in serving.drafting_arms
                for rule in (rule_speedup_falls_with_load, rule_tpot_better_throughput_worse)]  # fmt: skip
    return findings + [rule_ttft_and_throughput_up_with_load(serving, arm) for arm in serving.arms]
