"""The adaptive draft-length policy: per request, per round, aware of the load (issue 16).

Each round it estimates every request's survival curve S_1..S_cap from its recent rounds, shrunk
toward the workload's (:mod:`~spectoolkit.policy.acceptance`), and the step's costs from what the
engine measured (:mod:`~spectoolkit.policy.costs`: target step time by token count, per batch size —
calibration at batch 1, the scheduler's own decode steps under load — and one draft forward). It then picks the k_i that
maximise the step's expected emitted tokens per second, jointly over the batch under the step's
candidate budget (:func:`~spectoolkit.policy.allocate.best_lengths`): a request's marginal candidate
competes with every other request's. A step that also carries prefill chunks is priced as the decoding
sequences' plain step plus what the drafts add to it (:class:`DecodeView`).

A request's estimate only learns from the positions it drafts, so now and then a request below its cap drafts
past its optimum (a probe): at k = 0 one token (does it draft at all: a summary that starts copying its source),
past k a chain's next position or a tree's whole node budget. Issue 57 replaced intervals that doubled on every
rejected probe (a request that turned to copying after 80 plain rounds waited 64-128 more) by a budget: each
probe is priced at the step at hand (its rows and draft forwards less its expected tokens at the request's own
estimate, :meth:`_Step.probe_loss`), and a request's probes are spaced so that the batch's cost at most
:data:`EXPLORE` of the time (:meth:`AdaptivePolicy.probe_interval`), and no closer than ``probe_every`` rounds.
A probe likely to be accepted is cheap, so it comes soon; one of a hopeless drafter comes rarely. In a step of
several sequences where drafts accepted at the workload's rate would not pay (a busy CPU, where every verify row
costs), a request is probed only after :data:`MAX_PROBE_INTERVAL` plain rounds: a draft head then feeds nothing
for requests that do not draft (it holds their rows), and a request that copies its context is still found; when
the load falls, probing resumes at once. So is one while even drafts that are always accepted would not pay at the
measured costs (a draft model as slow as the target, where its probes' price spaces them far further): those costs
are measured only by drafting, and without probes one noisy warm-up that priced the draft forward or the verify
rows high ended drafting for the whole run (issue 57: the chain at c1 drafted no token in 5784 timed steps, where
a rerun of it drafted in 232 of 241). A draft head pays, before it drafts
for a request that sat out rounds, a catch-up over the rows it held for it (a draft model: its prompt too): a
request whose remaining tokens cannot repay that (its backlog rows at the measured cost per row, against the time
its drafts save in the step's best plan beside the others' drafts, at the better of its own and the workload's
acceptance) neither drafts nor is probed; a request near its end after a busy stretch decodes plainly to the end.
A catch-up is paid for good, so it is judged on what the batch's steps measured: inside a gap of unmeasured widths
the chord (:class:`~spectoolkit.policy.costs.Chords`), and where its drafts would make the step wider than any the
batch has run, one request at a time pays it, each step's width measured before the next
(:meth:`AdaptivePolicy._wider`).

The step-cost curve is explored too: a batch size's first decode step is plain (its baseline measured, not
borrowed from a batch whose rows cost otherwise: at a cost kink, a batch of 4 priced from batch 1's flat curve
drafted 28 tokens a step for 80 steps), and while the width just below the plan has fewer than a window of
measurements a step now and then drops its least valuable draft token to measure it, at the same budget
(:meth:`AdaptivePolicy._narrower`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from spectoolkit.policy.acceptance import AcceptanceModel, NodeAcceptance
from spectoolkit.policy.allocate import best_lengths
from spectoolkit.policy.base import Prediction
from spectoolkit.policy.costs import WINDOW, Chords, DraftCost, ShiftedCurve, StepCosts, StepCurve

MAX_PROBE_INTERVAL = 256  # plain rounds between probes where drafts at the workload's acceptance do not pay
EXPLORE = 0.01  # the share of throughput probes are expected to cost


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
        self._idle: dict[Hashable, int] = {}  # plain rounds in a row, per request
        self._held: set[Hashable] = set()  # the last step's requests that could draft and were kept plain
        self._since_narrower: dict[int, int] = {}  # steps since one measured the width below the plan, per batch
        self._prediction: Prediction | None = None

    def choose(
        self, keys: Sequence[Hashable], caps: Sequence[int], fixed_tokens: int, budget: int,
        backlogs: Sequence[int] | None = None, rooms: Sequence[int] | None = None, settled: int | None = None,
    ) -> list[int]:  # fmt: skip
        caps = [max(0, min(cap, self.max_gamma)) for cap in caps]
        if not any(caps):  # nothing to weigh: a lookup that proposed nothing (most steps of one at c1)
            return self._plain(keys, fixed_tokens)
        could = [cap > 0 for cap in caps]
        if fixed_tokens == len(keys) and not self.costs.measured(len(keys)):
            caps = [0] * len(caps)  # a batch size's first decode step is plain: its baseline, measured, not borrowed
        prior = self.acceptance.workload_acceptance()
        survival = [self.acceptance.survival(key, cap, prior) for key, cap in zip(keys, caps, strict=True)]
        curve = _decoding(self.step_curve(len(keys)), fixed_tokens, len(keys))
        by_count = self.costs.drafts_by_count(len(keys), self.catch_up_cost.per_forward)
        forwards = self.forwards(max(caps, default=0))
        batch, able, estimated, wider = None, list(caps), list(survival), None
        if backlogs is not None and rooms is not None and self.catch_up_cost.per_forward > 0:
            here = _Batch([], fixed_tokens, _decoding(self.costs.judged(len(keys)), fixed_tokens, len(keys)), by_count)
            batch = self._settled(len(keys), settled, max(caps, default=0), prior, here)
            blocked, judged = self._not_repaid(survival, prior, backlogs, rooms, budget, forwards, batch)
            blocked, wider = self._wider(backlogs, survival, blocked, judged, batch, fixed_tokens == len(keys))
            for i in blocked:
                caps[i], survival[i] = 0, []
        step = _best_step(survival, fixed_tokens, budget, curve, by_count, forwards)
        lengths = step.lengths
        narrower = self._narrower(len(keys), lengths, fixed_tokens, step)
        if narrower is not None:
            lengths = narrower
        elif budget > 0 and (
            self._load_bound(prior, caps, fixed_tokens, budget, curve, by_count, forwards)
            or not any(lengths)
            and not any(best_lengths([[1.0] * cap for cap in caps], fixed_tokens, budget, curve, by_count, forwards))
        ):  # drafts at the workload's acceptance, or even always accepted, would not pay at the costs measured
            lengths = self._probe(keys, caps, lengths, budget, step, MAX_PROBE_INTERVAL)
        else:
            lengths = self._probe(keys, caps, lengths, budget, step)
        if wider is not None:
            lengths = wider
            self._idle.update((key, 0) for key, k in zip(keys, lengths, strict=True) if k)
        elif batch is not None and budget > 0 and not any(lengths):
            learner = self._learner(able, survival, estimated, prior, backlogs, rooms, budget, forwards, batch)
            if learner is not None:
                lengths[learner], survival[learner], self._idle[keys[learner]] = 1, estimated[learner], 0
        self._predict(keys, lengths, survival, fixed_tokens, curve, by_count, forwards)
        self._held = {key for key, can, k in zip(keys, could, lengths, strict=True) if can and not k}
        return lengths

    def _learner(
        self, caps: list[int], survival: list, estimated: list, prior: np.ndarray, backlogs: Sequence[int],
        rooms: Sequence[int], budget: int, forwards: list[float], batch: _Batch,
    ) -> int | None:  # fmt: skip
        """In a step where nothing drafts, the request that drafts a token to learn from: of those that may draft, the
        one owing its drafter the least catch-up (one that drafted last owes none: the same request goes on, one
        prompt fed), while the workload's estimate rests on fewer rounds than a window
        (:meth:`~spectoolkit.policy.acceptance.AcceptanceModel.learning`), and after that if at the workload's
        acceptance one standard error up (:meth:`~spectoolkit.policy.acceptance.AcceptanceModel.workload_upper`)
        its drafts would pay, catch-up and all (:meth:`_not_repaid`, owing a row at least, beside the others as the
        step has them: ``survival``, the requests held back empty; ``estimated``: every request's own estimate);
        else None. Requests held back by their catch-up are never probed, so an estimate made of a round or two
        stopped drafting for good (issue 57: the chain on chat at c1 drafted once in its warm-up, both drafts
        rejected, 0.25 at each position, and never again in four passes where γ 2 gave 1.24× the target alone). Each
        round learnt narrows the bound, so the rounds stop where the estimate, made of enough of them, says drafting
        does not pay."""
        i = min((j for j, cap in enumerate(caps) if cap > 0), key=lambda j: backlogs[j], default=None)
        if i is None or self.acceptance.learning():
            return i
        owed, hopeful = [0] * len(backlogs), list(survival)
        owed[i], hopeful[i] = max(backlogs[i], 1), estimated[i]
        upper = self.acceptance.workload_upper(prior)
        return None if self._not_repaid(hopeful, upper, owed, rooms, budget, forwards, batch)[0] else i

    def _wider(
        self, backlogs: Sequence[int], survival: list, blocked: list[int], judged: list[int], batch: _Batch,
        decode: bool,
    ) -> tuple[list[int], list[int] | None]:  # fmt: skip
        """The requests held back from their catch-up (``blocked``: not repaid), and the step's lengths where those
        repaid were judged so (``judged``: the plan of :meth:`_not_repaid`) in a step wider than any of ``batch``'s
        size has run: the requests that owe nothing and the one owing least of those repaid draft as that plan has
        them, the others wait; in a step with prefill chunks (``decode`` False: its time is not learnt) all of them
        wait. None: plan the step (the judged plan is within the widths measured). A catch-up is paid for good, and
        a batch's rows past its widest step are priced on a line through narrower ones (another batch's, while it
        has run only plainly): where rows cost more the wider the step (a cost kink, rows cheap while the weights'
        read dominates), a batch of 4 priced on batch 1's rows fed its draft model four prompts (0.69 s) for
        28-token steps priced 48 ms that took 132, and priced on its own 10-token step, three more for 22-token steps
        (issue 57). One request at a time, each step's width is measured before the next prompt is paid for, and
        drafts that pay only jointly (a batched draft forward shared) still grow to their width, a request a step."""
        repaid = [i for i, owes in enumerate(backlogs) if owes and survival[i] and i not in blocked]
        size = len(backlogs) + len(batch.others)
        drafting = sum(k for i, k in enumerate(judged) if i not in blocked)  # the others beside: at the plan's lengths
        if not repaid or size + drafting <= self.costs.curves[size].widest():
            return blocked, None
        if not decode:
            return blocked + repaid, None
        first = min(repaid, key=lambda i: backlogs[i])
        lengths = [k if i == first or not backlogs[i] else 0 for i, k in enumerate(judged[: len(backlogs)])]
        return blocked + [i for i in repaid if i != first], lengths

    def _plain(self, keys: Sequence[Hashable], fixed_tokens: int) -> list[int]:
        """A step in which no request may draft: what :meth:`choose` does with every cap 0 (no request held plain, no
        probe, and a round it could not draft in neither counts toward its next probe nor resets it; the step's
        prediction its plain tokens at T(n0)) without pricing drafts that cannot be."""
        self._held = set()
        curve = _decoding(self.step_curve(len(keys)), fixed_tokens, len(keys))
        lengths = [0] * len(keys)
        self._predict(keys, lengths, [[] for _ in keys], fixed_tokens, curve, [0.0] * (len(keys) + 1), [0.0])
        return lengths

    def _predict(
        self, keys: Sequence[Hashable], lengths: list[int], survival: list, fixed_tokens: int,
        curve: StepCurve | ShiftedCurve | DecodeView, by_count: list[float], forwards: list[float],
    ) -> None:  # fmt: skip
        """Keep what the chosen ``lengths`` are expected to give (a probe's token at the request's own estimate).
        ``survival``: each request's estimate up to its cap; a chain's first k positions are its estimate up to k, a
        tree's node rates are fitted over the nodes asked for, so they are estimated again."""
        if isinstance(self.acceptance, NodeAcceptance):
            prior = self.acceptance.workload_acceptance()
            survival = [self.acceptance.survival(key, k, prior) for key, k in zip(keys, lengths, strict=True)]
        else:
            survival = [s[:k] for s, k in zip(survival, lengths, strict=True)]
        step = _Step(survival, lengths, fixed_tokens, curve, by_count, forwards)
        self._prediction = Prediction(
            tokens=step.emitted,
            target_seconds=step.target,
            fixed_tokens=fixed_tokens,
            curve=[round(float(t), 6) for t in curve(np.arange(fixed_tokens, fixed_tokens + sum(lengths) + 1))],
            draft_seconds=step.draft(step.drafting, step.deepest),
            survival=[[round(x, 4) for x in s] for s in survival],
            prior_strength=self.acceptance.prior_strength(),
        )

    def prediction(self) -> Prediction | None:
        return self._prediction

    def _settled(self, sequences: int, settled: int | None, cap: int, prior: np.ndarray, step: _Batch) -> _Batch:
        """The batch a catch-up is repaid in: the ``step`` at hand's own, unless more sequences are about to decode
        (prompts being computed, requests waiting): then a plain decode step of ``settled``, the requests beside the
        step's at the workload's acceptance.

        Priced at the step at hand, requests that started decoding while the others' prompts were computed caught up
        on their prompts to draft in a batch of 5-9, then sat out the rounds at 16, where drafts do not pay (issue
        57: the chain at c16 fed its draft model 2.6 s of prompts a pass and gave 0.92x the target alone)."""
        if settled is None or settled <= sequences:
            return step
        others = [self.acceptance.typical(cap, prior)] * (settled - sequences)
        by_settled = self.costs.drafts_by_count(settled, self.catch_up_cost.per_forward)
        return _Batch(others, settled, self.costs.judged(settled), by_settled)

    def _not_repaid(
        self, survival: list, prior: np.ndarray, backlogs: Sequence[int], rooms: Sequence[int], budget: int,
        forwards: list[float], batch: _Batch,
    ) -> tuple[list[int], list[int]]:  # fmt: skip
        """The requests whose catch-up (their backlog rows at the measured cost per row) the time their drafts would
        save over the tokens they may still emit cannot repay, at the better of their own and the workload's
        acceptance: a request near its end with many rows held (it sat out the rounds of a busy step) decodes
        plainly to the end instead of feeding the draft for a few drafts.

        A request's drafts are worth what they add to the step's best plan (:func:`_time_saved`), beside the others
        as they would draft, not what they would give alone: a batched draft forward costs little more for four
        sequences than for one, so where rows are cheap drafting pays jointly while one request drafting beside
        plain ones would not. Priced alone (and at the forward of every request drafting), a request that held any
        backlog never drafted again at c4 (issue 57: fixed γ 6 gave 1.14× the target alone, adaptive drafted 402
        tokens in six passes and gave 0.99×). Nor more than its share of what the plan saves against plain steps, in
        proportion to the tokens its drafts add: where the batch would decode plainly without it, its drafts alone
        seem to save all the plan does, and so would every newcomer's, each paying its own prompt for them (issue
        57: the chain on code at c4 drafted a token a request, 8% faster a step, and its catch-ups made it 0.94x the
        target alone). And none is repaid before a step of ``batch``'s size has run: until then its plain step is
        another batch's curve (a batch of 2's at four tokens for a batch of 4 that never ran): at the start of a c4
        pass, requests decoding beside the prompts still being computed priced it at 33.7 ms, where its first step
        took 22.4, and fed the draft model their prompts (0.5 s) for drafts that did not pay. Held back, a request waits
        for that batch's first step (plain: :meth:`choose`), its backlog a row or two longer."""
        owed = [i for i, backlog in enumerate(backlogs) if backlog > 0 and survival[i]]
        if not owed or not self.costs.measured(len(survival) + len(batch.others)):
            return owed, []
        hopeful = list(survival) + batch.others
        for i in owed:
            hopeful[i] = np.maximum(survival[i], self.acceptance.typical(len(survival[i]), prior)).tolist()
        plan = _best_step(hopeful, batch.fixed_tokens, budget, batch.curve, batch.by_count, forwards)
        blocked = []
        for i in owed:
            owes = backlogs[i] * self.catch_up_cost.per_forward
            if not plan.lengths[i] or owes >= _share(plan, i) * _most_saved(plan, i, rooms[i]):
                blocked.append(i)  # its share first: it spares planning the step without i (16 a step at c16)
            elif owes >= _time_saved(plan, i, rooms[i], budget):
                blocked.append(i)
        return blocked, plan.lengths

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
        self, keys: Sequence[Hashable], caps: Sequence[int], lengths: list[int], budget: int, step: _Step,
        least: int = 0,
    ) -> list[int]:  # fmt: skip
        """More draft tokens for each request below its cap whose rounds there have reached its probe interval
        (:meth:`probe_interval` of what they are expected to cost, :meth:`_Step.probe_loss`), at least ``probe_every``
        (and ``least``) rounds: at k = 0 one token, a probe of whether it drafts at all; past k a chain's next
        position, a tree's whole cap (an estimate no round reaches again is never corrected: a chain reaches its
        deeper positions only through the next one, while a tree's nodes past k are mostly siblings and cousins,
        each reached whenever drafted and each of small worth alone: one at a time none looked worth drafting, and
        trees with cheap rows stayed at 2 nodes where 11 paid, issue 57)."""
        spare, planned = budget - sum(lengths), list(lengths)
        tree = isinstance(self.acceptance, NodeAcceptance)
        for i, key in enumerate(keys):
            if planned[i] >= caps[i]:
                if caps[i]:  # at its cap: not held (a round it could not draft in, cap 0, leaves the count as it is)
                    self._idle.pop(key, None)
                continue
            grow = min(caps[i] if tree and planned[i] else planned[i] + 1, planned[i] + spare)
            idle = self._idle.get(key, 0)  # rounds below its cap so far: this one is a probe after the interval
            probe = grow > planned[i] and idle >= max(least, self.probe_every)
            if probe:  # priced only once the floor is reached
                probe = idle >= self.probe_interval(step.probe_loss(i, planned[i], grow), len(keys))
            if probe:
                lengths[i], spare, idle = grow, spare - (grow - planned[i]), 0
            else:
                idle += 1
            self._idle[key] = idle
        return lengths

    def _narrower(self, sequences: int, lengths: list[int], fixed_tokens: int, step: _Step) -> list[int] | None:
        """The plan less its least valuable draft token, on a decode step now and then while the width just below the
        plan has fewer than a window of measurements at this batch: its interval the probes' (:meth:`probe_interval`)
        of what the token is expected to be worth (:meth:`_Step.drop_loss`); else None. The marginal token is priced
        by T(n) − T(n − 1), and a T(n − 1) interpolated between a noisy far width and n stays wrong while no step
        runs there (issue 57: at a cost kink, one noisy step 6 widths below made the token past the kink look free)."""
        drafted = sum(lengths)
        curve = self.costs.curves.get(sequences)
        if not drafted or fixed_tokens != sequences or curve is None:
            return None
        if curve.observations(fixed_tokens + drafted - 1) >= WINDOW:
            return None
        since = self._since_narrower.get(sequences, 0) + 1
        i = min((j for j, k in enumerate(lengths) if k), key=lambda j: step.survival[j][lengths[j] - 1])
        out = list(lengths)
        out[i] -= 1
        if since < self.probe_interval(step.drop_loss(i, lengths[i], max(out)), 1):
            self._since_narrower[sequences] = since
            return None
        self._since_narrower[sequences] = 0
        return out

    @staticmethod
    def probe_interval(loss: float, sequences: int) -> int:
        """Plain rounds between a request's probes such that probes costing ``loss`` plain steps each, one per interval
        from each of ``sequences`` requests, cost at most :data:`EXPLORE` of the time."""
        return int(np.ceil(sequences * max(loss, 0.0) / EXPLORE))

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
        if not chosen and key in self._held:
            self.acceptance.age(key)
        if isinstance(self.acceptance, NodeAcceptance) and depth is not None and drafted:
            total, rounds = self._depths.get(drafted, (0.0, 0.0))
            self._depths[drafted] = (total + depth, rounds + 1)

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
        self._held.discard(key)


class DecodeView:
    """T as the decoding sequences of a step that also carries prefill chunks see it: their plain decode step plus
    what drafts add to this step, T(n) − T(n0) + T(plain). The prefill's own time buys prompt tokens, not emitted
    ones: counting it in a step's goodput makes every draft look nearly free beside it (a 400 ms step of six
    decoding sequences and a 250-token chunk), so drafts rode along that a plain decode step would not pay for."""

    def __init__(self, curve: StepCurve | ShiftedCurve | Chords, fixed_tokens: int, plain_tokens: int) -> None:
        self.curve = curve
        plain, fixed = curve(np.array([plain_tokens, fixed_tokens]))
        self.shift = float(plain - fixed)

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        return self.curve(tokens) + self.shift


def _decoding(
    curve: StepCurve | ShiftedCurve | Chords, fixed_tokens: int, sequences: int
) -> StepCurve | ShiftedCurve | Chords | DecodeView:  # fmt: skip
    """``curve`` as the ``sequences`` decoding sequences of a step of ``fixed_tokens`` tokens before drafts see it: a
    step that carries prefill chunks prices drafts at what they add to it (:class:`DecodeView`)."""
    return DecodeView(curve, fixed_tokens, sequences) if fixed_tokens > sequences else curve


def _time_saved(plan: _Step, i: int, room: int, budget: int) -> float:
    """Seconds the step's requests save while request i drafts as ``plan`` (the step's best plan, i drafting) has it,
    until it has emitted ``room`` tokens, against the best plan without its drafts: i's room / E_i rounds at the plan's
    seconds, each emitting what the plan without i takes (its rate's) longer to (batch 1, or i the only one drafting:
    room · (T(n0) − T_k / E(k)) and the like)."""
    others = list(plan.survival)
    others[i] = []
    without = _best_step(others, plan.fixed_tokens, budget, plan.curve, plan.by_count, plan.forwards)
    return max(_rounds(plan, i, room) * (plan.emitted * without.seconds / without.emitted - plan.seconds), 0.0)


def _most_saved(plan: _Step, i: int, room: int) -> float:
    """An upper bound of :func:`_time_saved` that needs no second plan: the best plan without i is at least as fast as
    its plain step (every request one token in T(n0); the plan search starts from it and only takes a better one)."""
    plain = float(plan.curve(np.array([plan.fixed_tokens]))[0]) / len(plan.survival)
    return max(_rounds(plan, i, room) * (plan.emitted * plain * (1 + 1e-9) - plan.seconds), 0.0)


def _share(plan: _Step, i: int) -> float:
    """Request i's share of what ``plan`` saves: the tokens its drafts add over all that the plan's drafts add (i
    drafting)."""
    return float(sum(plan.survival[i][: plan.lengths[i]])) / (plan.emitted - len(plan.survival))


def _rounds(plan: _Step, i: int, room: int) -> float:
    """Rounds request i takes to emit ``room`` tokens drafting as ``plan`` has it."""
    return room / (1.0 + float(sum(plan.survival[i][: plan.lengths[i]])))


class _Batch(NamedTuple):
    """The batch a catch-up is priced in (:meth:`AdaptivePolicy._settled`): the requests beside the step's (at the
    workload's acceptance), its tokens before drafts, T and a draft forward by drafting count there."""

    others: list[list[float]]
    fixed_tokens: int
    curve: StepCurve | ShiftedCurve | Chords | DecodeView
    by_count: list[float]


def _best_step(
    survival: list, fixed_tokens: int, budget: int, curve: StepCurve | ShiftedCurve | Chords | DecodeView,
    by_count: list[float], forwards: list[float],
) -> _Step:  # fmt: skip
    """The step planned at its best lengths (:func:`~spectoolkit.policy.allocate.best_lengths`)."""
    lengths = best_lengths(survival, fixed_tokens, budget, curve, by_count, forwards)
    return _Step(survival, lengths, fixed_tokens, curve, by_count, forwards)


class _Step:
    """A planned step: its expected tokens and seconds, and what one request's draft tokens more (a probe,
    :meth:`probe_loss`) or its last one less (:meth:`drop_loss`) would change."""

    def __init__(
        self, survival: list, lengths: list[int], fixed_tokens: int,
        curve: StepCurve | ShiftedCurve | Chords | DecodeView, by_count: list[float], forwards: list[float],
    ) -> None:  # fmt: skip
        self.survival, self.lengths, self.by_count, self.forwards = survival, lengths, by_count, forwards
        self.fixed_tokens = fixed_tokens
        self.drafting, self.deepest = sum(1 for k in lengths if k), max(lengths, default=0)
        self.emitted = float(sum(1.0 + sum(s[:k]) for s, k in zip(survival, lengths, strict=True)))
        self.curve, self.tokens = curve, fixed_tokens + sum(lengths)
        self.target = self._at(self.tokens)
        self.seconds = self._seconds(self.target, self.drafting, self.deepest)

    def _at(self, tokens: int) -> float:
        return float(self.curve(np.array([tokens]))[0])

    def draft(self, drafting: int, deepest: int) -> float:
        """Seconds of the draft forwards when ``drafting`` requests draft, the deepest ``deepest`` tokens."""
        return self.by_count[drafting] * self.forwards[deepest] if deepest else 0.0

    def _seconds(self, target: float, drafting: int, deepest: int) -> float:
        return target + self.draft(drafting, deepest)

    def probe_loss(self, i: int, k: int, grow: int) -> float:
        """What drafting request i ``grow`` tokens instead of ``k`` costs, in plain steps: the step's extra seconds
        (its rows, deeper draft forwards if it is the deepest, one more drafting sequence's if k = 0) less the seconds
        its expected extra tokens (its estimated survival at positions k + 1..grow) are worth at the step's rate, over
        the step's seconds (< 0: it pays)."""
        seconds = self._seconds(self._at(self.tokens + grow - k), self.drafting + (k == 0), max(self.deepest, grow))
        gained = float(sum(self.survival[i][k:grow]))
        return seconds / self.seconds - (self.emitted + gained) / self.emitted

    def drop_loss(self, i: int, k: int, deepest: int) -> float:
        """What dropping request i's last draft token (of ``k``; the plan's deepest draft then ``deepest``) costs, in
        plain steps: its expected tokens' worth at the step's rate less the seconds it saves, over the step's."""
        seconds = self._seconds(self._at(max(self.tokens - 1, 1)), self.drafting - (k == 1), deepest)
        return float(self.survival[i][k - 1]) / self.emitted - (self.seconds - seconds) / self.seconds
