"""The cost model checked against a gamma sweep (DESIGN §1; ``experiment=gamma_sweep``, issue 16).

A sweep measures one fixed-γ arm spec-gN per N, all with the same draft, target and reference arm. The
rounds of each arm predict the speedup at every γ' (:func:`~spectoolkit.metrics.cost_model.predicted_by_gamma`):
exactly for γ' <= N (truncating a round keeps its accepted prefix), by extrapolation for γ' > N (a
geometric tail). Here

- :func:`gamma_validation` sets every such prediction at a measured γ' beside the measured speedup of the
  arm that ran at γ' (error = predicted / measured - 1, kind "truncation" or "extrapolation");
- :func:`widen_recommendations` searches each fixed arm's ``recommended_gamma`` over the sweep's whole
  measured range 1..max γ, each candidate γ' predicted by truncating measured rounds: the arm's own for
  γ' <= N, else those of the arm with the smallest measured γ >= γ'. So a recommendation may name
  another arm's γ (``recommended_source`` says whose rounds predict it); the best γ' above the range
  stays the arm's ``extrapolated_gamma`` (predicted, not measured).

Arms group by reference arm; a group needs two fixed-policy arms with a cost model to compare. Both
functions work on the JSON form of the cost model (str γ keys), as ``summary.json`` holds it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from spectoolkit.metrics.cost_model import FIXED, recommendation

TRUNCATION, EXTRAPOLATION = "truncation", "extrapolation"
Models = Mapping[str, dict[str, Any]]  # arm -> its cost_model entry (JSON form)


def _sweeps(models: Models, arms: Mapping[str, Mapping[str, Any]]) -> list[list[tuple[int, str]]]:
    """Per reference arm, its fixed-policy arms with a what-if curve, as (γ, arm) ascending; groups of >= 2."""
    groups: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for name, info in arms.items():
        model = models.get(name)
        if model and model.get("predicted_by_gamma") and info.get("gamma") and info.get("reference"):
            if info.get("policy", FIXED) == FIXED:
                groups[info["reference"]].append((int(info["gamma"]), name))
    return [sorted(group) for group in groups.values() if len(group) >= 2]


def gamma_validation(models: Models, arms: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every (source arm, measured γ') pair of a sweep: the source's predicted speedup at γ' beside the
    measured speedup of the arm run at γ' (the JSON form of
    :class:`~spectoolkit.metrics.summary_sections.GammaCheck`); [] without a sweep.

    ``arms`` maps arm name -> {"reference", "gamma", "policy"} as the runner passes them.
    """
    checks = []
    for sweep in _sweeps(models, arms):
        for source_gamma, source in sweep:
            predicted_by = models[source]["predicted_by_gamma"]
            for gamma, arm in sweep:
                predicted, measured = predicted_by.get(str(gamma)), models[arm].get("measured_speedup")
                if predicted is None or measured is None:
                    continue
                checks.append({
                    "source_arm": source, "source_gamma": source_gamma, "arm": arm, "gamma": gamma,
                    "kind": TRUNCATION if gamma <= source_gamma else EXTRAPOLATION,
                    "predicted_speedup": predicted, "measured_speedup": measured,
                    "error": predicted / measured - 1 if measured else None,
                })  # fmt: skip
    return checks


def widen_recommendations(models: dict[str, dict[str, Any]], arms: Mapping[str, Mapping[str, Any]]) -> None:
    """In place: each fixed arm of a sweep recommends the best γ' of 1..the sweep's max γ (module docstring)."""
    for sweep in _sweeps(models, arms):
        top = sweep[-1][0]
        for own_gamma, name in sweep:
            candidates: dict[int, tuple[float, str]] = {}  # γ' -> (predicted speedup, arm whose rounds say so)
            for gamma in range(1, top + 1):
                source = name if gamma <= own_gamma else next(arm for g, arm in sweep if g >= gamma)
                value = models[source]["predicted_by_gamma"].get(str(gamma))
                if value is not None:
                    candidates[gamma] = (value, source)
            own = {int(g): value for g, value in models[name]["predicted_by_gamma"].items()}
            merged = {g: value for g, (value, _) in candidates.items()} | {g: v for g, v in own.items() if g > top}
            found = recommendation(merged, top)
            source = candidates[found["recommended_gamma"]][1] if found["recommended_gamma"] is not None else None
            models[name].update(found, recommended_source=source)
