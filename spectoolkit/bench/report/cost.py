"""The cost-model section of the run report (DESIGN §1): per-arm costs and predictions, the predicted
speedup per γ and, in a gamma sweep, every prediction set beside the arm that measured it.

A γ is printed as a recommendation only when it lies in the measured range (``recommended_gamma``:
1..``measured_gamma_max``, predicted by truncating measured rounds, which is exact); the best γ beyond it
(``extrapolated_gamma``) is always labelled "predicted, not measured". An arm whose draft-length policy
is not fixed has no fixed-γ what-if: its cells say why instead of a number.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spectoolkit.bench.report.load import Records, arm_policy, fmt, is_fixed, md_table, speed
from spectoolkit.bench.report.plots import predicted_curve
from spectoolkit.metrics.summary_schema import Summary
from spectoolkit.metrics.summary_sections import CostModel, GammaCheck

UNMEASURED = "predicted, not measured"
COST_HEADERS = (
    "arm|T₁ ms|D per step ms|V(γ+1) ms|C ms|round ms|E[N]|predicted decode|predicted request|measured|"
    "error|break-even α|recommended γ (measured range)|best γ beyond it (extrapolation)"
)


def _ms(seconds: float | None) -> str:
    return fmt(seconds * 1e3 if seconds is not None else None, ".2f")


def _first_known(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def variable_k_note(summary: Summary, arm: str) -> str:
    """Why ``arm`` has no fixed-γ what-if."""
    return f"n/a ({arm_policy(summary, arm)} policy: k varies per round)"


def recommended_text(summary: Summary, arm: str, model: CostModel) -> str:
    """``recommended_gamma`` with its predicted speedup, the range it was searched in and (when another arm's
    rounds predict it) whose rounds; never a γ outside the measured range."""
    if not is_fixed(summary, arm):
        return variable_k_note(summary, arm)
    gamma, top = model.recommended_gamma, model.measured_gamma_max
    if gamma is None:
        return "n/a"
    if top is None:
        return f"{gamma} (measured range not recorded)"
    source = f", {model.recommended_source}'s rounds" if model.recommended_source not in (None, arm) else ""
    return f"{gamma}: {speed(model.recommended_speedup)} (of 1–{top}{source})"


def extrapolated_text(summary: Summary, arm: str, model: CostModel) -> str:
    """``extrapolated_gamma`` with its speedup, always labelled as a prediction beyond the measured range."""
    if not is_fixed(summary, arm):
        return variable_k_note(summary, arm)
    if model.extrapolated_gamma is None:
        return "n/a"
    return f"{model.extrapolated_gamma}: {speed(model.extrapolated_speedup)} ({UNMEASURED})"


def _cost_row(summary: Summary, arm: str, model: CostModel) -> list[Any]:
    predicted, measured = model.predicted_speedup, model.measured_speedup
    measured = measured if measured is not None else summary.speedups.get(arm)
    error = _first_known(model.prediction_error, predicted / measured - 1 if predicted and measured else None)
    stats = summary.arms.get(arm)
    gamma = stats.gamma if stats else None
    verify = model.verify.get(gamma + 1) if gamma else None
    times = [model.t1, model.draft_step, verify, model.overhead, model.round_cost]
    even = fmt(model.break_even_alpha) if is_fixed(summary, arm) else variable_k_note(summary, arm)
    return [arm, *(_ms(t) for t in times), fmt(model.expected_tokens, ".2f"), speed(model.predicted_decode_speedup),
            speed(predicted), speed(measured), fmt(error, "+.1%"), even, recommended_text(summary, arm, model),
            extrapolated_text(summary, arm, model)]  # fmt: skip


def _basis(gamma: int, own: int | None) -> str:
    if own is None:
        return "n/a (the arm's γ is not recorded)"
    return "exact (truncated measured rounds)" if gamma <= own else f"extrapolation: {UNMEASURED}"


def _curve_lines(summary: Summary) -> list[str]:
    """The primary arm's predicted speedup per γ, each γ labelled exact or extrapolated."""
    arm = summary.primary_arm or ""
    model = summary.cost_model.get(arm)
    if model is not None and not is_fixed(summary, arm):
        return [f"Predicted speedup per γ ({arm}): {variable_k_note(summary, arm)}; a fixed-γ what-if does not "
                "describe it (its prediction above is over its actual rounds).", ""]  # fmt: skip
    curve = predicted_curve(summary)
    if not curve or model is None:
        return []
    stats = summary.arms.get(arm)
    own = stats.gamma if stats and stats.gamma else None
    mine = model.recommended_source in (None, arm)
    rows = []
    for gamma, value in curve:
        marks = [
            " (recommended)" if mine and gamma == model.recommended_gamma else "",
            f" (best beyond the measured range: {UNMEASURED})" if gamma == model.extrapolated_gamma else "",
        ]
        rows.append([gamma, speed(value) + "".join(marks), _basis(gamma, own)])  # fmt: skip
    lines = [f"Predicted speedup per γ ({arm}, from its own rounds at γ={own or 'n/a'}):", ""]
    lines += md_table(["γ", "predicted speedup", "basis"], rows)
    if not mine and model.recommended_gamma is not None:
        lines += [f"Recommended γ over the sweep's measured range: {recommended_text(summary, arm, model)}.", ""]
    return lines


def _validation_lines(checks: list[GammaCheck]) -> list[str]:
    """The gamma sweep's predictions at each measured γ' beside the arm that ran it, with the mean |error|."""
    rows = [[c.source_arm, c.source_gamma, c.gamma, speed(c.predicted_speedup), speed(c.measured_speedup), c.arm,
             fmt(c.error, "+.1%"), "exact truncation (γ' ≤ its γ)" if c.kind == "truncation" else
             "extrapolation (γ' > its γ)"] for c in checks]  # fmt: skip
    headers = ["predicted from", "its γ", "at γ'", "predicted", "measured", "arm run at γ'", "error", "basis"]
    means = []
    for kind, label in (("truncation", "exact truncations"), ("extrapolation", "extrapolations")):
        errors = [abs(c.error) for c in checks if c.kind == kind and c.error is not None]
        if errors:
            means.append(f"{label} {sum(errors) / len(errors):.1%} over {len(errors)}")
    note = ("Cost model vs the gamma sweep: each fixed arm's rounds predict the speedup at every measured γ' "
            "(exact for γ' ≤ its γ, extrapolated above), beside the speedup the arm run at γ' measured; "
            "error = predicted / measured − 1.")  # fmt: skip
    return [note, "", *md_table(headers, rows), f"Mean |error|: {'; '.join(means) or 'n/a'}.", ""]


def _image(plots: dict[str, Path], name: str, alt: str) -> list[str]:
    return [f"![{alt}](plots/{plots[name].name})", ""] if name in plots else []


def cost_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    """The cost model section: the per-arm table, the primary arm's curve over γ, a gamma sweep's validation."""
    note = (
        "Speedup ≈ E[N]·T₁ / (D·γ + V(γ+1) + C) (DESIGN §1), T₁ per target step, D per draft step, V and C per "
        "round; the request prediction adds the prefill both arms pay; error = predicted / measured − 1. "
        f"A recommended γ lies in the measured range (exact: truncated measured rounds); beyond it: {UNMEASURED}."
    )
    lines = ["## Cost model", "", note, ""]
    rows = [_cost_row(summary, arm, model) for arm, model in summary.cost_model.items()]
    empty = ["n/a: no cost model in summary.json (no drafting arm).", ""]
    lines += md_table(COST_HEADERS.split("|"), rows) if rows else empty
    lines += _curve_lines(summary) + _image(plots, "speedup_vs_gamma", "speedup vs gamma")
    if summary.gamma_validation:
        lines += _validation_lines(summary.gamma_validation) + _image(plots, "gamma_validation", "gamma validation")
    return lines
