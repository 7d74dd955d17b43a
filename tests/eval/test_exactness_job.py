"""``+eval=exactness`` end to end on a tiny checkpoint: every part runs and lands in exactness.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spectoolkit.config import DraftConfig, EvalConfig, ModelConfig, RunConfig, WorkloadConfig
from spectoolkit.errors import SpecToolkitError
from spectoolkit.eval.exactness_job import PAIRS_FILE, RESULT_FILE, run_exactness_job


def _config(checkpoint: Path, out: Path, draft: DraftConfig) -> RunConfig:
    return RunConfig(
        draft=draft,
        model=ModelConfig(target_path=str(checkpoint)),
        workload=WorkloadConfig(kind="builtin", max_new_tokens=8, num_prompts=2),
        eval=EvalConfig(kind="exactness", stochastic_temperature=0.05, analytic_positions=3, samples=60, length=3),
        device="cpu",
        output_dir=str(out),
    )


def test_exactness_job_writes_every_part(one_thread, tiny_checkpoint: Path, tmp_path: Path) -> None:
    cfg = _config(tiny_checkpoint, tmp_path, DraftConfig(kind="model", precision="rtn-int8"))
    text = run_exactness_job(cfg)
    print(text)
    result = json.loads((tmp_path / RESULT_FILE).read_text(encoding="utf-8"))
    assert result["complete"] is True and result["sampling"]["temperature"] == 0.05
    assert result["greedy"]["pairs"] == 2 and result["greedy"]["passed"]
    assert result["max_tv"] == result["analytic"]["max_tv"] and result["analytic"]["positions"] == 6
    assert result["analytic"]["passed"]
    assert min(c["max_tv"] for c in result["analytic"]["controls"].values()) > 1e-2
    assert not result["empirical"]["rejected"] and result["empirical"]["samples"] == 60
    assert result["passed"] in (True, None)  # None only when the control was not rejected (no power)
    assert result["quant_quality"] is None  # fp32 target: nothing quantized
    assert "no quantization cost measured" in text and "speculation added nothing" in text
    pairs = (tmp_path / PAIRS_FILE).read_text(encoding="utf-8").splitlines()
    assert len(pairs) == 4  # 2 prompts x (baseline, spec), appended as produced


def test_exactness_job_needs_a_drafter(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(SpecToolkitError, match=r"\+draft="):
        run_exactness_job(_config(tiny_checkpoint, tmp_path, DraftConfig(kind="none")))
