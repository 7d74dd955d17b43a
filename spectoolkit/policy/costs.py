"""What a step costs, learnt online: target step time by token count, and one draft forward.

:class:`StepCurve` keeps an exponentially weighted mean of the step time at each token count n seen
(the batch-1 verify forward of width n, or a batched step of n tokens), optionally seeded from
calibration (:mod:`spectoolkit.bench.protocol.calibrate`). Queried, it fits the non-decreasing curve
closest to those means (a wider step never costs less: a dip is noise), interpolates linearly between
them and extrapolates past the widest with the least-squares slope of all points (floored at 0).
Below the narrowest it extrapolates with the same slope, never under proportional to the tokens. With
one point only it assumes a step costs in proportion to its tokens (so the policy tries other widths,
which measures a second point); with none, every width costs the same (so it drafts, and measures).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

MIN_WEIGHT = 0.1  # the EWMA's weight on a new observation once warm (1/n before: a plain mean)


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
    """T(n): seconds of one target step of n tokens."""

    def __init__(self) -> None:
        self._mean: dict[int, float] = {}
        self._count: dict[int, int] = {}
        self._fitted: tuple[np.ndarray, np.ndarray, float] | None = None

    def seed(self, seconds_by_tokens: Mapping[int, float]) -> None:
        """Start from calibrated points (they count as one observation each)."""
        for tokens, seconds in seconds_by_tokens.items():
            self.observe(int(tokens), float(seconds))

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not seconds > 0:
            return
        count = self._count.get(tokens, 0) + 1
        weight = max(1.0 / count, MIN_WEIGHT)
        previous = self._mean.get(tokens, seconds)
        self._mean[tokens] = previous + weight * (seconds - previous)
        self._count[tokens] = count
        self._fitted = None

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        """T at every token count in ``tokens`` [M] -> seconds [M]."""
        tokens = np.asarray(tokens, dtype=np.float64)
        if not self._mean:
            return np.ones_like(tokens)
        xs, ys, slope = self._fit()
        inside = np.interp(tokens, xs, ys)
        beyond = ys[-1] + slope * (tokens - xs[-1])
        below = np.maximum(ys[0] + slope * (tokens - xs[0]), ys[0] * tokens / xs[0])  # never under proportional
        return np.where(tokens > xs[-1], beyond, np.where(tokens < xs[0], below, inside))

    def _fit(self) -> tuple[np.ndarray, np.ndarray, float]:
        if self._fitted is None:
            xs = np.array(sorted(self._mean), dtype=np.float64)
            ys = monotone_fit(np.array([self._mean[int(x)] for x in xs]))
            if len(xs) == 1:
                slope = ys[0] / xs[0]  # proportional to tokens until a second width is seen
            else:
                slope = max(0.0, float(np.polyfit(xs, ys, 1)[0]))
            self._fitted = (xs, ys, slope)
        return self._fitted

    def points(self) -> dict[int, float]:
        return dict(sorted(self._mean.items()))


class DraftCost:
    """Seconds of one sequential draft forward (or lookup) per step, as an EWMA; 0 until measured."""

    def __init__(self) -> None:
        self.per_forward = 0.0
        self._count = 0

    def observe(self, forwards: int, seconds: float) -> None:
        if forwards < 1 or seconds < 0:
            return
        self._count += 1
        weight = max(1.0 / self._count, MIN_WEIGHT)
        self.per_forward += weight * (seconds / forwards - self.per_forward)
