"""Draft-length policies: how many tokens each request drafts in its next round (issue 16).

One class per policy, chosen once from ``speculate.policy`` (:func:`make_policy`); the batch-1 engine
and the serving scheduler call the same interface. ``choose`` gets, for the requests that may draft
this step, their caps k_i <= min(γ, room − 1), the step's other tokens (pending tokens and prefill
chunks) and the step's candidate budget, and returns each k_i (0: that request decodes plainly this
round). After the target forward the engine reports each request's round (``observe``) and the step's
times (``observe_step``). The choice never looks at the round it decides, so verification stays exact.

- :class:`FixedPolicy`: k_i = min(γ, cap_i) while the budget lasts (the constant γ of before).
- :class:`ConfidencePolicy`: the same caps; the draft model stops itself when its top probability
  falls below ``speculate.confidence`` (transformers' assistant confidence threshold).
- :class:`~spectoolkit.policy.adaptive.AdaptivePolicy`: per-request acceptance and measured costs,
  the goodput-maximising k_i jointly over the batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Prediction:
    """What a policy expected of the step it planned, to log beside what the step measured (issue 57)."""

    tokens: float  # Σ_i E_i(k_i): the decoding requests' expected emitted tokens
    target_seconds: float  # T_B(n) of the step's planned tokens, on the curve the policy used
    fixed_tokens: int  # the step's tokens besides drafts (pending tokens, prefill chunks)
    curve: list[float]  # T_B at fixed_tokens + 0, 1, .. planned drafts: the curve at the width a step actually ran
    draft_seconds: float  # one draft forward at the step's drafting count × the forwards of its deepest draft
    survival: list[list[float]]  # per request (the step's order): S_1..S_k_i, its acceptance estimate by position
    prior_strength: float  # m: the pseudo-rounds of the workload's prior in each request's estimate


class DraftLengthPolicy(Protocol):
    name: str
    max_gamma: int  # no request drafts more than this in a round (a tree's nodes)
    max_depth: int  # nor deeper than this (a chain: max_gamma)

    def choose(
        self, keys: Sequence[Hashable], caps: Sequence[int], fixed_tokens: int, budget: int,
        backlogs: Sequence[int] | None = None, rooms: Sequence[int] | None = None, settled: int | None = None,
    ) -> list[int]:  # fmt: skip
        """k_i <= caps[i] with Σ k_i <= ``budget`` for requests ``keys`` in a step with ``fixed_tokens`` others;
        ``backlogs[i]``: rows the drafter first feeds before it drafts for request i (a draft head's held states of
        the rounds it sat out), ``rooms[i]``: the tokens request i may still emit, ``settled``: the sequences the
        step's requests will share once the prompts being computed and the requests waiting decode (None: the
        step's own), the batch a catch-up is repaid in."""

    def observe(
        self, key: Hashable, chosen: int, drafted: int, accepted: int, path: list[int] | None = None,
        depth: int | None = None,
    ) -> None:  # fmt: skip
        """``key``'s verified round: asked for ``chosen``, ``drafted`` proposed, ``accepted`` kept; a token
        tree's accepted ``path`` (node indices) and ``depth`` (its draft forwards)."""

    def observe_step(
        self, num_tokens: int, draft_forwards: int, target_seconds: float, draft_seconds: float, sequences: int = 1,
        drafting: int | None = None,
    ) -> None:  # fmt: skip
        """A decode step of ``num_tokens`` target tokens over ``sequences`` sequences (batch 1: a round);
        its drafting took ``draft_forwards`` sequential forwards for ``drafting`` of them (default: all). Steps with
        prefill chunks are not reported."""

    def observe_catch_up(self, rows: int, seconds: float) -> None:
        """The drafter fed ``rows`` backlog rows in ``seconds`` before it drafted (what ``backlogs`` cost)."""

    def prediction(self) -> Prediction | None:
        """What the last :meth:`choose` expected of its step (None: a policy that predicts nothing)."""

    def seed(self, seconds_by_tokens: Mapping[int, float]) -> None:
        """Calibrated target step times by token count (batch 1: the verify widths)."""

    def release(self, key: Hashable) -> None:
        """``key`` finished: forget it."""


class FixedPolicy:
    """The constant draft length: k_i = min(γ, cap_i), in order, while the step's budget lasts."""

    name = "fixed"
    stop_below: float | None = None

    def __init__(self, gamma: int, depth: int | None = None) -> None:
        """``gamma`` drafts (token-tree nodes) per round, ``depth`` deep at most (default: ``gamma``, a chain)."""
        self.max_gamma = gamma
        self.max_depth = gamma if depth is None else depth

    def choose(
        self, keys: Sequence[Hashable], caps: Sequence[int], fixed_tokens: int, budget: int,
        backlogs: Sequence[int] | None = None, rooms: Sequence[int] | None = None, settled: int | None = None,
    ) -> list[int]:  # fmt: skip
        lengths = []
        for cap in caps:
            k = max(0, min(self.max_gamma, cap, budget))
            lengths.append(k)
            budget -= k
        return lengths

    def observe(
        self, key: Hashable, chosen: int, drafted: int, accepted: int, path: list[int] | None = None,
        depth: int | None = None,
    ) -> None:  # fmt: skip
        pass

    def observe_step(
        self, num_tokens: int, draft_forwards: int, target_seconds: float, draft_seconds: float, sequences: int = 1,
        drafting: int | None = None,
    ) -> None:  # fmt: skip
        pass

    def observe_catch_up(self, rows: int, seconds: float) -> None:
        pass

    def prediction(self) -> Prediction | None:
        return None

    def seed(self, seconds_by_tokens: Mapping[int, float]) -> None:
        pass

    def release(self, key: Hashable) -> None:
        pass


class ConfidencePolicy(FixedPolicy):
    """Caps of :class:`FixedPolicy`; the draft model stops when its top probability is below ``stop_below``."""

    name = "confidence"

    def __init__(self, gamma: int, stop_below: float, depth: int | None = None) -> None:
        super().__init__(gamma, depth)
        self.stop_below = stop_below
