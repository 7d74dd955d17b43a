"""Hydra multirun sweeps as a user runs them: aggregation, resume, a killed job, parallel launchers.

Each call is a real ``python -m spectoolkit -m ...`` process on the tiny random checkpoint, so these
tests pay Python start-up (~4 s) per sweep; the jobs themselves take about a second each.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TIMEOUT_S = 300


def _sweep_args(tiny_checkpoint: Path, sweep_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "spectoolkit", "-m", f"model.target_path={tiny_checkpoint}", "+draft=ngram",
            "workload.max_new_tokens=48", "workload.num_prompts=4", "bench.warmup=0", "bench.repeat=2",
            "device=cpu", f"hydra.sweep.dir={sweep_dir}", *overrides]  # fmt: skip


def _env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "HYDRA_FULL_ERROR"}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _sweep(tiny_checkpoint: Path, sweep_dir: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    result = subprocess.run(_sweep_args(tiny_checkpoint, sweep_dir, *overrides), cwd=sweep_dir.parent, env=_env(),
                            capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result, time.perf_counter() - start


def _rows(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "sweep_summary.csv", newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _jobs(sweep_dir: Path) -> dict[str, dict]:
    """job.json of every job, keyed by its γ."""
    found = {}
    for path in sweep_dir.glob("*/job.json"):
        job = json.loads(path.read_text(encoding="utf-8"))
        found[job["config"]["speculate"]["gamma"]] = {**job, "dir": path.parent}
    return found


def _kill_midway(tiny_checkpoint: Path, sweep_dir: Path, *overrides: str) -> Path:
    """Start a sweep, SIGKILL it once its (new) job has written its first record; returns the job dir."""
    existing = set(sweep_dir.iterdir())
    process = subprocess.Popen(_sweep_args(tiny_checkpoint, sweep_dir, *overrides), cwd=sweep_dir.parent,
                               env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while time.monotonic() < deadline and process.poll() is None:
            records = [p for p in sweep_dir.glob("*/records.jsonl") if p.parent not in existing and p.stat().st_size]
            if records:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
                return records[0].parent
            time.sleep(0.02)
    finally:
        if process.poll() is None:
            process.kill()
    pytest.fail("the job finished (or never wrote a record) before it could be killed")


@pytest.mark.slow  # whole Hydra sweeps in subprocesses: 20-84 s each on AMD Zen 3
def test_multirun_writes_one_row_per_job_and_resumes(tiny_checkpoint: Path, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    first, first_s = _sweep(tiny_checkpoint, sweep_dir, "speculate.gamma=2,4")
    rows = _rows(sweep_dir)
    assert sorted(int(row["speculate.gamma"]) for row in rows) == [2, 4]
    assert all(row["status"] == "complete" and row["complete"] == "True" and row["speedup"] for row in rows)
    assert all(row["exact_match"] == "1.0" and row["draft"] == "ngram" for row in rows)
    report = (sweep_dir / "sweep_report.md").read_text(encoding="utf-8")
    assert "| job | status | speculate.gamma |" in report and "2 jobs (2 complete)" in report
    assert (sweep_dir / "plots" / "speedup_vs_gamma.png").is_file()
    finished = {gamma: job["finished"] for gamma, job in _jobs(sweep_dir).items()}

    killed = _kill_midway(tiny_checkpoint, sweep_dir, "speculate.gamma=8")
    assert json.loads((killed / "job.json").read_text(encoding="utf-8"))["status"] == "running"
    partial = (killed / "records.jsonl").read_text(encoding="utf-8")

    resumed, _ = _sweep(tiny_checkpoint, sweep_dir, "speculate.gamma=2,4,8")
    jobs = _jobs(sweep_dir)
    assert resumed.stdout.count("skipped:") == 2
    assert {gamma: jobs[gamma]["finished"] for gamma in (2, 4)} == finished  # untouched
    assert jobs[8]["status"] == "complete" and jobs[8]["dir"] == killed
    assert [p.read_text(encoding="utf-8") for p in killed.glob("records.*.jsonl")] == [partial]  # set aside, kept
    assert sorted(int(row["speculate.gamma"]) for row in _rows(sweep_dir)) == [2, 4, 8]

    again, again_s = _sweep(tiny_checkpoint, sweep_dir, "speculate.gamma=2,4,8")
    assert again.stdout.count("skipped:") == 3
    assert again_s < 0.6 * first_s, (again_s, first_s)


@pytest.mark.slow  # whole Hydra sweeps in subprocesses: 20-84 s each on AMD Zen 3
def test_changed_config_under_the_same_overrides_is_rerun_and_the_old_result_kept(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    sweep_dir = tmp_path / "sweep"
    _sweep(tiny_checkpoint, sweep_dir, "speculate.gamma=2")
    job_dir = _jobs(sweep_dir)[2]["dir"]
    job = json.loads((job_dir / "job.json").read_text(encoding="utf-8"))
    job["config_hash"] = "0" * 16  # as if a preset file changed since: same overrides, other config
    (job_dir / "job.json").write_text(json.dumps(job), encoding="utf-8")
    result, _ = _sweep(tiny_checkpoint, sweep_dir, "speculate.gamma=2")
    assert "skipped:" not in result.stdout
    superseded = list(job_dir.glob(".superseded-*"))
    assert len(superseded) == 1 and (superseded[0] / "summary.json").is_file()
    assert len(_rows(sweep_dir)) == 1  # the superseded copy is not a job of the sweep


@pytest.mark.slow  # whole Hydra sweeps in subprocesses: 20-84 s each on AMD Zen 3
@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
def test_parallel_launchers_run_a_two_job_sweep(launcher: str, tiny_checkpoint: Path, tmp_path: Path) -> None:
    sweep_dir = tmp_path / launcher
    extra = ["hydra.launcher.n_jobs=2"] if launcher == "joblib" else ["hydra.launcher.timeout_min=5"]
    _sweep(tiny_checkpoint, sweep_dir, f"hydra/launcher={launcher}", *extra, "speculate.gamma=2,4",
           "workload.max_new_tokens=8", "workload.num_prompts=2")  # fmt: skip
    rows = _rows(sweep_dir)
    assert sorted(int(row["speculate.gamma"]) for row in rows) == [2, 4]
    assert all(row["status"] == "complete" and row["speedup"] for row in rows)
    assert (sweep_dir / "sweep_report.md").is_file()


def test_slurm_preset_composes_onto_submitit_slurm() -> None:
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    with initialize_config_module(config_module="spectoolkit.conf", version_base=None):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)  # fmt: skip
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.gpus_per_node, launcher.partition, launcher.max_num_timeout) == (1, "gpu", 1)
    assert OmegaConf.to_container(cfg.hydra.sweep)["subdir"].startswith("${spectoolkit_job_dir:")
