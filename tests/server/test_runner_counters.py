"""The engine side of the server on a tiny random model: EngineCounters (vLLM's spec-decode convention),
the engine's counting and abort, and EngineRunner (the engine on its own thread, one bad step never
takes the server down).
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from spectoolkit.drafting import NgramDrafter
from spectoolkit.server.runner import SHUTDOWN_REASON, Done, EngineRunner, Listener, Tokens
from spectoolkit.serving.api import FinishedRequest, ServeRequest
from spectoolkit.serving.counters import EngineCounters
from tests.serving.helpers import VOCAB, all_free, engine, outputs, prompts, requests, run, tiny

GAMMA = 3
EVENT_TIMEOUT_S = 60.0
LONG = 1000  # max_new_tokens of a request that is aborted long before (tiny context: 1024)

# ---- EngineCounters.count_round ------------------------------------------------------------------------


def test_count_round_per_position_and_rollbacks():
    counters = EngineCounters()
    counters.count_round(0, 0)  # a verify round without candidates: no draft
    assert (counters.verify_rounds, counters.drafts, counters.accepted_per_position) == (1, 0, [])
    counters.count_round(4, 4)
    assert counters.accepted_per_position == [1, 1, 1, 1] and counters.rollback_rounds == 0
    counters.count_round(4, 2)
    assert counters.accepted_per_position == [2, 2, 1, 1] and counters.rollback_rounds == 1
    counters.count_round(2, 0)
    assert counters.accepted_per_position == [2, 2, 1, 1] and counters.rollback_rounds == 2
    counters.count_round(6, 5)  # a longer draft than ever: the series grow
    assert counters.accepted_per_position == [3, 3, 2, 2, 1, 0]
    assert (counters.verify_rounds, counters.drafts, counters.draft_tokens, counters.accepted_tokens) == (5, 4, 16, 11)
    assert counters.rollback_rounds == 3


def test_count_round_invariants_over_random_rounds():
    rng = random.Random(0)
    counters = EngineCounters()
    rounds = [(drafted, rng.randint(0, drafted)) for drafted in (rng.randint(0, 8) for _ in range(500))]
    for drafted, accepted in rounds:
        counters.count_round(drafted, accepted)
    per_position = counters.accepted_per_position
    assert sum(per_position) == counters.accepted_tokens == sum(a for _, a in rounds)
    assert all(earlier >= later for earlier, later in zip(per_position, per_position[1:], strict=False))
    assert per_position[0] == sum(1 for _, a in rounds if a > 0) <= counters.drafts
    assert counters.drafts == sum(1 for d, _ in rounds if d > 0) and counters.verify_rounds == len(rounds)
    assert counters.rollback_rounds == sum(1 for d, a in rounds if 0 < d and a < d)
    assert counters.draft_tokens == sum(d for d, _ in rounds)


# ---- the engine's counting and abort ------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny()


def _spec_engine(model):
    return engine(model, gamma=GAMMA, drafter=NgramDrafter(3, 1, VOCAB, one_hot_probs=False))


def test_engine_counters_sum_the_requests(model):
    eng = _spec_engine(model)
    done = run(eng, requests(prompts((6, 9, 12, 7)), 20))
    results = list(done.values())
    counters = eng.counters
    assert counters.finished_requests == len(results) and counters.failed_requests == 0
    assert counters.generation_tokens == sum(len(r.output_ids) for r in results)
    assert counters.prompt_tokens == sum(len(p) for p in prompts((6, 9, 12, 7)))
    assert counters.draft_tokens == sum(r.drafted_tokens for r in results) > 0
    assert counters.accepted_tokens == sum(r.accepted_tokens for r in results) > 0
    assert counters.verify_rounds == sum(r.verify_rounds for r in results)
    assert counters.drafts == sum(1 for r in results for d in r.draft_lengths if d > 0)
    expected = [0] * GAMMA
    for r in results:
        for accepted in r.accept_lengths:
            for position in range(accepted):
                expected[position] += 1
    assert counters.accepted_per_position == expected
    assert counters.rollback_rounds == sum(
        1 for r in results for d, a in zip(r.draft_lengths, r.accept_lengths, strict=True) if a < d
    )


def test_engine_abort_frees_kv_running_and_queued(model):
    eng = engine(model, max_num_seqs=1)
    for request in requests(prompts((6, 8)), 50):
        eng.submit(request)
    eng.step()
    assert [s.request.request_id for s in eng.scheduler.running] == ["0"] and len(eng.scheduler.queue) == 1
    assert eng.abort("1") and eng.abort("0")
    assert not eng.abort("0") and not eng.abort("missing")
    assert not eng.has_work() and all_free(eng)
    assert eng.counters.aborted_requests == 2 and eng.counters.finished_requests == 0


def test_engine_counts_rejected_requests_as_failed(model):
    """A request the engine refuses at submit (empty, overlong, larger than the KV pool) comes back from
    step() with its error — the server answers 500 engine_error — yet no counter (so no /metrics series)
    records it."""
    eng = engine(model, num_blocks=4)
    eng.submit(ServeRequest("empty", [], 4))
    eng.submit(ServeRequest("too-big", [5] * 8, 100))  # 107 KV slots, the pool holds 32
    done = {r.request_id: r for r in eng.step()}
    assert done.keys() == {"empty", "too-big"} and all(r.error for r in done.values())
    assert eng.counters.failed_requests == 2


# ---- EngineRunner ---------------------------------------------------------------------------------------


async def _events(listener: Listener) -> tuple[list[int], FinishedRequest]:
    """Every Tokens event's ids, then the Done event's request."""
    ids: list[int] = []
    while True:
        event = await asyncio.wait_for(listener.queue.get(), EVENT_TIMEOUT_S)
        if isinstance(event, Tokens):
            ids += event.ids
            continue
        assert isinstance(event, Done)
        return ids, event.finished


def test_runner_step_failure_fails_every_listener_and_keeps_running(model, monkeypatch):
    eng = _spec_engine(model)
    runner = EngineRunner(eng)
    seen: list[FinishedRequest] = []
    runner.on_finish = seen.append
    forward, calls = eng._forward, []

    def failing_once(works, proposals):  # inside the step: blocks for tokens and drafts are held
        calls.append(len(works))
        if len(calls) == 2:
            raise RuntimeError("boom")
        return forward(works, proposals)

    monkeypatch.setattr(eng, "_forward", failing_once)
    prompt_ids = prompts((6, 8))
    reference = outputs(run(_spec_engine(model), requests(prompt_ids[:1], 8)))["0"]

    async def main():
        loop = asyncio.get_running_loop()
        first = [Listener(loop), Listener(loop)]
        for i, listener in enumerate(first):
            runner.submit(ServeRequest(f"a{i}", prompt_ids[i], 30), listener)
        runner.start()  # after both submits: they join the same first step
        failed = [await _events(listener) for listener in first]
        later = Listener(loop)
        runner.submit(ServeRequest("b", prompt_ids[0], 8), later)
        return failed, await _events(later)

    try:
        failed, (later_ids, later_done) = asyncio.run(main())
        assert runner.alive, "one failed step stopped the runner"
    finally:
        runner.stop(0.0)
    assert calls[:2] == [2, 2], "both requests ran in the step that failed"
    for ids, done in failed:
        assert done.error == "engine step failed: RuntimeError: boom"
        assert len(ids) == 1, "each got its prefill token before the failing step"
    assert later_done.error is None and later_done.output_ids == later_ids == reference
    assert sorted(d.request_id for d in seen[:2]) == ["a0", "a1"] and [d.request_id for d in seen[2:]] == ["b"]
    assert all(d.error for d in seen[:2]), "on_finish (the metrics hook) sees the failures"
    assert all_free(eng) and not eng.has_work() and runner.in_flight() == 0


def _slowed(eng, monkeypatch, seconds: float = 0.002):
    """``eng`` with every step at least ``seconds`` long: a long request cannot finish before the test acts."""
    step = eng.step

    def slow_step():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(eng, "step", slow_step)
    return eng


async def _long_request_started(runner: EngineRunner) -> Listener:
    """Submit a LONG request, start the runner, and wait until the request has emitted its first tokens."""
    listener = Listener(asyncio.get_running_loop())
    runner.submit(ServeRequest("long", prompts((6,))[0], LONG), listener)
    runner.start()
    assert isinstance(await asyncio.wait_for(listener.queue.get(), EVENT_TIMEOUT_S), Tokens)
    return listener


def test_runner_abort_frees_kv_and_call_runs_between_steps(model, monkeypatch):
    eng = _slowed(_spec_engine(model), monkeypatch)
    runner = EngineRunner(eng)

    async def main():
        await _long_request_started(runner)
        runner.abort("long")
        # call() runs after the abort command, on the engine thread
        state = await asyncio.wrap_future(runner.call(lambda: (len(eng.scheduler.running), all_free(eng))))
        with pytest.raises(ZeroDivisionError):
            await asyncio.wrap_future(runner.call(lambda: 1 / 0))
        return state

    try:
        state = asyncio.run(main())
    finally:
        runner.stop(0.0)
    assert state == (0, True)
    assert eng.counters.aborted_requests == 1 and eng.counters.generation_tokens < LONG // 2
    assert runner.in_flight() == 0


def test_runner_stop_cancels_in_flight_requests(model, monkeypatch):
    eng = _slowed(_spec_engine(model), monkeypatch)
    runner = EngineRunner(eng)

    async def main():
        listener = await _long_request_started(runner)
        await asyncio.get_running_loop().run_in_executor(None, runner.stop, 0.0)
        return await _events(listener)

    _, done = asyncio.run(main())
    assert done.error == SHUTDOWN_REASON
    assert not runner.alive and not runner.accepting
    assert all_free(eng) and not eng.has_work()
