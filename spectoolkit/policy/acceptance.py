"""Online estimates of each request's per-position conditional acceptance, with a workload prior.

Position j of a round is *reached* when the drafter proposed at least j tokens and the first j - 1
were accepted; it is *accepted* when the first j were. Conditional acceptance
a_j = Pr(accept j | reached j) and survival S_j = Π_{i<=j} a_i = Pr(K >= j) give the expected
emitted tokens of a k-token draft, E(k) = 1 + Σ_{j<=k} S_j (DESIGN §1).

Counts decay geometrically (per round of the request: recent text matters more; per round of the
whole workload for the prior). A request's first position shrinks toward the workload's, each deeper
one toward the request's own estimate of the position before it:

    a_1(request) = (accepted_1 + m · A_1) / (reached_1 + m)
    a_j(request) = (accepted_j + m · a_{j-1}) / (reached_j + m)          j >= 2
    A_j(workload) = (accepted_j + m₀ · A_{j-1}) / (reached_j + m₀),       A_0 = ``base``

so a position a request has not reached yet inherits its own acceptance of the one before (the tail
assumption of the cost model's γ extrapolation): a request whose text turns repetitive at k = 1 is
expected to go on being accepted at k = 2, and drafts deeper to find out. A new request starts from
the workload so far.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

BASE_ACCEPTANCE = 0.5  # before anything is measured
REQUEST_PRIOR = 1.0  # m: pseudo-rounds of the prior in a request's estimate (its own rounds soon dominate)
WORKLOAD_PRIOR = 1.0  # m₀: pseudo-rounds of the previous position in the workload estimate
WORKLOAD_DECAY = 0.995  # per observed round of any request


class _Counts:
    """Decayed reached/accepted counts per draft position [max_gamma]."""

    def __init__(self, max_gamma: int) -> None:
        self.reached = np.zeros(max_gamma)
        self.accepted = np.zeros(max_gamma)

    def add(self, drafted: int, accepted: int, decay: float) -> None:
        self.reached *= decay
        self.accepted *= decay
        self.reached[: min(drafted, accepted + 1)] += 1.0  # positions 1..min(k, K+1) were reached
        self.accepted[:accepted] += 1.0


class AcceptanceModel:
    """Per-request survival curves S_1..S_cap from decayed counts; ``decay`` per round of a request."""

    def __init__(self, max_gamma: int, decay: float) -> None:
        self.max_gamma = max_gamma
        self.decay = decay
        self.workload = _Counts(max_gamma)
        self._requests: dict[Hashable, _Counts] = {}

    def observe(self, key: Hashable, drafted: int, accepted: int) -> None:
        """A verified round of ``key``: ``drafted`` tokens proposed, the first ``accepted`` kept."""
        if not 0 <= accepted <= drafted <= self.max_gamma:
            raise ValueError(f"round (drafted={drafted}, accepted={accepted}) outside 0..{self.max_gamma}")
        if drafted == 0:
            return  # nothing proposed: nothing learned
        counts = self._requests.setdefault(key, _Counts(self.max_gamma))
        counts.add(drafted, accepted, self.decay)
        self.workload.add(drafted, accepted, WORKLOAD_DECAY)

    def workload_acceptance(self) -> np.ndarray:
        """A_1..A_max_gamma [max_gamma]: the prior every request starts from."""
        out = []
        previous = BASE_ACCEPTANCE
        for reached, accepted in zip(self.workload.reached.tolist(), self.workload.accepted.tolist(), strict=True):
            previous = (accepted + WORKLOAD_PRIOR * previous) / (reached + WORKLOAD_PRIOR)
            out.append(previous)
        return np.array(out)

    def survival(self, key: Hashable, cap: int, prior: np.ndarray | None = None) -> list[float]:
        """S_1..S_cap of ``key`` (``prior``: :meth:`workload_acceptance`, passed in when batching)."""
        if cap <= 0:
            return []
        prior = self.workload_acceptance() if prior is None else prior
        counts = self._requests.get(key)
        if counts is None:
            return np.cumprod(prior[:cap]).tolist()
        survival, alive, previous = [], 1.0, float(prior[0])
        for reached, accepted in zip(counts.reached[:cap].tolist(), counts.accepted[:cap].tolist(), strict=True):
            previous = (accepted + REQUEST_PRIOR * previous) / (reached + REQUEST_PRIOR)
            alive *= previous
            survival.append(alive)
        return survival

    def release(self, key: Hashable) -> None:
        self._requests.pop(key, None)
