"""A request that ends early frees its KV at once: a client that goes away (streaming or not), or a stop string.

Either way the engine aborts the request (``counters.aborted_requests`` + 1), its sequence leaves the
running batch and every KV block returns to the allocator, long before ``max_tokens`` would have run.
A stop string also ends the request's token ids with the token that completed it.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server import helpers
from tests.server.helpers import REPETITIVE, TIMEOUT_S, Server, completion, counters, wait_idle

pytestmark = pytest.mark.integration

LONG = 400  # max_tokens no test waits for
CHUNKS_READ = 3


def test_client_disconnect_mid_stream_frees_kv(server: Server):
    assert wait_idle(server)
    before = counters(server)
    body = completion(REPETITIVE, LONG, stream=True)
    with httpx.stream("POST", server.url + "/completions", json=body, timeout=TIMEOUT_S) as response:
        assert response.status_code == 200
        chunks = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks.append(json.loads(line.removeprefix("data: ")))
            if len(chunks) == CHUNKS_READ:
                break
        assert server.engine.scheduler.running, "the request should still be running when the client leaves"
        assert server.engine.allocator.num_free < server.engine.allocator.num_blocks
    # leaving the block closes the connection with the stream unfinished
    assert all(choice["finish_reason"] is None for chunk in chunks for choice in chunk["choices"])
    assert wait_idle(server, 10.0), "the disconnected request kept its sequence or KV blocks"
    after = counters(server)
    assert after.aborted_requests == before.aborted_requests + 1
    assert after.finished_requests == before.finished_requests, "an aborted request is no success"
    generated = after.generation_tokens - before.generation_tokens
    assert generated < LONG // 2, f"{generated} tokens generated: the request ran on after the disconnect"


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
    assert wait_idle(server, 10.0), "the stopped request kept its sequence or KV blocks"
    after = counters(server)
    assert after.aborted_requests == before.aborted_requests + 1
    assert after.generation_tokens - before.generation_tokens < LONG // 2


def test_client_disconnect_non_streaming_frees_kv(server: Server):
    """The handler awaits complete() and nothing listens for http.disconnect (vLLM wraps its handlers in
    with_cancellation), so the engine request keeps its sequence and KV until it has run LONG tokens."""
    assert wait_idle(server)
    before = counters(server)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/completions", json=completion(REPETITIVE, LONG), timeout=httpx.Timeout(1.0))
        assert wait_idle(server, 5.0), "the abandoned request kept its sequence or KV blocks"
        assert counters(server).aborted_requests == before.aborted_requests + 1
    finally:  # whatever happened, the next test starts from an idle engine
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
    assert wait_idle(server, 10.0)
