"""The joint choice of draft lengths for one step: maximise expected emitted tokens per second.

For the B sequences of a step, request i drafting k_i tokens emits E_i(k_i) = 1 + Σ_{j<=k_i} S_ij
tokens in expectation, where S_ij = Pr(its first j drafts are all accepted) is non-increasing in j
(DESIGN §1). The step costs

    step_time(k) = T(n0 + Σ_i k_i) + draft_forward · max_i k_i

with T(n) the target step time at n tokens (``n0``: pending tokens and prefill chunks) and
``draft_forward`` the time of one sequential draft forward (a draft model runs max_i k_i of them for
the whole batch; n-gram lookup is ~0), optionally by how many sequences draft in it (a batched draft
forward of 16 rows costs more than one of 1: issue 57). Goodput = Σ_i E_i(k_i) / step_time(k), under Σ_i k_i <= budget
and k_i <= cap_i. At batch 1 this is the cost model's E[N]·T₁ / (D·k + V(k+1) + C) up to the
constant T₁: the speedup-maximising k.

Exact solution: fix the deepest draft L; every candidate (i, j <= min(L, cap_i)) then costs the same
one token, so for m candidates the best set is the m largest S_ij (S is non-increasing in j, so the
top m are prefixes per request), and only the total m changes T (and the draft forward's cost, through
the requests the m reach). Scan L and m; the bound ``draft_forward · L`` is exact at the L that the
chosen set reaches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def best_lengths(
    survival: Sequence[Sequence[float]],
    fixed_tokens: int,
    budget: int,
    step_time: Callable[[np.ndarray], np.ndarray],
    draft_forward: float | Sequence[float] = 0.0,
    forwards: Sequence[float] | None = None,
) -> list[int]:
    """k_i per request maximising goodput; ``survival[i]`` = [S_i1..S_i,cap_i] (its length is cap_i).

    ``step_time(n)`` maps token counts [M] -> seconds [M] (non-decreasing). ``draft_forward``: seconds of one
    draft forward, or [B + 1] of them by the number of requests drafting. ``forwards[k]``: the sequential
    draft forwards of a k-token draft (default k; a token tree of k nodes: its depth). Ties keep the
    shorter drafts.
    """
    deepest = max((len(s) for s in survival), default=0)
    if deepest == 0 or budget <= 0:
        return [0] * len(survival)
    by_count = _by_count(draft_forward, len(survival))
    forwards = list(forwards) if forwards is not None else list(range(deepest + 1))
    times = np.asarray(step_time(np.arange(fixed_tokens, fixed_tokens + min(budget, deepest * len(survival)) + 1)))
    if len(survival) == 1:  # batch 1: k itself is the depth
        return [_best_single(survival[0], budget, times.tolist(), by_count[1], forwards)]
    ranked = _Ranked(survival)
    depths = np.arange(1 if any(by_count) else deepest, deepest + 1)  # without a draft cost only L = deepest
    within = ranked.positions[None, :] < depths[:, None]  # [D, N]: candidate n may be drafted at depth L
    count = np.cumsum(within, axis=1)  # [D, N]: m, the candidates taken once the n-th ranked one is
    taken = within & (count <= budget)
    # Σ S over the first m, summed in rank order after the base (the rounding of a running total, tie for tie)
    gains = np.where(within, ranked.gains[None, :], 0.0)
    emitted = np.cumsum(np.concatenate([np.full((len(depths), 1), float(len(survival))), gains], axis=1), axis=1)
    drafting = np.cumsum(within & (ranked.positions[None, :] == 0), axis=1)  # a request's first candidate is its S_1
    per_forward = np.asarray(by_count)[drafting] * np.asarray(forwards, dtype=np.float64)[depths][:, None]
    values = (emitted[:, 1:] / (times[np.minimum(count, len(times) - 1)] + per_forward))[taken]
    rows, columns = np.nonzero(taken)  # row-major: depth by depth, m ascending: the order they are weighed in
    best_value, best, start = len(survival) / float(times[0]), (0, 0), 0
    while True:  # the running best, replaced only by a value more than 1e-12 above it (ties keep the shorter drafts)
        above = np.flatnonzero(values[start:] > best_value * (1 + 1e-12))
        if not len(above):
            break
        start += int(above[0])
        best_value, best = float(values[start]), (int(depths[rows[start]]), int(count[rows[start], columns[start]]))
        start += 1
    return ranked.take(*best)


class _Ranked:
    """Every candidate (i, j) of ``survival``, largest S first; at equal S the shallower position (a prefix), then
    the lower i: ``gains`` S_ij, ``positions`` j and ``owners`` i [N]."""

    def __init__(self, survival: Sequence[Sequence[float]]) -> None:
        lengths = np.array([len(s) for s in survival])
        gains = np.concatenate([np.asarray(s, dtype=np.float64) for s in survival])
        owners = np.repeat(np.arange(len(survival)), lengths)
        positions = np.arange(len(gains)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        order = np.lexsort((owners, positions, -gains))
        self.gains, self.positions, self.owners = gains[order], positions[order], owners[order]
        self.requests = len(survival)

    def take(self, depth: int, count: int) -> list[int]:
        """How many of each request's first ``depth`` candidates are among the ``count`` largest S."""
        chosen = self.owners[self.positions < depth][:count]
        return np.bincount(chosen, minlength=self.requests).tolist()


def _by_count(draft_forward: float | Sequence[float], batch: int) -> list[float]:
    """Seconds of one draft forward for 0..``batch`` drafting requests [batch + 1]."""
    if isinstance(draft_forward, int | float):
        return [float(draft_forward)] * (batch + 1)
    if len(draft_forward) < batch + 1:
        raise ValueError(f"draft_forward has {len(draft_forward)} costs, {batch + 1} needed (0..{batch} drafting)")
    return [float(x) for x in draft_forward]


def _best_single(
    survival: Sequence[float], budget: int, times: list[float], draft_forward: float, forwards: Sequence[float]
) -> int:
    """The k <= min(len(survival), budget) of one request with the best (1 + Σ_{j<=k} S_j) / (T(n0+k) + d·k)."""
    best_k, best_value, emitted = 0, 1.0 / times[0], 1.0
    for k, gain in enumerate(survival[:budget], start=1):
        emitted += gain
        value = emitted / (times[k] + draft_forward * forwards[k])
        if value > best_value * (1 + 1e-12):
            best_k, best_value = k, value
    return best_k


def goodput(
    lengths: Sequence[int],
    survival: Sequence[Sequence[float]],
    fixed_tokens: int,
    step_time: Callable[[np.ndarray], np.ndarray],
    draft_forward: float = 0.0,
) -> float:
    """The objective of :func:`best_lengths` for given ``lengths`` (the reference the tests brute-force)."""
    emitted = sum(1.0 + float(sum(s[:k])) for s, k in zip(survival, lengths, strict=True))
    seconds = float(step_time(np.array([fixed_tokens + sum(lengths)]))[0]) + draft_forward * max(lengths, default=0)
    return emitted / seconds
