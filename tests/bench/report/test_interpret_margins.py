"""Every interpretation rule (bench.report.interpret) fires only when its premise holds materially.

Per rule: the premise clearly true (applies), false, and equal or within the margin (does not apply).
"Up"/"down"/"below 1" mean beyond MATERIAL_CHANGE of the reference value; the other rules have their
own named thresholds, checked at the threshold itself. A run report once said "TTFT up, throughput up"
over "TTFT p50 0.307 → 0.307 s": the first case below.
"""

from __future__ import annotations

from typing import Any

import pytest

from spectoolkit.bench.report import interpret as ip
from tests.bench.report.test_report import make_run, typed
from tests.bench.report.test_serving_report import CONCURRENCY, serving_summary
from tests.bench.report.test_serving_report import typed as typed_serving

M = ip.MATERIAL_CHANGE


def _run(speedup: float = 1.25, **arm_edits: Any) -> dict[str, Any]:
    """A standard run (speedup on the primary "spec" arm and its cost model) with ``arm_edits`` on "spec"."""
    summary, _ = make_run(speedup=speedup)
    spec = summary["arms"]["spec"]
    for key, value in arm_edits.items():
        spec[key].update(value) if isinstance(value, dict) else spec.__setitem__(key, value)
    return summary


def _applies(rule, summary: dict[str, Any]) -> bool:
    return rule(typed(summary)).applies


# ---- TTFT up, throughput up ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base_ttft", "spec_ttft", "speedup", "expected"),
    [
        (0.30, 0.35, 1.25, True),  # +17% TTFT, 1.25×
        (0.307, 0.307, 1.25, False),  # the report that started this: equal TTFT is not "up"
        (0.30, 0.30 * (1 + M), 1.25, False),  # exactly the margin: not beyond it
        (0.30, 0.31, 1.25, False),  # +3%: noise
        (0.30, 0.35, 1.0, False),  # throughput equal
        (0.30, 0.35, 1 + M / 2, False),  # throughput within the margin
        (0.30, 0.25, 1.25, False),  # TTFT down
    ],
)
def test_ttft_and_throughput_up(base_ttft: float, spec_ttft: float, speedup: float, expected: bool) -> None:
    summary = _run(speedup, ttft={"p50": spec_ttft})
    summary["arms"]["baseline"]["ttft"]["p50"] = base_ttft
    assert _applies(ip.rule_ttft_vs_throughput, summary) is expected
    assert "margin ±5%" in ip.rule_ttft_vs_throughput(typed(summary)).text


# ---- speedup below 1 / α high with speedup below 1 ------------------------------------------------


@pytest.mark.parametrize(
    ("speedup", "expected"), [(0.9, True), (1.0, False), (1 - M, False), (0.97, False), (1.2, False)]
)
def test_keep_off_needs_a_speedup_materially_below_one(speedup: float, expected: bool) -> None:
    assert _applies(ip.rule_keep_off, _run(speedup)) is expected


@pytest.mark.parametrize(
    ("alpha", "speedup", "expected"),
    [(0.95, 0.9, True), (0.95, 1.0, False), (0.95, 0.97, False), (ip.HIGH_ALPHA - 0.01, 0.9, False)],
)
def test_draft_too_expensive_needs_high_alpha_and_a_material_slowdown(alpha: float, speedup: float, expected: bool):
    assert _applies(ip.rule_draft_too_expensive, _run(speedup, acceptance_rate=alpha)) is expected


# ---- tail risk -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p50", "p99", "expected"),
    [
        (1.8, 3.5, True),  # baseline 2.0 / 2.5 s: P50 −10%, P99 +40%
        (1.8, 2.5, False),  # P99 equal
        (1.8, 2.55, False),  # P99 +2%: noise
        (2.0, 3.5, False),  # P50 equal
        (1.95, 3.5, False),  # P50 −2.5%: noise
        (2.2, 3.5, False),  # slower everywhere: not a tail risk
    ],
)
def test_tail_risk_needs_both_quantiles_to_move_materially(p50: float, p99: float, expected: bool) -> None:
    summary = _run(latency={"p50": p50, "p99": p99})
    base = summary["arms"]["baseline"]["latency"]
    assert (base["p50"], base["p99"]) == (2.0, 2.5)
    assert _applies(ip.rule_tail_risk, summary) is expected


# ---- rules with their own thresholds ---------------------------------------------------------------


@pytest.mark.parametrize(("code_alpha", "expected"), [(0.95, True), (0.75, False), (0.75 + ip.ALPHA_GAP - 0.01, False)])
def test_alpha_by_task_needs_a_gap_above_its_threshold(code_alpha: float, expected: bool) -> None:
    summary = _run()
    for task, alpha in (("chat", 0.75), ("code", code_alpha)):
        summary["by_task_type"][task]["arms"]["spec"]["acceptance_rate"] = alpha
    assert _applies(ip.rule_alpha_by_task, summary) is expected


@pytest.mark.parametrize(
    ("predicted", "expected"), [(1.6, True), (1.25, False), (1.25 * (1 + ip.MODEL_ERROR_LIMIT), False)]
)
def test_cost_model_error_needs_an_error_above_its_limit(predicted: float, expected: bool) -> None:
    summary = _run()
    summary["cost_model"]["spec"].update(predicted_speedup=predicted, measured_speedup=1.25)
    assert _applies(ip.rule_cost_model_error, summary) is expected


@pytest.mark.parametrize(("error", "expected"), [(0.3, True), (0.0, False), (-0.1, False)])
def test_gamma_extrapolation_needs_an_error_above_its_limit(error: float, expected: bool) -> None:
    summary = _run()
    summary["gamma_validation"] = [
        {"source_arm": "spec-g2", "source_gamma": 2, "arm": "spec-g4", "gamma": 4, "kind": "extrapolation",
         "predicted_speedup": 1.25 * (1 + error), "measured_speedup": 1.25, "error": error},
        {"source_arm": "spec-g4", "source_gamma": 4, "arm": "spec-g2", "gamma": 2, "kind": "truncation",
         "predicted_speedup": 1.2, "measured_speedup": 1.2, "error": 0.0},
    ]  # fmt: skip
    assert _applies(ip.rule_gamma_extrapolation, summary) is expected


@pytest.mark.parametrize(("precision", "expected"), [("rtn-int4", True), ("fp32", False)])
def test_quantized_target_is_about_the_precision(precision: str, expected: bool) -> None:
    assert _applies(ip.rule_quantized_target, _run(target_precision=precision)) is expected


# ---- serving rules -------------------------------------------------------------------------------


def _serving(speedups: tuple[float, ...] | None = None, spec_tpot: float | None = None, spec_ttft: float | None = None):
    summary = serving_summary()
    for i, key in enumerate(map(str, CONCURRENCY)):
        spec = summary["serving"]["spec"][key]
        if speedups is not None:
            spec["speedup"] = speedups[i]
        if spec_tpot is not None:
            spec["tpot_p50"] = spec_tpot
        if spec_ttft is not None:
            spec["ttft_p99"] = spec_ttft
    return typed_serving(summary)[1]


@pytest.mark.parametrize(
    ("speedups", "expected"),
    [
        (None, True),  # 1.4 → 0.85
        ((1.3,) * 5, False),  # flat
        ((1.30, 1.30, 1.29, 1.28, 1.27), False),  # −2.3%: within the tolerance
    ],
)
def test_speedup_falls_with_load_needs_a_material_fall(speedups, expected: bool) -> None:
    assert ip.rule_speedup_falls_with_load(_serving(speedups), "spec").applies is expected


@pytest.mark.parametrize(("spec_ttft", "expected"), [(None, True), (0.05, False)])
def test_ttft_and_throughput_up_with_load_needs_both_to_grow(spec_ttft, expected: bool) -> None:
    assert ip.rule_ttft_and_throughput_up_with_load(_serving(spec_ttft=spec_ttft), "spec").applies is expected


@pytest.mark.parametrize(
    ("speedups", "spec_tpot", "expected"),
    [
        (None, None, True),  # TPOT 18 vs 22 ms at 0.92× and 0.85×
        (None, 0.022, False),  # TPOT equal to the baseline's
        (None, 0.0215, False),  # TPOT −2%: noise
        ((1.4, 1.3, 1.1, 1.0, 0.97), None, False),  # throughput equal or within the margin
    ],
)
def test_tpot_better_throughput_worse_needs_material_moves(speedups, spec_tpot, expected: bool) -> None:
    assert ip.rule_tpot_better_throughput_worse(_serving(speedups, spec_tpot), "spec").applies is expected
