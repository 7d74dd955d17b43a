"""The real pair (Qwen2.5-Coder 1.5B <- 0.5B, ``make pair``) at the target's own GGUF precision: exact (slow lane,
skipped where the pair is not assembled).

- greedy identity with the target alone at concurrency 1 and 4 (the serving protocol's exactness: every output of
  every arm at every level against the target alone at concurrency 1), the target at int8 activations (integer dot
  products, issue 47), the 0.5B draft at gguf (int8 activations) and at rtn-int4 (float activations);
- sampled: the exactness job's per-position chi-square of the speculative sampler against the target alone, and its
  negative control (a draft that reports another distribution than it samples from) rejected at the same size.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spectoolkit.bench.load.runner import run_serving
from spectoolkit.config import run_config_from_dict
from spectoolkit.eval.exactness_job import RESULT_FILE, run_exactness_job
from spectoolkit.pair import PAIR, not_assembled

TARGET, DRAFT = (model.name for model in PAIR)
pytestmark = [pytest.mark.slow, pytest.mark.integration]
PROMPT = "Three words that describe the sea:"  # open-ended: the target's distribution is spread at temperature 1
SAMPLES = 300


@pytest.fixture(scope="module", autouse=True)
def assembled() -> None:
    for name in (TARGET, DRAFT):
        problem = not_assembled(name)
        if problem:
            pytest.skip(f"{name} {problem}")


def _cfg(out: Path, draft: str, **extra) -> dict:
    return {
        "model": {"name": "qwen2.5-coder-1.5b", "target_path": TARGET, "draft_path": DRAFT},
        "target": {"precision": "gguf", "activations": "int8"},
        "draft": {"kind": "model", "precision": draft, "group_size": 32},
        "speculate": {"gamma": 4}, "workload": {"kind": "humaneval", "num_prompts": 4, "max_new_tokens": 24},
        "output_dir": str(out), **extra,
    }  # fmt: skip


@pytest.mark.parametrize("draft", ["gguf", "rtn-int4"])
def test_greedy_identity_at_concurrency_1_and_4(tmp_path: Path, draft: str) -> None:
    cfg = run_config_from_dict(_cfg(tmp_path, draft, serve={"enabled": True, "concurrency": [1, 4],
                                                            "requests_per_level": 4, "warmup_requests": 0},
                                    bench={"repeat": 1, "calibrate": False, "baseline_check": False}))  # fmt: skip
    summary = run_serving(cfg, progress=False)
    assert summary["complete"] and summary["errors"] == 0, summary["error_reasons"]
    exactness = summary["serving_exactness"]
    assert exactness["checked"] == 4 * 2 * 2 and not exactness["divergent"], exactness  # 4 prompts, 2 arms, 2 levels
    spec = summary["serving"]["spec"]
    assert all(spec[level]["acceptance_rate"] > 0.5 for level in ("1", "4")), spec  # the pair agrees: drafts land


def test_sampled_distribution_is_the_targets_and_the_negative_control_is_rejected(tmp_path: Path) -> None:
    """One short raw prompt (each of the 3 x SAMPLES generations prefills its context again, and a 1.5B prefill is
    the slow part on a CPU), sampled at temperature 1."""
    prompts = tmp_path / "prompt.jsonl"
    prompts.write_text(json.dumps({"id": "short", "task_type": "chat", "prompt": PROMPT}) + "\n", encoding="utf-8")
    workload = {"kind": "jsonl", "path": str(prompts), "max_new_tokens": 8, "chat_template": False}
    cfg = run_config_from_dict(_cfg(tmp_path, "gguf", eval={"kind": "exactness", "samples": SAMPLES, "length": 3},
                                    workload=workload, quant_quality={"enabled": False}))  # fmt: skip
    run_exactness_job(cfg)
    result = json.loads((tmp_path / RESULT_FILE).read_text(encoding="utf-8"))
    assert result["greedy"]["verdict"] == "exact" and result["greedy"]["identical"] == 1, result["greedy"]
    empirical = result["empirical"]
    assert empirical["positions"] and empirical["passed"] and empirical["power_shown"], empirical
