"""The measurement protocol of one run: warm-up, then repeats with baseline and spec interleaved.

For every (case, repeat) both arms decode the same prompt with the same seed, one right after the
other (their order alternates), so they share the machine's state and time window (DESIGN §3).
Records are appended as produced; ``summary.json`` is written atomically at the end — also after
Ctrl-C, then with ``"complete": false``.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from spectoolkit.bench.conditions import run_conditions
from spectoolkit.bench.quality import quant_quality
from spectoolkit.bench.setup import RunSetup, build
from spectoolkit.bench.workloads import Request, encode_prompt, load_workload
from spectoolkit.config import RunConfig
from spectoolkit.errors import SpecToolkitError
from spectoolkit.metrics.records import RecordWriter, RequestRecord, read_records, write_json_atomic
from spectoolkit.metrics.summary import summarize

RECORDS_FILE = "records.jsonl"
SUMMARY_FILE = "summary.json"


def request_seed(seed: int, case_id: str, repeat_idx: int) -> int:
    """A per-(case, repeat) seed derived from ``sampling.seed``; both arms use it."""
    digest = hashlib.sha256(f"{seed}:{case_id}:{repeat_idx}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def run(cfg: RunConfig, progress: bool = True) -> dict[str, Any]:
    """Run the protocol for ``cfg``; returns the summary (also written to ``output_dir``)."""
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    requests = load_workload(cfg.workload)
    setup = build(cfg)
    prompts = [_encode(setup, request, cfg) for request in requests]
    _set_aside(out_dir / RECORDS_FILE)
    complete, extra = False, {}
    try:
        with RecordWriter(out_dir / RECORDS_FILE) as writer:
            _warm_up(setup, cfg, prompts)
            _measure(setup, cfg, requests, prompts, writer, progress)
        extra["quant_quality"] = _quality(cfg, setup)
        complete = True
    finally:  # Ctrl-C included: keep what was finished and say the run is incomplete
        summary = _write_summary(cfg, setup, out_dir, complete, extra)
    return summary


def _quality(cfg: RunConfig, setup: RunSetup) -> dict[str, Any] | None:
    """The quant_quality section; a failure is reported in it instead of losing the run."""
    try:
        return quant_quality(cfg, setup)
    except SpecToolkitError as exc:
        return {"error": str(exc)}


def _encode(setup: RunSetup, request: Request, cfg: RunConfig) -> list[int] | str:
    """Prompt ids, or the reason this request cannot run (it then fails alone)."""
    if request.error:
        return request.error
    ids = encode_prompt(setup.tokenizer, request, cfg.workload.chat_template)
    if not ids:
        return "empty prompt"
    needed = len(ids) + cfg.workload.max_new_tokens
    if needed > setup.max_positions:
        return (
            f"prompt of {len(ids)} tokens + max_new_tokens {cfg.workload.max_new_tokens} exceeds the "
            f"model's context of {setup.max_positions} positions"
        )
    return ids


def _set_aside(path: Path) -> None:
    """Never overwrite earlier measurements: move an old records file out of the way."""
    if path.exists():
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside, count = path.with_name(f"records.{stamp}.jsonl"), 1
        while aside.exists():  # two runs within one second: rename() would silently replace the first
            aside, count = path.with_name(f"records.{stamp}-{count}.jsonl"), count + 1
        path.rename(aside)


def _arms(setup: RunSetup) -> list[tuple[str, Any]]:
    arms = [("baseline", setup.baseline)]
    return arms + [("spec", setup.spec)] if setup.spec else arms


def _warm_up(setup: RunSetup, cfg: RunConfig, prompts: list[list[int] | str]) -> None:
    """Untimed generations so first-call costs (allocation, kernel selection) are not measured."""
    runnable = [ids for ids in prompts if isinstance(ids, list)]
    for index in range(cfg.bench.warmup if runnable else 0):
        ids = runnable[index % len(runnable)]
        for _, engine in _arms(setup):
            engine.generate(ids, min(cfg.workload.max_new_tokens, 16), torch.Generator().manual_seed(index))


def _measure(setup, cfg: RunConfig, requests, prompts, writer: RecordWriter, progress: bool) -> None:
    arms = _arms(setup)
    total = cfg.bench.repeat * len(requests) * len(arms)
    with tqdm(total=total, disable=not progress, desc="generations", unit="gen") as bar:
        for repeat_idx in range(cfg.bench.repeat):
            for case_idx, (request, ids) in enumerate(zip(requests, prompts, strict=True)):
                seed = request_seed(cfg.sampling.seed, request.case_id, repeat_idx)
                order = arms if (repeat_idx + case_idx) % 2 == 0 else arms[::-1]  # interleave fairly
                for arm, engine in order:
                    writer.write(_one(setup, cfg, request, ids, arm, engine, repeat_idx, seed))
                    bar.update()


def _one(setup, cfg: RunConfig, request: Request, ids, arm: str, engine, repeat_idx: int, seed: int):
    """Generate once and turn the result into a record (or an error record)."""
    record = RequestRecord(
        case_id=request.case_id, task_type=request.task_type, repeat_idx=repeat_idx, arm=arm,
        drafter=setup.drafter_name if arm == "spec" else "none", target_precision=cfg.target.precision,
        draft_precision=cfg.draft.precision if cfg.draft.kind == "model" else None, random_seed=seed,
        kv_target=cfg.kv.target, kv_draft=cfg.kv.draft if cfg.draft.kind == "model" else None,
        temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
        draft_len=cfg.speculate.gamma if arm == "spec" else 0,
    )  # fmt: skip
    if isinstance(ids, str):
        record.error = ids
        return record
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(setup.device)
    result = engine.generate(ids, cfg.workload.max_new_tokens, torch.Generator().manual_seed(seed))
    for name in ("ttft", "total_time", "draft_time", "verify_time", "verify_rounds", "drafted_tokens",
                 "accepted_tokens", "rollback_count", "proposed_rounds", "accept_lengths", "output_ids"):  # fmt: skip
        setattr(record, name, getattr(result, name))
    record.input_len, record.output_len = len(ids), len(result.output_ids)
    if setup.device.type == "cuda":
        record.gpu_mem_peak = torch.cuda.max_memory_allocated(setup.device)
    return record


def _write_summary(cfg: RunConfig, setup: RunSetup, out_dir: Path, complete: bool, extra: dict) -> dict[str, Any]:
    path = out_dir / RECORDS_FILE
    records = read_records(path) if path.exists() else []
    summary = summarize(records, greedy=cfg.sampling.greedy, complete=complete)
    summary.update(extra)
    summary["conditions"] = run_conditions(cfg, setup)
    write_json_atomic(out_dir / SUMMARY_FILE, summary)
    return summary
