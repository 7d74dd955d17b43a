"""EndpointEngine against fake OpenAI servers (tests/backends/fake_servers.py): streams and faults (issue 17).

Every fault fails its request alone with a reason that names it, exactly once; requests beside it
succeed; nothing waits past the timeouts; ``reset()`` cancels what is in flight. No model is loaded
except the embedded tokenizer for the text-only server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from spectoolkit.backends.endpoint import EndpointEngine, LoopThread, Timeouts
from spectoolkit.bench.load.generator import LevelRun, run_closed
from spectoolkit.config import SamplingConfig
from spectoolkit.serving.api import FinishedRequest, ServeRequest
from tests.backends.fake_servers import (
    MODEL,
    MODES,
    STALL_S,
    TEXT_CHUNKS,
    TEXT_SPLIT_CHUNKS,
    ClosedPort,
    FakeOpenAIServer,
    expected_ids,
)

DEADLINE_S = 15.0  # no test here waits longer for its requests
# Timeouts far above what the fake needs wherever a timeout is not what is tested: a loaded machine must
# not turn an HTTP 500 into a ReadTimeout. SHORT_READ: the tests of a stalled stream (fake_servers.STALL_S).
FAST = Timeouts(connect_s=5.0, read_s=5.0, request_s=20.0)
SHORT_READ = Timeouts(connect_s=5.0, read_s=1.0, request_s=20.0)
MIXED = Timeouts(connect_s=5.0, read_s=2.0, request_s=20.0)  # a stall among good requests
MAX_NEW = 9  # 3 chunks of 3 tokens


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer():
    from spectoolkit.wiring.loading import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture
def make_engine(loop: LoopThread) -> Iterator[Callable[..., EndpointEngine]]:
    engines: list[EndpointEngine] = []

    def make(url: str, timeouts: Timeouts = FAST, tokenizer=None) -> EndpointEngine:
        engines.append(EndpointEngine("test", url, MODEL, SamplingConfig(), timeouts, loop, tokenizer))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def request(request_id: str, mode: str = "ok", last: int = 5) -> ServeRequest:
    """A request whose first prompt id picks ``mode`` on the fake's ``byprompt`` route."""
    return ServeRequest(request_id, [MODES.index(mode), 3, last], MAX_NEW)


def wait_idle(engine: EndpointEngine, deadline_s: float = 2.0) -> None:
    """``has_work()`` turns False once the last request's future is done, just after its result is queued."""
    deadline = time.monotonic() + deadline_s
    while engine.has_work() and time.monotonic() < deadline:
        assert engine.step() == [], "a request came back after every request had finished"
    assert not engine.has_work()


def collect(engine: EndpointEngine, count: int, deadline_s: float = DEADLINE_S) -> dict[str, FinishedRequest]:
    """Step until ``count`` requests finished and the engine is idle; each id must come back once."""
    finished: dict[str, FinishedRequest] = {}
    deadline = time.monotonic() + deadline_s
    while (len(finished) < count or engine.has_work()) and time.monotonic() < deadline:
        for done in engine.step():
            assert done.request_id not in finished, f"{done.request_id} finished twice"
            finished[done.request_id] = done
    assert len(finished) == count, f"{len(finished)}/{count} finished within {deadline_s} s: {sorted(finished)}"
    wait_idle(engine)
    return finished


def serve_one(engine: EndpointEngine, req: ServeRequest) -> FinishedRequest:
    engine.submit(req)
    return collect(engine, 1)[req.request_id]


def assert_succeeded(done: FinishedRequest, prompt: list[int]) -> None:
    assert done.error is None, done.error
    assert done.output_ids == expected_ids(prompt, MAX_NEW)
    assert len(done.token_times) == MAX_NEW


# ---- a normal stream --------------------------------------------------------------------------


def test_stream_gives_ids_and_one_time_per_chunk(fake, make_engine) -> None:
    engine = make_engine(fake.url("ok"))
    req = ServeRequest("a", [11, 12, 13], MAX_NEW, seed=7)
    done = serve_one(engine, req)
    assert_succeeded(done, req.prompt_ids)
    assert done.prompt_len == 3 and done.arrival == req.arrival
    times = done.token_times
    assert times == sorted(times) and done.arrival < times[0] <= times[-1] <= done.finish
    assert len(set(times)) == 3  # a chunk of 3 tokens is one delivery: one time each
    assert times[0] == times[2] < times[3] == times[5] < times[6] == times[8]
    body = fake.received[-1]
    assert body["prompt"] == [11, 12, 13] and body["max_tokens"] == MAX_NEW and body["seed"] == 7
    assert body["model"] == MODEL and body["stream"] is True and body["return_token_ids"] is True
    assert body["temperature"] == 0.0 and body["top_p"] == 1.0 and "top_k" not in body


# ---- faults, one at a time --------------------------------------------------------------------


@pytest.mark.parametrize("status", [500, 400])
def test_http_error_names_status_and_message(fake, make_engine, status: int) -> None:
    from tests.backends.fake_servers import ERROR_MESSAGES

    url = fake.url(f"http{status}")
    done = serve_one(make_engine(url), ServeRequest("a", [1, 2], MAX_NEW))
    assert done.error == f"HTTP {status} from {url}: {ERROR_MESSAGES[status]}"
    assert done.output_ids == [] and done.token_times == []


def test_stream_closed_before_finish(fake, make_engine) -> None:
    url = fake.url("cut")
    done = serve_one(make_engine(url), ServeRequest("a", [1, 2], MAX_NEW))
    assert done.error is not None and "ended before the request finished" in done.error
    assert url in done.error and "after 6 tokens" in done.error
    assert done.output_ids == expected_ids([1, 2], MAX_NEW)[:6]  # what came is kept, the request still failed


def test_chunked_stream_cut_midway(fake, make_engine) -> None:
    url = fake.url("cut_chunked")
    done = serve_one(make_engine(url), ServeRequest("a", [1, 2], MAX_NEW))
    assert done.error is not None and done.error.startswith(f"RemoteProtocolError from {url}")


def test_stall_longer_than_read_timeout(fake, make_engine) -> None:
    start = time.monotonic()
    done = serve_one(make_engine(fake.url("stall"), SHORT_READ), ServeRequest("a", [1, 2], MAX_NEW))
    assert time.monotonic() - start < STALL_S - 1  # the read timeout fired, not the server's end
    assert done.error is not None and "sent nothing for backend.read_timeout_s=" in done.error
    assert done.output_ids in ([], expected_ids([1, 2], MAX_NEW)[:1])  # the one chunk sent before the stall


def test_whole_request_timeout(fake, make_engine) -> None:
    timeouts = Timeouts(connect_s=5.0, read_s=5.0, request_s=0.5)  # chunks keep coming, the request is too long
    start = time.monotonic()
    done = serve_one(make_engine(fake.url("trickle"), timeouts), ServeRequest("a", [1, 2], MAX_NEW))
    assert time.monotonic() - start < 2.5
    assert done.error == "timed out after backend.request_timeout_s=0.5 s"
    assert len(done.output_ids) >= 1


def test_error_event_mid_stream(fake, make_engine) -> None:
    done = serve_one(make_engine(fake.url("error_chunk")), ServeRequest("a", [1, 2], MAX_NEW))
    assert done.error == "the server failed the request mid-stream: the fake engine stopped mid-stream"


def test_server_down_is_connection_refused(make_engine) -> None:
    with ClosedPort() as url:
        start = time.monotonic()
        done = serve_one(make_engine(url), ServeRequest("a", [1, 2], MAX_NEW))
    assert time.monotonic() - start < FAST.connect_s  # refused at once, not a connect timeout
    assert done.error is not None and done.error.startswith(f"connection refused by {url}")


def test_server_down_error_says_refused(make_engine) -> None:
    with ClosedPort() as url:
        done = serve_one(make_engine(url), ServeRequest("a", [1, 2], MAX_NEW))
    assert "refused" in done.error.lower()


def test_a_connection_dropped_before_any_response_gets_the_request_once_more(fake, make_engine) -> None:
    prompt = [7, 3, 5]
    done = serve_one(make_engine(fake.url("drop_once")), ServeRequest("a", prompt, MAX_NEW))
    assert_succeeded(done, prompt)
    assert [body["prompt"] for body in fake.received].count(prompt) == 2


def test_a_server_that_keeps_dropping_fails_the_request(fake, make_engine) -> None:
    done = serve_one(make_engine(fake.url("drop")), ServeRequest("a", [1, 2], MAX_NEW))
    assert done.error is not None and done.error.startswith("RemoteProtocolError"), done.error


# ---- a server that streams text only ----------------------------------------------------------


def test_text_only_stream_is_retokenized(fake, make_engine, tokenizer) -> None:
    engine = make_engine(fake.url("text"), tokenizer=tokenizer)
    assert not engine.ids_from_text
    done = serve_one(engine, ServeRequest("a", [1, 2], MAX_NEW))
    assert done.error is None, done.error
    assert done.output_ids == tokenizer("".join(TEXT_CHUNKS), add_special_tokens=False).input_ids
    assert len(done.token_times) == len(done.output_ids) and len(set(done.token_times)) == len(TEXT_CHUNKS)
    assert engine.ids_from_text


def test_text_only_stream_without_tokenizer_fails_alone(fake, make_engine) -> None:
    done = serve_one(make_engine(fake.url("text")), ServeRequest("a", [1, 2], MAX_NEW))
    assert done.error is not None and "no token_ids and no tokenizer" in done.error


def test_text_chunks_split_mid_word_count_every_token(fake, make_engine, tokenizer) -> None:
    engine = make_engine(fake.url("text_split"), tokenizer=tokenizer)
    done = serve_one(engine, ServeRequest("a", [1, 2], MAX_NEW))
    assert done.error is None, done.error
    assert done.output_ids == tokenizer("".join(TEXT_SPLIT_CHUNKS), add_special_tokens=False).input_ids


# ---- faults beside good requests --------------------------------------------------------------


def test_faults_fail_alone_among_concurrent_requests(fake, make_engine) -> None:
    engine = make_engine(fake.url("byprompt"), MIXED)
    faults = ("http500", "http400", "cut", "cut_chunked", "stall", "error_chunk")
    reqs = [request(f"ok{i}", "ok", last=i) for i in range(4)] + [request(mode, mode) for mode in faults]
    for req in reqs:
        engine.submit(req)
    finished = collect(engine, len(reqs))
    for i in range(4):
        assert_succeeded(finished[f"ok{i}"], reqs[i].prompt_ids)
    for mode in faults:
        assert finished[mode].error, f"{mode} did not fail"
    assert "HTTP 500" in finished["http500"].error and "HTTP 400" in finished["http400"].error
    assert "ended before the request finished" in finished["cut"].error
    assert "backend.read_timeout_s=" in finished["stall"].error


def test_good_engine_is_not_held_up_by_a_stalled_one(fake, make_engine) -> None:
    stalled = make_engine(fake.url("stall"), Timeouts(connect_s=5.0, read_s=3.0, request_s=20.0))
    good = make_engine(fake.url("ok"))
    stalled.submit(ServeRequest("slow", [1, 2], MAX_NEW))
    reqs = [ServeRequest(f"ok{i}", [1, i], MAX_NEW) for i in range(3)]
    for req in reqs:
        good.submit(req)
    finished = collect(good, 3)
    assert stalled.has_work()  # still waiting on its read timeout while the good server answered
    for req in reqs:
        assert_succeeded(finished[req.request_id], req.prompt_ids)
    slow = collect(stalled, 1)["slow"]
    assert "backend.read_timeout_s=" in slow.error
    assert slow.finish > max(done.finish for done in finished.values())


# ---- reset ------------------------------------------------------------------------------------


def test_reset_cancels_requests_in_flight(fake, make_engine) -> None:
    engine = make_engine(fake.url("byprompt"), Timeouts(connect_s=5.0, read_s=30.0, request_s=60.0))
    before = len(fake.received)
    for i in range(3):
        engine.submit(request(f"stall{i}", "stall"))
    deadline = time.monotonic() + DEADLINE_S
    while len(fake.received) < before + 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(fake.received) == before + 3 and engine.has_work()
    start = time.monotonic()
    engine.reset()
    assert time.monotonic() - start < 2.0
    assert not engine.has_work()
    time.sleep(0.3)  # a cancelled request must not come back later
    assert engine.step() == [] and not engine.has_work()
    again = request("after-reset", "ok", last=4)
    assert_succeeded(serve_one(engine, again), again.prompt_ids)  # the engine serves on after a reset


# ---- the load generator over a server that fails some requests --------------------------------


def _bounded(fn: Callable[[], LevelRun], timeout_s: float) -> LevelRun:
    """``fn()`` on a daemon thread; fails the test instead of hanging when it does not return."""
    result: list[LevelRun] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001  re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"run_closed did not return within {timeout_s} s"
    if errors:
        raise errors[0]
    return result[0]


def test_closed_loop_over_failing_server_finishes_every_request(fake, make_engine) -> None:
    engine = make_engine(fake.url("byprompt"), MIXED)
    modes = ["ok", "http500", "ok", "cut", "ok", "stall", "ok", "http400", "ok", "ok"]
    reqs = [request(f"{i}:{mode}", mode, last=i) for i, mode in enumerate(modes)]
    run = _bounded(lambda: run_closed(engine, reqs, 2), DEADLINE_S)
    by_id = {done.request_id: done for done in run.finished}
    assert len(run.finished) == len(reqs) and set(by_id) == {req.request_id for req in reqs}
    for req, mode in zip(reqs, modes, strict=True):
        if mode == "ok":
            assert_succeeded(by_id[req.request_id], req.prompt_ids)
        else:
            assert by_id[req.request_id].error, f"{req.request_id} did not fail"
    wait_idle(engine)
    assert run.end > run.start and 0 < run.mean_in_flight <= 2
