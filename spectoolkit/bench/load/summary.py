"""Aggregate the records of a load sweep: ``summary["serving"][arm][level]`` (DESIGN §3, §6).

Conventions, per (arm, level) over its successful records (never means of per-request means):
- output_throughput = output tokens / (last finish − first arrival) of each run, median over repeats;
  request_throughput likewise with successful requests; speedup = the arm's output_throughput / its
  reference arm's, per repeat (the same time window), then the median; None for a target-alone arm;
  speedup_low / speedup_high = the least and greatest of those per-repeat ratios (the run's own spread: a speedup
  whose range spans 1 was not told apart from the baseline by this run)
- ttft/tpot/latency quantiles are request-level; itl quantiles pool every delivery gap of every request
  (:mod:`spectoolkit.metrics.timing`); numpy linear interpolation
- acceptance_rate = accepted / drafted; mean_accept_length = 1 + accepted / rounds with drafts (vLLM)
- mean_batch_size = mean running batch per engine step; peak_temp_kv_tokens = max candidate KV
  reserved in a step; speculating_share = steps that speculated / steps
- mean_in_flight = total time in the system / window (Little's law), median over repeats
- exact_match (greedy) = share of successful requests whose output equals the batch-1 reference output
  of their case; None when sampling or nothing was checked
- k_distribution: per drafting arm, verify rounds by the draft length k its policy chose, overall, per
  load level (run order) and per task type (:mod:`spectoolkit.metrics.draft_lengths`)
- by sampling mode ("greedy", "T=0.7": a request's temperature; several with ``serve.sampling_mix``):
  mode_throughput = that mode's output tokens / the whole run's window (both modes share it), median over
  repeats; speedup_by_mode = the arm's mode_throughput / its reference arm's, per repeat, then the median;
  acceptance_by_mode as acceptance_rate. Exactness checks only greedy requests against the greedy references
A leaf module (metrics and the serving API only), so the report may import it.
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from spectoolkit.metrics.draft_lengths import k_distributions
from spectoolkit.metrics.records import RequestRecord
from spectoolkit.metrics.spec_counters import SpecCounters
from spectoolkit.metrics.summary import first_divergence, quantiles
from spectoolkit.metrics.timing import delivery_gaps
from spectoolkit.serving.api import StepStats

if TYPE_CHECKING:
    from spectoolkit.bench.load.plan import Level

Records = list[RequestRecord]
REFERENCE_LEVEL = "1"  # a closed loop of one client: the batch-1 reference when the sweep has it


@dataclass
class StepTotals:
    """Engine steps of one run (arm, level, repeat), totalled as they come."""

    steps: int = 0
    speculating: int = 0
    batch_total: int = 0  # sum of running batch sizes
    peak_reserved_kv: int = 0  # most candidate KV slots reserved in one step
    # The draft-length policy's decode steps (it predicted; no prefill chunk): what it expected and what they gave.
    predicted_tokens: float = 0.0
    predicted_planned: float = 0.0  # its T_B at the tokens it planned (what it decided on)
    predicted_target: float = 0.0  # its T_B at the tokens the step ran (its curve against V(w))
    predicted_draft: float = 0.0
    emitted_tokens: int = 0
    measured_target: float = 0.0  # step_time - draft_time: the forward, verification and commit
    measured_draft: float = 0.0

    def add(self, stats: StepStats) -> None:
        self.steps += 1
        self.speculating += int(stats.speculating)
        self.batch_total += stats.batch_size
        self.peak_reserved_kv = max(self.peak_reserved_kv, stats.reserved_kv_tokens)
        if stats.predicted_tokens is not None and not stats.prefill_tokens:
            self.predicted_tokens += stats.predicted_tokens
            self.predicted_planned += stats.predicted_target_seconds or 0.0
            self.predicted_target += stats.predicted_actual_seconds or 0.0
            self.predicted_draft += stats.predicted_draft_seconds or 0.0
            self.emitted_tokens += stats.emitted_tokens
            self.measured_target += stats.step_time - stats.draft_time
            self.measured_draft += stats.draft_time


StepBook = dict[tuple[str, str, int], StepTotals]  # (arm, level key, repeat) -> its steps


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def run_rates(records: Records) -> dict[str, float | None]:
    """Throughputs of one run: output tokens and successful requests per second of its window."""
    spans = [(r.arrival_offset, r.arrival_offset + r.total_time) for r in records
             if r.arrival_offset is not None and r.total_time is not None]  # fmt: skip
    window = max(end for _, end in spans) - min(start for start, _ in spans) if spans else 0.0
    ok = [r for r in records if not r.error]
    if window <= 0:
        return {"output_throughput": None, "request_throughput": None, "mean_in_flight": None}
    return {
        "output_throughput": sum(r.output_len for r in ok) / window,
        "request_throughput": len(ok) / window,
        "mean_in_flight": sum(end - start for start, end in spans) / window,
    }


def _by_repeat(records: Records) -> dict[int, Records]:
    groups: dict[int, Records] = defaultdict(list)
    for record in records:
        groups[record.repeat_idx].append(record)
    return dict(sorted(groups.items()))


def acceptance(records: Records) -> dict[str, float | None]:
    """acceptance_rate = accepted / drafted; mean_accept_length = 1 + accepted / rounds with drafts."""
    drafted = sum(r.drafted_tokens for r in records)
    accepted = sum(r.accepted_tokens for r in records)
    rounds = sum(sum(d > 0 for d in r.draft_lengths) for r in records)
    mean_accept_length = 1 + accepted / rounds if rounds else None
    return {"acceptance_rate": _ratio(accepted, drafted), "mean_accept_length": mean_accept_length}


def _steps(totals: list[StepTotals]) -> dict[str, float | None]:
    steps = sum(t.steps for t in totals)
    return {
        "mean_batch_size": _ratio(sum(t.batch_total for t in totals), steps),
        "peak_temp_kv_tokens": max(t.peak_reserved_kv for t in totals) if steps else None,
        "speculating_share": _ratio(sum(t.speculating for t in totals), steps),
        **_predicted(totals),
    }


def _predicted(totals: list[StepTotals]) -> dict[str, float | None]:
    """The policy's expectation against the measurement over its decode steps (issue 57): tokens per second it
    predicted (for the drafts it planned) and got, and each part's ratio predicted / measured (tokens: its acceptance
    estimates, and drafters proposing fewer than planned; target: its step-cost curve at the width each step ran
    against the engine's V(w) at that batch; draft: its draft forward's cost)."""
    predicted = sum(t.predicted_tokens for t in totals)
    seconds = sum(t.predicted_planned + t.predicted_draft for t in totals)
    measured = sum(t.measured_target + t.measured_draft for t in totals)
    emitted = sum(t.emitted_tokens for t in totals)
    return {
        "policy_predicted_rate": _ratio(predicted, seconds) if predicted else None,
        "policy_measured_rate": _ratio(emitted, measured) if predicted else None,
        "policy_tokens_ratio": _ratio(predicted, emitted) if predicted else None,
        "policy_target_ratio": _ratio(sum(t.predicted_target for t in totals), sum(t.measured_target for t in totals))
        if predicted else None,
        "policy_draft_ratio": _ratio(sum(t.predicted_draft for t in totals), sum(t.measured_draft for t in totals))
        if predicted else None,
    }  # fmt: skip


def _pooled_itl(records: Records) -> list[float]:
    return [gap for r in records for gap in delivery_gaps(r.token_offsets)]


def sampling_mode(record: RequestRecord) -> str:
    """ "greedy" or "T=0.7": the rule a request ran under, as reports group requests."""
    return "greedy" if not record.temperature else f"T={record.temperature:g}"


def mode_rates(records: Records) -> dict[str, float | None]:
    """One run's output tokens per second of its whole window, per sampling mode."""
    window = run_rates(records)["output_throughput"]
    total = sum(r.output_len for r in records if not r.error)
    modes = sorted({sampling_mode(r) for r in records})
    if window is None or not total:
        return dict.fromkeys(modes)
    return {mode: window * sum(r.output_len for r in records if not r.error and sampling_mode(r) == mode) / total
            for mode in modes}  # fmt: skip


def _checked(records: Records, references: dict[str, list[int]] | None) -> list[tuple[RequestRecord, int | None]]:
    """(record, first divergence or None) for every successful greedy record whose case has a reference (the
    references are greedy: a sampled request of a sampling mix is not checked against them)."""
    if references is None:
        return []
    return [(r, first_divergence(references[r.case_id], r.output_ids)) for r in records
            if r.case_id in references and sampling_mode(r) == "greedy"]  # fmt: skip


def level_stats(
    records: Records, totals: list[StepTotals], references: dict[str, list[int]] | None, greedy: bool
) -> dict[str, Any]:
    """The statistics of one arm at one level (all its repeats)."""
    ok = [r for r in records if not r.error]
    rates = {repeat: run_rates(group) for repeat, group in _by_repeat(records).items()}
    ttft, tpot = quantiles([r.ttft for r in ok], (50, 99)), quantiles([r.tpot for r in ok], (50, 99))
    itl, latency = quantiles(_pooled_itl(ok), (50, 99)), quantiles([r.total_time for r in ok], (95, 99))
    checked = _checked(ok, references) if greedy else []
    by_task: dict[str, Records] = defaultdict(list)
    for record in records:
        by_task[record.task_type].append(record)
    return {
        "output_throughput": _median([rate["output_throughput"] for rate in rates.values()]),
        "output_throughput_by_repeat": {str(k): rate["output_throughput"] for k, rate in rates.items()},
        "request_throughput": _median([rate["request_throughput"] for rate in rates.values()]),
        "mean_in_flight": _median([rate["mean_in_flight"] for rate in rates.values()]),
        "ttft_p50": ttft["p50"], "ttft_p99": ttft["p99"], "tpot_p50": tpot["p50"], "tpot_p99": tpot["p99"],
        "itl_p50": itl["p50"], "itl_p99": itl["p99"], "latency_p95": latency["p95"], "latency_p99": latency["p99"],
        **_steps(totals),
        **acceptance(ok),
        "preemptions": sum(r.preemptions or 0 for r in ok),
        "errors": len(records) - len(ok),
        "num_requests": len(records),
        "speedup": None,
        "speedup_low": None,
        "speedup_high": None,
        "exact_match": sum(pos is None for _, pos in checked) / len(checked) if checked else None,
        "by_task": {task: {**acceptance([r for r in group if not r.error]), "num_requests": len(group)}
                    for task, group in sorted(by_task.items())},
        "requests_by_mode": dict(Counter(sampling_mode(r) for r in records)),
        "acceptance_by_mode": {mode: acceptance([r for r in ok if sampling_mode(r) == mode])["acceptance_rate"]
                               for mode in sorted({sampling_mode(r) for r in ok})},
        "speedup_by_mode": {},
    }  # fmt: skip


def _speedup_by_mode(arm: dict[int, Records], reference: dict[int, Records]) -> dict[str, float | None]:
    """Per sampling mode, the median over repeats of its mode_throughput(arm) / mode_throughput(reference)."""
    ratios: dict[str, list[float | None]] = defaultdict(list)
    for repeat, group in arm.items():
        if repeat in reference:
            mine, theirs = mode_rates(group), mode_rates(reference[repeat])
            for mode, rate in mine.items():
                other = theirs.get(mode)
                ratios[mode].append(rate / other if rate is not None and other else None)
    return {mode: _median(values) for mode, values in sorted(ratios.items())}


def _speedup(arm: dict[int, Records], reference: dict[int, Records]) -> dict[str, float | None]:
    """output_throughput(arm) / output_throughput(reference) per repeat (the same time window): their median, least
    and greatest."""
    ratios = []
    for repeat, group in arm.items():
        if repeat in reference:
            mine, theirs = run_rates(group)["output_throughput"], run_rates(reference[repeat])["output_throughput"]
            if mine is not None and theirs:
                ratios.append(mine / theirs)
    return {"speedup": _median(ratios), "speedup_low": min(ratios, default=None),
            "speedup_high": max(ratios, default=None)}  # fmt: skip


def references_from_level(records: Records, arm: str, level_key: str = REFERENCE_LEVEL) -> dict[str, list[int]]:
    """case_id -> output ids of ``arm``'s first successful request of that case at ``level_key``."""
    out: dict[str, list[int]] = {}
    for record in sorted(records, key=lambda r: r.repeat_idx):
        if record.arm == arm and record.load_level == level_key and not record.error:
            out.setdefault(record.case_id, record.output_ids)
    return out


def _exactness(records: Records, reference_arm: str, references: dict[str, list[int]] | None) -> dict[str, Any]:
    checked = _checked([r for r in records if not r.error], references)
    divergent = [
        {"arm": r.arm, "level": r.load_level, "case_id": r.case_id, "repeat": r.repeat_idx, "position": pos}
        for r, pos in checked if pos is not None
    ]  # fmt: skip
    return {"reference": f"{reference_arm} at concurrency 1", "divergent": divergent, "checked": len(checked)}


def serving_summary(
    records: Records,
    levels: list[Level],
    arms: dict[str, str | None],
    steps: StepBook,
    references: dict[str, list[int]] | None,
    greedy: bool,
    server_counters: dict[tuple[str, str, int], SpecCounters] | None = None,
) -> dict[str, Any]:
    """``serving_levels``, ``serving`` ({arm: {level key: stats}}), ``serving_exactness`` (greedy runs) and
    ``k_distribution`` ({drafting arm: the distribution of k per round}).

    ``arms`` maps each arm name to its reference arm (None for a target-alone arm), in run order;
    ``references`` maps case_id -> the batch-1 output ids of the target-alone reference.
    ``server_counters``: an arm on a server, the change of its ``/metrics`` speculation counters per
    (arm, level, repeat); where the records carry no drafts, the level's acceptance comes from them.
    """
    groups: dict[tuple[str, str], Records] = defaultdict(list)
    for record in records:
        groups[(record.arm, record.load_level)].append(record)
    serving: dict[str, dict[str, Any]] = {}
    for arm, reference in arms.items():
        serving[arm] = {}
        for level in levels:
            totals = [t for (name, key, _), t in steps.items() if (name, key) == (arm, level.key)]
            stats = level_stats(groups.get((arm, level.key), []), totals, references, greedy)
            if reference is not None:
                mine, theirs = groups.get((arm, level.key), []), groups.get((reference, level.key), [])
                stats.update(_speedup(_by_repeat(mine), _by_repeat(theirs)))
                stats["speedup_by_mode"] = _speedup_by_mode(_by_repeat(mine), _by_repeat(theirs))
            deltas = [v for (a, k, _), v in (server_counters or {}).items() if (a, k) == (arm, level.key)]
            _server_acceptance(stats, deltas)
            serving[arm][level.key] = stats
    reference_arm = next((name for name, ref in arms.items() if ref is None), next(iter(arms), "baseline"))
    return {
        "serving_levels": [level.as_json() for level in levels],
        "serving": serving,
        "serving_exactness": _exactness(records, reference_arm, references) if greedy else None,
        "k_distribution": _k_by_level(records, [arm for arm, ref in arms.items() if ref is not None], levels),
    }


def _server_acceptance(stats: dict[str, Any], deltas: list[SpecCounters]) -> None:
    """The repeats' server counter deltas summed into ``stats["server_counters"]``; acceptance from them
    when the records have none (an HTTP client sees tokens, not drafts)."""
    if not deltas:
        return
    summed = functools.reduce(SpecCounters.plus, deltas).as_json()
    stats["server_counters"] = summed
    if stats["acceptance_rate"] is None and summed["acceptance_rate"] is not None:
        stats["acceptance_rate"], stats["mean_accept_length"] = summed["acceptance_rate"], summed["mean_accept_length"]
        stats["acceptance_source"] = "server /metrics"


def _k_by_level(records: Records, drafting: list[str], levels: list[Level]) -> dict[str, Any]:
    """:func:`k_distributions` of the drafting arms, each arm's load levels in the sweep's order."""
    found = k_distributions(records, drafting)
    order = [level.key for level in levels]
    for dist in found.values():
        by_level = dist["by_load_level"]
        ordered = {key: by_level[key] for key in order if key in by_level}
        dist["by_load_level"] = ordered | {key: value for key, value in by_level.items() if key not in ordered}
    return found
