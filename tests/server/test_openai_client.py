"""The official ``openai`` client against our server (issue 56): per-request sampling with speculation on.

Completions and chat, streamed and not, with every sampling parameter a client sends (vLLM's extensions and our
per-request speculation through ``extra_body``); a bad value is OpenAI's 400 naming the parameter. Concurrent mixed
requests, on the row-exact server (``exact_server``): the greedy ones equal the target alone (the same server, one at
a time, speculation off), each sampled one equals its own seeded replay sent alone. ``n=2`` shares the prompt's KV
and choice c equals the n=1 request seeded ``seed + c``; a client that leaves mid-stream frees every sample's KV
(the prefix cache across requests: ``test_prefix_cache_server.py``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.server.helpers import MODEL, REPETITIVE, TIMEOUT_S, Server, counters, sample, scrape, wait_idle

pytestmark = pytest.mark.integration

MAX_TOKENS = 8
MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPTS = [REPETITIVE, "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "The capital of France is"]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", timeout=TIMEOUT_S, max_retries=0)


def _ids(choice: Any) -> list[int]:
    return list(choice.model_extra["token_ids"])


def test_chat_with_every_sampling_parameter(client: openai.OpenAI, server: Server):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.7, top_p=0.9, seed=3, n=2, stop=["\n\n"],
        presence_penalty=0.5, frequency_penalty=0.3, logprobs=True, top_logprobs=3,
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "num_speculative_tokens": 2,
                    "return_token_ids": True},
    )  # fmt: skip
    assert len(response.choices) == 2 and response.usage.completion_tokens > 0
    for choice in response.choices:
        assert choice.message.content and choice.finish_reason in ("stop", "length")
        entries = choice.logprobs.content
        assert len(entries) == len(_ids(choice)) and all(len(e.top_logprobs) == 3 for e in entries)
        assert all(e.logprob <= 0 and e.top_logprobs[0].logprob >= e.logprob - 1e-4 for e in entries)
    assert wait_idle(server)


def test_completion_with_seed_best_of_and_logprobs(client: openai.OpenAI, server: Server):
    request = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0.8, seed=3, n=2, best_of=3,
                   logprobs=2, extra_body={"return_token_ids": True})  # fmt: skip
    response = client.completions.create(**request)
    assert [c.index for c in response.choices] == [0, 1]
    totals = [sum(c.logprobs.token_logprobs) for c in response.choices]
    assert totals[0] >= totals[1], "best_of returns the samples of highest cumulative logprob first"
    for choice in response.choices:
        assert choice.text and len(choice.logprobs.tokens) == len(_ids(choice))
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    again = client.completions.create(**request)
    assert [_ids(c) for c in again.choices] == [_ids(c) for c in response.choices], "a seed replays"
    assert wait_idle(server)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streams_equal_their_non_streamed_replay(client: openai.OpenAI, kind: str):
    common = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.9, "seed": 11, "n": 2,
              "extra_body": {"return_token_ids": True, "top_k": 50}}  # fmt: skip
    if kind == "chat":
        create, common = client.chat.completions.create, {**common, "messages": MESSAGES}
    else:
        create, common = client.completions.create, {**common, "prompt": PROMPTS[1]}
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for chunk in create(stream=True, **common):
        for choice in chunk.choices:
            streamed[choice.index] += choice.model_extra.get("token_ids") or []
    plain = create(**common)
    assert streamed == {c.index: _ids(c) for c in plain.choices}


def test_n_samples_are_their_own_seeded_requests(client: openai.OpenAI, server: Server):
    """Choice c of n=2 is the n=1 request seeded seed + c: the samples share the prompt's KV, not their draws."""
    prompt = PROMPTS[1] * 4  # several full blocks for the second sample to share
    hits = sample(scrape(server), "vllm:prefix_cache_hits_total")
    both = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=1.0, seed=5, n=2,
                                     extra_body={"return_token_ids": True})  # fmt: skip
    assert sample(scrape(server), "vllm:prefix_cache_hits_total") > hits
    for c in (0, 1):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=1.0,
                                          seed=5 + c, extra_body={"return_token_ids": True})  # fmt: skip
        assert _ids(alone.choices[0]) == _ids(both.choices[c])


@pytest.mark.parametrize(
    ("create", "extra", "param"),
    [
        ("completions", {"temperature": -1}, "temperature"),
        ("completions", {"top_p": 1.5}, "top_p"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"n": 0}, "n"),
        ("completions", {"extra_body": {"min_p": 2}}, "min_p"),
        ("chat", {"presence_penalty": 3}, "presence_penalty"),
        ("chat", {"frequency_penalty": -3}, "frequency_penalty"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"extra_body": {"repetition_penalty": -1}}, "repetition_penalty"),
        ("chat", {"extra_body": {"num_speculative_tokens": -2}}, "num_speculative_tokens"),
    ],
)
def test_a_bad_value_is_openais_400_naming_the_parameter(client: openai.OpenAI, create, extra, param):
    with pytest.raises(openai.BadRequestError) as raised:
        if create == "chat":
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **extra)
        else:
            client.completions.create(model=MODEL, prompt="a", max_tokens=2, **extra)
    assert raised.value.status_code == 400 and raised.value.param == param
    assert param in raised.value.message


def _mixed(client: openai.OpenAI, count: int, concurrency: int, speculate: bool = True) -> dict[str, list[int]]:
    """``count`` completions, every other one greedy (the rest T=0.7 / T=1.2 seeded by their index), sent by
    ``concurrency`` threads; request key -> output ids."""

    def one(index: int) -> tuple[str, list[int]]:
        fields = {"temperature": 0.0} if index % 2 == 0 else {"temperature": 0.7 if index % 4 == 1 else 1.2}
        response = client.completions.create(
            model=MODEL, prompt=PROMPTS[index % len(PROMPTS)], max_tokens=MAX_TOKENS, seed=index, **fields,
            extra_body={"return_token_ids": True, "speculate": speculate},
        )  # fmt: skip
        return str(index), _ids(response.choices[0])

    with ThreadPoolExecutor(concurrency) as pool:
        return dict(pool.map(one, range(count)))


@pytest.mark.parametrize(
    ("count", "concurrency"), [(16, 8), pytest.param(64, 8, marks=pytest.mark.slow)], ids=["16-at-c8", "64-at-c8"]
)
def test_concurrent_mixed_requests(exact_server: Server, count: int, concurrency: int):
    """Greedy ones equal the target alone (speculation off, one at a time), sampled ones their replay alone: on
    the row-exact server, where a request's numerics cannot depend on its company (on a runner whose rows do, a
    sampled request's draw may cross a CDF boundary, as a greedy one may flip a near-tie)."""
    server = exact_server
    client = openai.OpenAI(base_url=server.url, api_key="unused", timeout=TIMEOUT_S, max_retries=0)
    before = counters(server)
    together = _mixed(client, count, concurrency)
    assert wait_idle(server), "KV not back to 0"
    after = counters(server)
    assert (
        after.finished_requests - before.finished_requests == count and after.failed_requests == before.failed_requests
    )
    assert after.draft_tokens > before.draft_tokens, "speculation never ran"
    target_alone = _mixed(client, len(PROMPTS) * 2, 1, speculate=False)  # greedy keys 0, 2, 4 cover every prompt
    greedy_reference = {int(k) % len(PROMPTS): ids for k, ids in target_alone.items() if int(k) % 2 == 0}
    for key, ids in together.items():
        index = int(key)
        if index % 2 == 0:
            assert ids == greedy_reference[index % len(PROMPTS)], f"greedy request {index} differs from the target"
    replay = _mixed_one_at_a_time(client, [int(k) for k in together if int(k) % 2 == 1])
    assert {k: together[k] for k in replay} == replay, "a sampled request differs from its own seeded replay"
    assert wait_idle(server)


def _mixed_one_at_a_time(client: openai.OpenAI, indices: list[int]) -> dict[str, list[int]]:
    out = {}
    for index in indices:
        fields = {"temperature": 0.7 if index % 4 == 1 else 1.2}
        response = client.completions.create(model=MODEL, prompt=PROMPTS[index % len(PROMPTS)], max_tokens=MAX_TOKENS,
                                             seed=index, extra_body={"return_token_ids": True}, **fields)  # fmt: skip
        out[str(index)] = _ids(response.choices[0])
    return out


def test_disconnect_mid_stream_frees_every_samples_kv(client: openai.OpenAI, server: Server):
    assert wait_idle(server)
    before = counters(server)
    stream = client.completions.create(model=MODEL, prompt=REPETITIVE, max_tokens=200, temperature=0.8, n=2,
                                       stream=True)  # fmt: skip
    received = 0
    for chunk in stream:
        received += len(chunk.choices)
        if received >= 3:
            break
    stream.close()
    assert wait_idle(server, 60.0), "the requests of a client that left kept their KV"
    after = counters(server)
    assert after.aborted_requests == before.aborted_requests + 2
    assert after.generation_tokens - before.generation_tokens < 2 * 200


def test_metrics_say_what_each_request_got(client: openai.OpenAI, server: Server):
    def requests(speculation: str) -> float:
        return sample(scrape(server), "spectoolkit:requests_total", 0.0, sampling="sampled", speculation=speculation)

    before = {kind: requests(kind) for kind in ("off", "capped")}
    client.completions.create(model=MODEL, prompt="a", max_tokens=2, temperature=0.5, extra_body={"speculate": False})
    client.completions.create(model=MODEL, prompt="a", max_tokens=2, temperature=0.5,
                              extra_body={"num_speculative_tokens": 1})  # fmt: skip
    assert wait_idle(server)
    assert {kind: requests(kind) - before[kind] for kind in before} == {"off": 1, "capped": 1}
