"""The standard lm-eval CLI against our server: ``lm_eval --model local-completions`` (issue 17).

Runs lm-eval's own command line (a subprocess, offline) on the shipped tasks — one generate_until
(``spectoolkit_shortqa``) and one log-likelihood (``spectoolkit_shortqa_loglik``, which needs ``echo`` and
``logprobs`` on ``/v1/completions``) — against ``python -m spectoolkit.serve``'s app on the embedded model
with n-gram speculation, and checks every log-likelihood lm-eval recorded against the target's own
log-probabilities computed here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spectoolkit.config import run_config_from_dict
from spectoolkit.embedded import embedded_dir
from spectoolkit.server.build import BackgroundServer, build_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a server plus lm-eval's API model: 30 s
TASKS_DIR = Path(__file__).resolve().parents[2] / "spectoolkit" / "eval" / "tasks"
LIMIT = 3


@pytest.fixture(scope="module")
def server():
    cfg = run_config_from_dict({
        "draft": {"kind": "ngram"}, "serve": {"max_kv_tokens": 4096, "concurrency": [1]},
        "runtime": {"kernels": "reference"},
    })  # fmt: skip
    built = build_server(cfg)
    with BackgroundServer(built) as running:
        yield built, running


def _lm_eval(base_url: str, out: Path) -> subprocess.CompletedProcess:
    model_args = (f"base_url={base_url}/completions,model=smollm2-135m,tokenizer={embedded_dir()},"
                  "tokenizer_backend=huggingface,max_length=2048")  # fmt: skip
    command = [
        sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
        "--tasks", "spectoolkit_shortqa,spectoolkit_shortqa_loglik", "--include_path", str(TASKS_DIR),
        "--limit", str(LIMIT), "--output_path", str(out), "--log_samples",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": ""}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def _samples(out: Path, task: str) -> list[dict]:
    path = next(out.rglob(f"samples_{task}_*.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_lm_eval_local_completions_runs_shipped_tasks_offline(server, tmp_path):
    built, running = server
    result = _lm_eval(running.base_url, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    scores = json.loads(next(tmp_path.rglob("results_*.json")).read_text())["results"]
    assert scores["spectoolkit_shortqa"]["exact_match,none"] >= 2 / 3  # capitals: the 135M model knows them
    assert scores["spectoolkit_shortqa_loglik"]["acc,none"] == 1.0  # its greedy answers, so each is greedy
    tokenizer, model = built.served.tokenizer, built.arm.engine.model
    samples = _samples(tmp_path, "spectoolkit_shortqa_loglik")
    assert len(samples) == LIMIT
    for sample in samples:
        context, continuation = sample["arguments"]["gen_args_0"]["arg_0"], sample["arguments"]["gen_args_0"]["arg_1"]
        context_ids = tokenizer(context, add_special_tokens=False).input_ids
        continuation_ids = tokenizer(continuation, add_special_tokens=False).input_ids
        ids = torch.tensor([context_ids + continuation_ids])
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)  # [L, V]
        positions = range(len(context_ids) - 1, ids.shape[1] - 1)
        expected = sum(logprobs[p, ids[0, p + 1]].item() for p in positions)
        served, greedy = sample["filtered_resps"][0]
        assert float(served) == pytest.approx(expected, abs=1e-4)
        assert greedy == "True"
