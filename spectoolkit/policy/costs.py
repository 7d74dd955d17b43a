"""What a step costs, learnt online: target step time by token count, and one draft forward.

:class:`StepCurve` keeps the median of the recent step times at each token count n seen (the
batch-1 verify forward of width n, or a batched step of n tokens), optionally seeded from
calibration (:mod:`spectoolkit.bench.protocol.calibrate`). Queried, it fits a convex, non-decreasing curve
to those medians (:func:`convex_fit`: a wider step never costs less, and each extra row costs at least what
the one before did — a dip, or a bump, is noise), interpolates linearly between them and extrapolates past
the widest with the last segment's slope (so the extra rows stay at least that dear). Below the narrowest it
extrapolates with the first segment's slope, never under proportional to the tokens. With one point only, or
none, every wider step costs the same (so the policy drafts, which measures a second width: a pessimistic
guess would make a first plain step look like the best forever).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping

import numpy as np

MIN_WEIGHT = 0.1  # DraftCost's EWMA weight on a new observation once warm (1/n before: a plain mean)
WINDOW = 15  # StepCurve: observations kept per token count (the median: one preempted step is not a trend)
REFIT = 8  # StepCurve: observations between fits


def monotone_fit(values: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """The non-decreasing sequence closest to ``values`` [n] in least squares, each term weighted by ``weights`` [n]
    (> 0; None: all 1): pool adjacent violators, a pooled block at its weighted mean."""
    weights = np.ones(len(values)) if weights is None else np.asarray(weights, dtype=np.float64)
    blocks: list[list[float]] = []  # [weighted sum, weight, count] per pooled block, left to right
    for value, weight in zip(np.asarray(values, dtype=np.float64).tolist(), weights.tolist(), strict=True):
        blocks.append([value * weight, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, weight, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += weight
            blocks[-1][2] += count
    return np.array([total / weight for total, weight, count in blocks for _ in range(int(count))])


def convex_fit(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Values at ``xs`` [n] (ascending, distinct) near ``ys`` [n] that never fall and whose every segment is at least
    as steep as the one before (convex: each extra row costs at least what the one before did).

    The segment slopes are made non-decreasing by :func:`monotone_fit` weighted by segment width (a pooled stretch
    rises by what its ends rise: the chord over it), floored at 0, and integrated from the offset that fits ``ys``
    best in least squares. Not the least-squares convex fit of the values (a quadratic program) but near it,
    deterministic, and the identity on values that are convex and non-decreasing already."""
    ys = np.asarray(ys, dtype=np.float64)
    if len(xs) < 2:
        return ys.copy()
    widths = np.diff(np.asarray(xs, dtype=np.float64))  # [n - 1]
    slopes = np.maximum(monotone_fit(np.diff(ys) / widths, widths), 0.0)  # [n - 1], non-decreasing, >= 0
    rise = np.concatenate([[0.0], np.cumsum(slopes * widths)])  # [n], from the first point
    return rise + float(np.mean(ys - rise))


class StepCurve:
    """T(n): seconds of one target step of n tokens (the median of its last :data:`WINDOW` observations).

    The fit is redone after every :data:`REFIT` observations (and on the first query after a seed).
    """

    def __init__(self) -> None:
        self._recent: dict[int, deque[float]] = {}
        self._fitted: tuple[np.ndarray, np.ndarray, float, float] | None = None  # xs, ys, first and last slope
        self._stale = 0
        self._cache: dict[bytes, np.ndarray] = {}

    def seed(self, seconds_by_tokens: Mapping[int, float]) -> None:
        """Start from calibrated points (each counts as one observation)."""
        for tokens, seconds in seconds_by_tokens.items():
            self.observe(int(tokens), float(seconds))
        self._fitted = None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not seconds > 0:
            return
        self._recent.setdefault(tokens, deque(maxlen=WINDOW)).append(seconds)
        self._stale += 1
        if self._stale >= REFIT or len(self._recent) <= 2:  # refit at once while the curve is still forming
            self._fitted = None

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        """T at every token count in ``tokens`` [M] -> seconds [M]."""
        tokens = np.asarray(tokens, dtype=np.float64)
        if not self._recent:
            return np.ones_like(tokens)
        if self._fitted is None:
            self._fitted, self._stale, self._cache = self._fit(), 0, {}
        key = tokens.tobytes()
        if key not in self._cache:
            xs, ys, first, last = self._fitted
            inside = np.interp(tokens, xs, ys)
            beyond = ys[-1] + last * (tokens - xs[-1])
            below = np.maximum(ys[0] + first * (tokens - xs[0]), ys[0] * tokens / xs[0])  # never under proportional
            self._cache[key] = np.where(tokens > xs[-1], beyond, np.where(tokens < xs[0], below, inside))
        return self._cache[key]

    def _fit(self) -> tuple[np.ndarray, np.ndarray, float, float]:
        """The fitted points (:func:`convex_fit`) and the slopes of their first and last segments (0 with one point:
        flat until a second width is seen, which drafting then measures)."""
        points = self.points()
        xs = np.array(list(points), dtype=np.float64)
        ys = convex_fit(xs, np.array(list(points.values())))
        if len(xs) == 1:
            return xs, ys, 0.0, 0.0
        slopes = np.diff(ys) / np.diff(xs)
        return xs, ys, float(slopes[0]), float(slopes[-1])

    def widths(self) -> int:
        """How many distinct token counts have been observed."""
        return len(self._recent)

    def points(self) -> dict[int, float]:
        """Token count -> median of its recent step times, ascending."""
        return {tokens: statistics.median(self._recent[tokens]) for tokens in sorted(self._recent)}


class DraftCost:
    """Seconds of one sequential draft forward (or lookup) per step, as an EWMA; 0 until measured. The adaptive
    policy's ``catch_up_cost`` is one too, per backlog row a draft head fed ("forwards" are rows there)."""

    def __init__(self) -> None:
        self.per_forward = 0.0
        self._count = 0

    def observe(self, forwards: int, seconds: float) -> None:
        if forwards < 1 or seconds < 0:
            return
        self._count += 1
        weight = max(1.0 / self._count, MIN_WEIGHT)
        self.per_forward += weight * (seconds / forwards - self.per_forward)
