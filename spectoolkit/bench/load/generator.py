"""Load generators over a :class:`~spectoolkit.serving.api.ServingEngine`: closed loop and open loop (DESIGN §6).

- Closed loop: N clients, each sends its next request when its previous one finishes. The first N are
  submitted at once, then one per finish, so exactly N are in flight until the requests run out.
- Open loop: arrival times fixed in advance from a seed (exponential inter-arrival gaps of mean
  1/rate, the first request at the level start), so every arm sees the same schedule. A request is
  submitted once its arrival time has passed, stamped with that scheduled time (a late generator counts
  as queueing); an idle engine sleeps until the next arrival.

Faults: a request the engine refuses (``submit`` raises) or a step that raises fails the requests
concerned with ``error`` and the level goes on. KeyboardInterrupt propagates; every request finished
before it has already been handed to ``on_finish``, so the caller has written it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from spectoolkit.errors import SpecToolkitError
from spectoolkit.serving.api import FinishedRequest, ServeRequest, ServingEngine, StepStats

Clock = Callable[[], float]


@dataclass(frozen=True)
class Completion:
    """A finished request as the load generator saw it."""

    finished: FinishedRequest
    level_start: float  # clock at the start of the level run (arrival offsets count from here)
    in_flight: float  # requests in flight (submitted, not finished), time-weighted mean over its own life


FinishHook = Callable[[Completion], None]
StepHook = Callable[[StepStats], None]


@dataclass
class LevelRun:
    """What one level run gives back: every finished request, every step, the time window."""

    finished: list[FinishedRequest] = field(default_factory=list)
    steps: list[StepStats] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    mean_in_flight: float = 0.0  # time-weighted over [start, end] (Little's law: the load it ran under)


@dataclass
class _Sent:
    request: ServeRequest
    area: float  # in-flight area (requests x seconds) when it was submitted
    submitted: float


class _Driver:
    """Submits, steps and collects for one level run; tracks what is in flight, time-weighted."""

    def __init__(self, engine: ServingEngine, clock: Clock, on_finish: FinishHook | None, on_step: StepHook | None):
        self.engine, self.clock, self._on_finish, self._on_step = engine, clock, on_finish, on_step
        self.run = LevelRun(start=clock())
        self._sent: dict[str, _Sent] = {}
        self._area, self._last = 0.0, self.run.start

    def __enter__(self) -> _Driver:
        self._previous_hook = getattr(self.engine, "on_step", None)
        self.engine.on_step = self._stepped
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.on_step = self._previous_hook
        self.run.end = self._advance()
        span = self.run.end - self.run.start
        self.run.mean_in_flight = self._area / span if span > 0 else 0.0

    @property
    def in_flight(self) -> int:
        return len(self._sent)

    def _advance(self) -> float:
        now = self.clock()
        self._area += len(self._sent) * (now - self._last)
        self._last = now
        return now

    def _stepped(self, stats: StepStats) -> None:
        self.run.steps.append(stats)
        if self._on_step:
            self._on_step(stats)

    def submit(self, request: ServeRequest) -> None:
        now = self._advance()
        request = request if request.arrival is not None else replace(request, arrival=now)
        try:
            self.engine.submit(request)
        except Exception as exc:  # noqa: BLE001  a request the engine refuses fails alone
            self._sent[request.request_id] = _Sent(request, self._area, now)
            self._done([_failed(request, f"submit failed: {type(exc).__name__}: {exc}", now)], now)
            return
        self._sent[request.request_id] = _Sent(request, self._area, now)

    def step(self) -> None:
        """One engine step; a step that raises fails every request in flight (and resets the engine)."""
        try:
            finished = self.engine.step()
        except Exception as exc:  # noqa: BLE001  the level goes on; the records carry the reason
            finished = self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
            self.engine.reset()
        now = self._advance()
        if self._sent and not self.engine.has_work():  # the engine lost requests: fail them, do not wait forever
            known = {done.request_id for done in finished}
            lost = [_failed(sent.request, "the engine dropped the request", now) for sent in self._sent.values()]
            finished = [*finished, *(done for done in lost if done.request_id not in known)]
        self._done(finished, now)

    def _fail_all(self, reason: str) -> list[FinishedRequest]:
        now = self.clock()
        return [_failed(sent.request, reason, now) for sent in self._sent.values()]

    def _done(self, finished: list[FinishedRequest], now: float) -> None:
        for done in finished:
            sent = self._sent.pop(done.request_id, None)
            if sent is None:  # not ours (a leftover of an earlier run): ignore it
                continue
            life = now - sent.submitted
            in_flight = (self._area - sent.area) / life if life > 0 else float(len(self._sent) + 1)
            self.run.finished.append(done)
            if self._on_finish:
                self._on_finish(Completion(done, self.run.start, in_flight))


def _failed(request: ServeRequest, reason: str, now: float) -> FinishedRequest:
    arrival = request.arrival if request.arrival is not None else now
    prompt_len = len(request.prompt_ids)
    return FinishedRequest(request.request_id, error=reason, arrival=arrival, finish=now, prompt_len=prompt_len)


def run_closed(
    engine: ServingEngine,
    requests: list[ServeRequest],
    concurrency: int,
    clock: Clock = time.perf_counter,
    on_finish: FinishHook | None = None,
    on_step: StepHook | None = None,
) -> LevelRun:
    """Closed loop: ``concurrency`` clients send ``requests`` in order, each its next when one finishes."""
    if concurrency < 1:
        raise SpecToolkitError(f"concurrency={concurrency} must be >= 1 (serve.concurrency)")
    pending = deque(requests)
    with _Driver(engine, clock, on_finish, on_step) as driver:
        while pending or driver.in_flight:
            while pending and driver.in_flight < concurrency:
                driver.submit(pending.popleft())
            if driver.in_flight:
                driver.step()
    return driver.run


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """[count] arrival times in seconds after the level start: 0, then exponential gaps of mean 1/rate."""
    if rate <= 0:
        raise SpecToolkitError(f"rate={rate} must be > 0 requests/s (serve.rate)")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()] if count else []


def run_open(
    engine: ServingEngine,
    requests: list[ServeRequest],
    rate: float,
    seed: int,
    clock: Clock = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
    on_finish: FinishHook | None = None,
    on_step: StepHook | None = None,
) -> LevelRun:
    """Open loop: ``requests`` arrive at ``rate`` per second on the schedule of ``arrival_offsets(seed)``."""
    offsets = arrival_offsets(len(requests), rate, seed)
    with _Driver(engine, clock, on_finish, on_step) as driver:
        due = [replace(r, arrival=driver.run.start + o) for r, o in zip(requests, offsets, strict=True)]
        upcoming = deque(due)
        while upcoming or driver.in_flight:
            now = clock()
            while upcoming and upcoming[0].arrival <= now:
                driver.submit(upcoming.popleft())
            if driver.in_flight:
                driver.step()
            elif upcoming:
                sleep(max(0.0, upcoming[0].arrival - now))
    return driver.run
