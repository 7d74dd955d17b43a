"""A request that ends early frees its KV at once: a client that goes away (streaming or not), or a stop string.

Either way the engine aborts the request (``counters.aborted_requests`` + 1), its sequence leaves the
running batch and every KV block returns to the allocator, long before ``max_tokens`` would have run.
A stop string also ends the request's token ids with the token that completed it.

The engine takes commands (an abort) only between two steps, and a step on a shared CPU may take seconds,
so no test bounds in seconds how soon KV is freed. A client leaves while the engine is parked between two
steps (:func:`~tests.server.helpers.engine_parked`): the abort must then land before the next step, and
:func:`~tests.server.helpers.engine_caught_up` waits for it without a deadline on the CPU's speed.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse

import httpx
import pytest

from tests.server import helpers
from tests.server.helpers import REPETITIVE, TIMEOUT_S, Server, completion, counters, wait_idle

pytestmark = pytest.mark.integration

LONG = 400  # max_tokens no test waits for
CHUNKS_READ = 3
NOTICE_S = 5.0  # for the server to notice a closed connection (app.DISCONNECT_POLL_S; the engine is parked)


def _leave(server: Server, aborts, close) -> int:
    """With the engine parked between two steps (the request running, holding KV): ``close()`` the client's
    connection and wait for the server's abort. Returns the tokens generated until then."""
    with helpers.engine_parked(server):
        assert server.engine.scheduler.running, "the request should still be running when the client leaves"
        assert server.engine.allocator.num_free < server.engine.allocator.num_blocks
        generated = counters(server).generation_tokens
        close()
        assert aborts.wait(NOTICE_S), "the server did not abort the request of a client that left"
    return generated


def _assert_aborted_at_once(server: Server, before, generated: int, what: str) -> None:
    """The abort ran before the engine's next step: idle, KV free, one abort, no success, no token after."""
    helpers.engine_caught_up(server)
    assert helpers.idle(server), f"the {what} request kept its sequence or KV blocks"
    after = counters(server)
    assert after.aborted_requests == before.aborted_requests + 1
    assert after.finished_requests == before.finished_requests, "an aborted request is no success"
    assert after.generation_tokens == generated, "a step ran for the request after its client left"


def test_client_disconnect_mid_stream_frees_kv(server: Server, monkeypatch: pytest.MonkeyPatch):
    assert wait_idle(server)
    before = counters(server)
    aborts = helpers.watch_aborts(server, monkeypatch)
    body = completion(REPETITIVE, LONG, stream=True)
    with httpx.stream("POST", server.url + "/completions", json=body, timeout=TIMEOUT_S) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept: dropping a half-read iterator closes the connection (httpcore)
        chunks = []
        while len(chunks) < CHUNKS_READ:
            line = next(lines)
            if line.startswith("data: "):
                chunks.append(json.loads(line.removeprefix("data: ")))
        generated = _leave(server, aborts, response.close)  # the connection closes with the stream unfinished
    assert all(choice["finish_reason"] is None for chunk in chunks for choice in chunk["choices"])
    _assert_aborted_at_once(server, before, generated, "disconnected")
    assert generated - before.generation_tokens < LONG // 2


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_stop_string_ends_request_and_frees_kv(server: Server, stream: bool):
    """The repetitive prompt continues " 3, 1, 2, 3, 1, …": the stop "2, 3" (several tokens) comes soon."""
    assert wait_idle(server)
    before = counters(server)
    body = completion(REPETITIVE, LONG, stop=["2, 3", "never appears"])
    if stream:
        chunks = [c["choices"][0] for c in helpers.sse_payloads(helpers.stream_lines(server, "/completions", body))]
        text, reasons = "".join(c["text"] for c in chunks), [c["finish_reason"] for c in chunks]
        assert reasons[-1] == "stop" and set(reasons[:-1]) <= {None}
    else:
        response = helpers.post(server, "/completions", body)
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        text = choice["text"]
        assert choice["finish_reason"] == "stop"
    assert text == " 3, 1, ", text
    helpers.engine_caught_up(server)  # the server sent the abort before the stop reached the client
    assert helpers.idle(server), "the stopped request kept its sequence or KV blocks"
    after = counters(server)
    assert after.aborted_requests == before.aborted_requests + 1
    assert after.generation_tokens - before.generation_tokens < LONG // 2


def test_client_disconnect_non_streaming_frees_kv(server: Server, monkeypatch: pytest.MonkeyPatch):
    """The client sends its request, then closes the connection unanswered while the engine runs the request:
    the handler hears the disconnect (app._unless_disconnected) and the request is aborted before its next step."""
    assert wait_idle(server)
    before = counters(server)
    aborts = helpers.watch_aborts(server, monkeypatch)
    address = urllib.parse.urlsplit(server.root)
    client = http.client.HTTPConnection(address.hostname, address.port, timeout=TIMEOUT_S)
    try:
        body = json.dumps(completion(REPETITIVE, LONG))
        client.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        assert helpers.wait_for(lambda: server.engine.scheduler.running, TIMEOUT_S), "the request never ran"
        generated = _leave(server, aborts, client.close)  # the client leaves without reading a response
        _assert_aborted_at_once(server, before, generated, "abandoned")
    finally:  # whatever happened, the next test starts from an idle engine
        client.close()
        for seq in [*server.engine.scheduler.running, *server.engine.scheduler.queue]:
            server.built.runner.abort(seq.request.request_id)
        assert wait_idle(server, 30.0)


def test_stop_string_token_ids_end_at_the_stop(server: Server):
    """A speculative step emits up to γ + 1 tokens; when a stop string completes inside them, the text is
    cut but ``token_ids`` (and ``usage.completion_tokens``) keep the whole step (generation.py yields
    ``Delta(event.ids, ...)``). vLLM drops the tokens after the one completing the stop string."""
    stop = "3, 1, 2"
    response = helpers.post(server, "/completions", completion(REPETITIVE, LONG, stop=[stop]))
    assert response.status_code == 200, response.text
    body = response.json()
    (choice,) = body["choices"]
    tokenizer = server.built.served.tokenizer
    ids = choice["token_ids"]
    assert choice["finish_reason"] == "stop" and choice["text"] == " "
    assert stop not in tokenizer.decode(ids[:-1]), "tokens after the stop string's last token were kept"
    assert stop in tokenizer.decode(ids)
    assert body["usage"]["completion_tokens"] == len(ids)
    helpers.engine_caught_up(server)  # the server sent the abort before the stop reached the client
    assert helpers.idle(server)
