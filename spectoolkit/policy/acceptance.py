"""Online estimates of each request's per-position conditional acceptance, with a workload prior.

Position j of a round is *reached* when the drafter proposed at least j tokens and the first j - 1
were accepted; it is *accepted* when the first j were. Conditional acceptance
a_j = Pr(accept j | reached j) and survival S_j = Π_{i<=j} a_i = Pr(K >= j) give the expected
emitted tokens of a k-token draft, E(k) = 1 + Σ_{j<=k} S_j (DESIGN §1).

Counts decay geometrically (per round of the request, one the policy held plain too (:meth:`AcceptanceModel.age`):
recent text matters more, and a request that stopped drafting on a few rejections drifts back toward the workload
instead of keeping that estimate for good; per round of the whole workload for the prior). A request's first
position shrinks toward the workload's, each deeper one toward the request's own estimate of the position before it,
carried by the workload's shape:

    a_1(request) = (accepted_1 + m · A_1) / (reached_1 + m)
    a_j(request) = (accepted_j + m · min(1, max(A_j, a_{j-1} · A_j / A_{j-1}))) / (reached_j + m)     j >= 2
    A_j(workload) = (accepted_j + m₀ · A_{j-1}) / (reached_j + m₀),       A_0 = ``base``

so a position a request has not reached yet inherits its own acceptance of the one before, scaled as
the workload's rises or falls there: a request whose text turns repetitive at k = 1 is expected to go
on being accepted at k = 2, and drafts deeper to find out; a request like the workload gets the
workload's deep positions (code acceptance rises with depth), not its own first one's. Never below the workload's
A_j, though: position j is reached only once the ones before it were accepted, and a request accepted less often
than the workload at its first position is not, for that alone, expected to fare worse past it (scaled down, a
lookup's two-token matches, accepted at 0.84 at their second position, were priced at 0.3-0.6 and cut to one at c4;
its own rounds there correct the estimate as they come).

The prior's weight m (pseudo-rounds) is estimated from how much requests' rates differ over windows of
about 1/(1 − decay) of their drafting rounds, the span a request's estimate remembers (empirical Bayes
over the first-position totals of the last :data:`RECENT_REQUESTS` closed windows and the live ones):
m = p(1 − p) / τ² − 1, τ² the between-window variance of their rates (DerSimonian–Laird: the
rounds-weighted spread less its binomial part), kept within [1, 1/(1 − decay)] (at most a full window of the
request's own decayed rounds). Windows, not whole requests: a request that turns to copying its context
halfway has a lifetime rate like every other's, and shrunk that hard its copying went unseen (issue 57).
Issue 57: with m = 1 one rejected first round halved a request's estimate, and a request that stopped
drafting on it learnt nothing more; at c4 on chat-like acceptance every request
ended at k = 0 where γ = 1 paid. A new request starts from the workload so far.

Token trees (:class:`NodeAcceptance`): node j of a k-node tree adds Pr(node j is on the accepted path)
to the expected emitted tokens (the accepted path's nodes are all among the first k: parents come
first), so E(k) = 1 + Σ_{j<=k} S_j with S_j that hit rate, shrunk the same way. Unlike a chain's
survival it need not fall with j (a first node's second sibling may be hit less often than its
child); the allocator needs non-increasing gains, so S is replaced by the closest non-increasing
sequence (pool adjacent violators: E(k) stays exact at the ends of each pooled block).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

import numpy as np

from spectoolkit.policy.costs import monotone_fit

BASE_ACCEPTANCE = 0.5  # before anything is measured
REQUEST_PRIOR = 1.0  # m's floor: pseudo-rounds of the prior in a request's estimate
RECENT_REQUESTS = 64  # finished requests whose first-position totals inform m
WORKLOAD_PRIOR = 1.0  # m₀: pseudo-rounds of the previous position in the workload estimate
WORKLOAD_DECAY = 0.995  # per observed round of any request


class _Counts:
    """Decayed reached/accepted counts per draft position (a tree: per node) [max_gamma]."""

    def __init__(self, max_gamma: int) -> None:
        self.reached = np.zeros(max_gamma)
        self.accepted = np.zeros(max_gamma)
        self.first = [0, 0]  # undecayed rounds that reached, and accepted, the first position, in its open window

    def age(self, decay: float) -> None:
        self.reached *= decay
        self.accepted *= decay

    def add(self, reached: int, hits: list[int], decay: float) -> None:
        """Positions 1..``reached`` were reached, those at indices ``hits`` accepted."""
        self.age(decay)
        self.reached[:reached] += 1.0
        self.accepted[hits] += 1.0
        self.first[0] += reached > 0
        self.first[1] += 0 in hits


class AcceptanceModel:
    """Per-request survival curves S_1..S_cap from decayed counts; ``decay`` per round of a request."""

    def __init__(self, max_gamma: int, decay: float) -> None:
        self.max_gamma = max_gamma
        self.decay = decay
        self.workload = _Counts(max_gamma)
        self._requests: dict[Hashable, _Counts] = {}
        self._windows: deque[list[int]] = deque(maxlen=RECENT_REQUESTS)  # first-position totals of past windows
        self._window = round(1.0 / (1.0 - decay)) if decay < 1 else float("inf")  # a request's rounds per window
        self._strength: float | None = None  # m, until the next round or release
        self._prior: tuple[bytes, list[float], list[float], list[float]] | None = None  # _of_prior's, for one prior
        self.rounds = 0  # verified rounds that drafted, over every request

    def observe(self, key: Hashable, drafted: int, accepted: int, path: list[int] | None = None) -> None:
        """A verified round of ``key``: ``drafted`` tokens proposed, ``accepted`` kept (a tree: the nodes of
        ``path``; a chain's path is its first ``accepted`` nodes)."""
        path = list(range(accepted)) if path is None else list(path)
        if not 0 <= accepted == len(path) <= drafted <= self.max_gamma or not all(0 <= n < drafted for n in path):
            raise ValueError(f"round (drafted={drafted}, path={path}) outside 0..{self.max_gamma}")
        if drafted == 0:
            return  # nothing proposed: nothing learned
        reached = self._reached(drafted, accepted)
        counts = self._requests.setdefault(key, _Counts(self.max_gamma))
        counts.add(reached, path, self.decay)
        if counts.first[0] >= self._window:  # a window's rounds: a sample of how far a request's rate strays
            self._windows.append(counts.first)
            counts.first = [0, 0]
        self.workload.add(reached, path, WORKLOAD_DECAY)
        self.rounds += 1
        self._strength = None

    def learning(self) -> bool:
        """Whether the workload's estimate rests on fewer drafting rounds than a request's window (1/(1 − decay), the
        span its own estimate remembers; :data:`RECENT_REQUESTS` without decay)."""
        return self.rounds < (self._window if self.decay < 1 else RECENT_REQUESTS)

    def age(self, key: Hashable) -> None:
        """A round of ``key`` that drafted nothing because the policy held it back: its text moved on, so its counts
        decay as a round's would (it drifts back toward the workload instead of keeping, for good, the estimate that
        stopped it). Not a lookup that had nothing to propose: that says nothing about its matches' acceptance."""
        counts = self._requests.get(key)
        if counts is not None:
            counts.age(self.decay)

    def prior_strength(self) -> float:
        """m: the prior's pseudo-rounds in a request's estimate, from how much requests differ (module docstring)."""
        if self._strength is None:
            most = max(REQUEST_PRIOR, 1.0 / (1.0 - self.decay)) if self.decay < 1 else float(RECENT_REQUESTS)
            totals = [c.first for c in self._requests.values() if c.first[0]] + list(self._windows)
            self._strength = most
            if len(totals) >= 2:
                rounds, hits = np.array(totals, dtype=np.float64).T
                rates, mean = hits / rounds, hits.sum() / rounds.sum()
                # τ² by DerSimonian–Laird: the rounds-weighted spread less what binomial noise alone gives, so a
                # request seen for three probes weighs three rounds, not as much as one seen for a hundred
                excess = np.sum(rounds * (rates - mean) ** 2) - (len(totals) - 1) * mean * (1 - mean)
                spread = excess / (rounds.sum() - np.sum(rounds**2) / rounds.sum())
                if spread > 0:
                    self._strength = float(np.clip(mean * (1 - mean) / spread - 1, REQUEST_PRIOR, most))
        return self._strength

    def _reached(self, drafted: int, accepted: int) -> int:
        """A chain: positions 1..min(k, K+1) were reached."""
        return min(drafted, accepted + 1)

    def workload_acceptance(self) -> np.ndarray:
        """A_1..A_max_gamma [max_gamma]: the prior every request starts from."""
        out = []
        previous = BASE_ACCEPTANCE
        for reached, accepted in zip(self.workload.reached.tolist(), self.workload.accepted.tolist(), strict=True):
            previous = (accepted + WORKLOAD_PRIOR * previous) / (reached + WORKLOAD_PRIOR)
            out.append(previous)
        return np.array(out)

    def workload_upper(self, rates: np.ndarray | None = None) -> np.ndarray:
        """A_j raised by one standard error of it (its decayed rounds and the prior's pseudo-round), at most 1
        [max_gamma]: what the workload's acceptance may well be, given how few rounds made the estimate (one round of
        two drafts both rejected sets A at 0.25; 0.5 is still one standard error up). ``rates``:
        :meth:`workload_acceptance`, passed in when the caller has it."""
        rates = self.workload_acceptance() if rates is None else rates
        return np.minimum(1.0, rates + np.sqrt(rates * (1.0 - rates) / (self.workload.reached + WORKLOAD_PRIOR + 1.0)))

    def survival(self, key: Hashable, cap: int, prior: np.ndarray | None = None) -> list[float]:
        """S_1..S_cap of ``key`` (``prior``: :meth:`workload_acceptance`, passed in when batching)."""
        if cap <= 0:
            return []
        prior = self.workload_acceptance() if prior is None else prior
        return self._curve(self._requests.get(key), cap, prior)

    def typical(self, cap: int, prior: np.ndarray) -> list[float]:
        """S_1..S_cap of a request with the workload's acceptance (``prior``), none of its own rounds seen."""
        return self._curve(None, cap, prior) if cap > 0 else []

    def _of_prior(self, prior: np.ndarray) -> tuple[list[float], list[float], list[float]]:
        """``prior`` as floats, its shape A_j / A_{j-1} (:func:`_shape`) and its survival Π A, computed once for the
        prior at hand (a step prices every request, and the typical ones, against the same prior)."""
        key = prior.tobytes()
        if self._prior is None or self._prior[0] != key:
            rates = prior.tolist()
            shape = [1.0] + [_shape(prior, j) for j in range(1, len(rates))]
            self._prior = (key, rates, shape, np.cumprod(prior).tolist())
        return self._prior[1:]

    def _curve(self, counts: _Counts | None, cap: int, prior: np.ndarray) -> list[float]:
        rates, shape, typical = self._of_prior(prior)
        if counts is None:
            return typical[:cap]  # a product's prefix: the survival of prior[:cap]
        strength = self.prior_strength()
        survival, alive, previous = [], 1.0, None
        for j, (reached, accepted) in enumerate(
            zip(counts.reached[:cap].tolist(), counts.accepted[:cap].tolist(), strict=True)
        ):
            target = rates[0]
            if previous is not None:  # never below the workload's A_j (the module docstring)
                target = min(1.0, max(rates[j], previous * shape[j]))
            previous = (accepted + strength * target) / (reached + strength)
            alive *= previous
            survival.append(alive)
        return survival

    def release(self, key: Hashable) -> None:
        counts = self._requests.pop(key, None)
        if counts is not None and counts.first[0]:
            self._windows.append(counts.first)
            self._strength = None


def _shape(prior: np.ndarray, j: int) -> float:
    """A_j / A_{j-1}: how the workload's acceptance changes from position j to j + 1 (1 where it fell to 0)."""
    return float(prior[j] / prior[j - 1]) if prior[j - 1] > 0 else 1.0


class NodeAcceptance(AcceptanceModel):
    """Token trees: per node, how often it is on the accepted path (see the module doc), non-increasing."""

    def _reached(self, drafted: int, accepted: int) -> int:
        return drafted  # every proposed node could have been on the path

    def _curve(self, counts: _Counts | None, cap: int, prior: np.ndarray) -> list[float]:
        rates = prior[:cap]
        if counts is not None:
            strength = self.prior_strength()
            rates = (counts.accepted[:cap] + strength * rates) / (counts.reached[:cap] + strength)
        return (-monotone_fit(-np.asarray(rates, dtype=float))).tolist()
