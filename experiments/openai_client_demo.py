"""Issue 56's must-show items, with the official ``openai`` client against a running server.

Start the server first (the embedded model, n-gram drafts, greedy default), then run one of the three parts:

    python -m spectoolkit.serve +draft=ngram                       # http://127.0.0.1:8000/v1
    python experiments/openai_client_demo.py walkthrough          # every parameter, a bad value's 400
    python experiments/openai_client_demo.py mixed                 # 64 mixed requests at concurrency 8
    python experiments/openai_client_demo.py ttft                  # a repeated ~1,000-token prompt, TTFT

- **walkthrough**: chat and completions, streamed and not, with temperature, top_p, top_k, min_p, seed, stop,
  penalties, logprobs/top_logprobs, n, best_of and per-request speculation (``extra_body``); prints each answer,
  then sends bad values and prints OpenAI's 400 with the parameter it names.
- **mixed**: ``--requests`` completions (half greedy, a quarter T=0.7, a quarter T=1.2, seeded by index) from
  ``--concurrency`` threads, speculation on. Checks: every request succeeds; each greedy output equals the target
  alone (the same prompt with ``speculate: false``, one request at a time); each sampled output equals its own
  seeded replay sent alone; afterwards ``vllm:kv_cache_usage_perc`` and the running/waiting gauges are 0.
- **ttft**: a prompt of ``--tokens`` tokens starting with a fresh nonce (nothing cached yet) streamed twice; prints
  the TTFT of each, their ratio (issue 56 asks <= 0.2) and whether the outputs are the same, and the
  ``vllm:prefix_cache_hits`` it took. Prefix caching needs a row-exact runner (``runtime.kernels=auto``, the
  default, or ``serve.batch_invariant=true``).

Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

PROMPTS = ["1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
           "The capital of France is", "Write a haiku about the sea."]  # fmt: skip


def _client(url: str) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=url, api_key="unused", timeout=600, max_retries=0)
    return client, client.models.list().data[0].id


def _ids(choice: Any) -> list[int]:
    return list(choice.model_extra["token_ids"])


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=60).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples if not
            s.labels.keys() - {"model_name"}}  # fmt: skip


def walkthrough(url: str) -> bool:
    client, model = _client(url)
    messages = [{"role": "user", "content": "Name three colours."}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0.7, top_p=0.9, seed=3, n=2, stop=["\n\n"],
        presence_penalty=0.5, frequency_penalty=0.3, logprobs=True, top_logprobs=2,
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "num_speculative_tokens": 2},
    )  # fmt: skip
    for choice in chat.choices:
        top = choice.logprobs.content[0].top_logprobs
        print(f"chat n={choice.index}: {choice.message.content!r} (first token's top: {[t.token for t in top]})")
    done = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=12, temperature=0.8, seed=3, n=2,
                                     best_of=3, logprobs=1)  # fmt: skip
    for choice in done.choices:
        print(
            f"completion best {choice.index}: {choice.text!r} (sum logprob {sum(choice.logprobs.token_logprobs):.2f})"
        )
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0, stream=True) if c.choices)  # fmt: skip
    print(f"chat streamed, greedy: {text!r}")
    off = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, extra_body={"speculate": False})
    print(f"completion, speculation off: {off.choices[0].text!r}")
    ok = all(c.message.content for c in chat.choices) and all(c.text for c in done.choices) and bool(text)
    for bad in ({"temperature": -1}, {"top_p": 2}, {"n": 0}, {"extra_body": {"min_p": 3}}, {"presence_penalty": 9}):
        try:
            client.completions.create(model=model, prompt="a", max_tokens=2, **bad)
            print(f"{bad}: accepted (a check failed)")
            ok = False
        except openai.BadRequestError as exc:
            print(f"{bad}: {exc.status_code}, param={exc.param!r}: {exc.message}")
            ok &= exc.param is not None
    return ok


def _send(client: openai.OpenAI, model: str, index: int, speculate: bool = True) -> list[int]:
    fields = {"temperature": 0.0} if index % 2 == 0 else {"temperature": 0.7 if index % 4 == 1 else 1.2}
    response = client.completions.create(model=model, prompt=PROMPTS[index % len(PROMPTS)], max_tokens=32,
                                         seed=index, extra_body={"return_token_ids": True, "speculate": speculate},
                                         **fields)  # fmt: skip
    return _ids(response.choices[0])


def mixed(url: str, requests: int, concurrency: int) -> bool:
    client, model = _client(url)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        together = dict(zip(range(requests), pool.map(lambda i: _send(client, model, i), range(requests)), strict=True))
    wall = time.perf_counter() - start
    gauges = _metrics(url)
    alone = {i: _send(client, model, i, speculate=False) for i in range(2 * len(PROMPTS)) if i % 2 == 0}
    greedy_ok = all(ids == alone[i % (2 * len(PROMPTS))] for i, ids in together.items() if i % 2 == 0)
    replays = {i: _send(client, model, i) for i in together if i % 2 == 1}
    sampled_ok = all(together[i] == ids for i, ids in replays.items())
    idle = all(gauges.get(name, 0) == 0 for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                                                     "vllm:num_requests_waiting"))  # fmt: skip
    drafted = gauges.get("vllm:spec_decode_num_draft_tokens_total", 0)
    print(
        f"{requests} requests at concurrency {concurrency} in {wall:.1f} s; all returned: {len(together) == requests}"
    )
    print(f"greedy == target alone (speculate=false, one at a time): {greedy_ok}")
    print(f"sampled == their own seeded replay alone: {sampled_ok}")
    print(f"KV and queues back to 0: {idle}; draft tokens so far: {drafted:.0f}")
    return len(together) == requests and greedy_ok and sampled_ok and idle and drafted > 0


def _ttft(client: openai.OpenAI, model: str, prompt: str) -> tuple[float, list[int], int]:
    """(TTFT in seconds, output ids, prompt tokens) of one streamed greedy completion."""
    start, first, ids, prompt_len = time.perf_counter(), None, [], 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"return_token_ids": True}):  # fmt: skip
        prompt_len = chunk.usage.prompt_tokens if chunk.usage else prompt_len
        for choice in chunk.choices:
            new = choice.model_extra.get("token_ids") or []
            if new and first is None:
                first = time.perf_counter() - start
            ids += new
    return first or float("nan"), ids, prompt_len


def ttft(url: str, tokens: int) -> bool:
    client, model = _client(url)
    client.completions.create(model=model, prompt="warm up", max_tokens=2)  # the first forward's one-off costs
    words = " ".join(f"item {i} is {i * 7 % 13}," for i in range(tokens // 4))
    ids = client.completions.create(model=model, prompt=words, max_tokens=1, extra_body={"return_token_ids": True})
    prompt_len = ids.usage.prompt_tokens
    prompt = f"[{uuid.uuid4().hex}] " + words[: int(len(words) * tokens / max(prompt_len, 1))]
    before = _metrics(url)
    first, first_ids, prompt_len = _ttft(client, model, prompt)
    again, again_ids, _ = _ttft(client, model, prompt)
    after = _metrics(url)
    hits = after.get("vllm:prefix_cache_hits_total", 0) - before.get("vllm:prefix_cache_hits_total", 0)
    ratio = again / first
    print(
        f"prompt {prompt_len} tokens: TTFT first {first * 1000:.0f} ms, cached {again * 1000:.0f} ms, ratio {ratio:.3f}"
    )
    print(f"prefix cache hits: {hits:.0f} tokens; same output: {first_ids == again_ids}")
    return ratio <= 0.2 and first_ids == again_ids and hits > 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("walkthrough", "mixed", "ttft"))
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1000)
    args = parser.parse_args(argv)
    if args.part == "walkthrough":
        ok = walkthrough(args.url)
    elif args.part == "mixed":
        ok = mixed(args.url, args.requests, args.concurrency)
    else:
        ok = ttft(args.url, args.tokens)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
