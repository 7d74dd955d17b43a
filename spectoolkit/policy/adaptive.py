"""The adaptive draft-length policy: per request, per round, aware of the load (issue 16).

Each round it estimates every request's survival curve S_1..S_cap from its recent rounds, shrunk
toward the workload's (:mod:`~spectoolkit.policy.acceptance`), and the step's costs from what the
engine measured (:mod:`~spectoolkit.policy.costs`: target step time by token count, per batch size —
calibration at batch 1, the scheduler's own decode steps under load — and one draft forward). It then picks the k_i that
maximise the step's expected emitted tokens per second, jointly over the batch under the step's
candidate budget (:func:`~spectoolkit.policy.allocate.best_lengths`): a request's marginal candidate
competes with every other request's. A step that also carries prefill chunks is priced as the decoding
sequences' plain step plus what the drafts add to it (:class:`DecodeView`).

A request that fell to k = 0 learns nothing more about its own acceptance, so now and then it is re-probed
with one draft token: after ``probe_every`` plain rounds at first (a new request: after the median interval
recent requests ended at); the request's interval doubles each time its probe is rejected (to at most
:data:`MAX_PROBE_INTERVAL`), or accepted while its acceptance stays at or below the workload's, and halves
when one is accepted and lifts it above. Per request, because requests differ: a summary that copies its
source must not wait for the probes of a chat request that never accepts. No request is probed while even
drafts that are always accepted would not pay at the measured costs (a draft model as slow as the target): a
probe of a draft model also pays its catch-up over every token since it last drafted. In a step of several
sequences where drafts accepted at the workload's rate would not pay (a busy CPU, where every verify row
costs), a request is probed only after :data:`MAX_PROBE_INTERVAL` plain rounds: a draft head then feeds
nothing for requests that do not draft (it holds their rows), and a request that copies its context is still
found; when the load falls, probing resumes at once. A draft head pays, before it drafts for a request that
sat out rounds, a catch-up over the rows it held for it: a request whose remaining tokens cannot repay that
(its backlog rows at the measured cost per row, against the time its best drafts would save, at the better of
its own and the workload's acceptance) neither drafts nor is probed; a request near its end after a busy
stretch decodes plainly to the end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from spectoolkit.policy.acceptance import RECENT_REQUESTS, AcceptanceModel, NodeAcceptance
from spectoolkit.policy.allocate import best_lengths
from spectoolkit.policy.base import Prediction
from spectoolkit.policy.costs import DraftCost, ShiftedCurve, StepCosts, StepCurve

MAX_PROBE_INTERVAL = 256  # the doubling stops here (or at probe_every, if that is larger)


class AdaptivePolicy:
    """Goodput-maximising k_i per request from online acceptance and cost estimates."""

    name = "adaptive"
    stop_below: float | None = None

    def __init__(
        self, max_gamma: int, decay: float, probe_every: int, tree: bool = False, depth: int | None = None
    ) -> None:
        """``tree``: k_i counts token-tree nodes (:class:`~spectoolkit.policy.acceptance.NodeAcceptance`), and a
        k-node tree costs the draft forwards (its depth) that trees of k nodes took so far; ``depth``: how deep a
        round drafts at most (default ``max_gamma``)."""
        self.max_gamma = max_gamma
        self.max_depth = max_gamma if depth is None else depth
        self.acceptance = (NodeAcceptance if tree else AcceptanceModel)(max_gamma, decay)
        self._depths: dict[int, tuple[float, float]] = {}  # trees: drafted nodes -> (depth sum, rounds)
        self.costs = StepCosts()  # T_B(n) per batch size, a draft forward per drafting count
        self.catch_up_cost = DraftCost()  # seconds per backlog row a drafter fed before drafting
        self.probe_every = probe_every
        self._interval: dict[Hashable, int] = {}  # plain rounds before the next probe, per request
        self._finished_intervals: deque[int] = deque(maxlen=RECENT_REQUESTS)  # of finished requests ever probed
        self._idle: dict[Hashable, int] = {}  # plain rounds in a row, per request
        self._probing: set[Hashable] = set()
        self._prediction: Prediction | None = None

    def choose(
        self, keys: Sequence[Hashable], caps: Sequence[int], fixed_tokens: int, budget: int,
        backlogs: Sequence[int] | None = None, rooms: Sequence[int] | None = None,
    ) -> list[int]:  # fmt: skip
        caps = [max(0, min(cap, self.max_gamma)) for cap in caps]
        prior = self.acceptance.workload_acceptance()
        survival = [self.acceptance.survival(key, cap, prior) for key, cap in zip(keys, caps, strict=True)]
        curve, by_count = self.step_curve(len(keys)), self.costs.drafts_by_count(len(keys))
        draft_forward = by_count[-1]  # every request drafting: the catch-up's price of a draft forward
        if fixed_tokens > len(keys):  # the step carries prefill chunks: drafts are priced at what they add to it
            curve = DecodeView(curve, fixed_tokens, len(keys))
        forwards = self.forwards(max(caps, default=0))
        if backlogs is not None and rooms is not None and self.catch_up_cost.per_forward > 0:
            for i in self._not_repaid(survival, prior, backlogs, rooms, fixed_tokens, curve, draft_forward, forwards):
                caps[i], survival[i] = 0, []
        lengths = best_lengths(survival, fixed_tokens, budget, curve, by_count, forwards)
        spare = budget - sum(lengths)
        if budget > 0 and self._load_bound(prior, caps, fixed_tokens, budget, curve, by_count, forwards):
            lengths = self._probe(keys, caps, lengths, spare, MAX_PROBE_INTERVAL)
        elif (
            budget <= 0
            or any(lengths)
            or any(best_lengths([[1.0] * cap for cap in caps], fixed_tokens, budget, curve, by_count, forwards))
        ):  # else even drafts that are always accepted would not pay: a probe cannot find a gain
            lengths = self._probe(keys, caps, lengths, spare)
        self._predict(keys, lengths, fixed_tokens, curve, by_count, forwards)
        return lengths

    def _predict(
        self, keys: Sequence[Hashable], lengths: list[int], fixed_tokens: int,
        curve: StepCurve | ShiftedCurve | DecodeView, by_count: list[float], forwards: list[float],
    ) -> None:  # fmt: skip
        """Keep what the chosen ``lengths`` are expected to give (a probe's token at the request's own estimate)."""
        prior = self.acceptance.workload_acceptance()
        survival = [self.acceptance.survival(key, k, prior) for key, k in zip(keys, lengths, strict=True)]
        deepest = max(lengths, default=0)
        drafting = sum(1 for k in lengths if k)
        self._prediction = Prediction(
            tokens=float(sum(1.0 + sum(s) for s in survival)),
            target_seconds=float(curve(np.array([fixed_tokens + sum(lengths)]))[0]),
            fixed_tokens=fixed_tokens,
            curve=[round(float(t), 6) for t in curve(np.arange(fixed_tokens, fixed_tokens + sum(lengths) + 1))],
            draft_seconds=by_count[drafting] * forwards[deepest] if deepest else 0.0,
            survival=[[round(x, 4) for x in s] for s in survival],
            prior_strength=self.acceptance.prior_strength(),
        )

    def prediction(self) -> Prediction | None:
        return self._prediction

    def _not_repaid(
        self, survival: list, prior: np.ndarray, backlogs: Sequence[int], rooms: Sequence[int], fixed_tokens: int,
        curve: StepCurve | ShiftedCurve | DecodeView, draft_forward: float, forwards: list[float],
    ) -> list[int]:  # fmt: skip
        """The requests whose catch-up (their backlog rows at the measured cost per row) the time their drafts would
        save over the tokens they may still emit cannot repay, at the better of their own and the workload's
        acceptance: a request near its end with many rows held (it sat out the rounds of a busy step) decodes
        plainly to the end instead of feeding the head for a few drafts."""
        sequences, blocked = len(survival), []
        for i, (backlog, room) in enumerate(zip(backlogs, rooms, strict=True)):
            if backlog <= 0 or not len(survival[i]):
                continue
            hopeful = np.maximum(survival[i], self.acceptance.typical(len(survival[i]), prior))
            if backlog * self.catch_up_cost.per_forward >= _time_saved(
                hopeful, room, sequences, fixed_tokens, curve, draft_forward, forwards
            ):
                blocked.append(i)
        return blocked

    def _load_bound(
        self, prior: np.ndarray, caps: list[int], fixed_tokens: int, budget: int, curve: StepCurve | DecodeView,
        by_count: list[float], forwards: list[float],
    ) -> bool:  # fmt: skip
        """A step of several sequences in which drafts accepted at the workload's rate would not pay (a busy CPU,
        where every verify row costs): a probe, and a draft head's catch-up over the rounds a request sat out,
        would cost more than it finds."""
        if len(caps) < 2 or not any(caps):
            return False
        typical = [self.acceptance.typical(cap, prior) for cap in caps]  # requests with the workload's acceptance
        return not any(best_lengths(typical, fixed_tokens, budget, curve, by_count, forwards))

    def _probe(
        self, keys: Sequence[Hashable], caps: Sequence[int], lengths: list[int], spare: int, least: int = 0
    ) -> list[int]:
        for i, key in enumerate(keys):
            if lengths[i] > 0 or caps[i] == 0:
                self._idle.pop(key, None)
                continue
            idle = self._idle.get(key, 0)  # plain rounds so far: this one is a probe after probe_interval of them
            if idle >= max(least, self.probe_interval(key)) and spare > 0:
                lengths[i], spare, idle = 1, spare - 1, 0
                self._probing.add(key)
            else:
                idle += 1
            self._idle[key] = idle
        return lengths

    def forwards(self, cap: int) -> list[float]:
        """Draft forwards of a k-node draft, k = 0..cap: k for a chain; a tree, the mean depth of the trees of k
        nodes seen so far, and for a k not seen yet the least depth it can have (a tree grows by whole nodes, so no
        shallower than the largest tree seen below k, at least 1): a size priced at k forwards until seen was never
        tried, so never seen (issue 57: with cheap rows, trees of 5-10 nodes stayed priced as chains)."""
        out = [0.0]
        for k in range(1, cap + 1):
            if k in self._depths:
                out.append(self._depths[k][0] / self._depths[k][1])
            elif not isinstance(self.acceptance, NodeAcceptance):
                out.append(float(k))
            else:
                below = [self._depths[j][0] / self._depths[j][1] for j in self._depths if j < k]
                out.append(max(1.0, max(below, default=1.0)))
        return out

    def observe(
        self, key: Hashable, chosen: int, drafted: int, accepted: int, path: list[int] | None = None,
        depth: int | None = None,
    ) -> None:  # fmt: skip
        self.acceptance.observe(key, drafted, accepted, path)
        if isinstance(self.acceptance, NodeAcceptance) and depth is not None and drafted:
            total, rounds = self._depths.get(drafted, (0.0, 0.0))
            self._depths[drafted] = (total + depth, rounds + 1)
        if key in self._probing:
            self._probing.discard(key)  # a probe the drafter had nothing for (an n-gram miss) says nothing
            if not drafted:
                return
            if accepted and self._above_workload(key):
                self._interval[key] = max(self.probe_every, self.probe_interval(key) // 2)
            else:
                self._interval[key] = min(max(MAX_PROBE_INTERVAL, self.probe_every), self.probe_interval(key) * 2)

    def _above_workload(self, key: Hashable) -> bool:
        """Whether ``key``'s first-position acceptance, its probe counted, is above the workload's: an accepted probe
        of a request like all the others finds nothing the workload's estimate does not say already (issue 57: at
        70% acceptance where only 87% would pay, probes accepted every 8 rounds cost a lone request 2%)."""
        prior = self.acceptance.workload_acceptance()
        return self.acceptance.survival(key, 1, prior)[0] > prior[0]

    def probe_interval(self, key: Hashable) -> int:
        """Plain rounds ``key`` waits before its next probe: a new request, the median interval the last finished
        requests that were probed ended at (at least ``probe_every``): where their probes were rejected a new one
        does not start probing from scratch (issue 57: a workload where no draft pays lost 2% to every new request
        probing after 8, 16, 32... rounds), and where they were accepted it starts at ``probe_every``."""
        if key in self._interval:
            return self._interval[key]
        if not self._finished_intervals:
            return self.probe_every
        return max(self.probe_every, int(np.median(list(self._finished_intervals))))

    @property
    def draft_cost(self) -> DraftCost:
        """One draft forward's seconds over every step (before a drafting count has its own)."""
        return self.costs.draft_cost

    def step_curve(self, sequences: int) -> StepCurve | ShiftedCurve:
        """T(n) for steps of ``sequences`` sequences (attention and per-sequence work differ by batch):
        :meth:`StepCosts.target <spectoolkit.policy.costs.StepCosts.target>`."""
        return self.costs.target(sequences)

    def observe_step(
        self, num_tokens: int, draft_forwards: int, target_seconds: float, draft_seconds: float, sequences: int = 1,
        drafting: int | None = None,
    ) -> None:  # fmt: skip
        drafting = sequences if drafting is None else drafting
        self.costs.observe(sequences, num_tokens, target_seconds, draft_forwards, draft_seconds, drafting)

    def observe_catch_up(self, rows: int, seconds: float) -> None:
        self.catch_up_cost.observe(rows, seconds)

    def seed(self, seconds_by_tokens: Mapping[int, float]) -> None:
        """Batch-1 calibration: the verify forward time by width."""
        self.costs.seed(seconds_by_tokens)

    def release(self, key: Hashable) -> None:
        self.acceptance.release(key)
        self._idle.pop(key, None)
        interval = self._interval.pop(key, None)
        if interval is not None:
            self._finished_intervals.append(interval)
        self._probing.discard(key)


class DecodeView:
    """T as the decoding sequences of a step that also carries prefill chunks see it: their plain decode step plus
    what drafts add to this step, T(n) − T(n0) + T(plain). The prefill's own time buys prompt tokens, not emitted
    ones: counting it in a step's goodput makes every draft look nearly free beside it (a 400 ms step of six
    decoding sequences and a 250-token chunk), so drafts rode along that a plain decode step would not pay for."""

    def __init__(self, curve: StepCurve | ShiftedCurve, fixed_tokens: int, plain_tokens: int) -> None:
        self.curve = curve
        plain, fixed = curve(np.array([plain_tokens, fixed_tokens]))
        self.shift = float(plain - fixed)

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        return self.curve(tokens) + self.shift


def _time_saved(
    survival: np.ndarray,
    room: int,
    sequences: int,
    fixed_tokens: int,
    curve: StepCurve | DecodeView,
    draft_forward: float,
    forwards: list[float],
) -> float:
    """Seconds the step's requests save while one of ``sequences`` drafts its best k (``survival`` [cap]) until it
    has emitted ``room`` tokens, against decoding plainly: each of its room / E(k) rounds emits n − 1 + E(k) tokens
    in T(n0 + k) + d·forwards[k] where plain steps take T(n0) for n (batch 1: room · (T(n0) − T_k / E(k)))."""
    cap = len(survival)
    times = curve(np.arange(fixed_tokens, fixed_tokens + cap + 1))  # [cap + 1]
    emitted = 1.0 + np.cumsum(survival)  # E(k), k = 1..cap
    drafting = times[1:] + draft_forward * np.asarray(forwards[1 : cap + 1])  # [cap]
    saved = room / emitted * ((sequences - 1 + emitted) * times[0] / sequences - drafting)
    return float(max(saved.max(), 0.0))
