"""A scripted engine for the draft-length policies: known step costs, known acceptance, no real time.

Each step of a level of ``batch`` sequences (a closed loop: a finished request is replaced at once) asks the policy
for every request's k_i, draws each request's accepted drafts from its known per-position conditional acceptance,
and reports the round and the step's scripted seconds (with multiplicative noise, as a busy CPU measures them) the
way :class:`~spectoolkit.serving.engine.ContinuousEngine` does. The policy is scored by what it chose, not by the
draws: expected committed tokens (E_i(k_i) = 1 + Σ_{j<=k_i} S_ij from the true survival) over the noise-free
seconds, so a fixed γ's value is exact in closed form and the comparison has no sampling error on either side.

A lookup proposes only as far as its match goes: with ``Workload.proposed`` (the chance it proposes position j once it
proposed j - 1), a request asked for k drafts proposes min(k, L) of them, L drawn each round; only proposed rows
are verified, and a fixed γ's value counts the expected rows and tokens of what it asks for.

A draft model first feeds what it has not seen of a request (its prompt, the rounds it sat out) before it drafts for
it: with ``Workload.prompt`` rows and ``Costs.catch_up`` seconds a row, a request's first drafting round pays its
prompt's rows, and a round after more than ``BACKLOG_ROWS`` plain tokens pays those, as the engine's drafters do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from spectoolkit.drafting.base import BACKLOG_ROWS
from spectoolkit.policy.base import DraftLengthPolicy


@dataclass(frozen=True)
class Costs:
    """Seconds of a step: the target's T_B(n) over n tokens of B sequences, and one batched draft forward d_B."""

    target: Callable[[int, int], float]  # (sequences, tokens) -> seconds
    draft: Callable[[int], float]  # (sequences drafting) -> seconds of one draft forward
    catch_up: float = 0.0  # seconds per row a draft model feeds before it drafts (its prompt, rounds sat out)

    def step(self, sequences: int, tokens: int, forwards: int, drafting: int) -> float:
        return self.target(sequences, tokens) + (self.draft(drafting) * forwards if forwards else 0.0)


@dataclass(frozen=True)
class Workload:
    """Per-position conditional acceptance a_1..a_J of every request; ``switch``: (round, a) from which a request's
    acceptance becomes ``a`` at every position (a request that starts copying its context)."""

    acceptance: tuple[float, ...]
    output_len: int = 200
    switch: tuple[int, tuple[float, ...]] | None = None
    prompt: int = 0  # rows a draft model feeds before it first drafts for a request (0: a lookup, a head fed along)
    proposed: tuple[float, ...] | None = None  # Pr(a lookup proposes position j | it proposed j - 1); None: always

    def reach(self, k: int) -> list[float]:
        """Pr(position j is proposed) for j = 1..k: the rows a k-token ask verifies, in expectation."""
        return [1.0] * k if self.proposed is None else _chain(self.proposed, k)

    def expected(self, round_idx: int, k: int) -> float:
        """Expected emitted tokens of a k-token ask: 1 + Σ_j Pr(j proposed) · S_j."""
        return 1.0 + float(np.dot(self.reach(k), self.survival(round_idx, k)))

    def draw_proposed(self, k: int, rng: np.random.Generator) -> int:
        """How many of k asked drafts the drafter proposes this round."""
        return k if self.proposed is None else _drawn(self.proposed, k, rng)

    def conditional(self, round_idx: int) -> tuple[float, ...]:
        if self.switch is not None and round_idx >= self.switch[0]:
            return self.switch[1]
        return self.acceptance

    def survival(self, round_idx: int, k: int) -> list[float]:
        return _chain(self.conditional(round_idx), k)


def _chain(rates: tuple[float, ...], k: int) -> list[float]:
    """Pr(positions 1..j all pass) for j = 1..k, position j passing at ``rates[j - 1]`` (the last rate past the end)."""
    return np.cumprod([rates[min(j, len(rates) - 1)] for j in range(k)]).tolist()


def _drawn(rates: tuple[float, ...], k: int, rng: np.random.Generator) -> int:
    """How many of k positions pass in a row this round, drawn at :func:`_chain`'s rates."""
    n = 0
    while n < k and rng.random() < rates[min(n, len(rates) - 1)]:
        n += 1
    return n


def best_fixed(costs: Costs, workload: Workload, batch: int, gammas: Sequence[int]) -> tuple[int, float]:
    """The best fixed γ (0: the target alone) of a homogeneous level, and its committed tokens per second, exactly
    (a drafting request's prompt catch-up spread over its rounds)."""
    best = (0, batch / costs.step(batch, batch, 0, 0))
    for gamma in gammas:
        emitted = batch * workload.expected(0, gamma)
        catch_up = workload.prompt * costs.catch_up * emitted / workload.output_len  # per step, over the batch
        rows = batch * float(sum(workload.reach(gamma)))
        value = emitted / (costs.step(batch, batch + rows, gamma, batch) + catch_up)
        if value > best[1]:
            best = (gamma, value)
    return best


@dataclass
class _Request:
    key: int
    room: int
    unfed: int = 0  # rows its draft model has not seen
    rounds: int = 0

    @property
    def backlog(self) -> int:
        """Rows a drafting round first feeds apart (:meth:`spectoolkit.drafting.base.OwnKV._backlog`)."""
        return self.unfed - 1 if self.unfed > BACKLOG_ROWS else 0


def run_level(
    policy: DraftLengthPolicy, costs: Costs, workload: Workload, batch: int, steps: int, seed: int = 0,
    noise: float = 0.05, budget: int = 4096, calibrate: Sequence[int] = (), warmup: int = 0, rejected: int = 0,
) -> float:  # fmt: skip
    """Drive ``policy`` for ``warmup`` + ``steps`` steps at ``batch`` sequences; returns its committed tokens per second
    over the last ``steps`` (expected tokens of what it chose over noise-free seconds; the first ``warmup`` untimed, as
    a sweep's warm-up requests are). ``calibrate``: batch-1 widths seeded first (the bench's V(w)); ``rejected``: the
    level's first rounds that draft have every draft rejected (a warm-up that met text its draft does not predict)."""
    rng = np.random.default_rng(seed)
    if calibrate:
        policy.seed({w: costs.target(1, w) for w in calibrate})
    next_key = 0
    running = []
    for _ in range(batch):
        running.append(_Request(next_key, workload.output_len, workload.prompt))
        next_key += 1
    tokens_total = seconds_total = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            tokens_total = seconds_total = 0.0
        keys = [r.key for r in running]
        caps = [min(policy.max_gamma, r.room - 1) for r in running]
        lengths = policy.choose(keys, caps, batch, budget, [r.backlog for r in running], [r.room for r in running])
        proposed = [workload.draw_proposed(k, rng) for k in lengths]
        forwards = max(proposed, default=0)
        drafting = sum(1 for k in proposed if k)
        tokens = batch + sum(proposed)  # the rows verified; scored at the rows expected of what was asked
        target = costs.target(batch, tokens)
        draft = costs.draft(drafting) * forwards if forwards else 0.0
        expected = costs.target(batch, batch + sum(float(sum(workload.reach(k))) for k in lengths))
        fed = sum(r.backlog for r, k in zip(running, lengths, strict=True) if k)
        catch_up = fed * costs.catch_up
        if fed and costs.catch_up:
            policy.observe_catch_up(fed, catch_up)
        pairs = zip(running, lengths, strict=True)
        tokens_total += sum(workload.expected(r.rounds, k) for r, k in pairs)
        seconds_total += expected + draft + catch_up
        for i, (request, k, n) in enumerate(zip(running, lengths, proposed, strict=True)):
            accepted = _drawn(workload.conditional(request.rounds), n, rng)
            if n and rejected > 0:
                accepted, rejected = 0, rejected - 1
            policy.observe(request.key, k, n, accepted)
            request.rounds += 1
            request.room -= accepted + 1
            request.unfed = 1 if k else request.unfed + accepted + 1  # a draft forward feeds all but the pending
            if request.room <= 0:
                policy.release(request.key)
                running[i] = _Request(next_key, workload.output_len, workload.prompt)
                next_key += 1
        jitter = rng.lognormal(0.0, noise, size=2) if noise else np.ones(2)
        policy.observe_step(tokens, forwards, target * jitter[0], draft * jitter[1], batch, drafting)
    return tokens_total / seconds_total


@dataclass(frozen=True)
class Tree:
    """A draft tree in best-first order: node j's parent (-1: the root) and its conditional probability of being the
    target's token once its parent is (siblings exclude each other). A k-node round drafts the first k nodes."""

    parents: tuple[int, ...]
    conditional: tuple[float, ...]
    output_len: int = 200

    def hits(self) -> list[float]:
        """Pr(node j is on the accepted path) [len]: its conditional times its parent's."""
        out: list[float] = []
        for parent, p in zip(self.parents, self.conditional, strict=True):
            out.append(p * (out[parent] if parent >= 0 else 1.0))
        return out

    def depths(self) -> list[int]:
        out: list[int] = []
        for parent in self.parents:
            out.append(1 + (out[parent] if parent >= 0 else 0))
        return out

    def depth(self, k: int) -> int:
        return max(self.depths()[:k], default=0)

    def expected(self, k: int) -> float:
        return 1.0 + sum(self.hits()[:k])

    def path(self, k: int, rng: np.random.Generator) -> list[int]:
        """The accepted path of a k-node round: from the root, the child (if any) that the target's token is."""
        path, at = [], -1
        while True:
            children = [j for j in range(k) if self.parents[j] == at]
            u, cumulative, chosen = rng.random(), 0.0, None
            for child in children:
                cumulative += self.conditional[child]
                if u < cumulative:
                    chosen = child
                    break
            if chosen is None:
                return path
            path.append(chosen)
            at = chosen


def best_fixed_tree(costs: Costs, tree: Tree, batch: int, sizes: Sequence[int]) -> tuple[int, float]:
    """The best fixed node count (0: the target alone) of a level and its committed tokens per second, exactly."""
    best = (0, batch / costs.step(batch, batch, 0, 0))
    for k in sizes:
        value = batch * tree.expected(k) / costs.step(batch, batch * (1 + k), tree.depth(k), batch)
        if value > best[1]:
            best = (k, value)
    return best


def run_tree_level(
    policy: DraftLengthPolicy, costs: Costs, tree: Tree, batch: int, steps: int, seed: int = 0, noise: float = 0.05,
    calibrate: Sequence[int] = (), warmup: int = 0,
) -> float:  # fmt: skip
    """:func:`run_level` for token trees: each request drafts the first k_i nodes of ``tree``; the step's draft
    forwards are its deepest tree's depth. Returns expected committed tokens per noise-free second of the steps after
    the first ``warmup`` (untimed, as a sweep's warm-up requests are)."""
    rng = np.random.default_rng(seed)
    if calibrate:
        policy.seed({w: costs.target(1, w) for w in calibrate})
    rooms, keys, next_key = [tree.output_len] * batch, list(range(batch)), batch
    tokens_total = seconds_total = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            tokens_total = seconds_total = 0.0
        caps = [policy.max_gamma if room > 1 else 0 for room in rooms]
        lengths = policy.choose(keys, caps, batch, 4096, None, rooms)
        forwards = max((tree.depth(k) for k in lengths), default=0)
        drafting = sum(1 for k in lengths if k)
        tokens = batch + sum(lengths)
        target, draft = costs.target(batch, tokens), (costs.draft(drafting) * forwards if forwards else 0.0)
        tokens_total += sum(tree.expected(k) for k in lengths)
        seconds_total += target + draft
        for i, k in enumerate(lengths):
            path = tree.path(k, rng)
            policy.observe(keys[i], k, k, len(path), path, tree.depth(k))
            rooms[i] -= len(path) + 1
            if rooms[i] <= 0:
                policy.release(keys[i])
                keys[i], rooms[i], next_key = next_key, tree.output_len, next_key + 1
        jitter = rng.lognormal(0.0, noise, size=2) if noise else np.ones(2)
        policy.observe_step(tokens, forwards, target * jitter[0], draft * jitter[1], batch, drafting)
    return tokens_total / seconds_total
