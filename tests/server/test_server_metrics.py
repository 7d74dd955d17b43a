"""``/metrics`` moves exactly as the engine's counters do, under vLLM's names and conventions.

Scrape, send three concurrent completions (repetitive prompts: n-gram drafts are accepted), scrape
again: every vLLM counter's delta equals the delta of its EngineCounters field, per-position acceptance
counts are non-increasing in position and sum to the accepted tokens, token counters agree with the
responses' ``usage``, and each latency histogram observed one value per request.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.helpers import REPETITIVE, Server, completion, counters, post, sample, scrape, wait_idle

pytestmark = pytest.mark.integration

MAX_TOKENS = 12
PROMPTS = [REPETITIVE, "a b c d a b c d a b c", "for i in range(10):\n    print(i)\nfor i in range(10):\n"]
COUNTERS = [  # (vLLM sample name, EngineCounters field)
    ("vllm:spec_decode_num_drafts_total", "drafts"),
    ("vllm:spec_decode_num_draft_tokens_total", "draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens_total", "accepted_tokens"),
    ("vllm:generation_tokens_total", "generation_tokens"),
    ("vllm:prompt_tokens_total", "prompt_tokens"),
    ("vllm:request_success_total", "finished_requests"),
    ("vllm:num_preemptions_total", "preemptions"),
    ("spectoolkit:verify_rounds_total", "verify_rounds"),
    ("spectoolkit:rollback_rounds_total", "rollback_rounds"),
    ("spectoolkit:aborted_requests_total", "aborted_requests"),
]
HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds", "vllm:request_time_per_output_token_seconds"]  # fmt: skip


def _per_position(samples: dict) -> list[float]:
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    found = {dict(labels)["position"]: value for (sample_name, labels), value in samples.items() if sample_name == name}
    assert sorted(found, key=int) == [str(i) for i in range(len(found))], f"positions not 0..n-1: {sorted(found)}"
    return [found[str(i)] for i in range(len(found))]


def _padded(values: list, length: int) -> list:
    return list(values) + [0] * (length - len(values))


@pytest.fixture(scope="module")
def measured(server: Server):
    """(engine counters, /metrics samples) before and after the requests, and the responses."""
    assert wait_idle(server)
    counters_before, samples_before = counters(server), scrape(server)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(lambda p: post(server, "/completions", completion(p, MAX_TOKENS)), PROMPTS))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert wait_idle(server)
    return counters_before, samples_before, counters(server), scrape(server), [r.json() for r in responses]


def test_counters_move_as_engine_counters(measured):
    counters_before, samples_before, counters_after, samples_after, _ = measured
    for name, field in COUNTERS:
        metric_delta = sample(samples_after, name) - sample(samples_before, name)
        engine_delta = getattr(counters_after, field) - getattr(counters_before, field)
        assert metric_delta == engine_delta, f"{name} moved {metric_delta}, EngineCounters.{field} {engine_delta}"


def test_counters_agree_with_responses(measured):
    counters_before, samples_before, counters_after, samples_after, bodies = measured
    assert all(b["choices"][0]["finish_reason"] == "length" for b in bodies), "no EOS within MAX_TOKENS expected"
    delta = {name: sample(samples_after, name) - sample(samples_before, name) for name, _ in COUNTERS}
    assert delta["vllm:request_success_total"] == len(PROMPTS)
    assert delta["vllm:generation_tokens_total"] == sum(b["usage"]["completion_tokens"] for b in bodies)
    assert delta["vllm:prompt_tokens_total"] == sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert delta["vllm:spec_decode_num_accepted_tokens_total"] > 0, "repetitive prompts: drafts must be accepted"
    drafts = delta["vllm:spec_decode_num_drafts_total"]
    assert drafts <= delta["spectoolkit:verify_rounds_total"]
    assert delta["vllm:spec_decode_num_draft_tokens_total"] <= 4 * drafts, "γ = 4 candidates per draft at most"
    assert delta["vllm:spec_decode_num_accepted_tokens_total"] <= delta["vllm:spec_decode_num_draft_tokens_total"]
    # each request: a prefill token, then one token per verify round plus its accepted drafts
    assert delta["vllm:generation_tokens_total"] == (
        len(PROMPTS) + delta["spectoolkit:verify_rounds_total"] + delta["vllm:spec_decode_num_accepted_tokens_total"]
    )


def test_per_position_acceptance(measured):
    counters_before, samples_before, counters_after, samples_after, _ = measured
    after, before = _per_position(samples_after), _per_position(samples_before)
    assert after == [float(c) for c in counters_after.accepted_per_position]
    assert len(after) == 4, "γ = 4: one series per draft position"
    delta = [a - b for a, b in zip(after, _padded(before, len(after)), strict=True)]
    engine_before = _padded(counters_before.accepted_per_position, len(after))
    engine_delta = [a - b for a, b in zip(counters_after.accepted_per_position, engine_before, strict=True)]
    assert delta == engine_delta
    assert all(a >= b for a, b in zip(delta, delta[1:], strict=False)), f"not non-increasing: {delta}"
    accepted = counters_after.accepted_tokens - counters_before.accepted_tokens
    assert sum(delta) == accepted > 0
    assert delta[0] <= counters_after.drafts - counters_before.drafts


def test_histograms_observe_each_request(measured):
    _, samples_before, _, samples_after, _ = measured
    for name in HISTOGRAMS:
        count = sample(samples_after, name + "_count") - sample(samples_before, name + "_count", 0.0)
        assert count == len(PROMPTS), f"{name}: {count} observations for {len(PROMPTS)} requests"
        total = sample(samples_after, name + "_sum") - sample(samples_before, name + "_sum", 0.0)
        assert total >= 0
        assert sample(samples_after, name + "_bucket", le="+Inf") == sample(samples_after, name + "_count")
    inter_token = "vllm:inter_token_latency_seconds_count"
    assert sample(samples_after, inter_token) > sample(samples_before, inter_token, 0.0)


def test_gauges_read_idle_engine(measured):
    samples_after = measured[3]
    assert sample(samples_after, "vllm:num_requests_running") == 0
    assert sample(samples_after, "vllm:num_requests_waiting") == 0
    assert sample(samples_after, "vllm:kv_cache_usage_perc") == 0
