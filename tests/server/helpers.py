"""Client-side helpers for the server tests: requests, Server-Sent Events, /metrics, waiting for an idle engine."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx
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


def wait_idle(server: Server, timeout_s: float = 10.0) -> bool:
    """Whether the engine is idle with all KV free within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if idle(server):
            return True
        time.sleep(0.02)
    return idle(server)
