"""Greedy outputs through HTTP are the engine's own: the server adds no tokens, drops none, reorders none.

Eight requests go to the server at once (four non-streaming completions, one streamed batch of two
prompts, one chat completion streamed and not), so they share the running batch; the same prompts run
in-process on a second copy of the same arm (``setup.build`` + ``served_arm``), batched too. Every
output's token ids must equal the in-process ones; streamed ids and text must equal non-streamed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import httpx
import pytest

from spectoolkit.serving.api import ServeRequest
from tests.server.helpers import MODEL, REPETITIVE, TIMEOUT_S, Server, completion, sse_payloads, wait_idle

pytestmark = pytest.mark.integration

MAX_TOKENS = 8
PROMPTS = [
    REPETITIVE,
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "The cat sat on the mat. The cat sat on the",
    "Paris is the capital of",
]
MESSAGES = [{"role": "user", "content": "Count: one, two, three, one, two,"}]


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "return_token_ids": True, **extra}


async def _json(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def _stream(client: httpx.AsyncClient, path: str, body: dict) -> list[dict]:
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        return sse_payloads([line async for line in response.aiter_lines()])


async def _all_at_once(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as client:
        plain = [_json(client, "/completions", completion(p, MAX_TOKENS)) for p in PROMPTS]
        streamed = _stream(client, "/completions", completion(PROMPTS[:2], MAX_TOKENS,
                                                              stream_options={"include_usage": True}))  # fmt: skip
        chat = _json(client, "/chat/completions", _chat())
        chat_streamed = _stream(client, "/chat/completions", _chat())
        *plain_out, streamed_out, chat_out, chat_streamed_out = await asyncio.gather(
            *plain, streamed, chat, chat_streamed
        )
    return {"plain": plain_out, "streamed": streamed_out, "chat": chat_out, "chat_streamed": chat_streamed_out}


@pytest.fixture(scope="module")
def responses(server: Server) -> dict[str, Any]:
    return asyncio.run(_all_at_once(server.url))


def _chat_ids(tokenizer) -> list[int]:
    encoded = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)


@pytest.fixture(scope="module")
def in_process(run_config) -> tuple[Any, list[list[int]], list[list[int]]]:
    """(tokenizer, prompt ids, greedy output ids) of PROMPTS + the chat prompt, batched on a fresh arm."""
    from spectoolkit.serving.assemble import served_arm
    from spectoolkit.wiring.setup import build

    setup = build(run_config, arms=False)
    engine = served_arm(run_config, setup).engine
    tokenizer = setup.models.tokenizer
    prompt_ids = [list(tokenizer(p).input_ids) for p in PROMPTS] + [_chat_ids(tokenizer)]
    for i, ids in enumerate(prompt_ids):
        engine.submit(ServeRequest(str(i), list(ids), MAX_TOKENS))
    done = {}
    while engine.has_work():
        done.update({r.request_id: r for r in engine.step()})
    assert all(r.error is None for r in done.values()), [r.error for r in done.values()]
    assert max(max(r.batch_sizes) for r in done.values()) == len(prompt_ids), "the prompts never ran together"
    assert sum(r.accepted_tokens for r in done.values()) > 0, "no draft was ever accepted: not speculation"
    return tokenizer, prompt_ids, [done[str(i)].output_ids for i in range(len(prompt_ids))]


def _streamed_choices(chunks: list[dict], key: str) -> dict[int, dict[str, Any]]:
    """Per choice index: concatenated token ids and text, and the finish reasons seen in order."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            entry = out.setdefault(choice["index"], {"ids": [], "text": "", "reasons": []})
            entry["ids"] += choice.get("token_ids", [])
            entry["text"] += choice[key] if key == "text" else choice["delta"].get("content", "")
            if choice["finish_reason"] is not None:
                entry["reasons"].append(choice["finish_reason"])
    return out


def test_concurrent_completions_equal_in_process(responses, in_process):
    tokenizer, prompt_ids, references = in_process
    for i, body in enumerate(responses["plain"]):
        (choice,) = body["choices"]
        assert choice["prompt_token_ids"] == prompt_ids[i]
        assert choice["token_ids"] == references[i], f"prompt {i}: HTTP output differs from the engine's"
        assert choice["text"] == tokenizer.decode(references[i], skip_special_tokens=True)
        assert choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(prompt_ids[i]), "completion_tokens": MAX_TOKENS,
                                 "total_tokens": len(prompt_ids[i]) + MAX_TOKENS}  # fmt: skip


def test_streamed_batch_equals_non_streaming(responses, in_process):
    _, prompt_ids, references = in_process
    chunks = responses["streamed"]
    *deltas, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2 * MAX_TOKENS
    assert usage["usage"]["prompt_tokens"] == len(prompt_ids[0]) + len(prompt_ids[1])
    assert all(chunk["object"] == "text_completion" and chunk["model"] == MODEL for chunk in deltas)
    streamed = _streamed_choices(deltas, "text")
    assert sorted(streamed) == [0, 1]
    for index, entry in streamed.items():
        plain = responses["plain"][index]["choices"][0]
        assert entry["ids"] == references[index] == plain["token_ids"]
        assert entry["text"] == plain["text"]
        assert entry["reasons"] == ["length"], "one finish_reason per choice, on its last chunk"
    assert len(deltas) > 2, "one chunk per engine step expected, not one for the whole output"


def test_chat_streaming_equals_non_streaming(responses, in_process):
    tokenizer, prompt_ids, references = in_process
    (choice,) = responses["chat"]["choices"]
    assert choice["prompt_token_ids"] == prompt_ids[-1]
    assert choice["token_ids"] == references[-1]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == tokenizer.decode(references[-1], skip_special_tokens=True)
    chunks = responses["chat_streamed"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    (entry,) = _streamed_choices(chunks, "content").values()
    assert entry["ids"] == choice["token_ids"]
    assert entry["text"] == choice["message"]["content"]
    assert entry["reasons"] == [choice["finish_reason"]]


def test_server_idle_after_requests(responses, server):
    assert responses["plain"], "the requests ran"
    assert wait_idle(server), "requests left sequences or KV blocks behind"
