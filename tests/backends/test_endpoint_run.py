"""backend=endpoint end to end: a serving run against two of our servers on loopback (issue 17).

Two OpenAI servers on the embedded SmolLM2 model (draft=none and draft=ngram, gamma 4), started once
for the module on ephemeral ports; ``run_serving`` measures them at concurrency 1 and 2 through HTTP.
The run must write one record per request per arm per level with ids and token offsets, be greedy
exact against the baseline at concurrency 1, take the spec arm's acceptance from the server's
``/metrics`` (records of an HTTP client carry no drafts), and record what each server said about itself.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spectoolkit.config import run_config_from_dict
from spectoolkit.metrics.records import read_records

pytestmark = pytest.mark.integration

MAX_NEW = 16
NUM_PROMPTS = 2  # and serve.requests_per_level = 2: each prompt once per level
LEVELS = ("1", "2")
SERVER_BASE: dict[str, Any] = {
    "serve": {"max_kv_tokens": 8192, "concurrency": [1, 2]},
    "runtime": {"kernels": "reference"},
    "bench": {"calibrate": False, "baseline_check": False},
    "workload": {"max_new_tokens": MAX_NEW, "num_prompts": NUM_PROMPTS},
}


@pytest.fixture(scope="module")
def server_urls() -> Iterator[dict[str, str]]:
    from spectoolkit.server.build import BackgroundServer, build_server

    baseline = build_server(run_config_from_dict({**SERVER_BASE, "draft": {"kind": "none"}}))
    spec = build_server(run_config_from_dict({**SERVER_BASE, "draft": {"kind": "ngram"}}))
    with BackgroundServer(baseline) as baseline_server, BackgroundServer(spec) as spec_server:
        yield {"baseline": baseline_server.base_url, "spec": spec_server.base_url}


@pytest.fixture(scope="module")
def run_dir(server_urls: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    from spectoolkit.bench.load.runner import run_serving

    out = tmp_path_factory.mktemp("endpoint_run")
    cfg = run_config_from_dict({
        **SERVER_BASE,
        "serve": {"enabled": True, "concurrency": [1, 2], "warmup_requests": 1, "requests_per_level": NUM_PROMPTS},
        "bench": {"repeat": 1, "calibrate": False, "baseline_check": False},
        "backend": {"kind": "endpoint", "baseline_url": server_urls["baseline"], "spec_url": server_urls["spec"],
                    "connect_timeout_s": 5.0, "read_timeout_s": 60.0, "request_timeout_s": 120.0},
        "output_dir": str(out),
    })  # fmt: skip
    returned = run_serving(cfg, progress=False)
    assert json.loads((out / "summary.json").read_text(encoding="utf-8")) == json.loads(json.dumps(returned))
    return out


@pytest.fixture(scope="module")
def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))


def test_one_record_per_request_per_arm_per_level(run_dir: Path) -> None:
    records = read_records(run_dir / "records.jsonl")
    assert Counter((r.arm, r.load_level) for r in records) == {
        (arm, level): NUM_PROMPTS for arm in ("baseline", "spec") for level in LEVELS
    }
    for record in records:
        assert record.error is None, record.error
        assert record.repeat_idx == 0 and record.concurrency == int(record.load_level)
        assert 1 <= record.output_len <= MAX_NEW and len(record.output_ids) == record.output_len
        assert len(record.token_offsets) == record.output_len
        assert record.token_offsets == sorted(record.token_offsets) and record.token_offsets[0] > 0
        assert record.ttft == pytest.approx(record.token_offsets[0]) and record.total_time >= record.token_offsets[-1]
        assert record.input_len > 0 and record.drafted_tokens == 0  # an HTTP client sees tokens, not drafts
    cases = {(r.arm, r.load_level): set() for r in records}
    for record in records:
        cases[(record.arm, record.load_level)].add(record.case_id)
    assert all(len(found) == NUM_PROMPTS for found in cases.values())  # every prompt once per level


def test_greedy_exact_across_arms_and_levels(summary: dict[str, Any]) -> None:
    assert summary["complete"] is True and summary["errors"] == 0 and summary["error_reasons"] == []
    exactness = summary["serving_exactness"]
    assert exactness["checked"] == 2 * len(LEVELS) * NUM_PROMPTS and exactness["divergent"] == []
    for level in LEVELS:
        assert summary["serving"]["spec"][level]["exact_match"] == 1.0
        assert summary["serving"]["baseline"][level]["exact_match"] == 1.0
        assert summary["serving"]["spec"][level]["num_requests"] == NUM_PROMPTS


def test_spec_acceptance_comes_from_server_metrics(summary: dict[str, Any]) -> None:
    for level in LEVELS:
        stats = summary["serving"]["spec"][level]
        counters = stats["server_counters"]
        assert stats["acceptance_source"] == "server /metrics"
        assert counters["drafts"] > 0 and counters["draft_tokens"] >= counters["drafts"]
        assert 0 <= counters["accepted_tokens"] <= counters["draft_tokens"]
        assert stats["acceptance_rate"] == pytest.approx(counters["accepted_tokens"] / counters["draft_tokens"])
        assert stats["mean_accept_length"] == pytest.approx(1 + counters["accepted_tokens"] / counters["drafts"])
        per_position = counters["accepted_per_position"]
        assert len(per_position) == 4  # gamma 4
        assert all(a >= b for a, b in zip(per_position, per_position[1:], strict=False))  # non-increasing
        assert sum(per_position) == counters["accepted_tokens"]
        assert summary["serving"]["baseline"][level]["acceptance_rate"] is None  # the target alone drafts nothing


def test_report_and_alerts_written(run_dir: Path) -> None:
    report = (run_dir / "report.md").read_text(encoding="utf-8")
    assert report.strip() and "spec" in report
    assert (run_dir / "alerts.yml").read_text(encoding="utf-8").strip()


def test_conditions_record_both_servers(summary: dict[str, Any], server_urls: dict[str, str]) -> None:
    conditions = summary["conditions"]
    assert conditions["backend"]["kind"] == "endpoint"
    assert conditions["backend"]["baseline_url"] == server_urls["baseline"]
    assert conditions["backend"]["spec_url"] == server_urls["spec"]
    servers = conditions["servers"]
    assert set(servers) == {"baseline", "spec"}
    for arm, url in server_urls.items():
        assert servers[arm]["url"] == url and servers[arm]["models"]
        assert servers[arm]["info"]["engine"] == "spectoolkit" and servers[arm]["version"]["engine"] == "spectoolkit"
    assert servers["spec"]["info"]["gamma"] == 4 and servers["spec"]["info"]["drafter"] != "none"
    assert servers["baseline"]["info"]["gamma"] == 0
    arms = {arm["name"]: arm for arm in conditions["arms"]}
    assert arms["spec"]["gamma"] == 4 and arms["spec"]["reference"] == "baseline" and arms["spec"]["url"]
    assert arms["baseline"]["gamma"] == 0 and conditions["primary_arm"] == "spec"
    assert conditions["ids_from_text"] == {"baseline": False, "spec": False}
