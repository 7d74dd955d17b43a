"""Automatic prefix caching across requests on a served model (issue 56): a finished request's full blocks stay
cached, a repeated prompt starts after them and emits the same tokens as with the cache off, and ``/metrics``
counts it as vLLM does (``vllm:prefix_cache_queries``/``hits``, in tokens).

The server runs our CPU kernels (``runtime.kernels=auto``, the package's ``exact_server``): every row is computed by
itself, so a cached prefix has the bits a recompute would, which is where the engine keeps a cache at all (a runner
whose rows depend on the batch gets none). Its twin with ``serve.prefix_caching=false`` gives the reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest

from spectoolkit.config import run_config_from_dict
from tests.server.conftest import CONFIG
from tests.server.helpers import MODEL, TIMEOUT_S, Server, sample, scrape, wait_idle

pytestmark = pytest.mark.integration
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n" * 8


@contextmanager
def _server_without_cache() -> Iterator[Server]:
    from spectoolkit.server.build import BackgroundServer, build_server

    serve = {**CONFIG["serve"], "prefix_caching": False}
    built = build_server(run_config_from_dict({**CONFIG, "runtime": {"kernels": "auto"}, "serve": serve}))
    with BackgroundServer(built) as background:
        yield Server(built, background.base_url)


@pytest.fixture
def cached(exact_server: Server) -> Server:
    return exact_server  # prefix caching on (the default), on a row-exact runner


def _ids(server: Server, prompt: str, temperature: float = 0.0) -> tuple[list[int], int]:
    client = openai.OpenAI(base_url=server.url, api_key="unused", timeout=TIMEOUT_S, max_retries=0)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=temperature, seed=1,
                                         extra_body={"return_token_ids": True})  # fmt: skip
    return list(response.choices[0].model_extra["token_ids"]), response.usage.prompt_tokens


def test_a_repeated_prompt_starts_after_its_cached_blocks_with_the_same_output(cached: Server):
    assert cached.engine.allocator.cache, "a row-exact runner keeps a prefix cache"
    before = scrape(cached)
    first, prompt_len = _ids(cached, PROMPT)
    assert wait_idle(cached) and cached.engine.allocator.num_cached > 0  # finished, its blocks kept
    again, _ = _ids(cached, PROMPT)
    sampled = _ids(cached, PROMPT, temperature=0.9)[0]  # another rule on the same cached prefix
    after = scrape(cached)
    delta = {name: sample(after, name) - sample(before, name)
             for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}  # fmt: skip
    block = cached.engine.allocator.block_size
    assert delta["vllm:prefix_cache_queries_total"] == 3 * prompt_len
    assert delta["vllm:prefix_cache_hits_total"] >= 2 * (prompt_len - block)
    assert again == first and sampled
    assert wait_idle(cached), "KV not back to 0 (cached blocks count as free)"


def test_the_same_tokens_as_with_the_cache_off(cached: Server):
    with_cache = [_ids(cached, PROMPT)[0] for _ in range(2)]
    with _server_without_cache() as off:
        assert not off.engine.allocator.cache
        without = [_ids(off, PROMPT)[0] for _ in range(2)]
    assert with_cache == without
