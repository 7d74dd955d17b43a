"""``backend=vllm`` end to end on the embedded model: vLLM baseline and n-gram servers started by the run,
measured with the endpoint protocol, stopped afterwards (slow; skipped without ``make vllm``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spectoolkit.backends.vllm import vllm_available
from spectoolkit.bench.load.runner import run_serving
from spectoolkit.config import run_config_from_dict

REPO = Path(__file__).resolve().parents[2]
VLLM_ENV = REPO / ".venv-vllm"
pytestmark = [pytest.mark.slow, pytest.mark.integration]


@pytest.fixture(scope="module")
def vllm_env() -> str:
    reason = vllm_available(VLLM_ENV)
    if reason:
        pytest.skip(f"no vLLM environment: {reason}")
    return str(VLLM_ENV)


def test_vllm_baseline_and_ngram_through_the_endpoint_protocol(vllm_env, tmp_path):
    cfg = run_config_from_dict({
        "draft": {"kind": "ngram"}, "speculate": {"gamma": 4},
        "serve": {"enabled": True, "concurrency": [1, 2], "warmup_requests": 1},
        "bench": {"repeat": 1, "calibrate": False, "baseline_check": False},
        "workload": {"max_new_tokens": 24},
        "backend": {"kind": "vllm", "vllm_env": vllm_env, "port": 8190, "vllm_kv_cache_gib": 1,
                    "vllm_args": ["--enforce-eager", "--max-model-len", "2048"]},
        "output_dir": str(tmp_path),
    })  # fmt: skip
    summary = run_serving(cfg, progress=False)
    assert summary["complete"] and summary["errors"] == 0, summary["error_reasons"]
    for level in ("1", "2"):
        spec = summary["serving"]["spec"][level]
        assert spec["acceptance_source"] == "server /metrics"
        counters = spec["server_counters"]
        assert counters["drafts"] > 0 and 0 < counters["accepted_tokens"] <= counters["draft_tokens"]
        per_position = counters["accepted_per_position"]
        assert all(a >= b for a, b in zip(per_position, per_position[1:], strict=False))
        assert sum(per_position) == counters["accepted_tokens"]
        assert summary["serving"]["baseline"][level]["output_throughput"] > 0
    exactness = summary["serving_exactness"]
    assert exactness["checked"] > 0 and not exactness["divergent"]  # vLLM's n-gram output is its baseline's
    servers = summary["conditions"]["servers"]
    assert servers["baseline"]["version"]["version"].startswith("0.")
    assert {card["id"] for card in servers["spec"]["models"]} == {"smollm2-135m"}
    assert (tmp_path / "report.md").exists() and (tmp_path / "alerts.yml").exists()
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert {r["arm"] for r in records} == {"baseline", "spec"} and all(r["output_ids"] for r in records)
    assert "vllm-spec.log" in {p.name for p in tmp_path.iterdir()}
