"""A server's speculation counters from its Prometheus ``/metrics`` (spectoolkit.backends.scrape, issue 17)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from spectoolkit.backends.scrape import SpecCounters, metrics_url, parse_spec_counters, scrape
from tests.backends.fake_servers import ClosedPort, FakeOpenAIServer

# What a vLLM v1 server exposes: counters with engine/model_name labels (here two model names on one
# engine, to be summed), their _created samples, per-position counts, and unrelated families around.
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 120.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="llama-alias"} 30.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 480.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="llama-alias"} 120.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 300.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="llama-alias"} 60.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",position="0"} 110.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",position="1"} 90.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",position="2"} 60.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",position="3"} 40.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="llama-alias",position="0"} 25.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="llama-alias",position="1"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="llama-alias",position="2"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="llama-alias",position="3"} 5.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 9999.0
"""  # noqa: E501  exposition lines are as long as the server writes them

# What our server's prometheus_client writes (TYPE names without _total, model_name only).
OURS_TEXT = """\
# HELP vllm:spec_decode_num_drafts_total Verify rounds with at least one draft token.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{model_name="SmolLM2-135M-Instruct"} 10.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{model_name="SmolLM2-135M-Instruct"} 40.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{model_name="SmolLM2-135M-Instruct"} 12.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="SmolLM2-135M-Instruct",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="SmolLM2-135M-Instruct",position="0"} 8.0
"""

BASELINE_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 512.0
"""


def test_vllm_counters_summed_over_labels() -> None:
    counters = parse_spec_counters(VLLM_TEXT)
    assert counters == SpecCounters(150.0, 600.0, 360.0, [135.0, 110.0, 70.0, 45.0])
    summary = counters.as_json()
    assert summary["acceptance_rate"] == pytest.approx(360 / 600)
    assert summary["mean_accept_length"] == pytest.approx(1 + 360 / 150)


def test_our_servers_counters_and_unordered_positions() -> None:
    assert parse_spec_counters(OURS_TEXT) == SpecCounters(10.0, 40.0, 12.0, [8.0, 4.0])


def test_missing_positions_are_zero() -> None:
    text = OURS_TEXT.replace('position="1"} 4.0', 'position="2"} 4.0')
    assert parse_spec_counters(text).accepted_per_position == [8.0, 0.0, 4.0]


@pytest.mark.parametrize("text", [BASELINE_TEXT, "", "# HELP nothing here\n"])
def test_no_spec_metrics_is_none_not_zeros(text: str) -> None:
    assert parse_spec_counters(text) is None


def test_minus_is_the_change_over_a_run() -> None:
    before = SpecCounters(10.0, 40.0, 12.0, [8.0, 4.0])
    after = SpecCounters(25.0, 100.0, 40.0, [20.0, 12.0, 6.0, 2.0])  # a position first seen after the run began
    delta = after.minus(before)
    assert delta == SpecCounters(15.0, 60.0, 28.0, [12.0, 8.0, 6.0, 2.0])
    assert before.minus(before) == SpecCounters(0.0, 0.0, 0.0, [0.0, 0.0])
    assert delta.as_json()["acceptance_rate"] == pytest.approx(28 / 60)
    assert delta.as_json()["mean_accept_length"] == pytest.approx(1 + 28 / 15)


def test_plus_sums_runs() -> None:
    first = SpecCounters(15.0, 60.0, 28.0, [12.0, 8.0, 6.0, 2.0])
    second = SpecCounters(5.0, 20.0, 10.0, [5.0, 5.0])
    assert first.plus(second) == SpecCounters(20.0, 80.0, 38.0, [17.0, 13.0, 6.0, 2.0])
    assert first.plus(second).minus(second) == first


def test_as_json_without_drafts_says_none() -> None:
    summary = SpecCounters().as_json()
    assert summary["acceptance_rate"] is None and summary["mean_accept_length"] is None
    assert summary["drafts"] == 0.0 and summary["accepted_per_position"] == []


@pytest.mark.parametrize(
    ("base_url", "expected"),
    [
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/metrics"),
        ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/metrics"),
        ("http://localhost:8000", "http://localhost:8000/metrics"),
        ("http://127.0.0.1:8000/proxy/v1", "http://127.0.0.1:8000/proxy/metrics"),
    ],
)
def test_metrics_url(base_url: str, expected: str) -> None:
    assert metrics_url(base_url) == expected


# ---- scrape over HTTP -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server


def test_scrape_reads_the_servers_counters(fake) -> None:
    fake.metrics_text = VLLM_TEXT
    assert scrape(fake.url("prom"), 2.0) == parse_spec_counters(VLLM_TEXT)
    fake.metrics_text = BASELINE_TEXT
    assert scrape(fake.url("prom"), 2.0) is None


def test_scrape_without_metrics_or_server_is_none(fake) -> None:
    assert scrape(fake.url("ok"), 2.0) is None  # /metrics answers 404
    with ClosedPort() as url:
        assert scrape(url, 2.0) is None


def test_scrape_of_a_page_that_is_not_prometheus_is_none(fake) -> None:
    assert scrape(fake.url("html"), 2.0) is None
