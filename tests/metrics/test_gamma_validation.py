"""The cost model against a gamma sweep (metrics.gamma_validation), recommended_gamma within the measured
range, extrapolated_gamma beyond it, no fixed-γ what-if for a variable-k arm, and old summaries read so."""

from __future__ import annotations

import json

import pytest

from spectoolkit.metrics.cost_model import StepCosts, cost_model_for_arm, predict, predicted_by_gamma
from spectoolkit.metrics.gamma_validation import gamma_validation
from spectoolkit.metrics.records import rounds_of
from spectoolkit.metrics.summary import cost_models
from spectoolkit.metrics.summary_schema import Summary
from tests.metrics.sweep_records import ARMS, ROUNDS, measured, predicted, round_cost, sweep_records, verify_costs


@pytest.fixture(scope="module")
def models() -> dict:
    return json.loads(json.dumps(cost_models(sweep_records(), ARMS, verify_costs())))  # as summary.json holds it


def _checks(models: dict) -> dict[tuple[str, int], dict]:
    return {(c["source_arm"], c["gamma"]): c for c in gamma_validation(models, ARMS)}


def test_every_fixed_source_is_checked_at_every_measured_gamma(models: dict) -> None:
    checks = _checks(models)
    fixed = ("spec-g1", "spec-g2", "spec-g4")
    assert set(checks) == {(source, gamma) for source in fixed for gamma in (1, 2, 4)}  # spec-adaptive in neither role
    for (source, gamma), check in checks.items():
        own = ARMS[source]["gamma"]
        assert check["source_gamma"] == own and check["arm"] == f"spec-g{gamma}"
        assert check["kind"] == ("truncation" if gamma <= own else "extrapolation")
        assert check["measured_speedup"] == pytest.approx(measured(check["arm"]), rel=1e-12)
        assert check["error"] == pytest.approx(check["predicted_speedup"] / check["measured_speedup"] - 1)


def test_truncation_predicts_the_arm_run_at_that_gamma_exactly(models: dict) -> None:
    # spec-g4's rounds truncated to 2 are spec-g2's rounds: the prediction is the measurement
    checks = _checks(models)
    for source, gamma in (("spec-g4", 2), ("spec-g4", 1), ("spec-g2", 1), ("spec-g4", 4)):
        assert abs(checks[(source, gamma)]["error"]) < 1e-9
    assert checks[("spec-g4", 2)]["predicted_speedup"] == pytest.approx(predicted(2.5, round_cost(2)), rel=1e-9)


def test_extrapolations_follow_the_geometric_tail_and_miss(models: dict) -> None:
    checks = _checks(models)
    # spec-g1 accepted every draft: tail α = 1, so γ'=2 expects 3 tokens a round (measured at γ=2: 2.5)
    assert checks[("spec-g1", 2)]["predicted_speedup"] == pytest.approx(predicted(3.0, round_cost(2)), rel=1e-9)
    # spec-g2: Pr(K ≥ 2 | K ≥ 1) = 0.5, half the rounds full: E = 2.5 + 0.5·(0.5 + 0.25) (measured at γ=4: 3.5)
    assert checks[("spec-g2", 4)]["predicted_speedup"] == pytest.approx(predicted(2.875, round_cost(4)), rel=1e-9)
    assert checks[("spec-g1", 2)]["error"] > 0.15 and checks[("spec-g2", 4)]["error"] < -0.15


def test_no_validation_without_two_fixed_arms_on_one_reference(models: dict) -> None:
    one = {name: info for name, info in ARMS.items() if name in ("baseline", "spec-g2", "spec-adaptive")}
    assert gamma_validation(models, one) == []
    other_reference = {**ARMS, "spec-g1": {**ARMS["spec-g1"], "reference": "quant"}}
    assert {c["source_arm"] for c in gamma_validation(models, other_reference)} == {"spec-g2", "spec-g4"}


def test_recommendation_in_a_sweep_may_name_another_measured_arm(models: dict) -> None:
    g2, g4 = models["spec-g2"], models["spec-g4"]
    assert g2["measured_gamma_max"] == 4 and g4["measured_gamma_max"] == 4  # the sweep's largest γ
    # the draft is cheap: γ=4 is best; spec-g2's own rounds cannot say so exactly, spec-g4's can
    assert (g2["recommended_gamma"], g2["recommended_source"]) == (4, "spec-g4")
    assert g2["recommended_speedup"] == pytest.approx(measured("spec-g4"), rel=1e-9)
    assert (g4["recommended_gamma"], g4["recommended_source"]) == (4, "spec-g4")
    for model in (g2, g4):  # the best γ above the sweep: the arm's own extrapolation
        by_gamma = {int(g): v for g, v in model["predicted_by_gamma"].items()}
        beyond = {g: v for g, v in by_gamma.items() if g > 4}
        extrapolated = model["extrapolated_gamma"]
        assert extrapolated > 4 and model["extrapolated_speedup"] == by_gamma[extrapolated]
        assert model["extrapolated_speedup"] >= 0.99 * max(beyond.values())  # the smallest γ within 1% of the best


def test_recommendation_of_a_single_arm_stays_within_its_gamma() -> None:
    arms = {name: ARMS[name] for name in ("baseline", "spec-g1")}
    model = cost_models(sweep_records(), arms, verify_costs())["spec-g1"]
    # every draft accepted: the extrapolation keeps rising to γ'=16, but only γ=1 was measured
    assert (model["measured_gamma_max"], model["recommended_gamma"], model["recommended_source"]) == (1, 1, "spec-g1")
    assert model["extrapolated_gamma"] == 16 and model["extrapolated_speedup"] > model["recommended_speedup"]
    assert model["recommended_speedup"] == pytest.approx(measured("spec-g1"), rel=1e-9)


def test_a_variable_k_arm_has_no_fixed_gamma_what_if(models: dict) -> None:
    model = models["spec-adaptive"]
    assert model["policy"] == "adaptive"
    for key in ("predicted_by_gamma", "break_even_alpha", "measured_gamma_max", "recommended_gamma",
                "recommended_speedup", "recommended_source", "extrapolated_gamma", "extrapolated_speedup"):  # fmt: skip
        assert model[key] is None, key
    # the prediction over its actual rounds (k varies) still holds: these times follow the model exactly
    assert model["predicted_speedup"] == pytest.approx(measured("spec-adaptive"), rel=1e-9)
    typed = Summary.from_dict({"schema_version": 3, "cost_model": models}).cost_model["spec-adaptive"]
    assert typed.predicted_by_gamma == {} and typed.recommended_gamma is None and typed.policy == "adaptive"


def test_cost_model_for_arm_policy_switch() -> None:
    records = sweep_records()
    arm = [r for r in records if r.arm == "spec-g2"]
    base = [r for r in records if r.arm == "baseline"]
    fixed = cost_model_for_arm(arm, base, None, 2)
    variable = cost_model_for_arm(arm, base, None, 2, policy="confidence")
    assert fixed["policy"] == "fixed" and fixed["recommended_gamma"] == 2 and fixed["break_even_alpha"] is not None
    assert variable["predicted_by_gamma"] is None and variable["break_even_alpha"] is None
    assert variable["predicted_speedup"] == pytest.approx(fixed["predicted_speedup"])  # predict() is the same
    assert rounds_of(arm) == ROUNDS["spec-g2"] * 2


def _old_summary(recommended: int, schema_version: int | None) -> dict:
    """A summary of a γ=4 arm whose recommended_gamma was searched over every predicted γ (before version 3)."""
    by_gamma = {"1": 1.0, "2": 1.2, "3": 1.25, "4": 1.3, "5": 1.28, "6": 1.45, "8": 1.4}
    summary = {"arms": {"spec": {"requests": 2, "gamma": 4}},
               "cost_model": {"spec": {"recommended_gamma": recommended, "predicted_by_gamma": by_gamma}}}  # fmt: skip
    return summary if schema_version is None else {"schema_version": schema_version, **summary}


@pytest.mark.parametrize("version", [None, 2])
def test_an_old_recommendation_beyond_the_arm_gamma_reads_as_an_extrapolation(version: int | None) -> None:
    model = Summary.from_dict(_old_summary(6, version)).cost_model["spec"]
    assert (model.measured_gamma_max, model.recommended_gamma, model.recommended_speedup) == (4, 4, 1.3)
    assert (model.extrapolated_gamma, model.extrapolated_speedup) == (6, 1.45)
    assert model.recommended_source == "spec" and model.policy is None


def test_a_current_summary_is_read_as_written() -> None:
    raw = _old_summary(6, 3)
    raw["cost_model"]["spec"].update(measured_gamma_max=8, recommended_source="spec-g8")
    model = Summary.from_dict(raw).cost_model["spec"]
    assert (model.recommended_gamma, model.measured_gamma_max, model.extrapolated_gamma) == (6, 8, None)


def test_predicted_by_gamma_in_the_summary_is_the_library_function(models: dict) -> None:
    records = [r for r in sweep_records() if r.arm == "spec-g4"]
    base = [r for r in sweep_records() if r.arm == "baseline"]
    entry = cost_model_for_arm(records, base, verify_costs()["spec-g4"], 4)
    costs_prediction = predict(rounds_of(records), _costs(entry), 71.0)["predicted_speedup"]
    assert entry["predicted_speedup"] == pytest.approx(costs_prediction)
    assert {int(g): v for g, v in models["spec-g4"]["predicted_by_gamma"].items()} == pytest.approx(
        predicted_by_gamma(rounds_of(records), _costs(entry), 4, 16, output_len=71.0)
    )


def _costs(entry: dict) -> StepCosts:
    return StepCosts(entry["t1"], entry["draft_step"], {int(w): v for w, v in entry["verify"].items()},
                     entry["overhead"], entry["prefill"])  # fmt: skip
