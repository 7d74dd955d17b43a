"""A deterministic serving engine in fake time, for the load-protocol tests (no model, no torch work).

Each step admits queued requests up to ``max_num_seqs``, advances the clock by ``step_time`` and gives
every running request its tokens, all stamped with the step's end time: the first step of a request
(its prefill) emits one token, every later step ``tokens_per_step`` (a drafting arm: ``gamma`` drafts,
``tokens_per_step - 1`` accepted). Output tokens depend only on the prompt and the position, so every
arm and level produces the same outputs unless ``diverge_at`` makes batched requests differ.
"""

from __future__ import annotations

import sys
import types
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from spectoolkit.serving.api import FinishedRequest, ServeRequest, StepStats


class FakeClock:
    """A clock that only moves when slept on (or advanced by an engine step)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += max(0.0, seconds)


def fake_token(prompt_ids: list[int], position: int) -> int:
    return (sum(prompt_ids) * 31 + position * 7) % 1000


@dataclass
class _Running:
    request: ServeRequest
    arrival: float
    scheduled: float
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    verify_rounds: int = 0


class FakeServingEngine:
    """A :class:`~spectoolkit.serving.api.ServingEngine` in fake time (see the module docstring)."""

    def __init__(
        self,
        clock: Callable[[], float],
        advance: Callable[[float], None] | None = None,
        name: str = "baseline",
        gamma: int = 0,
        tokens_per_step: int = 1,
        step_time: float = 0.01,
        max_num_seqs: int = 64,
        interrupt_at_step: int | None = None,
        diverge_at: int | None = None,
        events: list | None = None,
    ) -> None:
        self.clock, self.advance, self.name = clock, advance or (lambda _seconds: None), name
        self.gamma, self.tokens_per_step, self.step_time = gamma, tokens_per_step, step_time
        self.max_num_seqs, self.interrupt_at_step, self.diverge_at = max_num_seqs, interrupt_at_step, diverge_at
        self.events = events if events is not None else []
        self.on_step: Callable[[StepStats], None] | None = None
        self.queue: deque[_Running] = deque()
        self.running: dict[str, _Running] = {}
        self.in_flight_log: list[int] = []  # queued + running at the start of every step
        self.submitted: list[tuple[str, float, float, int]] = []  # (request_id, arrival, clock, steps so far)
        self.total_steps = 0

    def submit(self, request: ServeRequest) -> None:
        arrival = request.arrival if request.arrival is not None else self.clock()
        self.submitted.append((request.request_id, arrival, self.clock(), self.total_steps))
        self.events.append((self.name, "submit", request))
        self.queue.append(_Running(request, arrival, scheduled=0.0))

    def has_work(self) -> bool:
        return bool(self.queue or self.running)

    def reset(self) -> None:
        self.events.append((self.name, "reset", None))
        self.queue.clear()
        self.running.clear()

    def step(self) -> list[FinishedRequest]:
        if self.interrupt_at_step is not None and self.total_steps == self.interrupt_at_step:
            raise KeyboardInterrupt
        self.total_steps += 1
        self.in_flight_log.append(len(self.queue) + len(self.running))
        while self.queue and len(self.running) < self.max_num_seqs:
            state = self.queue.popleft()
            state.scheduled = self.clock()
            self.running[state.request.request_id] = state
        self.advance(self.step_time)
        now, batch = self.clock(), len(self.running)
        finished = [done for state in list(self.running.values()) if (done := self._emit(state, now, batch))]
        self._stats(batch, len(finished))
        return finished

    def _emit(self, state: _Running, now: float, batch: int) -> FinishedRequest | None:
        prefill = not state.output_ids
        want = 1 if prefill else self.tokens_per_step
        count = min(want, state.request.max_new_tokens - len(state.output_ids))
        for _ in range(count):
            position = len(state.output_ids)
            token = fake_token(state.request.prompt_ids, position)
            state.output_ids.append(token + (1 if self.diverge_at == position and batch > 1 else 0))
            state.token_times.append(now)
        state.batch_sizes.append(batch)
        if not prefill:
            state.verify_rounds += 1
            if self.gamma:
                state.draft_lengths.append(self.gamma)
                state.accept_lengths.append(count - 1)
        if len(state.output_ids) < state.request.max_new_tokens:
            return None
        del self.running[state.request.request_id]
        return FinishedRequest(
            state.request.request_id, output_ids=state.output_ids, arrival=state.arrival, scheduled=state.scheduled,
            token_times=state.token_times, finish=now, batch_sizes=state.batch_sizes,
            verify_rounds=state.verify_rounds, drafted_tokens=sum(state.draft_lengths),
            accepted_tokens=sum(state.accept_lengths), accept_lengths=state.accept_lengths,
            draft_lengths=state.draft_lengths, prompt_len=len(state.request.prompt_ids),
            sampling=state.request.sampling,
        )  # fmt: skip

    def runners(self) -> dict:
        return {}

    def peak_kv_bytes(self) -> dict[str, int]:
        return {"target_kv_bytes": 0, "draft_kv_bytes": 0}

    def _stats(self, batch: int, finished: int) -> None:
        if self.on_step is None:
            return
        drafts = self.gamma * batch
        self.on_step(StepStats(
            index=self.total_steps - 1, batch_size=batch, num_tokens=batch + drafts, prefill_tokens=0,
            draft_tokens=drafts, reserved_kv_tokens=drafts, used_kv_tokens=0, queued=len(self.queue),
            speculating=self.gamma > 0, step_time=self.step_time, draft_time=0.0, finished=finished,
        ))  # fmt: skip


@dataclass
class FakeArm:
    """The fields of ``spectoolkit.serving.assemble.ServingArm`` the load protocol reads."""

    name: str
    engine: FakeServingEngine
    gamma: int = 0
    drafter: str = "none"
    target_precision: str = "fp32"
    draft_precision: str | None = None
    reference: str | None = None
    policy: str = "fixed"

    def snapshot(self) -> None:
        return None


def fake_arms(clock: Callable[[], float], advance=None, events: list | None = None, **spec) -> list[FakeArm]:
    """A baseline arm and a "spec" arm (γ 4, 3 tokens per round) on fake engines sharing ``events``."""
    events = events if events is not None else []
    base = FakeServingEngine(clock, advance, "baseline", events=events)
    spec_engine = FakeServingEngine(clock, advance, "spec", gamma=4, tokens_per_step=3, events=events, **spec)
    return [FakeArm("baseline", base), FakeArm("spec", spec_engine, 4, "ngram", reference="baseline")]


def install_serving_arms(monkeypatch, arms: list[FakeArm]) -> None:
    """``spectoolkit.serving.assemble.serving_arms`` returns ``arms`` (whether or not the real module exists)."""
    module = types.ModuleType("spectoolkit.serving.assemble")
    module.serving_arms = lambda cfg, setup: arms
    monkeypatch.setitem(sys.modules, "spectoolkit.serving.assemble", module)
