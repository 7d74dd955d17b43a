"""Batch 1 as the special case of continuous batching: one request in flight on the one engine.

The protocol's arms, the exactness and quality jobs decode a request at a time (the
:class:`Engine` interface, ``generate``); here that is a
:class:`~spectoolkit.serving.engine.ContinuousEngine` stepped until its only request finishes, so the
batch-1 arm and a served request run the very same scheduler, drafter, runner forward, verifier and
KV commit. Its :class:`~spectoolkit.serving.api.GenerationOutput` comes from the engine's step
statistics: the steps up to the first token are the prefill, and of every later step the drafting
is draft time, the target forward verify time, and the rest (acceptance test, KV commit, loop) overhead.

``target`` is the same runner and pool driven for one sequence (:class:`~spectoolkit.runtime.lone.LoneSequence`):
what calibration times and what a divergence replays is the forward the arm runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch

from spectoolkit.errors import SpecToolkitError
from spectoolkit.runtime.lone import LoneSequence
from spectoolkit.serving.api import FinishedRequest, GenerationOutput, ServeRequest, StepStats
from spectoolkit.serving.engine import ContinuousEngine


class Engine(Protocol):
    """Decodes one request at a time with a target (and, speculatively, a drafter)."""

    name: str
    target: LoneSequence  # the target runner: its forward is what calibration times and divergences replay

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        generator: torch.Generator | None,
        on_token: Callable[[int], None] | None = None,
    ) -> GenerationOutput:
        """Decode up to ``max_new_tokens`` tokens after ``prompt_ids``; ``on_token(id)`` streams them."""

    def runners(self) -> dict:
        """The model runners it drives, by role."""

    def peak_kv_bytes(self) -> dict[str, int]:
        """The most KV bytes a request held at once: ``{"target_kv_bytes": …, "draft_kv_bytes": …}``."""


class OneRequestEngine:
    """``generate`` one request at a time on ``engine`` (``name``: the arm's engine name, "baseline"/"spec")."""

    def __init__(self, engine: ContinuousEngine, name: str) -> None:
        self.engine, self.name = engine, name
        self.policy = engine.policy
        self.target = LoneSequence(engine.runner, engine.allocator)

    @property
    def drafter(self):
        """The engine's batched drafter (None for the target alone)."""
        return self.engine.drafter

    def runners(self) -> dict:
        return self.engine.runners()

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, generator: torch.Generator | None, on_token=None
    ) -> GenerationOutput:
        """Decode up to ``max_new_tokens`` tokens after ``prompt_ids``; ``on_token(id)`` streams them."""
        engine = self.engine
        self.target.reset()  # a calibration or replay before may hold blocks of the pool
        steps: list[StepStats] = []
        engine.on_step = steps.append
        engine.on_emit = None if on_token is None else lambda _, ids, __: [on_token(token) for token in ids]
        start = time.perf_counter()
        engine.submit(ServeRequest("0", list(prompt_ids), max_new_tokens, arrival=start, generator=generator))
        finished: list[FinishedRequest] = []
        try:
            while engine.has_work():
                finished += engine.step()
        finally:
            engine.on_step = engine.on_emit = None
            if engine.has_work():  # interrupted: nothing of this request stays in the engine
                engine.reset()
        end = time.perf_counter()
        (result,) = finished
        if result.error is not None:
            raise SpecToolkitError(f"the request failed: {result.error}")
        return _output(result, steps, start, end)

    def peak_kv_bytes(self) -> dict[str, int]:
        """The most KV bytes a request held at once, in the target's pool (candidates included) and the drafter's."""
        return self.engine.peak_kv_bytes()


def _output(result: FinishedRequest, steps: list[StepStats], start: float, end: float) -> GenerationOutput:
    """The request's counters and the time split of its steps (DESIGN §3)."""
    first = result.token_times[0]
    decode = [stats for stats in steps if stats.prefill_tokens == 0]
    out = GenerationOutput(
        output_ids=list(result.output_ids), ttft=first - start, prefill_time=first - start,
        total_time=end - start, draft_time=sum(s.draft_time for s in decode),
        verify_time=sum(s.forward_time for s in decode), verify_rounds=result.verify_rounds,
        drafted_tokens=result.drafted_tokens, accepted_tokens=result.accepted_tokens,
        rollback_count=result.rollback_count, proposed_rounds=result.proposed_rounds,
        accept_lengths=list(result.accept_lengths), draft_lengths=list(result.draft_lengths),
        chosen_lengths=list(result.chosen_lengths), tree_depths=list(result.tree_depths),
    )  # fmt: skip
    out.overhead_time = out.total_time - out.prefill_time - out.draft_time - out.verify_time
    return out
