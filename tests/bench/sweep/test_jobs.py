"""Sweep bookkeeping without subprocesses: job identity, job.json, job directories, the sweep table,
the shared checkpoint cache under concurrency, and the fast failure for unavailable hub models."""

from __future__ import annotations

import csv
import json
import threading
import time
from pathlib import Path

import pytest

from spectoolkit import job_dir_name
from spectoolkit.bench.sweep import jobs
from spectoolkit.bench.sweep.table import axis_key, sweep_rows, write_sweep_csv
from spectoolkit.checkpoints import resolve_path
from spectoolkit.embedded import cached_directory
from spectoolkit.errors import SpecToolkitError

CONFIG = {"draft": {"kind": "ngram"}, "speculate": {"gamma": 4}, "output_dir": "/a", "resume": True}


def test_config_hash_ignores_where_results_go_but_not_what_is_measured() -> None:
    digest = jobs.config_hash(CONFIG)
    assert len(digest) == 16
    assert jobs.config_hash({**CONFIG, "output_dir": "/b", "resume": False}) == digest
    assert jobs.config_hash({**CONFIG, "speculate": {"gamma": 2}}) != digest
    assert jobs.config_hash(dict(reversed(CONFIG.items()))) == digest  # key order does not matter


def test_job_lifecycle_and_skip_decision(tmp_path: Path) -> None:
    digest = jobs.config_hash(CONFIG)
    job = jobs.start_job(tmp_path, digest, "bench", CONFIG)
    assert jobs.read_job(tmp_path)["status"] == "running"
    assert jobs.finished_before(tmp_path, digest) is None  # a killed job stays "running": rerun it
    jobs.end_job(tmp_path, job, jobs.COMPLETE)
    done = jobs.finished_before(tmp_path, digest)
    assert done["status"] == "complete" and done["seconds"] >= 0 and done["config"] == CONFIG
    assert jobs.finished_before(tmp_path, "f" * 16) is None  # another config is not this job
    jobs.end_job(tmp_path, jobs.start_job(tmp_path, digest, "bench", CONFIG), "interrupted")
    assert jobs.finished_before(tmp_path, digest) is None


def test_a_different_config_in_the_directory_is_set_aside_not_overwritten(tmp_path: Path) -> None:
    jobs.end_job(tmp_path, jobs.start_job(tmp_path, "a" * 16, "bench", CONFIG), jobs.COMPLETE)
    (tmp_path / "summary.json").write_text("{}", encoding="utf-8")
    (tmp_path / ".hydra").mkdir()
    jobs.start_job(tmp_path, "b" * 16, "bench", CONFIG)
    aside = list(tmp_path.glob(".superseded-*"))
    assert len(aside) == 1
    assert (aside[0] / "summary.json").is_file() and json.loads((aside[0] / "job.json").read_text())["config_hash"]
    assert not (tmp_path / "summary.json").exists() and (tmp_path / ".hydra").is_dir()


def test_job_dir_name_is_stable_readable_and_safe() -> None:
    assert job_dir_name("+draft=int4,speculate.gamma=2") == "+draft=int4,speculate.gamma=2"
    assert job_dir_name("") == "default"
    slashed = job_dir_name("model.target_path=/data/llama,+draft=bf16")
    assert "/" not in slashed and slashed == job_dir_name("model.target_path=/data/llama,+draft=bf16")
    assert slashed != job_dir_name("model.target_path=_data_llama,+draft=bf16")  # sanitizing never merges two jobs
    long_a, long_b = "x=" + "a" * 300, "x=" + "a" * 299 + "b"
    assert len(job_dir_name(long_a)) < 200 and job_dir_name(long_a) != job_dir_name(long_b)


def test_axis_key() -> None:
    assert axis_key("+draft=int4") == "draft"
    assert axis_key("~kv") == "kv"
    assert axis_key("speculate.gamma=2") == "speculate.gamma"
    assert axis_key("hydra.launcher.n_jobs=2") is None


def _job(sweep: Path, name: str, overrides: list[str], config: dict, summary: dict | None, status: str) -> None:
    job_dir = sweep / name
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides), encoding="utf-8")
    job = jobs.start_job(job_dir, jobs.config_hash(config), "bench", config)
    if status != "running":
        jobs.end_job(job_dir, job, status)
    if summary is not None:
        (job_dir / "summary.json").write_text(json.dumps(summary), encoding="utf-8")


def _summary(gamma: int, speedup: float) -> dict:
    spec = {"requests": 2, "gamma": gamma, "acceptance_rate": 0.5, "tokens_per_verify": 2.0}
    return {"complete": True, "speedup": speedup, "primary_arm": "spec", "arms": {"baseline": {"requests": 2},
            "spec": spec}, "exact_match": {"spec": 1.0}, "errors": 0}  # fmt: skip


def test_sweep_table_has_one_row_per_job_with_axes_status_and_metrics(tmp_path: Path) -> None:
    base = {"target": {"precision": "fp32"}, "draft": {"kind": "model", "precision": "int4"}}
    for gamma, status in ((2, "complete"), (4, "running")):
        config = {**base, "speculate": {"gamma": gamma}}
        summary = _summary(gamma, 1.3) if status == "complete" else None
        _job(tmp_path, f"g{gamma}", ["+draft=int4", f"speculate.gamma={gamma}"], config, summary, status)
    (tmp_path / "g2" / ".superseded-x").mkdir()
    (tmp_path / "g2" / ".superseded-x" / "summary.json").write_text("{}", encoding="utf-8")
    axes, rows = sweep_rows(tmp_path)
    assert axes == ["draft", "speculate.gamma"]
    assert [(r["job"], r["status"], r["speculate.gamma"], r["draft"]) for r in rows] == [
        ("g2", "complete", 2, "int4"), ("g4", "running", 4, "int4")]  # fmt: skip
    assert rows[0]["speedup"] == 1.3 and rows[0]["exact_match"] == 1.0 and rows[1]["speedup"] is None
    with open(write_sweep_csv(tmp_path), newline="", encoding="utf-8") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 2 and table[0]["alpha"] == "0.5" and table[1]["alpha"] == ""
    assert list(table[0])[:7] == ["job", "status", "seconds", "config_hash", "overrides", "draft", "speculate.gamma"]


def test_sweep_table_of_an_empty_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SpecToolkitError, match="no job"):
        write_sweep_csv(tmp_path)


def test_concurrent_jobs_build_a_cached_checkpoint_once(tmp_path: Path) -> None:
    builds, seen = [], []

    def build(out: Path) -> None:
        builds.append(out)
        (out / "weights.bin").write_bytes(b"x" * 1000)
        time.sleep(0.3)  # long enough for the other job to arrive while this one builds
        (out / "config.json").write_text("{}", encoding="utf-8")

    def job() -> None:
        target = cached_directory(tmp_path / "ckpt", "config.json", build)
        seen.append(sorted(p.name for p in target.iterdir()))

    threads = [threading.Thread(target=job) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1
    assert seen == [["config.json", "weights.bin"]] * 3  # every job saw the whole directory
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt-")]  # no temporary left


def test_uncached_hub_model_offline_fails_fast_with_what_to_do(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    start = time.perf_counter()
    with pytest.raises(SpecToolkitError) as raised:
        resolve_path("meta-llama/Llama-3.1-8B-Instruct")
    assert time.perf_counter() - start < 5
    assert "HF_HUB_OFFLINE" in str(raised.value) and "hf download meta-llama/Llama-3.1-8B-Instruct" in str(raised.value)


def test_unreachable_hub_is_one_clear_error(monkeypatch, tmp_path: Path) -> None:
    import huggingface_hub

    def unreachable(repo_id: str) -> None:
        raise ConnectionError("Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *args, **kwargs: None)
    monkeypatch.setattr(huggingface_hub, "auth_check", unreachable)
    with pytest.raises(SpecToolkitError, match="hub cannot be reached .*model.target_path"):
        resolve_path("Qwen/Qwen2.5-7B-Instruct")
