"""Per-request records of a load level (DESIGN §3, §6), from the engine's finished requests.

TTFT = first token − arrival, total_time = finish − arrival, queue_time = admitted − arrival; TPOT and
inter-token latency follow :mod:`spectoolkit.metrics.timing`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from spectoolkit.bench.load.generator import Completion
from spectoolkit.bench.load.plan import Case, Level
from spectoolkit.config import RunConfig
from spectoolkit.metrics.records import RequestRecord
from spectoolkit.metrics.spec_counters import SpecCounters
from spectoolkit.metrics.timing import delivery_gaps, percentile, time_per_output_token
from spectoolkit.serving.api import FinishedRequest, ServingEngine


class ServingArmLike(Protocol):
    """What the load protocol reads of a serving arm (``spectoolkit.serving.assemble.ServingArm``)."""

    name: str
    engine: ServingEngine
    gamma: int
    drafter: str
    target_precision: str
    draft_precision: str | None
    reference: str | None
    policy: str

    def snapshot(self) -> SpecCounters | None:
        """A server's own speculation counters now (its ``/metrics``); None: the arm's engine reports none of its
        own (an in-process engine: its counts are in its records)."""
        ...


@dataclass(frozen=True)
class RunContext:
    """Where a record was measured: which arm, level and repeat, and when the timed phase began."""

    cfg: RunConfig
    arm: ServingArmLike
    level: Level
    repeat_idx: int
    measure_start: float  # clock when the first timed level run began (start_offset counts from here)


def base_record(ctx: RunContext, case: Case, seed: int) -> RequestRecord:
    """The identifying fields of a record of ``case`` in ``ctx`` (no measurement yet)."""
    cfg, arm = ctx.cfg, ctx.arm
    return RequestRecord(
        case_id=case.case_id, task_type=case.task_type, repeat_idx=ctx.repeat_idx, arm=arm.name,
        drafter=arm.drafter, target_precision=arm.target_precision, draft_precision=arm.draft_precision,
        random_seed=seed, kv_target=cfg.kv.target, kv_draft=cfg.kv.draft if arm.draft_precision else None,
        temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
        draft_len=arm.gamma, load_level=ctx.level.key, rate=None if ctx.level.closed else ctx.level.value,
        concurrency=int(ctx.level.value) if ctx.level.closed else 0, batch_size=0,
    )  # fmt: skip


def error_record(ctx: RunContext, case: Case, seed: int) -> RequestRecord:
    """A prompt that cannot run: recorded with its reason, never sent."""
    return replace(base_record(ctx, case, seed), error=case.error)


def serving_record(ctx: RunContext, case: Case, seed: int, completion: Completion) -> RequestRecord:
    """The record of one finished request (failed alone: its ``error`` and times only)."""
    done: FinishedRequest = completion.finished
    record = base_record(ctx, case, seed)
    if done.sampling is not None:  # the rule it ran under (a sampling mix's, or the engine's)
        sampling = done.sampling
        record = replace(record, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    mean_batch = float(np.mean(done.batch_sizes)) if done.batch_sizes else None
    times = done.token_times
    gaps = delivery_gaps(times)
    return replace(
        record,
        concurrency=record.concurrency if ctx.level.closed else round(completion.in_flight),
        batch_size=round(mean_batch) if mean_batch is not None else 0, mean_batch_size=mean_batch,
        input_len=done.prompt_len, output_len=len(done.output_ids), output_ids=list(done.output_ids),
        arrival_offset=done.arrival - completion.level_start, start_offset=done.arrival - ctx.measure_start,
        queue_time=done.scheduled - done.arrival if done.scheduled is not None else None,
        ttft=times[0] - done.arrival if times else None, ttft_nonstreaming=done.finish - done.arrival,
        total_time=done.finish - done.arrival, tpot=time_per_output_token(times),
        itl_p50=percentile(gaps, 50), itl_p99=percentile(gaps, 99),
        token_offsets=[t - done.arrival for t in times],
        verify_rounds=done.verify_rounds, drafted_tokens=done.drafted_tokens, accepted_tokens=done.accepted_tokens,
        accept_lengths=list(done.accept_lengths), draft_lengths=list(done.draft_lengths),
        chosen_lengths=list(done.chosen_lengths),
        rollback_count=sum(a < d for a, d in zip(done.accept_lengths, done.draft_lengths, strict=False)),
        proposed_rounds=sum(d > 0 for d in done.draft_lengths), preemptions=done.preemptions, error=done.error,
    )  # fmt: skip
