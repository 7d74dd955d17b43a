"""Serving arms on servers: address checks, probing, config errors (spectoolkit.backends.arms, issue 17)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from spectoolkit.backends.arms import check_address, endpoint_arms, max_model_len, probe, served_model
from spectoolkit.backends.endpoint import LoopThread
from spectoolkit.config import BackendConfig, run_config_from_dict
from spectoolkit.errors import SpecToolkitError
from tests.backends.fake_servers import MODEL, ClosedPort, FakeOpenAIServer

SETTING = "backend.baseline_url"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server


# ---- check_address ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:8000/v1", "http://localhost:8000/v1", "http://[::1]:8000/v1", "https://127.0.0.2/v1"],
)
def test_loopback_addresses_are_accepted(url: str) -> None:
    check_address(url, allow_remote=False, setting=SETTING)


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000/v1", "http://example.com/v1", "http://192.168.1.2/v1"])
def test_remote_addresses_need_allow_remote(url: str) -> None:
    with pytest.raises(SpecToolkitError, match="not a loopback address") as info:
        check_address(url, allow_remote=False, setting=SETTING)
    assert f"{SETTING}={url}" in str(info.value) and "backend.allow_remote=true" in str(info.value)
    check_address(url, allow_remote=True, setting=SETTING)  # named for it: allowed


@pytest.mark.parametrize("url", ["http://127.0.0.1.example.com/v1", "http://127.internal.example/v1"])
def test_names_that_merely_start_with_127_are_not_loopback(url: str) -> None:
    with pytest.raises(SpecToolkitError, match="not a loopback address"):
        check_address(url, allow_remote=False, setting=SETTING)


@pytest.mark.parametrize("url", ["not a url", "127.0.0.1:8000/v1", "ftp://127.0.0.1/v1", "http://", "/v1"])
def test_non_urls_are_rejected(url: str) -> None:
    with pytest.raises(SpecToolkitError, match="http") as info:
        check_address(url, allow_remote=True, setting=SETTING)
    assert SETTING in str(info.value)


# ---- probe, served_model ----------------------------------------------------------------------


def test_probe_of_a_down_server_names_the_url() -> None:
    with ClosedPort() as url:
        with pytest.raises(SpecToolkitError, match="cannot reach the server") as info:
            probe(url, BackendConfig(connect_timeout_s=2.0))
    assert url in str(info.value) and "is it up?" in str(info.value)


def test_probe_of_a_server_without_models_route(fake) -> None:
    url = fake.url("nomodels")
    with pytest.raises(SpecToolkitError, match="answered HTTP 404") as info:
        probe(url, BackendConfig(connect_timeout_s=2.0))
    assert url in str(info.value)


def test_probe_of_a_web_page_is_a_user_error(fake) -> None:
    with pytest.raises(SpecToolkitError, match=fake.url("html")):
        probe(fake.url("html"), BackendConfig(connect_timeout_s=2.0))


def test_probe_of_a_plain_openai_server(fake) -> None:
    url = fake.url("ok")
    report = probe(url, BackendConfig(connect_timeout_s=2.0))
    assert report == {"url": url, "models": [{"id": MODEL, "object": "model"}]}  # no /version, /info there
    assert served_model(report, None) == MODEL and served_model(report, MODEL) == MODEL
    assert max_model_len([report]) is None


def test_served_model_errors() -> None:
    report = {"url": "http://127.0.0.1:1/v1", "models": [{"id": "a"}, {"id": "b"}]}
    assert served_model(report, None) == "a"
    with pytest.raises(SpecToolkitError, match=r"serves \['a', 'b'\], not backend.model=c"):
        served_model(report, "c")
    with pytest.raises(SpecToolkitError, match="lists no model"):
        served_model({"url": "http://127.0.0.1:1/v1", "models": []}, None)


def test_max_model_len_is_the_smallest_reported() -> None:
    reports = [{"models": [{"id": "a", "max_model_len": 4096}]}, {"models": [{"id": "b", "max_model_len": 2048}]}]
    assert max_model_len(reports) == 2048
    assert max_model_len([{"models": [{"id": "a", "max_model_len": None}]}]) is None


def test_endpoint_arms_on_servers_that_do_not_describe_themselves(fake) -> None:
    cfg = run_config_from_dict({
        "serve": {"enabled": True}, "speculate": {"gamma": 3},
        "backend": {"kind": "endpoint", "baseline_url": fake.url("ok"), "spec_url": fake.url("prom"),
                    "connect_timeout_s": 2.0},
    })  # fmt: skip
    loop = LoopThread()
    try:
        baseline, spec = endpoint_arms(cfg, loop, tokenizer=None)
        try:
            assert (baseline.name, baseline.gamma, baseline.drafter) == ("baseline", 0, "none")
            assert baseline.reference is None
            assert (spec.name, spec.gamma, spec.reference, spec.policy) == ("spec", 3, "baseline", "fixed")
            assert spec.drafter == "server (as configured there)" and spec.engine.model == MODEL
            assert baseline.url == fake.url("ok") and spec.server["url"] == fake.url("prom")
            fake.metrics_text = ""
            assert baseline.snapshot() is None and spec.snapshot() is None  # no counters: never zeros
        finally:
            baseline.engine.close()
            spec.engine.close()
    finally:
        loop.close()


def test_endpoint_arms_refuse_a_remote_url_before_sending_anything() -> None:
    cfg = run_config_from_dict(
        {"serve": {"enabled": True}, "backend": {"kind": "endpoint", "baseline_url": "http://10.0.0.5:8000/v1"}}
    )
    with pytest.raises(SpecToolkitError, match="backend.baseline_url=http://10.0.0.5:8000/v1 is not a loopback"):
        endpoint_arms(cfg, loop=None, tokenizer=None)


# ---- config -----------------------------------------------------------------------------------


def test_endpoint_needs_a_baseline_url() -> None:
    with pytest.raises(SpecToolkitError, match="backend=endpoint needs backend.baseline_url"):
        run_config_from_dict({"serve": {"enabled": True}, "backend": {"kind": "endpoint"}})
    with pytest.raises(SpecToolkitError, match="backend.baseline_url"):
        run_config_from_dict({"backend": {"kind": "endpoint"}})


@pytest.mark.parametrize("kind", ["endpoint", "vllm"])
def test_server_backends_need_a_serving_run(kind: str) -> None:
    from spectoolkit.__main__ import _bench_job  # the job a `python -m spectoolkit` run starts

    with pytest.raises(SpecToolkitError, match="experiment=concurrency_sweep"):  # from the config or the job
        _bench_job(run_config_from_dict({"backend": {"kind": kind, "baseline_url": "http://127.0.0.1:8000/v1"}}))


def test_endpoint_config_is_accepted_with_serving() -> None:
    cfg = run_config_from_dict(
        {"serve": {"enabled": True}, "backend": {"kind": "endpoint", "baseline_url": "http://127.0.0.1:8000/v1"}}
    )
    assert cfg.backend.kind == "endpoint" and cfg.backend.spec_url is None and not cfg.backend.allow_remote


@pytest.mark.parametrize("name", ["connect_timeout_s", "read_timeout_s", "request_timeout_s"])
def test_timeouts_must_be_positive(name: str) -> None:
    with pytest.raises(SpecToolkitError, match=f"backend.{name} must be > 0"):
        BackendConfig(**{name: 0})
