"""One OpenAI-compatible server on the embedded SmolLM2-135M with the n-gram drafter (γ = 4), shared by
every test file of this package that asks for it (loading the model once keeps the package fast)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from spectoolkit.config import RunConfig, run_config_from_dict
from tests.server.helpers import Server, wait_idle

CONFIG = {
    "draft": {"kind": "ngram"},
    "speculate": {"gamma": 4},
    "serve": {"max_kv_tokens": 4096, "concurrency": [1]},
    "runtime": {"kernels": "reference"},
    "bench": {"calibrate": False, "baseline_check": False},
}


@pytest.fixture(scope="package")
def run_config() -> RunConfig:
    return run_config_from_dict(CONFIG)


@pytest.fixture(scope="package")
def server(run_config: RunConfig) -> Iterator[Server]:
    """The running server: ``server.url`` (…/v1), ``server.root``, ``server.built`` (engine, runner)."""
    from spectoolkit.server.build import BackgroundServer, build_server

    built = build_server(run_config)
    with BackgroundServer(built) as background:
        yield Server(built, background.base_url)


@pytest.fixture(scope="package")
def exact_server(run_config: RunConfig) -> Iterator[Server]:
    """The same arm on our CPU kernels (``runtime.kernels=auto``): every row is computed by itself, so no request's
    output depends on its batch (a sampled one's draws included) and the prefix cache is on."""
    from spectoolkit.server.build import BackgroundServer, build_server

    built = build_server(dataclasses.replace(run_config, runtime=dataclasses.replace(run_config.runtime,
                                                                                     kernels="auto")))  # fmt: skip
    with BackgroundServer(built) as background:
        yield Server(built, background.base_url)


@pytest.fixture(autouse=True)
def _starts_idle(request: pytest.FixtureRequest) -> None:
    """Every test on the server starts with no request in flight (an abort from the test before, e.g. a
    stop string's, is a command the engine thread may not have run yet)."""
    for name in ("server", "exact_server"):
        if name in request.fixturenames:
            assert wait_idle(request.getfixturevalue(name), 30.0), "a previous test left a request running"
