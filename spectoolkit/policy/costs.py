"""What a step costs, learnt online: target step time by token count, and one draft forward.

:class:`StepCurve` keeps the median of the recent step times at each token count n seen (the
batch-1 verify forward of width n, or a batched step of n tokens), optionally seeded from
calibration (:mod:`spectoolkit.bench.protocol.calibrate`). Queried, it fits the non-decreasing curve
closest to those means (a wider step never costs less: a dip is noise), interpolates linearly between
them and extrapolates past the widest with the least-squares slope of all points (floored at 0).
Below the narrowest it extrapolates with the same slope, never under proportional to the tokens. With
one point only, or none, every wider step costs the same (so the policy drafts, which measures a
second width: a pessimistic guess would make a first plain step look like the best forever).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping

import numpy as np

MIN_WEIGHT = 0.1  # DraftCost's EWMA weight on a new observation once warm (1/n before: a plain mean)
WINDOW = 15  # StepCurve: observations kept per token count (the median: one preempted step is not a trend)
REFIT = 8  # StepCurve: observations between fits


def monotone_fit(values: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence closest to ``values`` [n] in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count] per pooled block, left to right
    for value in values.tolist():
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return np.array([total / count for total, count in blocks for _ in range(int(count))])


class StepCurve:
    """T(n): seconds of one target step of n tokens (the median of its last :data:`WINDOW` observations).

    The fit is redone after every :data:`REFIT` observations (and on the first query after a seed).
    """

    def __init__(self) -> None:
        self._recent: dict[int, deque[float]] = {}
        self._fitted: tuple[np.ndarray, np.ndarray, float] | None = None
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
            xs, ys, slope = self._fitted
            inside = np.interp(tokens, xs, ys)
            beyond = ys[-1] + slope * (tokens - xs[-1])
            below = np.maximum(ys[0] + slope * (tokens - xs[0]), ys[0] * tokens / xs[0])  # never under proportional
            self._cache[key] = np.where(tokens > xs[-1], beyond, np.where(tokens < xs[0], below, inside))
        return self._cache[key]

    def _fit(self) -> tuple[np.ndarray, np.ndarray, float]:
        points = self.points()
        xs = np.array(list(points), dtype=np.float64)
        ys = monotone_fit(np.array(list(points.values())))
        if len(xs) == 1:
            slope = 0.0  # flat until a second width is seen: drafting then measures one
        else:
            centred = xs - xs.mean()
            slope = max(0.0, float(centred @ (ys - ys.mean()) / (centred @ centred)))  # least squares
        return xs, ys, slope

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
