"""The server runs compiled (``python -m spectoolkit.serve runtime.compile=true``), on the embedded model.

Every graph is compiled before the server takes a request; with ``serve.batch_invariant=true`` four requests
at once then return exactly what each returns alone (the compiled runner computes every row, prompts included,
as its lone decode step), with n-gram drafts accepted, and serving compiles nothing more.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from spectoolkit.config import run_config_from_dict
from spectoolkit.runtime.compiled import WIDTHS, compiled_runners
from tests.server.conftest import CONFIG
from tests.server.helpers import REPETITIVE, TIMEOUT_S, completion

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # compiles six widths of the embedded model (minutes)
PROMPTS = [REPETITIVE, "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "Paris is the capital of",
           "The cat sat on the mat. The cat sat on the"]  # fmt: skip
MAX_TOKENS = 12


def _ids(url: str, prompt: str) -> list[int]:
    response = httpx.post(url + "/completions", json=completion(prompt, MAX_TOKENS), timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_the_server_serves_compiled_and_batches_exactly():
    from spectoolkit.server.build import BackgroundServer, build_server

    serve = {**CONFIG["serve"], "batch_invariant": True}  # prompts through the graphs too (no BLAS prefill)
    built = build_server(run_config_from_dict({**CONFIG, "runtime": {"compile": True}, "serve": serve}))
    runners = compiled_runners([built.arm.engine])
    assert set(runners) == {"target"}  # n-gram lookup: no draft model
    stats = runners["target"].compile_stats
    assert stats.widths == WIDTHS  # compiled at start, before any request
    stats.mark_warm()
    with BackgroundServer(built) as background:
        alone = [_ids(background.base_url, prompt) for prompt in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda prompt: _ids(background.base_url, prompt), PROMPTS))
    assert together == alone
    assert all(len(ids) == MAX_TOKENS for ids in alone)
    assert built.arm.engine.counters.accepted_tokens > 0  # the drafts were used, not only the target
    assert stats.as_dict()["compiled_after_warm_up"] == 0
