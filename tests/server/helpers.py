"""Client-side helpers for the server tests: requests, Server-Sent Events, /metrics, waiting for an idle engine,
and pinning the engine thread between two steps (so a test decides when a client leaves, not the CPU's speed)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m"
TIMEOUT_S = 300.0  # generous: the CPU may be shared with other jobs
REPETITIVE = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"  # n-gram lookup finds drafts at once


@dataclass
class Server:
    built: Any  # spectoolkit.server.build.BuiltServer
    url: str  # http://127.0.0.1:PORT/v1

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    @property
    def engine(self):
        return self.built.arm.engine


def post(server: Server, path: str, body: Any) -> httpx.Response:
    """``body`` as JSON to ``/v1{path}``."""
    return httpx.post(server.url + path, json=body, timeout=TIMEOUT_S)


def completion(prompt: str | list, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True, **extra}


def sse_payloads(lines: list[str]) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE body's ``data:`` lines; asserts it ends with ``data: [DONE]``."""
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", f"the stream did not end with [DONE]: {data[-3:]}"
    assert all(line.startswith("data: ") or not line.strip() for line in lines), lines
    return [json.loads(payload) for payload in data[:-1]]


def stream_lines(server: Server, path: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=TIMEOUT_S) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(response.iter_lines())


def scrape(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: (sample name, sorted labels) -> value."""
    response = httpx.get(server.root + "/metrics", timeout=TIMEOUT_S)
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def sample(samples: dict, name: str, default: float | None = None, **labels: str) -> float:
    """One sample's value; ``default`` when it is absent (a labelled histogram before its first observation)."""
    key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
    assert key in samples or default is not None, f"/metrics has no {name}{labels}"
    return samples.get(key, default)


def counters(server: Server):
    """A copy of the engine's counters now."""
    return dataclasses.replace(server.engine.counters, accepted_per_position=list(
        server.engine.counters.accepted_per_position))  # fmt: skip


def idle(server: Server) -> bool:
    engine = server.engine
    return (not engine.scheduler.running and not engine.scheduler.queue and server.built.runner.in_flight() == 0
            and engine.allocator.num_free == engine.allocator.num_blocks)  # fmt: skip


def wait_for(condition: Callable[[], Any], timeout_s: float) -> bool:
    """Whether ``condition()`` holds within ``timeout_s`` (checked every 20 ms)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def wait_idle(server: Server, timeout_s: float = 10.0) -> bool:
    """Whether the engine is idle with all KV free within ``timeout_s``."""
    return wait_for(lambda: idle(server), timeout_s)


def engine_caught_up(server: Server) -> None:
    """Return once every command sent to the engine thread so far (an abort, say) has run. Commands run in the
    order sent, between two steps, so this waits out the step in flight, however slow the CPU makes it."""
    server.built.runner.call(lambda: None).result(timeout=TIMEOUT_S)


@contextmanager
def engine_parked(server: Server) -> Iterator[None]:
    """The engine thread held between two steps for the block: no step runs, and commands sent meanwhile (an
    abort) run in order, before its next step, once the block ends."""
    held, release = threading.Event(), threading.Event()

    def park() -> None:
        held.set()
        release.wait(TIMEOUT_S)

    server.built.runner.call(park)
    try:
        assert held.wait(TIMEOUT_S), "the engine thread never reached the end of its step"
        yield
    finally:
        release.set()


def watch_aborts(server: Server, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An event set once the server has asked the engine runner to abort a request (e.g. its client left)."""
    runner, asked = server.built.runner, threading.Event()
    abort = runner.abort

    def recorded(request_id: str) -> None:
        abort(request_id)
        asked.set()

    monkeypatch.setattr(runner, "abort", recorded)
    return asked
