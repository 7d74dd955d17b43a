"""``backend=llamacpp`` end to end on the embedded model: llama-server plain and drafting with the embedded GGUF as
its own draft model, started by the run, measured with the endpoint protocol, stopped afterwards (skipped without
``make llama-cpp``, as CI is: the build takes minutes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spectoolkit.backends.llamacpp import llamacpp_available
from spectoolkit.bench.load.runner import run_serving
from spectoolkit.config import run_config_from_dict

REPO = Path(__file__).resolve().parents[2]
LLAMA_DIR = REPO / ".llama-cpp"
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def llama_dir() -> str:
    reason = llamacpp_available(LLAMA_DIR)
    if reason:
        pytest.skip(f"no llama-server: {reason}")
    return str(LLAMA_DIR)


def test_llama_server_plain_and_with_a_draft_model_through_the_endpoint_protocol(llama_dir, tmp_path):
    cfg = run_config_from_dict({
        "target": {"precision": "gguf"}, "draft": {"kind": "model", "precision": "gguf"}, "speculate": {"gamma": 3},
        "serve": {"enabled": True, "concurrency": [1, 2], "requests_per_level": 4, "warmup_requests": 1},
        "bench": {"repeat": 1, "calibrate": False, "baseline_check": False},
        "workload": {"max_new_tokens": 16},
        "backend": {"kind": "llamacpp", "llamacpp_dir": llama_dir, "port": 8290, "llamacpp_ctx_per_slot": 1024},
        "output_dir": str(tmp_path),
    })  # fmt: skip
    summary = run_serving(cfg, progress=False)
    assert summary["complete"] and summary["errors"] == 0, summary["error_reasons"]
    for level in ("1", "2"):
        spec = summary["serving"]["spec"][level]
        assert spec["acceptance_source"] == "server /metrics"
        counters = spec["server_counters"]
        # the draft is the target's own file: it proposes what the target picks, nearly always
        assert counters["drafts"] > 0 and 0.5 * counters["draft_tokens"] < counters["accepted_tokens"]
        assert counters["accepted_tokens"] <= counters["draft_tokens"]
        assert summary["serving"]["baseline"][level]["output_throughput"] > 0
    arms = {arm["name"]: arm for arm in summary["conditions"]["arms"]}
    assert arms["spec"]["drafter"] == "llamacpp-draft-simple"
    assert arms["baseline"]["target_precision"].startswith("gguf")
    managed = summary["conditions"]["backend"]["managed"]
    assert managed["spec"]["version"].startswith("version") and "--spec-type" in managed["spec"]["command"]
    assert "--spec-type" not in managed["baseline"]["command"]
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert {r["arm"] for r in records} == {"baseline", "spec"} and all(r["output_ids"] for r in records)
    assert {"llamacpp-baseline.log", "llamacpp-spec.log", "report.md"} <= {p.name for p in tmp_path.iterdir()}
