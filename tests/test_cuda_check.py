"""experiments/cuda_check.py, the prepared CUDA run, checked here in its ``--smoke`` mode (toy shapes, CPU interpreter).

A GPU session gets one try at it: this keeps the script itself running, its JSON complete and its checks
(invariance, token identity) live, so what comes back from the GPU is numbers, not a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton ships for Linux only")

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "cuda_check.py"
PARTS = ("invariance_quant_matmul", "invariance_kv_attention", "timing", "engine", "pytest")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, str]:
    out = tmp_path_factory.mktemp("cuda_check")
    env = {**os.environ, "OUT": str(out)}  # the output directory from $OUT, as on the device machine
    env.pop("TRITON_INTERPRET", None)  # the script must set it itself, before triton is imported
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert (out / "cuda_check.json").is_file(), proc.stdout + proc.stderr
    return proc, json.loads((out / "cuda_check.json").read_text()), (out / "cuda_check.txt").read_text()


def test_smoke_run_passes_and_records_every_part(smoke_run):
    proc, results, text = smoke_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert set(results) == {"meta", *PARTS}
    assert results["meta"]["smoke"] is True
    for name in PARTS[:-1]:
        assert results[name]["status"] == "ok", results[name].get("traceback", results[name]["status"])
    assert results["pytest"]["status"].startswith("skipped: ")
    assert all(name in text for name in PARTS)


def test_smoke_invariance_counts_and_judges_against_the_reference(smoke_run):
    """Under the interpreter the bit checks run and are counted per case, but judged only on a GPU (a row's order
    within a tile is numpy's BLAS's there: tests/kernels/conftest.py); every call meets its reference."""
    _, results, text = smoke_run
    quant, kv = results["invariance_quant_matmul"], results["invariance_kv_attention"]
    assert len(quant["cases"]) == 2  # int4 g=128, int8 per channel
    assert all(case["mismatched_rows_by_width"] for case in quant["cases"])
    assert isinstance(quant["mismatched_rows"], int) and isinstance(kv["mismatches"], int)
    assert {case["check"] for case in kv["cases"]} == {"alone vs batched", "decode vs verify row"}
    assert kv["split_len"] == 64  # short splits: the toy contexts are merged over several
    for part in (quant, kv):
        assert part["bits"].startswith("not judged") and part["bits"] in text
        assert part["reference_ok"] is True, part["cases"]
        assert all(case["max_error_vs_reference"] >= 0 for case in part["cases"])


def test_judging_needs_zero_mismatches_on_a_gpu_and_the_reference_everywhere():
    """_all_good: a mismatch fails a GPU run, not a smoke run; a call off its reference fails both."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cuda_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parts = {"invariance_quant_matmul": {"status": "ok", "mismatched_rows": 3, "reference_ok": True},
             "invariance_kv_attention": {"status": "ok", "mismatches": 0, "reference_ok": True}}  # fmt: skip
    assert module._all_good(parts, smoke=True) and not module._all_good(parts, smoke=False)
    parts["invariance_quant_matmul"]["mismatched_rows"] = 0
    assert module._all_good(parts, smoke=False)
    parts["invariance_kv_attention"]["reference_ok"] = False
    assert not module._all_good(parts, smoke=True) and not module._all_good(parts, smoke=False)


def test_smoke_timing_and_engine_report_what_the_gpu_run_reports(smoke_run):
    _, results, _ = smoke_run
    rows = results["timing"]["rows"]
    assert {row["m"] for row in rows} == {1, 2}
    for row in rows:
        assert row["kernel_ms"] > 0 and row["torch_ms"] > 0 and row["kernel_gbps"] > 0
        assert {"peak_fraction", "kernel_v_over_t1", "torch_v_over_t1"} <= set(row)
    engine = results["engine"]
    assert engine["identical"] is True
    assert set(engine["cases"]) == {"ngram", "rtn-int4", "ngram-4-in-flight"}
    assert all(case["identical"] is True for case in engine["cases"].values())
    assert engine["cases"]["ngram"]["drafted"] > 0 and engine["cases"]["rtn-int4"]["drafted"] > 0
