"""Load generators (DESIGN §6): the closed loop keeps N in flight, the open loop's schedule is fixed by
its seed and shared by every arm, faults cost requests and not the level, Ctrl-C keeps what finished."""

from __future__ import annotations

import numpy as np
import pytest

from spectoolkit.bench.load.generator import Completion, arrival_offsets, run_closed, run_open
from spectoolkit.errors import SpecToolkitError
from spectoolkit.serving.api import ServeRequest
from tests.bench.load.fakes import FakeClock, FakeServingEngine


def _requests(count: int, lengths: tuple[int, ...] = (2, 5, 3, 7)) -> list[ServeRequest]:
    return [ServeRequest(f"r{i}", [i + 1, 2, 3], lengths[i % len(lengths)]) for i in range(count)]


def test_closed_loop_keeps_exactly_n_in_flight_until_the_tail() -> None:
    clock = FakeClock()
    engine = FakeServingEngine(clock, clock.sleep)
    requests = _requests(13)
    run = run_closed(engine, requests, 3, clock)
    assert sorted(done.request_id for done in run.finished) == sorted(r.request_id for r in requests)
    assert [entry[0] for entry in engine.submitted] == [r.request_id for r in requests]  # clients send in order
    last_submit_step = engine.submitted[-1][3]  # steps before it: requests were still waiting to be sent
    assert last_submit_step > 3  # the loop really refilled as requests finished
    assert engine.in_flight_log[:last_submit_step] == [3] * last_submit_step
    assert all(count <= 3 for count in engine.in_flight_log)
    assert engine.in_flight_log[-1] < 3  # the tail drains
    assert [entry[3] for entry in engine.submitted[:3]] == [0, 0, 0]  # the first N at once


def test_closed_loop_time_weighted_in_flight() -> None:
    clock = FakeClock()
    engine = FakeServingEngine(clock, clock.sleep)
    seen: list[Completion] = []
    run = run_closed(engine, _requests(6, lengths=(4,)), 2, clock, on_finish=seen.append)
    assert [c.in_flight for c in seen] == pytest.approx([2.0] * 6)  # equal lengths: always two in flight
    assert run.mean_in_flight == pytest.approx(2.0)
    assert run.end - run.start == pytest.approx(3 * 4 * engine.step_time)
    assert all(c.level_start == run.start for c in seen)
    assert len(run.steps) == engine.total_steps == 12


def test_closed_loop_with_more_clients_than_requests_sends_all_at_once() -> None:
    clock = FakeClock()
    engine = FakeServingEngine(clock, clock.sleep)
    run = run_closed(engine, _requests(3), 8, clock)
    assert len(run.finished) == 3 and engine.in_flight_log[0] == 3
    with pytest.raises(SpecToolkitError, match="concurrency"):
        run_closed(engine, _requests(3), 0, clock)


def _open_run(tokens_per_step: int, seed: int, rate: float = 20.0):
    clock = FakeClock()
    engine = FakeServingEngine(clock, clock.sleep, tokens_per_step=tokens_per_step)
    run = run_open(engine, _requests(12), rate, seed, clock, clock.sleep)
    return run, engine, clock


def test_open_loop_schedule_is_the_seeds_and_every_arms() -> None:
    base, base_engine, _ = _open_run(1, seed=7)
    spec, spec_engine, _ = _open_run(3, seed=7)  # finishes faster: a different interleaving of steps
    expected = arrival_offsets(12, 20.0, 7)
    for run, engine in ((base, base_engine), (spec, spec_engine)):
        offsets = [arrival - run.start for _, arrival, _, _ in engine.submitted]
        assert offsets == pytest.approx(expected)
        assert all(submitted >= arrival - 1e-12 for _, arrival, submitted, _ in engine.submitted)  # never early
        assert sorted(done.arrival - run.start for done in run.finished) == pytest.approx(expected)
    assert base_engine.total_steps != spec_engine.total_steps
    assert arrival_offsets(12, 20.0, 7) == expected  # reproducible
    assert arrival_offsets(12, 20.0, 8) != expected
    assert expected[0] == 0.0 and np.all(np.diff(expected) > 0)


def test_open_loop_sleeps_until_the_next_arrival_when_idle() -> None:
    run, engine, clock = _open_run(1, seed=3, rate=0.5)  # 2 s between arrivals, requests take < 0.1 s
    offsets = arrival_offsets(12, 0.5, 3)
    assert len(clock.sleeps) >= 10 and sum(clock.sleeps) > 0.8 * offsets[-1]
    assert max(engine.in_flight_log) == 1  # nothing overlaps at this rate
    late = [submitted - arrival for _, arrival, submitted, _ in engine.submitted]
    assert max(late) == pytest.approx(0.0, abs=1e-9)  # an idle generator submits on time


def test_arrival_gaps_are_exponential_with_mean_one_over_rate() -> None:
    gaps = np.diff(arrival_offsets(4001, 4.0, 0))
    assert gaps.mean() == pytest.approx(0.25, rel=0.08)
    assert gaps.std() == pytest.approx(0.25, rel=0.1)  # exponential: std == mean
    with pytest.raises(SpecToolkitError, match="rate"):
        arrival_offsets(3, 0.0, 0)


class _RefusingEngine(FakeServingEngine):
    def submit(self, request: ServeRequest) -> None:
        if not request.prompt_ids:
            raise ValueError("empty prompt")
        super().submit(request)


def test_a_refused_request_fails_alone_and_the_loop_goes_on() -> None:
    clock = FakeClock()
    engine = _RefusingEngine(clock, clock.sleep)
    requests = _requests(5)
    requests[1] = ServeRequest("bad", [], 4)
    run = run_closed(engine, requests, 2, clock)
    by_id = {done.request_id: done for done in run.finished}
    assert set(by_id) == {r.request_id for r in requests}
    assert by_id["bad"].error == "submit failed: ValueError: empty prompt"
    assert all(done.error is None for rid, done in by_id.items() if rid != "bad")


class _FailingStepEngine(FakeServingEngine):
    def step(self):
        if self.total_steps == 2 and not getattr(self, "failed", False):
            self.failed = True
            raise RuntimeError("nan logits")
        return super().step()


def test_a_failing_step_fails_the_requests_in_flight_and_the_level_goes_on() -> None:
    clock = FakeClock()
    engine = _FailingStepEngine(clock, clock.sleep)
    run = run_closed(engine, _requests(6, lengths=(5,)), 2, clock)
    errors = [done for done in run.finished if done.error]
    assert [done.request_id for done in errors] == ["r0", "r1"]
    assert errors[0].error == "engine step failed: RuntimeError: nan logits"
    assert sum(done.error is None for done in run.finished) == 4


def test_keyboard_interrupt_propagates_after_the_finished_were_handed_over() -> None:
    clock = FakeClock()
    engine = FakeServingEngine(clock, clock.sleep, interrupt_at_step=9)
    previous = engine.on_step = lambda stats: None
    seen: list[Completion] = []
    with pytest.raises(KeyboardInterrupt):
        run_closed(engine, _requests(10), 2, clock, on_finish=seen.append)
    assert 0 < len(seen) < 10 and all(c.finished.error is None for c in seen)
    assert engine.on_step is previous  # the engine's hook is restored
