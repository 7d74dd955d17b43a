"""The load-level protocol: every arm at every level, repeats mirroring the arm order in pairs (DESIGN §3, §6).

For each level: an untimed warm-up of ``serve.warmup_requests`` requests per arm at that load, then
``bench.repeat`` timed runs per arm over the same request sequence, the arm order mirrored in pairs of repeats
and rotated between pairs (:func:`arm_order`: baseline, spec; spec, baseline; spec, baseline; …) so arms share the
time window. ``engine.reset()`` before every run.
Records are written as requests finish; step statistics are totalled per (arm, level, repeat) and, with
``serve.step_log``, appended to ``steps.jsonl``. An arm on a server (``snapshot()``: its ``/metrics``
speculation counters) gets their change over each timed run in ``server_counters``. Afterwards, greedy
runs without level "1" get their exactness reference: the baseline at concurrency 1 over the distinct prompts, untimed.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from spectoolkit.bench.load.generator import Clock, Completion, FinishHook, LevelRun, StepHook, run_closed, run_open
from spectoolkit.bench.load.plan import Case, Level, Sent, level_requests, runnable, warmup_requests
from spectoolkit.bench.load.records import RunContext, ServingArmLike, error_record, serving_record
from spectoolkit.bench.load.summary import StepBook, StepTotals
from spectoolkit.bench.protocol.runner import request_seed
from spectoolkit.config import RunConfig
from spectoolkit.metrics.records import RecordWriter
from spectoolkit.metrics.spec_counters import SpecCounters
from spectoolkit.serving.api import ServeRequest, ServingEngine, StepStats

Sleep = Callable[[float], None]
COUNTER_SETTLE_S = 0.25  # wait before the closing /metrics scrape of a run on a server


class StepLog:
    """``steps.jsonl``: one JSON line per engine step with its arm, level and repeat, flushed."""

    def __init__(self, path: Path) -> None:
        self._file = Path(path).open("a", encoding="utf-8")

    def write(self, arm: str, level: str, repeat_idx: int, stats: StepStats) -> None:
        line = {"arm": arm, "level": level, "repeat": repeat_idx, **dataclasses.asdict(stats)}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class LoadSweep:
    """One sweep's inputs and what it collects besides the records."""

    cfg: RunConfig
    arms: list[ServingArmLike]
    levels: list[Level]
    cases: list[Case]
    clock: Clock = time.perf_counter
    sleep: Sleep = time.sleep
    steps: StepBook = field(default_factory=dict)
    server_counters: dict[tuple[str, str, int], SpecCounters] = field(default_factory=dict)  # (arm, level, repeat)
    on_run: Callable[[str, str, int], None] | None = None  # (arm, level key, repeat) after each timed run

    def requests(self, level: Level, repeat_idx: int) -> list[Sent]:
        """The request sequence of ``level`` in repeat ``repeat_idx``: the same for every arm."""
        cfg = self.cfg
        return level_requests(self.cases, level, cfg.serve, cfg.workload.max_new_tokens, cfg.sampling, repeat_idx)

    def arrival_seed(self, level: Level, repeat_idx: int) -> int:
        """The open-loop arrival schedule's seed: one per (level, repeat), shared by every arm."""
        return request_seed(self.cfg.sampling.seed, f"arrivals@{level.key}", repeat_idx)


def drive(
    sweep: LoadSweep,
    engine: ServingEngine,
    requests: list[ServeRequest],
    level: Level,
    seed: int,
    on_finish: FinishHook | None = None,
    on_step: StepHook | None = None,
) -> LevelRun:
    """Run ``requests`` on ``engine`` at ``level``: closed loop at N clients, or open loop at its rate."""
    if level.closed:
        return run_closed(engine, requests, int(level.value), sweep.clock, on_finish, on_step)
    return run_open(engine, requests, level.value, seed, sweep.clock, sweep.sleep, on_finish, on_step)


def arm_order(arms: list[ServingArmLike], repeat_idx: int) -> list[ServingArmLike]:
    """Repeats in mirrored pairs: repeat 2k runs the arms rotated by k, repeat 2k + 1 the same order reversed. A pair
    gives every arm the same mean position, so a drift linear in time (bandwidth, clocks) cancels from
    ``bench.repeat=2`` on, whatever the arm count; over 2 × the arm count repeats every arm also runs first, and
    last, equally often."""
    shift = (repeat_idx // 2) % len(arms) if arms else 0
    order = arms[shift:] + arms[:shift]
    return order[::-1] if repeat_idx % 2 else order


def _warm_up(sweep: LoadSweep, arm: ServingArmLike, level: Level) -> None:
    """Untimed: first-call costs (allocation, kernel selection) at this load are not measured."""
    warm = warmup_requests(sweep.cases, sweep.cfg.serve.warmup_requests, sweep.cfg.workload.max_new_tokens)
    if not warm:
        return
    arm.engine.reset()
    clients = int(level.value) if level.closed else len(warm)  # open loop: warm up all at once, no waiting
    run_closed(arm.engine, warm, clients, sweep.clock)
    arm.engine.reset()


def _timed_run(sweep: LoadSweep, ctx: RunContext, writer: RecordWriter, step_log: StepLog | None) -> None:
    """One arm at one level in one repeat: error records first, then the level's requests."""
    arm, level, repeat_idx = ctx.arm, ctx.level, ctx.repeat_idx
    for case in sweep.cases:
        if case.prompt_ids is None:
            writer.write(error_record(ctx, case, request_seed(sweep.cfg.sampling.seed, case.case_id, repeat_idx)))
    sent = {item.request.request_id: item for item in sweep.requests(level, repeat_idx)}
    totals = sweep.steps.setdefault((arm.name, level.key, repeat_idx), StepTotals())

    def finished(completion: Completion) -> None:
        item = sent[completion.finished.request_id]
        writer.write(serving_record(ctx, item.case, item.request.seed, completion))

    def stepped(stats: StepStats) -> None:
        totals.add(stats)
        if step_log:
            step_log.write(arm.name, level.key, repeat_idx, stats)

    arm.engine.reset()
    requests = [s.request for s in sent.values()]
    before = arm.snapshot()
    drive(sweep, arm.engine, requests, level, sweep.arrival_seed(level, repeat_idx), finished, stepped)
    if before is not None:
        sweep.sleep(COUNTER_SETTLE_S)  # the last request's counters reach /metrics just after its last chunk
        after = arm.snapshot()
        if after is not None:
            sweep.server_counters[(arm.name, level.key, repeat_idx)] = after.minus(before)


def run_levels(sweep: LoadSweep, writer: RecordWriter, step_log: StepLog | None = None) -> None:
    """Every level: warm-up per arm, then the timed repeats in :func:`arm_order`."""
    measure_start: float | None = None
    for level in sweep.levels:
        for arm in sweep.arms:
            _warm_up(sweep, arm, level)
        for repeat_idx in range(sweep.cfg.bench.repeat):
            for arm in arm_order(sweep.arms, repeat_idx):
                measure_start = sweep.clock() if measure_start is None else measure_start
                _timed_run(sweep, RunContext(sweep.cfg, arm, level, repeat_idx, measure_start), writer, step_log)
                if sweep.on_run:
                    sweep.on_run(arm.name, level.key, repeat_idx)


def reference_outputs(sweep: LoadSweep, arm: ServingArmLike) -> dict[str, list[int]]:
    """Untimed batch-1 outputs of ``arm`` over the distinct runnable prompts: case_id -> output ids."""
    cfg, by_id = sweep.cfg, {}
    requests = []
    for case in {case.case_id: case for case in runnable(sweep.cases)}.values():
        seed = request_seed(cfg.sampling.seed, case.case_id, 0)
        requests.append(ServeRequest(f"reference:{case.case_id}", case.prompt_ids, cfg.workload.max_new_tokens, seed))
        by_id[requests[-1].request_id] = case.case_id
    arm.engine.reset()
    run = run_closed(arm.engine, requests, 1, sweep.clock)
    arm.engine.reset()
    return {by_id[done.request_id]: list(done.output_ids) for done in run.finished if not done.error}
