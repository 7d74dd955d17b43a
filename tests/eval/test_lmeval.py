"""lm-eval integration: the ``spectoolkit`` model, the shipped offline tasks and the ``+eval=lmeval`` job.

Greedy speculative decoding must leave every lm-eval result unchanged: each check compares a
drafting configuration with ``draft=none`` (the target alone) on the same documents. The tiny
random checkpoint keeps the default run short; the embedded-model run is marked slow.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from spectoolkit.config import RunConfig, run_config_from_dict  # noqa: E402
from spectoolkit.errors import SpecToolkitError  # noqa: E402
from spectoolkit.eval.lmeval import TASKS_DIR, SpecToolkitLM  # noqa: E402
from spectoolkit.eval.lmeval_args import run_config_from_model_args  # noqa: E402
from spectoolkit.eval.lmeval_cli import lm_eval_argv  # noqa: E402
from spectoolkit.eval.lmeval_job import run_lmeval_job  # noqa: E402
from spectoolkit.eval.tasks.utils import humaneval_program, load_humaneval, run_python  # noqa: E402

TASK = "spectoolkit_shortqa"
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def task_manager() -> TaskManager:
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)  # lm-eval's own tasks: seconds to index


def _evaluate(model_args: str, task_manager: TaskManager, tasks=(TASK,), limit: int = 4, **kwargs) -> dict:
    return lm_eval.simple_evaluate(
        model="spectoolkit", model_args=model_args, tasks=list(tasks), limit=limit, task_manager=task_manager,
        log_samples=True, bootstrap_iters=0, **kwargs,
    )  # fmt: skip


def _outputs(results: dict, task: str = TASK) -> list:
    return [sample["filtered_resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.fixture(scope="module")
def reference_results(tiny_checkpoint: Path, task_manager: TaskManager) -> dict:
    return _evaluate(f"target_path={tiny_checkpoint},draft=none,device=cpu", task_manager)


# ---- model_args → RunConfig ---------------------------------------------------------------------


def test_model_args_map_to_run_config() -> None:
    config, cap = run_config_from_model_args({"target": "int4", "draft": "bf16", "gamma": 3, "kv": "int8"})
    assert (config.target.precision, config.draft.kind, config.draft.precision) == ("int4", "model", "bf16")
    assert config.speculate.gamma == 3 and (config.kv.target, config.kv.draft) == ("int8", "int8")
    assert config.sampling.greedy and config.model.target_path is None and cap is None
    config, _ = run_config_from_model_args({"draft": None, "batch_size": 1, "device": "cuda:0"})  # lm-eval's spelling
    assert config.draft.kind == "none" and config.target.precision == "fp32" and config.device == "cuda"
    config, cap = run_config_from_model_args({"draft": "ngram", "temperature": 0.7, "seed": 3, "max_new_tokens": 9})
    assert config.draft.kind == "ngram" and config.sampling.temperature == 0.7 and cap == 9


@pytest.mark.parametrize(
    ("model_args", "message"),
    [({"drfat": "bf16"}, "unknown spectoolkit model_args: drfat"), ({"draft": "medusa"}, "draft='medusa'"),
     ({"gamma": 0}, "speculate.gamma=0"), ({"max_new_tokens": 0}, "max_new_tokens=0")],
)  # fmt: skip
def test_bad_model_args_are_clear_errors(model_args: dict, message: str) -> None:
    with pytest.raises(SpecToolkitError, match=message):
        run_config_from_model_args(model_args)


def test_cli_wrapper_adds_the_task_directory() -> None:
    assert lm_eval_argv(["--model", "spectoolkit", "--tasks", TASK], "/t") == [
        "lm_eval", "run", "--model", "spectoolkit", "--tasks", TASK, "--include_path", "/t",
    ]  # fmt: skip
    assert lm_eval_argv(["ls", "tasks"], "/t") == ["lm_eval", "ls", "tasks", "--include_path", "/t"]
    assert lm_eval_argv(["--help"], "/t") == ["lm_eval", "--help"]


def test_entry_point_declares_the_model() -> None:
    """The ``lm_eval.models`` plugin group (lm-eval's discovery after 0.4.13) resolves to our class."""
    from importlib.metadata import entry_points

    points = {point.name: point for point in entry_points(group="lm_eval.models")}
    assert points["spectoolkit"].load() is SpecToolkitLM
    assert lm_eval.api.registry.get_model("spectoolkit") is SpecToolkitLM
    assert lm_eval.api.registry.get_model("hf").__name__ == "HFLM"  # built-ins still registered


# ---- lm-eval's Python API -----------------------------------------------------------------------


@pytest.mark.parametrize("draft", ["ngram", "bf16"])
def test_greedy_scores_identical_to_target_alone(
    tiny_checkpoint: Path, task_manager: TaskManager, reference_results: dict, draft: str
) -> None:
    results = _evaluate(f"target_path={tiny_checkpoint},draft={draft},gamma=3,device=cpu", task_manager)
    assert results["results"][TASK]["exact_match,none"] == reference_results["results"][TASK]["exact_match,none"]
    assert _outputs(results) == _outputs(reference_results)
    assert all(output[0] and "\n" not in output[0] for output in _outputs(results))  # cut at the stop string


def test_loglikelihood_equals_target_logits(tiny_checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    lm = SpecToolkitLM(target_path=str(tiny_checkpoint), device="cpu")
    context, continuation = "Question: What is the capital of France?\nAnswer:", " Paris"
    requests = [Instance("loglikelihood", {}, (context, continuation), 0), Instance("loglikelihood", {}, ("", "Hi"), 1)]
    (logprob, is_greedy), (empty_logprob, _) = lm.loglikelihood(requests)
    # reference: an independent fp32 load, one forward over context + continuation
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    context_ids = lm.tokenizer.encode(context, add_special_tokens=False)
    whole_ids = lm.tokenizer.encode(context + continuation, add_special_tokens=False)
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([whole_ids])).logits[0].float(), dim=-1)  # [n, V]
    positions = range(len(context_ids), len(whole_ids))
    expected = sum(log_probs[pos - 1, whole_ids[pos]].item() for pos in positions)
    assert logprob == pytest.approx(expected, abs=1e-4) and logprob < 0
    assert is_greedy == all(log_probs[pos - 1].argmax().item() == whole_ids[pos] for pos in positions)
    # empty context: conditioned on the EOS token, as lm-eval's TemplateLM does
    hi_ids = lm.tokenizer.encode("Hi", add_special_tokens=False)
    with torch.no_grad():
        hi_log_probs = torch.log_softmax(model(torch.tensor([[lm.eot_token_id, *hi_ids]])).logits[0], dim=-1)
    assert empty_logprob == pytest.approx(sum(hi_log_probs[i, t].item() for i, t in enumerate(hi_ids)), abs=1e-4)
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("Hi",), 0)])
    assert rolling == pytest.approx(empty_logprob, abs=1e-5)


def test_generate_until_cuts_at_the_first_stop_string(tiny_checkpoint: Path) -> None:
    lm = SpecToolkitLM(target_path=str(tiny_checkpoint), draft="ngram", device="cpu")
    context = "Question: What is 2 plus 2?\nAnswer:"
    (free,) = lm.generate_until([Instance("generate_until", {}, (context, {"until": [], "max_gen_toks": 12}), 0)])
    stop = free.strip()[len(free.strip()) // 2 :][:3]
    assert stop, free
    (cut,) = lm.generate_until([Instance("generate_until", {}, (context, {"until": [stop], "max_gen_toks": 12}), 0)])
    assert cut == free[: free.index(stop)]


# ---- HumanEval: offline data, code run in a subprocess, only with the opt-in --------------------


def test_humaneval_check_program_runs_in_a_subprocess() -> None:
    doc = load_humaneval()["test"][0]
    assert run_python(humaneval_program(doc, doc["canonical_solution"]))
    assert not run_python(humaneval_program(doc, "    return None\n"))
    assert not run_python("while True:\n    pass\n", timeout_s=1)


def test_humaneval_task_needs_the_unsafe_code_opt_in(tiny_checkpoint: Path, task_manager: TaskManager) -> None:
    args = f"target_path={tiny_checkpoint},draft=ngram,device=cpu,max_new_tokens=8"
    with pytest.raises(ValueError, match="unsafe"):
        _evaluate(args, task_manager, tasks=["spectoolkit_humaneval"], limit=1)
    results = _evaluate(args, task_manager, tasks=["spectoolkit_humaneval"], limit=1, confirm_run_unsafe_code=True)
    assert results["results"]["spectoolkit_humaneval"]["pass@1,none"] == 0.0  # a random model's code fails


# ---- the quality job ------------------------------------------------------------------------------


def _job_config(tmp_path: Path, **eval_values) -> RunConfig:
    return run_config_from_dict(
        {"eval": {"kind": "lmeval", **eval_values}, "device": "cpu", "output_dir": str(tmp_path)}
    )


def test_job_rejects_unknown_task_and_code_without_opt_in(tmp_path: Path) -> None:
    with pytest.raises(SpecToolkitError, match=r"unknown lm-eval task\(s\): spectoolkit_shortq;.*spectoolkit_shortqa"):
        run_lmeval_job(_job_config(tmp_path, tasks=["spectoolkit_shortq"]))
    with pytest.raises(SpecToolkitError, match="spectoolkit_humaneval run model-written code.*allow_code_execution"):
        run_lmeval_job(_job_config(tmp_path, tasks=["spectoolkit_humaneval"]))
    with pytest.raises(SpecToolkitError, match="eval.tasks is empty"):
        run_lmeval_job(replace(_job_config(tmp_path), eval=replace(_job_config(tmp_path).eval, tasks=())))
    assert not (tmp_path / "lmeval.json").exists()


def _spectoolkit(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "HYDRA_FULL_ERROR"}
    env["OMP_NUM_THREADS"] = "1"
    args = [sys.executable, "-m", "spectoolkit", *overrides, "device=cpu", f"hydra.run.dir={tmp_path / 'run'}"]
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.mark.slow  # the whole Hydra job in a subprocess (16 s); test_lm_eval_cli_runs_the_spectoolkit_model stays
def test_hydra_job_writes_both_scores(tiny_checkpoint: Path, tmp_path: Path) -> None:
    result = _spectoolkit(
        tmp_path, "+eval=lmeval", f"eval.tasks=[{TASK}]", "eval.limit=3", f"model.target_path={tiny_checkpoint}",
        "+draft=ngram",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    payload = json.loads((tmp_path / "run" / "lmeval.json").read_text(encoding="utf-8"))
    assert payload["greedy"] is True and payload["identical"] is True and payload["greedy_mismatch"] is False
    assert payload["reference"]["draft"] == "none" and payload["speculative"]["drafter"] == "ngram"
    (row,) = payload["rows"]
    assert row["task"] == TASK and row["metric"] == "exact_match,none" and row["identical"] is True
    assert row["reference"] == row["speculative"] and not math.isnan(row["reference"])
    lines = result.stdout.splitlines()
    assert lines[0].startswith("lm-eval (greedy, limit 3)") and "identical" in lines[1], result.stdout
    assert lines[2].split()[:2] == [TASK, "exact_match,none"] and lines[2].split()[-1] == "yes"


@pytest.mark.slow  # a Python start-up plus lm-eval indexing its own task tree: ~15 s for one message
def test_hydra_job_unknown_task_is_one_clear_error(tmp_path: Path) -> None:
    result = _spectoolkit(tmp_path, "+eval=lmeval", "eval.tasks=[no_such_task]")
    assert result.returncode != 0 and "Traceback" not in result.stdout + result.stderr
    assert result.stderr.startswith("error: unknown lm-eval task(s): no_such_task"), result.stderr


# ---- the lm_eval CLI ------------------------------------------------------------------------------


def test_lm_eval_cli_runs_the_spectoolkit_model(tiny_checkpoint: Path, tmp_path: Path, reference_results: dict) -> None:
    """lm-eval's own CLI (``lm_eval.__main__.cli_evaluate``) through ``spectoolkit-lm-eval``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [
        sys.executable, "-m", "spectoolkit.eval.lmeval_cli", "--model", "spectoolkit",
        "--model_args", f"target_path={tiny_checkpoint},draft=ngram,gamma=4,device=cpu", "--tasks", TASK,
        "--limit", "4", "--output_path", str(tmp_path / "out"), "--log_samples",
    ]  # fmt: skip
    result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"|{TASK}|" in result.stdout.replace(" ", "")
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    scores = json.loads(results_file.read_text(encoding="utf-8"))["results"][TASK]
    assert scores["exact_match,none"] == reference_results["results"][TASK]["exact_match,none"]
    (samples_file,) = (tmp_path / "out").rglob(f"samples_{TASK}_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text(encoding="utf-8").splitlines()]
    assert [s["filtered_resps"] for s in sorted(samples, key=lambda s: s["doc_id"])] == _outputs(reference_results)


# ---- the embedded model -----------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.slow
def test_embedded_model_answers_and_speculation_keeps_scores(task_manager: TaskManager) -> None:
    reference = _evaluate("draft=none,device=cpu", task_manager, limit=5)
    spec = _evaluate("draft=bf16,gamma=4,device=cpu", task_manager, limit=5)
    assert reference["results"][TASK]["exact_match,none"] >= 0.6  # capitals: SmolLM2-135M knows them
    assert spec["results"][TASK]["exact_match,none"] == reference["results"][TASK]["exact_match,none"]
    assert _outputs(spec) == _outputs(reference)
