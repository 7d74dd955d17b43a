"""``python -m spectoolkit`` and ``python -m spectoolkit.compat`` as a user runs them (subprocesses).

A user mistake must end the process with a non-zero status and one clear message, never a traceback.
Each call starts a Python process (~3-5 s with torch), so the cases are chosen, not enumerated.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT_S = 180


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "HYDRA_FULL_ERROR"}
    env["OMP_NUM_THREADS"] = "1"  # tiny models: extra threads only contend with other test processes
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _spectoolkit(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    run_dir = tmp_path / "run"
    return _run(["-m", "spectoolkit", *overrides, "device=cpu", f"hydra.run.dir={run_dir}"], cwd=tmp_path)


def _assert_one_clear_error(result: subprocess.CompletedProcess, *expected: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Traceback" not in output, output
    assert "arm  reqs" not in result.stdout  # no summary table after a failure
    for text in expected:
        assert text in result.stderr, result.stderr


@pytest.fixture(scope="module")
def incompatible_draft(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with a different EOS token (a whole checkpoint: the path check wants its weights before
    the compat check runs)."""
    out = tmp_path_factory.mktemp("incompatible") / "draft"
    out.mkdir()
    for path in tiny_checkpoint.iterdir():
        shutil.copy(path, out / path.name)
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    tokenizer_config["eos_token"] = "<|endoftext|>"
    config_path.write_text(json.dumps(tokenizer_config), encoding="utf-8")
    return out


def test_run_prints_table_and_writes_results(tiny_checkpoint: Path, tmp_path: Path) -> None:
    result = _spectoolkit(
        tmp_path, f"model.target_path={tiny_checkpoint}", "+draft=ngram", "workload.max_new_tokens=4",
        "bench.warmup=0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    header = result.stdout.splitlines()[0].split()
    assert header[:4] == ["arm", "reqs", "tok/s", "speedup"]
    spec_row = next(line for line in result.stdout.splitlines() if line.split()[:1] == ["spec"])
    assert spec_row.split()[3].endswith("x")  # the overall speedup
    assert "greedy exact match: spec 100.0%" in result.stdout
    # output_dir follows hydra.run.dir: records and summary land there
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["complete"] is True and summary["errors"] == 0
    assert summary["conditions"]["workload"]["max_new_tokens"] == 4
    assert summary["conditions"]["draft"]["kind"] == "ngram"
    assert len((run_dir / "records.jsonl").read_text(encoding="utf-8").splitlines()) == 2 * 6 * 5  # default repeat 5


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["foo=1"], ["Could not override 'foo'"]),  # rejected by Hydra: not in the config
        (["speculate.gama=4"], ["Could not override 'speculate.gama'"]),
        (["+speculate.gama=4"], ["error: unknown config option(s): speculate.gama"]),  # appended: ours
        (["model.target_path=/nonexistent"], ["error: ", "'/nonexistent' does not exist"]),
        (["workload=jsonl", "workload.path=/nonexistent.jsonl"], ["error: ", "/nonexistent.jsonl' does not exist"]),
        (["workload=jsonl"], ["error: ", "workload.path"]),
        (["workload.max_new_tokens=0"], ["error: ", "workload.max_new_tokens=0 must be >= 1"]),
        (["serve.max_num_seqs=4"], ["error: serve.max_num_seqs has no effect outside a serving run"]),
        (
            ["+draft=bf16", "speculate.tree.kind=static", "speculate.tree.branching=[3,2,1,1]"],
            ["error: speculate.tree.branching=[3,2,1,1]", "set speculate.tree.max_nodes=21, or shrink"],
        ),
    ],
    ids=[
        "unknown-option",
        "unknown-nested-option",
        "appended-unknown-option",
        "missing-model",
        "missing-workload",
        "jsonl-without-path",
        "zero-max-new-tokens",
        "dead-serve-key",
        "tree-cut-by-max-nodes",
    ],  # fmt: skip
)
def test_bad_input_is_one_clear_error(tmp_path: Path, overrides: list[str], expected: list[str]) -> None:
    result = _spectoolkit(tmp_path, *overrides)
    _assert_one_clear_error(result, *expected)
    if expected[0].startswith("error: "):  # ours: exactly one message, first thing on stderr
        assert result.stderr.startswith("error: ") and result.stderr.count("error:") == 1, result.stderr


def test_a_key_with_no_effect_is_one_line_naming_its_switch(tmp_path: Path) -> None:
    result = _spectoolkit(tmp_path, "speculate.tree.branching=[3,2,1,1]")
    _assert_one_clear_error(result)
    assert result.stderr.strip().splitlines() == [
        "error: speculate.tree.branching has no effect without speculate.tree.kind=static: "
        "set speculate.tree.kind=static, or drop the override"
    ]
    assert not (tmp_path / "run" / "job.json").exists()  # refused before the job started


def test_a_tree_chain_run_warns_and_records_the_cut_tree(tiny_checkpoint: Path, tmp_path: Path) -> None:
    result = _spectoolkit(
        tmp_path, f"model.target_path={tiny_checkpoint}", "+draft=fp32", "draft.quantize_head=false",
        "speculate.tree.kind=static", "speculate.tree.branching=[2,2]", "bench.arms=tree_chain", "bench.gammas=[2]",
        "workload.max_new_tokens=4", "workload.num_prompts=1", "bench.warmup=0", "bench.repeat=1",
        "bench.calibrate=false", "bench.baseline_check=false", "runtime.kernels=reference",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    warning = ("bench.arms=tree_chain cuts the static tree speculate.tree.branching=[2,2] (6 nodes) to each arm's "
               "node budget, breadth first: tree-n2 (depth 1)")  # fmt: skip
    assert f"warning: {warning}" in result.stderr.splitlines()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text(encoding="utf-8"))
    assert summary["complete"] is True and summary["conditions"]["warnings"] == [warning]
    assert f"| config warnings | {warning} |" in (tmp_path / "run" / "report.md").read_text(encoding="utf-8")


def test_incompatible_pair_lists_the_mismatch(tiny_checkpoint: Path, incompatible_draft: Path, tmp_path: Path) -> None:
    result = _spectoolkit(
        tmp_path, f"model.target_path={tiny_checkpoint}", f"model.draft_path={incompatible_draft}", "+draft=fp32"
    )
    _assert_one_clear_error(result, "error: incompatible", "eos token", "<|im_end|>", "<|endoftext|>")
    assert not (tmp_path / "run" / "records.jsonl").exists()  # nothing ran


def test_compat_cli_accepts_the_embedded_pair(tmp_path: Path) -> None:
    result = _run(["-m", "spectoolkit.compat", "embedded", "embedded"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("compatible")
