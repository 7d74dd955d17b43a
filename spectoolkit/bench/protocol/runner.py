"""The measurement protocol of one run: warm-up, then repeats with baseline and spec interleaved.

For every (case, repeat) every arm (baseline, spec, or an experiment's set: four_groups, gamma_sweep)
decodes the same prompt with the same seed, one right after the other (their order rotates), so they
share the machine's state and time window (DESIGN §3). Before the timed passes, the target forward
is timed at every verify width for the cost model (``bench.calibrate``).
Records are appended as produced; ``summary.json`` is written atomically at the end — also after
Ctrl-C, then with ``"complete": false``.
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from spectoolkit.bench.protocol.baseline_check import stock_baseline_check
from spectoolkit.bench.protocol.calibrate import calibration_context, calibration_widths, measure_verify_costs
from spectoolkit.bench.protocol.conditions import host_rss_bytes, run_conditions
from spectoolkit.bench.report.render import write_report
from spectoolkit.config import RunConfig
from spectoolkit.errors import SpecToolkitError
from spectoolkit.eval.exactness_section import greedy_exactness
from spectoolkit.eval.quality_section import quant_quality
from spectoolkit.metrics.gamma_validation import gamma_validation
from spectoolkit.metrics.records import RecordWriter, RequestRecord, read_records, write_json_atomic
from spectoolkit.metrics.summary import cost_models, summarize
from spectoolkit.metrics.token_cost import batch_token_cost
from spectoolkit.runtime.compiled import compiled_runners
from spectoolkit.wiring.setup import Arm, ArmSet, LoadedModels, RunSetup, build, frozen_heap
from spectoolkit.workloads.prompts import Request, encode_prompt, load_workload

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
    prompts = [_encode(setup.models, request, cfg) for request in requests]
    _set_aside(out_dir / RECORDS_FILE)
    complete, extra = False, {"verify_costs": {}}
    try:
        with frozen_heap(), RecordWriter(out_dir / RECORDS_FILE) as writer:
            _warm_up(setup.arm_set, cfg, prompts)
            extra["verify_costs"] = _calibrate(setup.arm_set, cfg, prompts, setup.models.max_positions)
            if cfg.bench.baseline_check:  # is our baseline as fast as stock transformers?
                extra["baseline_check"] = stock_baseline_check(cfg, setup, prompts, progress)
            _measure(setup.arm_set, setup.models.device, cfg, requests, prompts, writer, progress)
        extra["exactness"] = _exactness(cfg, setup.arm_set, requests, prompts, out_dir)
        extra["quant_quality"] = _quality(cfg, setup.models)
        complete = True
    finally:  # Ctrl-C included: keep what was finished and say the run is incomplete
        summary = _write_summary(cfg, setup, out_dir, complete, extra)
    return summary


def _exactness(cfg: RunConfig, arm_set: ArmSet, requests, prompts, out_dir: Path) -> dict[str, Any] | None:
    """Greedy runs: the classified divergences of every drafting arm (sampling: the quality eval's job)."""
    if not cfg.sampling.greedy or not arm_set.drafting():
        return None
    by_case = {r.case_id: ids for r, ids in zip(requests, prompts, strict=True) if isinstance(ids, list)}
    return greedy_exactness(read_records(out_dir / RECORDS_FILE), arm_set, by_case, cfg.kv.target)


def _quality(cfg: RunConfig, models: LoadedModels) -> dict[str, Any] | None:
    """The quant_quality section; a failure is reported in it instead of losing the run."""
    try:
        return quant_quality(cfg, models)
    except SpecToolkitError as exc:
        return {"error": str(exc)}


def _encode(models: LoadedModels, request: Request, cfg: RunConfig) -> list[int] | str:
    """Prompt ids, or the reason this request cannot run (it then fails alone)."""
    if request.error:
        return request.error
    ids = encode_prompt(models.tokenizer, request, cfg.workload.chat_template)
    if not ids:
        return "empty prompt"
    needed = len(ids) + cfg.workload.max_new_tokens
    if needed > models.max_positions:
        return (
            f"prompt of {len(ids)} tokens + max_new_tokens {cfg.workload.max_new_tokens} exceeds the "
            f"model's context of {models.max_positions} positions"
        )
    return ids


def _set_aside(path: Path) -> None:
    """Never overwrite earlier measurements: move an old ``name.jsonl`` out of the way (``name.<stamp>.jsonl``)."""
    if path.exists():
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside, count = path.with_name(f"{path.stem}.{stamp}{path.suffix}"), 1
        while aside.exists():  # two runs within one second: rename() would silently replace the first
            aside, count = path.with_name(f"{path.stem}.{stamp}-{count}{path.suffix}"), count + 1
        path.rename(aside)


def _warm_up(arm_set: ArmSet, cfg: RunConfig, prompts: list[list[int] | str]) -> None:
    """Untimed generations so first-call costs (allocation, kernel selection) are not measured."""
    runnable = [ids for ids in prompts if isinstance(ids, list)]
    for index in range(cfg.bench.warmup if runnable else 0):
        ids = runnable[index % len(runnable)]
        for arm in arm_set.arms:
            arm.engine.generate(ids, min(cfg.workload.max_new_tokens, 16), torch.Generator().manual_seed(index))
    for runner in compiled_runners(arm.engine for arm in arm_set.arms).values():
        runner.compile_stats.mark_warm()  # a graph compiled later would be inside measured time: reported


def _calibrate(
    arm_set: ArmSet, cfg: RunConfig, prompts: list[list[int] | str], max_positions: int
) -> dict[str, dict[int, float]]:
    """Target forward time per verify width, for each drafting arm's target (the cost model's V)."""
    runnable = [ids for ids in prompts if isinstance(ids, list)]
    drafting = arm_set.drafting()
    if not (cfg.bench.calibrate and runnable and drafting):
        return {}
    widths = calibration_widths(arm.gamma for arm in drafting)
    context = calibration_context(runnable, cfg.workload.max_new_tokens, max_positions, max(widths))
    by_runner: dict[int, dict[int, float]] = {}
    for arm in drafting:
        runner = arm.engine.target
        if id(runner) not in by_runner:
            by_runner[id(runner)] = measure_verify_costs(runner, context, widths)
        arm.engine.policy.seed(by_runner[id(runner)])  # an adaptive policy starts from the calibrated V(w)
    return {arm.name: by_runner[id(arm.engine.target)] for arm in drafting}


def _measure(
    arm_set: ArmSet, device: torch.device, cfg: RunConfig, requests, prompts, writer: RecordWriter, progress: bool
) -> None:
    arms = arm_set.arms
    total = cfg.bench.repeat * len(requests) * len(arms)
    started = time.perf_counter()
    with tqdm(total=total, disable=not progress, desc="generations", unit="gen") as bar:
        for repeat_idx in range(cfg.bench.repeat):
            for case_idx, (request, ids) in enumerate(zip(requests, prompts, strict=True)):
                seed = request_seed(cfg.sampling.seed, request.case_id, repeat_idx)
                shift = (repeat_idx + case_idx) % len(arms)  # rotate: every arm runs first equally often
                for arm in arms[shift:] + arms[:shift]:
                    record = _one(device, cfg, request, ids, arm, repeat_idx, seed)
                    record.start_offset = time.perf_counter() - started
                    writer.write(record)
                    bar.update()


def _one(
    device: torch.device, cfg: RunConfig, request: Request, ids, arm: Arm, repeat_idx: int, seed: int
) -> RequestRecord:
    """Generate once and turn the result into a record (or an error record)."""
    drafting = arm.gamma > 0
    record = RequestRecord(
        case_id=request.case_id, task_type=request.task_type, repeat_idx=repeat_idx, arm=arm.name,
        drafter=arm.drafter, target_precision=arm.target_precision, draft_precision=arm.draft_precision,
        random_seed=seed, kv_target=cfg.kv.target, kv_draft=cfg.kv.draft if arm.draft else None,
        temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
        draft_len=arm.gamma if drafting else 0,
    )  # fmt: skip
    drafter = arm.engine.drafter
    record.tree = drafter.describe_tree() if drafter is not None else None
    if isinstance(ids, str):
        record.error = ids
        return record
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first_delivered: list[float] = []
    on_token = lambda _token: first_delivered or first_delivered.append(time.perf_counter())  # noqa: E731
    start = time.perf_counter()
    result = arm.engine.generate(ids, cfg.workload.max_new_tokens, torch.Generator().manual_seed(seed), on_token)
    ttft_nonstreaming = time.perf_counter() - start
    return replace(
        record, ttft=first_delivered[0] - start, ttft_nonstreaming=ttft_nonstreaming,
        input_len=len(ids), output_len=len(result.output_ids), output_ids=result.output_ids,
        total_time=result.total_time, prefill_time=result.prefill_time, draft_time=result.draft_time,
        verify_time=result.verify_time, overhead_time=result.overhead_time, verify_rounds=result.verify_rounds,
        drafted_tokens=result.drafted_tokens, accepted_tokens=result.accepted_tokens,
        rollback_count=result.rollback_count, proposed_rounds=result.proposed_rounds,
        accept_lengths=result.accept_lengths, draft_lengths=result.draft_lengths,
        chosen_lengths=result.chosen_lengths, tree_depths=result.tree_depths, host_rss=host_rss_bytes(),
        gpu_mem_peak=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    )  # fmt: skip


def _write_summary(cfg: RunConfig, setup: RunSetup, out_dir: Path, complete: bool, extra: dict) -> dict[str, Any]:
    path = out_dir / RECORDS_FILE
    records = read_records(path) if path.exists() else []
    arm_set = setup.arm_set
    arm_info = {a.name: {"reference": a.reference, "gamma": a.gamma, "policy": a.policy} for a in arm_set.arms}
    summary = summarize(records, greedy=cfg.sampling.greedy, complete=complete, arms=arm_info, primary=arm_set.primary)
    summary["cost_model"] = cost_models(records, arm_info, extra.pop("verify_costs", {}))
    summary["gamma_validation"] = gamma_validation(summary["cost_model"], arm_info)
    summary["token_cost"] = batch_token_cost(cfg.bench.cost_per_hour, summary["arms"])
    summary.update(extra)
    summary["conditions"] = run_conditions(cfg, setup)
    write_json_atomic(out_dir / SUMMARY_FILE, summary)
    _report(out_dir)
    return summary


def _report(out_dir: Path) -> None:
    """Write report.md; the measurements are already safe in summary.json, so a failure only warns."""
    try:
        write_report(out_dir)
    except Exception as exc:  # noqa: BLE001  a report bug must not turn a finished run into a failure
        print(f"warning: report.md not written ({type(exc).__name__}: {exc}); retry with "
              f"python -m spectoolkit.report {out_dir}", file=sys.stderr)  # fmt: skip
