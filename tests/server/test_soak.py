"""Soak (issue 28): 1,000 requests at concurrency 8 against a server subprocess on a tiny random model, 10% of them
aborted by the client mid-stream and 5% malformed (``experiments/soak.py``). Every good request must get the batch-1
target-alone output, every aborted stream must be aborted by the server, every malformed request a 4xx; afterwards
no KV is in use (target or draft) and the server's RSS is within 5% of its RSS after the first 100 requests.

The slow soak runs twice: with n-gram drafts (rounds rejected, KV rolled back) and with a draft model (the target's
own checkpoint at fp32: its paged KV pool, drafts accepted). The fast tests show that each check can fail.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
sys.path.insert(0, str(_EXPERIMENTS))  # soak.py imports its sibling soak_client.py, as when run as a script
_SPEC = importlib.util.spec_from_file_location("soak", _EXPERIMENTS / "soak.py")
soak = importlib.util.module_from_spec(_SPEC)
sys.modules["soak"] = soak  # dataclasses resolve their module by name
_SPEC.loader.exec_module(soak)
client = sys.modules["soak_client"]

NUM_REQUESTS, CONCURRENCY, ABORT_SHARE, MALFORMED_SHARE = 1000, 8, 0.1, 0.05
DEADLINE_S = 1200.0  # nothing is sent after this: a stuck server fails the test instead of hanging it
DRAFTS = {"ngram": {"kind": "ngram"}, "self-fp32": {"kind": "model", "precision": "fp32"}}


def _plan(seed: int = 0) -> list:
    return soak.make_plan(NUM_REQUESTS, ABORT_SHARE, MALFORMED_SHARE, seed, "m", 1024, ["count", "cat"])


def test_plan_is_seeded_with_the_asked_shares():
    plan = _plan()
    assert plan == _plan() and plan != _plan(seed=1)
    kinds = [request.kind for request in plan]
    assert (kinds.count("good"), kinds.count("abort"), kinds.count("malformed")) == (850, 100, 50)
    good = [request for request in plan if request.kind == "good"]
    assert {request.stream for request in good} == {False, True}
    assert {request.path for request in good} == {"/v1/completions", "/v1/chat/completions"}
    assert all(soak.GOOD_MAX_TOKENS[0] <= request.max_tokens <= soak.GOOD_MAX_TOKENS[1] for request in good)
    aborts = [request for request in plan if request.kind == "abort"]
    assert all(r.stream and r.key in ("count", "cat") and 1 <= r.close_after <= 3 for r in aborts)
    assert {request.mistake for request in plan if request.kind == "malformed"} == set(soak.MALFORMED)


def test_checks_fail_on_a_wrong_outcome():
    good = client.PlannedRequest(0, "good", "/v1/completions", {}, "count", max_tokens=3)
    abort = client.PlannedRequest(1, "abort", "/v1/completions", {"stream": True}, "count", 128, close_after=1)
    bad = client.PlannedRequest(2, "malformed", "/v1/completions", b"{", mistake="bad_json")
    plan, refs = [good, abort, bad], {"count": client.Reference([1, 2], [5, 6, 7, 8], lambda n: " x" * n)}
    right = {
        0: client.Outcome(200, [5, 6, 7], " x x x", [1, 2], "length"),
        1: client.Outcome(200, [5, 6]),  # left after two tokens: no finish_reason
        2: client.Outcome(400, error="not JSON"),
    }
    assert client.check_outcomes(plan, right, refs) == []
    wrong = {
        0: client.Outcome(200, [5, 6, 9], " x x x", [1, 2], "length"),  # a token differs from batch 1
        1: client.Outcome(200, [5, 6], finish_reason="length"),  # finished: the server never had to abort it
        2: client.Outcome(200),  # a malformed request answered 200
    }
    failures = client.check_outcomes(plan, wrong, refs)
    assert [line.split(":")[0] for line in failures] == [
        "request 0 (good count)", "request 1 (abort count, streamed)", "request 2 (malformed bad_json)"
    ]  # fmt: skip
    assert "not run before the deadline" in client.check_outcomes([good], {}, refs)[0]


def test_server_checks_fail_on_a_leak():
    counts = {"good": 850, "abort": 100, "malformed": 50}
    delta = {"spectoolkit:aborted_requests_total": 100, "vllm:request_success_total": 850}
    idle = dict.fromkeys(client.IDLE_GAUGES, 0.0)
    assert client.check_server(counts, delta, idle, 100_000, 104_000, 0.05) == []
    assert len(client.check_server(counts, delta, idle, 100_000, 106_000, 0.05)) == 1  # RSS grew 6%
    kv_left = {**idle, "vllm:kv_cache_usage_perc": 0.02}
    assert len(client.check_server(counts, delta, kv_left, 100_000, 100_000, 0.05)) == 1
    not_aborted = {**delta, "spectoolkit:aborted_requests_total": 99, "vllm:request_success_total": 851}
    assert len(client.check_server(counts, not_aborted, idle, 100_000, 100_000, 0.05)) == 2


@pytest.mark.slow
@pytest.mark.parametrize("draft", DRAFTS)
def test_soak(tiny_checkpoint: Path, tmp_path: Path, draft: str):
    settings = soak.merged(soak.SETTINGS, {"model": {"target_path": str(tiny_checkpoint)}, "draft": DRAFTS[draft]})
    result = soak.run_soak(settings, tmp_path, NUM_REQUESTS, CONCURRENCY, ABORT_SHARE, MALFORMED_SHARE, seed=0,
                           deadline_s=DEADLINE_S)  # fmt: skip
    assert result.counts == {"good": 850, "abort": 100, "malformed": 50}
    assert result.failures == [], "\n".join(result.failures[:20])
    assert result.metrics_delta["vllm:spec_decode_num_drafts_total"] > 0, "speculation never ran"
    if draft == "self-fp32":
        assert result.metrics_delta["vllm:spec_decode_num_accepted_tokens_total"] > 0, "no draft was ever accepted"
    assert result.rss_checkpoint_kb and result.rss_end_kb, "the server's RSS was not read"
