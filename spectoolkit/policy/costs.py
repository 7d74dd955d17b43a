"""What a step costs, learnt online: target step time by token count, and one draft forward.

:class:`StepCurve` keeps the median of the recent step times at each token count n seen (the
batch-1 verify forward of width n, or a batched step of n tokens; the least of them while there are fewer than
three), optionally seeded from
calibration (:mod:`spectoolkit.bench.protocol.calibrate`). Queried, it fits a convex, non-decreasing curve
to those medians (:func:`convex_fit`: the least-squares one, each median weighted by its observations; a
wider step never costs less, and each extra row costs at least what the one before did — a dip, or a bump,
is noise) through the narrowest width's own median: a batch's plain step, every decision's baseline (issue 57: in
one process the first draft row of a batch of 4 cost 17 ms and the next ones 2, a shape no convex curve follows; fitted
through every width, its plain step read 32.6 ms against 30.7 and drafts that lose 3% looked 2% ahead), refit at once
when a width is seen for the first time, interpolates linearly between them and extrapolates past the widest with
the slope of a line through the upper half of the measured span (each width weighted by its observations). Not the
last segment's: on noisy medians one row apart the convex fit pools the noise into its steepest, last, segment,
and a slope that overstates what rows past the widest cost is never corrected, since the policy then never drafts
there to measure them (issue 57: at c16 the rows looked 2-3x their cost and drafting stopped). For the same reason a
token count inside a gap of unmeasured ones (between two measured counts more than one apart) costs the least
a convex curve through the measured points allows there (the segment before the gap extended, or the one after
it extended back), where the gap's left end has a segment before it: a step a few rows wider than the widest
plain one measured at a batch would otherwise be priced on the chord to a far, wide step, and never measured
(at a cost kink, where the rows stop being free, the policy stopped two rows short of it). A width seen once
past those seen more often is fitted at no more than they predict there (``StepCurve._doubted``: one slow step at a
wide width priced every wider draft out, and was never measured again). Below the narrowest it
extrapolates with the first segment's slope, never under proportional to the tokens. With one point only, or
none, every wider step costs the same (so the policy drafts, which measures a second width: a pessimistic
guess would make a first plain step look like the best forever).

:class:`StepCosts` holds one curve per batch size and one draft forward's cost per number of drafting
sequences, and answers for the step at hand (issue 57): a batch seen at one width only takes its row cost from
the nearest batch measured at two (T_B(n) = T_B(n0) + s_B'·(n − n0), s_B' that batch's cost per row), never a
curve pooled over batch sizes (whose per-sequence costs differ: pooled, the rows of a batch of 16 were priced
from steps of 4 and a batch-1 calibration). What is paid for good (a draft model's catch-up) is judged on
:class:`Chords`: the same measurements, no width doubted, the chord inside a gap.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping

import numpy as np
from scipy.optimize import nnls

MIN_WEIGHT = 0.1  # DraftCost's EWMA weight on a new observation once warm (1/n before: a plain mean)
WINDOW = 15  # StepCurve: observations kept per token count (the median: one preempted step is not a trend)
REFIT = 8  # StepCurve: observations between fits
FEW = 3  # StepCurve: below this many observations a token count's time is the least of them, not their median


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


def convex_fit(xs: np.ndarray, ys: np.ndarray, counts: np.ndarray | None = None, pinned: bool = False) -> np.ndarray:
    """Values at ``xs`` [n] (ascending, distinct) nearest ``ys`` [n] in least squares, each weighted by ``counts`` [n]
    (its observations; None: 1 each), among those that never fall and whose every segment is at least as steep as the
    one before (convex: each extra row costs at least what the one before did); ``pinned``: among those through the
    first point itself.

    Exact: such a curve is an offset, a slope and a kink at each inner point, all >= 0 (T = a + b·(x − x_0) +
    Σ_k c_k·max(0, x − x_k)), so the fit is a non-negative least-squares problem (:func:`scipy.optimize.nnls`). Not
    the slopes made monotone and integrated: on many noisy medians one row apart that pooled slopes from the noisy
    wide end into the first segments and lifted the narrow widths by their offset (issue 57: a batch of 16's plain
    step priced at twice its measured cost), and it weighed no point by how often it was seen."""
    xs, ys = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    if len(xs) < 2:
        return ys.copy()
    weights = np.sqrt(np.ones(len(ys)) if counts is None else np.asarray(counts, dtype=np.float64))
    basis = np.column_stack([np.ones(len(xs)), xs - xs[0]] + [np.maximum(xs - knot, 0.0) for knot in xs[1:-1]])
    if pinned:  # a = ys[0]: the other columns are 0 there
        coefficients, _ = nnls(basis[:, 1:] * weights[:, None], (ys - ys[0]) * weights)
        return basis[:, 1:] @ coefficients + ys[0]
    offset = min(float(ys.min()), 0.0)  # nnls keeps a >= 0: fit the values above 0, then shift them back
    coefficients, _ = nnls(basis * weights[:, None], (ys - offset) * weights)
    return basis @ coefficients + offset


def _optimistic(tokens: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Values at ``tokens`` [M] on the fitted points (``xs``, ``ys``) [n]: linear between adjacent measured counts;
    inside a wider gap whose left end has a segment before it, the lower bound a convex curve through the points
    allows (the module docstring), never above the chord."""
    values = np.interp(tokens, xs, ys)
    if len(xs) < 3:
        return values
    slopes = np.diff(ys) / np.diff(xs)  # [n - 1]
    gap = np.clip(np.searchsorted(xs, tokens, side="right") - 1, 0, len(xs) - 2)  # the segment each token is in
    inside = (tokens > xs[gap]) & (tokens < xs[gap + 1]) & (np.diff(xs)[gap] > 1) & (gap >= 1)
    left = ys[gap] + slopes[np.maximum(gap - 1, 0)] * (tokens - xs[gap])
    after = np.minimum(gap + 1, len(slopes) - 1)
    right = np.where(gap + 1 < len(slopes), ys[gap + 1] - slopes[after] * (xs[gap + 1] - tokens), -np.inf)
    low = np.minimum(values, np.maximum(np.maximum(left, right), ys[gap]))
    return np.where(inside, low, values)


def _line_slope(xs: np.ndarray, ys: np.ndarray, weights: np.ndarray) -> float:
    """The slope of the least-squares line through (``xs``, ``ys``) [n], each point weighted by ``weights`` [n], at
    least 0 (0 below two points)."""
    if len(xs) < 2:
        return 0.0
    centre = np.average(xs, weights=weights)
    slope = np.sum(weights * (xs - centre) * (ys - np.average(ys, weights=weights))) / np.sum(
        weights * (xs - centre) ** 2
    )
    return float(max(slope, 0.0))


def _upper_slope(xs: np.ndarray, ys: np.ndarray, counts: np.ndarray) -> float:
    """The slope past the widest of the points (``xs``, ``ys``) [n]: a least-squares line through those in the upper
    half of their span, each weighted by its observations ``counts`` [n] (a width seen once is one noisy step); with
    fewer than two there, through all of them."""
    upper = xs >= (xs[0] + xs[-1]) / 2
    upper = upper if upper.sum() >= 2 else np.ones(len(xs), dtype=bool)
    return _line_slope(xs[upper], ys[upper], counts[upper])


def _typical(seconds: deque[float]) -> float:
    """What a step at one token count takes: the median of its recent times, or with fewer than
    :data:`FEW` of them the least. Interference only slows a step, and the median of two is their mean: one slowed
    step (a host's other tenant, a width's first call) then priced its width out, and a width the policy stops
    planning is never measured again (issue 57: a batch of 4's width 8 at 38.9 ms where its steps take 21)."""
    return min(seconds) if len(seconds) < FEW else statistics.median(seconds)


class StepCurve:
    """T(n): seconds of one target step of n tokens (the median of its last :data:`WINDOW` observations).

    The fit is redone after every :data:`REFIT` observations (and on the first query after a seed).
    """

    def __init__(self) -> None:
        self._recent: dict[int, deque[float]] = {}
        self._fitted: tuple[np.ndarray, np.ndarray, float, float] | None = None  # xs, ys, first and last slope
        self._measured_fit: tuple[np.ndarray, np.ndarray, float, float] | None = None  # the same, no width doubted
        self._stale = 0
        self._cache: dict[tuple[bytes, bool], np.ndarray] = {}
        self._slope: float | None = None  # slope() over every measured count, until the next observation
        self._doubted_widths: set[int] = set()  # those the fit priced below their one step (_doubted)

    def seed(self, seconds_by_tokens: Mapping[int, float]) -> None:
        """Start from calibrated points (each counts as one observation)."""
        for tokens, seconds in seconds_by_tokens.items():
            self.observe(int(tokens), float(seconds))
        self._fitted = None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not seconds > 0:
            return
        new = tokens not in self._recent
        self._recent.setdefault(tokens, deque(maxlen=WINDOW)).append(seconds)
        self._stale += 1
        self._slope = None
        if self._stale >= REFIT or new or tokens in self._doubted_widths:  # a width seen for the first time refits at
            self._fitted = None  # once (it may move the whole curve), and one priced below its step at its second

    def __call__(self, tokens: np.ndarray, chords: bool = False) -> np.ndarray:
        """T at every token count in ``tokens`` [M] -> seconds [M]; ``chords``: fitted to every width as measured (none
        doubted), and inside a gap of unmeasured counts the chord between the measured ones (the most a convex curve
        through them costs there), not the least."""
        tokens = np.asarray(tokens, dtype=np.float64)
        if not self._recent:
            return np.ones_like(tokens)
        if self._fitted is None:
            self._fitted, self._measured_fit, self._stale, self._cache = self._fit(), None, 0, {}
        if chords and self._measured_fit is None:
            self._measured_fit = self._fit(doubt=False)
        key = (tokens.tobytes(), chords)
        if key not in self._cache:
            xs, ys, first, last = self._measured_fit if chords else self._fitted
            inside = np.interp(tokens, xs, ys) if chords else _optimistic(tokens, xs, ys)
            beyond = ys[-1] + last * (tokens - xs[-1])
            below = np.maximum(ys[0] + first * (tokens - xs[0]), ys[0] * tokens / xs[0])  # never under proportional
            self._cache[key] = np.where(tokens > xs[-1], beyond, np.where(tokens < xs[0], below, inside))
        return self._cache[key]

    def _fit(self, doubt: bool = True) -> tuple[np.ndarray, np.ndarray, float, float]:
        """The fitted points (:func:`convex_fit`, through the narrowest as measured) and the slopes of their first
        segment and past the widest (0 with one point: flat until a second width is seen, which drafting then
        measures); ``doubt``: a width seen once past the settled ones at no more than they predict
        (:meth:`_doubted`)."""
        xs, measured, counts = self._measured()
        if not doubt:
            ys = measured
        else:
            ys = self._doubted(xs, measured, counts)
            self._doubted_widths = {int(x) for x in xs[ys < measured]}
        fitted = convex_fit(xs, ys, counts, pinned=True)
        if len(xs) == 1:
            return xs, fitted, 0.0, 0.0
        slopes = np.diff(fitted) / np.diff(xs)
        return xs, fitted, float(slopes[0]), _upper_slope(xs, ys, counts)

    @staticmethod
    def _doubted(xs: np.ndarray, ys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """``ys`` [n] with each width seen once past the widest settled one (settled: the narrowest, a batch's plain
        step, and every width seen twice or more) priced no higher than the settled widths predict there: their fit
        at the widest of them, then the slope of their upper half. One slow step at a width wider than the policy
        usually plans (a host's other tenant, a width's first call) otherwise prices every wider draft out, and the
        policy never drafts there again to measure it (issue 57: at c4 the hybrid's single steps of 20, 22 and 25
        tokens priced its rows past 16 at 4.75 ms where fixed γ 4's 84 steps of 20 rows measured 3.9, and it planned
        10-14 drafts a step where γ 4's 16 were faster). Doubted, it drafts there again if that pays at the settled
        price; that second step refits the curve at once (:meth:`observe`) and then the least of the two stands: two
        slow steps are the width's cost (the first row of a new tile of rows), and a staircase of tiles costs a step
        or two a width to learn, not a doubted price held until the next refit (the scripted tiles: 0.960 of the
        best fixed γ at c1). Inside the settled span a width seen once keeps its time: the fit weighs it by its one
        observation against its settled neighbours on both sides."""
        settled = counts >= 2
        settled[0] = True
        if settled.sum() < 2 or settled.all():
            return ys
        sx, sy, sc = xs[settled], ys[settled], counts[settled]
        widest = convex_fit(sx, sy, sc, pinned=True)[-1]
        beyond = widest + _upper_slope(sx, sy, sc) * (xs - sx[-1])
        return np.where(xs > sx[-1], np.minimum(ys, beyond), ys)

    def slope(self) -> float:
        """Seconds per extra token: a least-squares line through the typical time at every measured count, each
        weighted by its observations, at least 0 (0 below two counts); kept until the next observation (a batch
        held plain prices its rows from another batch's slope every step)."""
        if self._slope is None:
            self._slope = _line_slope(*self._measured())
        return self._slope

    def _measured(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every measured token count, ascending [n], its typical time (:meth:`points`) [n] and its observations [n]."""
        points = self.points()
        xs = np.array(list(points), dtype=np.float64)
        counts = np.array([len(self._recent[tokens]) for tokens in points], dtype=np.float64)
        return xs, np.array(list(points.values())), counts

    def observations(self, tokens: int) -> int:
        """How many recent steps of ``tokens`` tokens the curve holds (at most :data:`WINDOW`)."""
        return len(self._recent.get(tokens, ()))

    def widest(self) -> int:
        """The widest token count observed (0: none)."""
        return max(self._recent, default=0)

    def widths(self) -> int:
        """How many distinct token counts have been observed."""
        return len(self._recent)

    def points(self) -> dict[int, float]:
        """Token count -> its typical recent step time (:func:`_typical`), ascending."""
        return {tokens: _typical(self._recent[tokens]) for tokens in sorted(self._recent)}


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


class StepCosts:
    """What a decode step costs at the batch at hand: T_B(n) per batch size B, and one draft forward per number of
    sequences drafting in it (a batched draft forward grows with its rows). See the module docstring."""

    def __init__(self) -> None:
        self.curves: dict[int, StepCurve] = {}  # by the step's sequence count
        self.drafts: dict[int, DraftCost] = {}  # by the sequences that drafted
        self.draft_cost = DraftCost()  # every step's: until a drafting count has its own
        self._line: tuple[float, float] | None = None  # (offset, slope) through the counts measured, until the next
        self._by_count: dict[int, tuple[tuple, list[float]]] = {}  # drafts_by_count per batch, with what it read
        self._observed = 0  # draft forwards observed through observe_draft

    def seed(self, seconds_by_tokens: Mapping[int, float]) -> None:
        """Batch-1 calibration: the verify forward time by width."""
        self.curves.setdefault(1, StepCurve()).seed(seconds_by_tokens)

    def observe(
        self, sequences: int, tokens: int, seconds: float, forwards: int, draft_seconds: float, drafting: int
    ) -> None:
        self.observe_target(sequences, tokens, seconds)
        self.observe_draft(drafting, forwards, draft_seconds)

    def observe_target(self, sequences: int, tokens: int, seconds: float) -> None:
        """A target step of ``tokens`` over ``sequences`` sequences took ``seconds``."""
        self.curves.setdefault(sequences, StepCurve()).observe(tokens, seconds)

    def observe_draft(self, drafting: int, forwards: int, seconds: float) -> None:
        """``forwards`` sequential draft forwards for ``drafting`` sequences took ``seconds``."""
        if forwards >= 1 and drafting >= 1:
            self.draft_cost.observe(forwards, seconds)
            self.drafts.setdefault(drafting, DraftCost()).observe(forwards, seconds)
            self._line = None
            self._observed += 1

    def measured(self, sequences: int) -> bool:
        """Whether a step of ``sequences`` sequences was measured at any token count."""
        return sequences in self.curves and self.curves[sequences].widths() > 0

    def target(self, sequences: int) -> StepCurve | ShiftedCurve:
        """T(n) for steps of ``sequences`` sequences: their own curve once measured at two token counts; at one, that
        point plus the row increments of the nearest batch measured at two; at none, the nearest batch's curve."""
        own = self.curves.get(sequences)
        if own is not None and own.widths() >= 2:
            return own
        donors = [b for b, curve in self.curves.items() if curve.widths() >= 2]
        if not donors:
            return own if own is not None else StepCurve()
        donor = self.curves[min(donors, key=lambda b: (abs(b - sequences), -b))]
        if own is None or not own.widths():
            return donor
        ((anchor, seconds),) = own.points().items()
        return ShiftedCurve(donor, anchor, seconds)

    def judged(self, sequences: int) -> Chords | ShiftedCurve:
        """:meth:`target` as a catch-up is judged on it: a measured curve by its chords (:class:`Chords`); a batch
        measured at one width keeps its borrowed line (a line has no gap)."""
        curve = self.target(sequences)
        return Chords(curve) if isinstance(curve, StepCurve) else curve

    def draft(self, drafting: int, per_row: float = 0.0) -> float:
        """Seconds of one draft forward for ``drafting`` sequences: measured at that count, else the least-squares
        line through the counts measured, else every step's; 0 until anything is measured. With one count measured,
        each sequence past it adds ``per_row`` (what a row through the draft is measured to cost elsewhere: a draft
        model's catch-up rows; 0: a lookup's, whose cost does not grow with its rows) and fewer cost the same.
        Not one count's cost everywhere: a 0.5B draft measured alone at c1 (13.7 ms) then looked as cheap for
        four sequences (19.7 ms), and four prompts' catch-ups were paid for drafts that did not pay (issue 57)."""
        if drafting in self.drafts:
            return self.drafts[drafting].per_forward
        if not self.drafts:
            return self.draft_cost.per_forward
        if len(self.drafts) == 1:
            ((count, cost),) = self.drafts.items()
            return cost.per_forward + per_row * max(drafting - count, 0)
        if self._line is None:
            counts = np.array(sorted(self.drafts), dtype=np.float64)
            seconds = np.array([self.drafts[int(b)].per_forward for b in counts])
            slope, offset = np.polyfit(counts, seconds, 1)
            self._line = (float(offset), max(float(slope), 0.0))
        offset, slope = self._line
        return max(offset + slope * drafting, 0.0)

    def drafts_by_count(self, batch: int, per_row: float = 0.0) -> list[float]:
        """:meth:`draft` for 0..``batch`` drafting sequences [batch + 1] (0 drafting: nothing); the same list until a
        draft forward is observed (callers read it, never change it)."""
        read = (per_row, self._observed, self.draft_cost.per_forward)  # the last: one observed through draft_cost
        kept = self._by_count.get(batch)
        if kept is None or kept[0] != read:
            kept = self._by_count[batch] = (read, [0.0] + [self.draft(b, per_row) for b in range(1, batch + 1)])
        return kept[1]


class ShiftedCurve:
    """A batch measured at one width ``anchor`` (``seconds``): each further row at ``donor``'s cost per row (its
    least-squares slope over every width it measured, not its convex fit: a convex fit of noisy, nearly straight
    medians steepens at its upper end, and rows priced from there are never drafted to be measured), never less
    below the anchor than proportional."""

    def __init__(self, donor: StepCurve, anchor: int, seconds: float) -> None:
        self.anchor, self.seconds = anchor, seconds
        self.per_token = donor.slope()

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.float64)
        above = self.seconds + self.per_token * (tokens - self.anchor)
        return np.where(tokens >= self.anchor, above, np.maximum(above, self.seconds * tokens / self.anchor))


class Chords:
    """A :class:`StepCurve` fitted to every width as measured and priced by its chords inside a gap of unmeasured
    token counts, the most a convex curve through the measured ones costs there: what a catch-up, paid for good, is
    judged on. The curve itself doubts a width seen once past the usual ones and prices a gap at the least such a
    curve allows, so that drafts go there and measure it (a draft is undone by the next plan; a catch-up is not).
    Judged on that, four requests fed their prompts for single drafts in an 8-token step priced 31.7 ms between a
    7-token one at 31 and a 10-token one at 48 (issue 57, a cost kink), and the chain on code at c4 fed a prompt a
    pass for a 16-token step measured once at 67 ms and priced 57."""

    def __init__(self, curve: StepCurve) -> None:
        self.curve = curve

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        return self.curve(tokens, chords=True)
