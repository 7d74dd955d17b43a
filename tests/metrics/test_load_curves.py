"""Load curves of a serving run (spectoolkit.metrics.load_curves): knee, saturation, crossover and the reader.

Hand-built curves with the answer known from the definitions in the module docstring.
"""

from __future__ import annotations

import math

import pytest

from spectoolkit.metrics import load_curves as lc

LEVELS = [1, 2, 4, 8, 16, 32]
SATURATING = [10.0, 19.0, 34.0, 48.0, 52.0, 53.0]  # gains per doubling 1.9, 1.79, 1.41, 1.08, 1.02


def test_saturating_curve_has_its_knee_and_saturation() -> None:
    assert lc.knee(LEVELS, SATURATING) == 4  # 34 → 48 is the first doubling below 1.5×
    assert lc.saturation(LEVELS, SATURATING) == 16  # 0.95 × 53 = 50.35: 48 misses, 52 is within
    assert lc.knee(LEVELS, SATURATING, min_gain=1.8) == 2
    assert lc.saturation(LEVELS, SATURATING, share=0.10) == 8  # 0.90 × 53 = 47.7


def test_a_curve_still_scaling_at_the_top_has_neither() -> None:
    linear = [10.0, 20.0, 40.0, 80.0]
    assert lc.knee(LEVELS[:4], linear) is None
    assert lc.saturation(LEVELS[:4], linear) is None  # the maximum is the highest level: no plateau seen


def test_knee_normalises_uneven_steps_to_one_doubling() -> None:
    assert lc.gain_per_doubling((1, 10.0), (3, 25.0)) == pytest.approx(2.5 ** (1 / math.log2(3)))
    assert lc.knee([1, 3, 12], [10.0, 25.0, 40.0]) == 3  # 1 → 3: 1.78× per doubling; 3 → 12: 1.26×
    assert lc.knee([1, 2, 4], [10.0, 12.0, 13.0]) == 1  # sublinear from the first step
    assert lc.gain_per_doubling((2, 10.0), (2, 12.0)) is None and lc.gain_per_doubling((1, 0.0), (2, 5.0)) is None


def test_throughput_that_falls_after_its_peak_saturates_at_the_peak() -> None:
    assert lc.saturation([1, 2, 4, 8], [10.0, 20.0, 28.0, 25.0]) == 4
    assert lc.knee([1, 2, 4, 8], [10.0, 20.0, 28.0, 25.0]) == 2  # 20 → 28: 1.4× per doubling
    assert lc.knee([1, 2, 4, 8], [10.0, 20.0, 30.0, 25.0]) == 4  # exactly 1.5× is not below the threshold


def test_crossover_is_the_first_level_from_which_speculation_never_pays_again() -> None:
    levels = [1, 2, 4, 8, 16]
    speedups = [1.4, 1.3, 1.1, 0.92, 0.85]
    assert lc.crossover(levels, speedups) == 8 and lc.last_paying(levels, speedups) == 4
    dip = [1.2, 0.9, 1.05, 0.95, 0.9]  # a dip at 2 that recovers at 4 is not the crossover
    assert lc.crossover(levels, dip) == 8 and lc.last_paying(levels, dip) == 4
    assert lc.crossover(levels, [1.4, 1.2, 1.1, 1.05, 1.01]) is None
    assert lc.last_paying(levels, [1.4, 1.2, 1.1, 1.05, 1.01]) == 16
    assert lc.crossover(levels, [0.9, 0.8, 0.7, 0.7, 0.6]) == 1
    assert lc.last_paying(levels, [0.9, 0.8, 0.7, 0.7, 0.6]) is None
    assert lc.crossover(levels, speedups, threshold=1.2) == 4


def test_unmeasured_points_are_left_out() -> None:
    levels = [1, 2, 4, 8, 16]
    assert lc.crossover(levels, [1.3, None, 0.9, None, 0.8]) == 4
    assert lc.crossover(levels, [None] * 5) is None and lc.last_paying(levels, [None] * 5) is None
    assert lc.knee(levels, [None] * 5) is None and lc.saturation(levels, [None] * 5) is None
    assert lc.points([4, None, 1], [2.0, 3.0, float("nan")]) == [(4.0, 2.0)]
    assert lc.saturation([1], [10.0]) is None and lc.knee([1], [10.0]) is None


def test_falls_with_load_tolerates_noise_not_a_recovery() -> None:
    levels = [1, 2, 4, 8]
    assert lc.falls_with_load(levels, [1.4, 1.2, 1.0, 0.8]) is True
    assert lc.falls_with_load(levels, [1.4, 1.2, 1.23, 0.8]) is True  # +2.5%: noise
    assert lc.falls_with_load(levels, [1.4, 1.0, 1.2, 0.8]) is False  # +20%: a recovery
    assert lc.falls_with_load(levels, [1.0, 1.0, 1.0, 0.99]) is False  # ends within 5% of the start
    assert lc.falls_with_load([1], [1.4]) is None


def test_growth_and_meets_up_to() -> None:
    assert lc.growth([1, 2, 4], [0.05, None, 0.4]) == pytest.approx(8.0)
    assert lc.growth([1, 2], [0.0, 1.0]) is None and lc.growth([1], [1.0]) is None
    assert lc.meets_up_to([1, 2, 4, 8], [0.1, 0.15, 0.25, 0.18], 0.2) == 2  # 8 meets it again, 4 does not
    assert lc.meets_up_to([1, 2], [0.3, 0.1], 0.2) is None


def _raw(**extra: object) -> dict:
    stats = {"output_throughput": 20.0, "speedup": None, "ttft_p99": "fast", "by_task": {"code": {"num_requests": 3}}}
    spec = {**stats, "output_throughput": 26.0, "speedup": None}
    return {"mode": "serving", "serving": {"baseline": {"1": stats, "rate=0.5": stats}, "spec": {"1": spec}}, **extra}


def test_reader_is_tolerant_and_derives_levels_and_speedups() -> None:
    assert lc.ServingSummary.from_dict({"arms": {}}) is None and lc.ServingSummary.from_dict([1]) is None
    serving = lc.ServingSummary.from_dict(_raw(conditions={"serve": {"slo_ttft_ms": 200}}))
    levels = [(lv.key, lv.kind, lv.value) for lv in serving.levels]
    assert levels == [("1", "concurrency", 1.0), ("rate=0.5", "rate", 0.5)]
    assert serving.stats("spec", "1").ttft_p99 is None  # a string is not a number
    assert serving.stats("baseline", "1").by_task["code"].num_requests == 3
    assert serving.speedup("spec", "1") == pytest.approx(1.3)  # recorded None: the throughput ratio
    assert serving.speedup("baseline", "1") is None and serving.speedup("spec", "rate=0.5") is None
    assert serving.stats("spec", "missing") == lc.LevelStats() and serving.drafting_arms == ["spec"]
    assert serving.serve == {"slo_ttft_ms": 200} and serving.exactness is None
    assert serving.levels[1].label == "rate 0.5 req/s" and serving.levels[0].label == "concurrency 1"


def test_reader_keeps_the_written_levels_and_serve_section() -> None:
    levels = [{"key": "2", "kind": "concurrency", "value": 2}, {"key": "rate=1", "kind": "rate", "value": 1}, 7]
    raw = _raw(serving_levels=levels, serve={"spec_max_batch": 4}, serving_exactness={"checked": "x"})
    serving = lc.ServingSummary.from_dict(raw)
    assert [lv.key for lv in serving.levels] == ["2", "rate=1"] and serving.serve == {"spec_max_batch": 4}
    assert serving.exactness == lc.ServingExactness() and serving.curve("spec", "output_throughput") == ([2.0], [None])


def test_curve_marks_of_the_baseline_have_no_crossover() -> None:
    serving = lc.ServingSummary(
        levels=[lc.ServingLevel(str(n), lc.CONCURRENCY, n) for n in LEVELS],
        arms={
            "baseline": {str(n): lc.LevelStats(output_throughput=t) for n, t in zip(LEVELS, SATURATING, strict=True)},
            "spec": {str(n): lc.LevelStats(output_throughput=t * 1.1, speedup=s)
                     for n, t, s in zip(LEVELS, SATURATING, [1.3, 1.2, 1.1, 0.95, 0.9, 0.9], strict=True)},
        },
    )  # fmt: skip
    assert lc.curve_marks(serving, "baseline") == lc.CurveMarks(knee=4, saturation=16)
    assert lc.curve_marks(serving, "spec") == lc.CurveMarks(knee=4, saturation=16, crossover=8, last_paying=4)
