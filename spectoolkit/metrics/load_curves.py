"""Load curves of a serving run (issue 15, DESIGN §6): the typed ``serving`` part of summary.json, and the
knee, saturation point and crossover of its throughput and speedup curves.

A serving summary (``summary["mode"] == "serving"``) holds ``serving_levels`` (closed-loop concurrency
levels, then open-loop rates, in run order), ``serving[arm][level_key]`` (one :class:`LevelStats` per arm
and level; "baseline" is the reference, every other arm drafts), ``serving_exactness`` and ``serve`` (the
run's ``ServeConfig``). :meth:`ServingSummary.from_dict` reads it tolerantly (any metric may be None).

The curve functions take ``levels`` (concurrency values) and one value per level; a point whose level
or value is None is left out, the rest is sorted by level. Definitions:

- **saturation**: the lowest level whose throughput is within ``SATURATION_SHARE`` (5%) of the maximum
  over all levels. A plateau needs a higher level to be seen: None when that level is the highest one
  measured (the curve may still rise) or fewer than two levels are measured.
- **knee**: between consecutive levels a < b the throughput gain per doubling of load is
  (T_b / T_a) ^ (1 / log2(b / a)). The knee is the lower level of the first step whose gain per doubling
  is below ``KNEE_GAIN`` (1.5× per 2× load: scaling turned sublinear); None when every step gains at
  least that (still scaling at the highest level) or fewer than two levels have throughput > 0.
- **crossover**: the first level from which speculation stops paying: speedup < ``threshold`` (1.0)
  there and at every higher measured level; None when it pays at the highest level (or no speedup).
- **last paying level**: the highest level below the crossover with speedup ≥ ``threshold``, the value
  for ``serve.spec_max_batch`` (a concurrency of N runs at most N sequences); None when none pays.
- **falls with load**: the curve never rises by more than ``tolerance`` (5%) from one level to the next
  and ends more than ``tolerance`` below where it started ("monotonically, up to noise").
- **growth**: value at the highest level / value at the lowest (both measured, the lowest > 0).
- **meets up to**: the highest level L such that every measured level ≤ L has value ≤ ``limit``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from spectoolkit.metrics.summary_schema import BASELINE
from spectoolkit.metrics.tolerant import from_mapping, num

CONCURRENCY, RATE = "concurrency", "rate"
SATURATION_SHARE = 0.05
KNEE_GAIN = 1.5  # throughput × per 2× load below which scaling counts as sublinear
FALL_TOLERANCE = 0.05
BY_MODE = ("requests_by_mode", "acceptance_by_mode", "speedup_by_mode")  # LevelStats per sampling mode
Values = Sequence[float | None]


# ---- the serving part of summary.json ------------------------------------------------------------


@dataclass
class TaskAcceptance:
    """Acceptance of one task type at one level (drafting arms)."""

    acceptance_rate: float | None = None
    mean_accept_length: float | None = None
    num_requests: int | None = None


@dataclass
class LevelStats:
    """One arm at one load level: throughput (tok/s, req/s), latencies (seconds), scheduler facts."""

    output_throughput: float | None = None
    request_throughput: float | None = None
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    tpot_p50: float | None = None
    tpot_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    latency_p95: float | None = None
    latency_p99: float | None = None
    mean_batch_size: float | None = None
    acceptance_rate: float | None = None
    mean_accept_length: float | None = None
    peak_temp_kv_tokens: float | None = None
    speculating_share: float | None = None
    # The adaptive policy over its decode steps (issue 57): tokens/s it predicted and measured; predicted / measured
    # of its emitted tokens (acceptance estimates), target step seconds (its curve vs V(w)) and draft seconds.
    policy_predicted_rate: float | None = None
    policy_measured_rate: float | None = None
    policy_tokens_ratio: float | None = None
    policy_target_ratio: float | None = None
    policy_draft_ratio: float | None = None
    preemptions: int | None = None
    errors: int | None = None
    num_requests: int | None = None
    speedup: float | None = None  # vs the baseline arm at the same level; None for the baseline
    speedup_low: float | None = None  # the least and greatest of its per-repeat ratios (the run's own spread)
    speedup_high: float | None = None
    exact_match: float | None = None  # share of requests equal to the reference; None when sampling
    by_task: dict[str, TaskAcceptance] = field(default_factory=dict)
    requests_by_mode: dict[str, int] = field(default_factory=dict)  # sampling mode ("greedy", "T=0.7") -> requests
    acceptance_by_mode: dict[str, float | None] = field(default_factory=dict)
    speedup_by_mode: dict[str, float | None] = field(default_factory=dict)  # mode -> its share's speedup


METRICS = tuple(f.name for f in fields(LevelStats) if f.name not in ("by_task", *BY_MODE))


@dataclass
class ServingLevel:
    """One load level: ``kind`` "concurrency" (N closed-loop clients) or "rate" (requests/s, Poisson)."""

    key: str
    kind: str
    value: float | None = None

    @property
    def label(self) -> str:
        if self.kind == RATE:
            return f"rate {format(self.value, 'g') if self.value is not None else self.key} req/s"
        return f"concurrency {format(self.value, 'g') if self.value is not None else self.key}"


@dataclass
class BatchDivergence:
    """A request whose output at a load level differs from its batch-1 reference."""

    arm: str | None = None
    level: str | None = None
    case_id: Any = None
    position: int | None = None  # output token index of the first difference
    classification: str | None = None  # near_tie | unexplained (spectoolkit.bench.load.exactness); None: not replayed
    margin: float | None = None  # the target alone's top-2 logit margin there (batch 1)
    threshold: float | None = None
    reference_token: int | None = None
    token: int | None = None


@dataclass
class ServingExactness:
    """``serving_exactness``: every request's output at every level vs the batch-1 ``reference``."""

    reference: str | None = None
    divergent: list[BatchDivergence] = field(default_factory=list)
    checked: int | None = None
    verdict: str | None = None  # exact | exact up to near-ties | unexplained divergence | not batch-invariant
    near_ties: int | None = None
    unexplained: int | None = None


@dataclass
class ServingSummary:
    """The serving part of a summary.json: levels in run order, ``arms[arm][level key]``, exactness, serve."""

    levels: list[ServingLevel] = field(default_factory=list)
    arms: dict[str, dict[str, LevelStats]] = field(default_factory=dict)
    exactness: ServingExactness | None = None
    serve: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: Any) -> ServingSummary | None:
        """The serving part of a parsed summary.json, or None when it is not a serving summary."""
        if not isinstance(raw, dict) or raw.get("mode") != "serving":
            return None
        serving = raw.get("serving") if isinstance(raw.get("serving"), dict) else {}
        arms = {
            str(arm): {str(key): from_mapping(LevelStats, stats) for key, stats in by_level.items()}
            for arm, by_level in serving.items()
            if isinstance(by_level, dict)
        }
        exactness = raw.get("serving_exactness")
        conditions = raw.get("conditions") if isinstance(raw.get("conditions"), dict) else {}
        serve = next((s for s in (raw.get("serve"), conditions.get("serve")) if isinstance(s, dict)), {})
        return cls(
            levels=_read_levels(raw.get("serving_levels"), arms),
            arms=arms,
            exactness=from_mapping(ServingExactness, exactness) if isinstance(exactness, dict) else None,
            serve=serve,
        )

    def stats(self, arm: str, key: str) -> LevelStats:
        """``arm`` at level ``key`` (all None when not measured)."""
        return self.arms.get(arm, {}).get(key) or LevelStats()

    def of_kind(self, kind: str) -> list[ServingLevel]:
        """The levels of ``kind`` with a value, ascending."""
        return sorted((lv for lv in self.levels if lv.kind == kind and lv.value is not None), key=lambda lv: lv.value)

    def label_of(self, key: Any) -> str:
        """The label of the level with ``key`` ("concurrency 8"), or the key itself when unknown."""
        return next((lv.label for lv in self.levels if lv.key == str(key)), str(key))

    @property
    def drafting_arms(self) -> list[str]:
        return [arm for arm in self.arms if arm != BASELINE]

    def speedup(self, arm: str, key: str) -> float | None:
        """The recorded speedup, else output throughput / the baseline's at the same level."""
        stats = self.stats(arm, key)
        if stats.speedup is not None or arm == BASELINE:
            return stats.speedup
        base = self.stats(BASELINE, key).output_throughput
        return stats.output_throughput / base if stats.output_throughput is not None and base else None

    def curve(self, arm: str, metric: str, kind: str = CONCURRENCY) -> tuple[list[float], list[float | None]]:
        """(level values, ``metric`` per level) of ``arm`` over the levels of ``kind``; metric "speedup"
        falls back to the throughput ratio."""
        levels = self.of_kind(kind)
        if metric == "speedup":
            values = [self.speedup(arm, lv.key) for lv in levels]
        else:
            values = [getattr(self.stats(arm, lv.key), metric) for lv in levels]
        return [float(lv.value) for lv in levels if lv.value is not None], values


def _parse_key(key: str) -> ServingLevel:
    """A level from its key alone: "4" is concurrency 4, "rate=0.5" is 0.5 requests/s."""
    if key.startswith("rate="):
        return ServingLevel(key, RATE, num(_float_or_none(key[5:])))
    return ServingLevel(key, CONCURRENCY, num(_float_or_none(key)))


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _read_levels(raw: Any, arms: dict[str, dict[str, LevelStats]]) -> list[ServingLevel]:
    """``serving_levels`` as written; without it, the level keys of the arms in first-seen order."""
    levels = []
    for item in raw if isinstance(raw, list) else []:
        if isinstance(item, dict) and item.get("key") is not None:
            parsed = _parse_key(str(item["key"]))
            kind = item.get("kind") if item.get("kind") in (CONCURRENCY, RATE) else parsed.kind
            value = num(item.get("value"))
            levels.append(ServingLevel(str(item["key"]), kind, value if value is not None else parsed.value))
    if levels:
        return levels
    keys = dict.fromkeys(key for by_level in arms.values() for key in by_level)
    return [_parse_key(key) for key in keys]


# ---- curve points --------------------------------------------------------------------------------


def points(levels: Sequence[float | None], values: Values) -> list[tuple[float, float]]:
    """(level, value) pairs with both measured, sorted by level (levels ≤ 0 dropped): the curve."""
    pairs = [(num(x), num(y)) for x, y in zip(levels, values, strict=True)]
    return sorted((x, y) for x, y in pairs if x is not None and y is not None and x > 0)


def saturation(levels: Sequence[float | None], throughputs: Values, share: float = SATURATION_SHARE) -> float | None:
    """The lowest level within ``share`` of the maximum throughput, when a higher level confirms it."""
    curve = points(levels, throughputs)
    if len(curve) < 2:
        return None
    peak = max(y for _, y in curve)
    level = next(x for x, y in curve if y >= (1 - share) * peak)
    return None if level == curve[-1][0] else level


def gain_per_doubling(low: tuple[float, float], high: tuple[float, float]) -> float | None:
    """(T_b / T_a) ^ (1 / log2(b / a)) for points (a, T_a), (b, T_b) with a < b and T_a > 0."""
    (a, t_a), (b, t_b) = low, high
    if b <= a or t_a <= 0 or t_b < 0:
        return None
    return (t_b / t_a) ** (1 / math.log2(b / a))


def knee(levels: Sequence[float | None], throughputs: Values, min_gain: float = KNEE_GAIN) -> float | None:
    """The lower level of the first step whose throughput gain per doubling of load is below ``min_gain``."""
    curve = [(x, y) for x, y in points(levels, throughputs) if y > 0]
    for low, high in zip(curve, curve[1:], strict=False):
        gain = gain_per_doubling(low, high)
        if gain is not None and gain < min_gain:
            return low[0]
    return None


def crossover(levels: Sequence[float | None], speedups: Values, threshold: float = 1.0) -> float | None:
    """The first level from which the speedup stays below ``threshold`` at every higher measured level."""
    found = None
    for level, speedup in reversed(points(levels, speedups)):
        if speedup >= threshold:
            break
        found = level
    return found


def last_paying(levels: Sequence[float | None], speedups: Values, threshold: float = 1.0) -> float | None:
    """The highest level below the crossover (any level without one) with speedup ≥ ``threshold``."""
    cross = crossover(levels, speedups, threshold)
    paying = [x for x, y in points(levels, speedups) if y >= threshold and (cross is None or x < cross)]
    return paying[-1] if paying else None


def falls_with_load(levels: Sequence[float | None], values: Values, tolerance: float = FALL_TOLERANCE) -> bool | None:
    """True when no step rises by more than ``tolerance`` and the end is > ``tolerance`` below the start."""
    curve = points(levels, values)
    if len(curve) < 2:
        return None
    steps_ok = all(y_b <= y_a * (1 + tolerance) for (_, y_a), (_, y_b) in zip(curve, curve[1:], strict=False))
    return steps_ok and curve[-1][1] < curve[0][1] * (1 - tolerance)


def growth(levels: Sequence[float | None], values: Values) -> float | None:
    """Value at the highest measured level / value at the lowest; None with < 2 points or a start ≤ 0."""
    curve = points(levels, values)
    if len(curve) < 2 or curve[0][1] <= 0:
        return None
    return curve[-1][1] / curve[0][1]


def meets_up_to(levels: Sequence[float | None], values: Values, limit: float) -> float | None:
    """The highest level L such that every measured level ≤ L has value ≤ ``limit``; None if the lowest fails."""
    found = None
    for level, value in points(levels, values):
        if value > limit:
            break
        found = level
    return found


@dataclass(frozen=True)
class CurveMarks:
    """The marked points of one arm's concurrency curves (levels; None: not reached or not measured)."""

    knee: float | None = None
    saturation: float | None = None
    crossover: float | None = None  # drafting arms only
    last_paying: float | None = None  # drafting arms only: the serve.spec_max_batch to set


def curve_marks(serving: ServingSummary, arm: str, threshold: float = 1.0) -> CurveMarks:
    """Knee and saturation of ``arm``'s output throughput, and (drafting arms) the speedup crossover."""
    levels, throughputs = serving.curve(arm, "output_throughput")
    if arm == BASELINE:
        return CurveMarks(knee(levels, throughputs), saturation(levels, throughputs))
    _, speedups = serving.curve(arm, "speedup")
    return CurveMarks(knee(levels, throughputs), saturation(levels, throughputs),
                      crossover(levels, speedups, threshold), last_paying(levels, speedups, threshold))  # fmt: skip
