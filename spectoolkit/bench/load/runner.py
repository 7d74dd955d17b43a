"""``serve.enabled`` runs: the load-level protocol end to end (DESIGN §6, issue 15).

Loads the workload and models as the batch-1 protocol does (same prompts, same "cannot run" reasons),
builds the serving arms (``spectoolkit.serving.assemble.serving_arms``; with ``backend=endpoint|vllm``
the arms are OpenAI-compatible servers instead, :mod:`spectoolkit.backends.source`), runs every level
(:mod:`spectoolkit.bench.load.levels`), then writes ``records.jsonl`` (an older one set aside),
``summary.json`` (atomically; after Ctrl-C too, with ``"complete": false``) and ``report.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from spectoolkit.bench.load.exactness import classify_divergences
from spectoolkit.bench.load.levels import LoadSweep, StepLog, reference_outputs, run_levels
from spectoolkit.bench.load.plan import cases_of, check_fits, load_levels
from spectoolkit.bench.load.records import ServingArmLike
from spectoolkit.bench.load.summary import REFERENCE_LEVEL, references_from_level, serving_summary
from spectoolkit.bench.protocol.conditions import run_conditions
from spectoolkit.bench.protocol.runner import RECORDS_FILE, SUMMARY_FILE, _encode, _report, _set_aside
from spectoolkit.config import RunConfig
from spectoolkit.errors import SpecToolkitError
from spectoolkit.metrics.records import RecordWriter, read_records, write_json_atomic
from spectoolkit.metrics.summary_schema import SUMMARY_SCHEMA_VERSION
from spectoolkit.metrics.token_cost import serving_token_cost
from spectoolkit.wiring.setup import Arm, ArmSet, RunSetup, build, frozen_heap
from spectoolkit.workloads.prompts import load_workload

STEPS_FILE = "steps.jsonl"


def _serving_arms(cfg: RunConfig, setup: RunSetup) -> list[ServingArmLike]:
    from spectoolkit.serving.assemble import serving_arms  # the engine core; imported only when serving

    arms = list(serving_arms(cfg, setup))
    if not arms:
        raise SpecToolkitError("serve.enabled=true but no serving arm was built: check draft and bench.arms")
    return arms


def _with_arms(setup: RunSetup, arms: list[ServingArmLike]) -> RunSetup:
    """``setup`` (its models) with the serving arms as the arms its conditions report: what each runs, its
    footprint (weights, the most KV its requests held at once) and its compiled graphs."""
    models = setup.models
    reported = [
        Arm(arm.name, arm.engine, models.target, arm.target_precision, arm.drafter,
            models.draft if arm.draft_precision else None, arm.draft_precision, arm.gamma, arm.reference, arm.policy)
        for arm in arms
    ]  # fmt: skip
    primary = _primary(arms)
    drafter = next((arm.drafter for arm in arms if arm.name == primary), "none")
    facts = dataclasses.replace(setup.facts, drafter_name=drafter)
    return dataclasses.replace(setup, arm_set=ArmSet(reported, primary), facts=facts)


def _step_log(out_dir: Path, enabled: bool) -> contextlib.AbstractContextManager[StepLog | None]:
    if not enabled:
        return contextlib.nullcontext()
    _set_aside(out_dir / STEPS_FILE)  # like the records file: renamed, never appended to
    return contextlib.closing(StepLog(out_dir / STEPS_FILE))


@dataclass
class _Source:
    """What the levels run on: prompts are encoded with ``encoding`` (.tokenizer, .max_positions)."""

    encoding: Any
    arms: list[ServingArmLike]
    conditions: Callable[[list[ServingArmLike]], dict[str, Any]]


@contextlib.contextmanager
def _source(cfg: RunConfig) -> Iterator[_Source]:
    """backend=local: our engine in process; endpoint / vllm: servers (:mod:`spectoolkit.backends.source`)."""
    if cfg.backend.kind == "local":
        setup = build(cfg, arms=False)  # the models: the serving arms are the run's only engines
        arms = _serving_arms(cfg, setup)
        setup = _with_arms(setup, arms)
        with frozen_heap():
            yield _Source(setup.models, arms, lambda _arms: _conditions(cfg, setup))
        return
    from spectoolkit.backends.source import server_source
    from spectoolkit.bench.load.server_conditions import server_conditions

    with server_source(cfg) as servers:
        yield _Source(servers.encoding, list(servers.arms), lambda arms: server_conditions(cfg, arms, servers.managed))


def run_serving(cfg: RunConfig, progress: bool = True) -> dict[str, Any]:
    """Run every load level of ``cfg.serve`` for every arm; returns the summary (also written)."""
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    requests = load_workload(cfg.workload)
    with _source(cfg) as source:
        return _run_levels(cfg, source, requests, out_dir, progress)


def _run_levels(cfg: RunConfig, source: _Source, requests, out_dir: Path, progress: bool) -> dict[str, Any]:
    cases = cases_of(requests, [_encode(source.encoding, request, cfg) for request in requests])
    if cfg.backend.kind == "local":
        check_fits(cases, cfg.serve, cfg.workload.max_new_tokens)
    levels = load_levels(cfg.serve)
    sweep = LoadSweep(cfg, source.arms, levels, cases)
    _set_aside(out_dir / RECORDS_FILE)
    references: dict[str, list[int]] | None = None
    complete = False
    total = len(levels) * cfg.bench.repeat * len(sweep.arms)
    try:
        with tqdm(total=total, disable=not progress, desc="load runs", unit="run") as bar:
            sweep.on_run = lambda arm, level, repeat: bar.update()
            with RecordWriter(out_dir / RECORDS_FILE) as writer, _step_log(out_dir, cfg.serve.step_log) as log:
                run_levels(sweep, writer, log)
        if cfg.sampling.greedy and not _has_reference_level(sweep):
            references = reference_outputs(sweep, _reference_arm(sweep.arms))
        complete = True
    finally:  # Ctrl-C included: keep what was finished and say the run is incomplete
        summary = _write_summary(cfg, source, sweep, out_dir, complete, references)
    return summary


def _has_reference_level(sweep: LoadSweep) -> bool:
    return any(level.key == REFERENCE_LEVEL for level in sweep.levels)


def _reference_arm(arms: list[ServingArmLike]) -> ServingArmLike:
    """The target-alone arm the exactness reference comes from (the baseline)."""
    return next((arm for arm in arms if arm.reference is None), arms[0])


def _conditions(cfg: RunConfig, setup: RunSetup) -> dict[str, Any]:
    """The run conditions of ``setup`` (its arms the serving arms: :func:`_with_arms`), with the load settings in
    place of batch 1."""
    conditions = run_conditions(cfg, setup)
    conditions["batch_size"] = conditions["concurrency"] = None  # they vary: see serving_levels
    conditions["serve"] = dataclasses.asdict(cfg.serve)
    return conditions


def _primary(arms: list[ServingArmLike]) -> str | None:
    return next((arm.name for arm in arms if arm.gamma > 0), None)


def _write_summary(
    cfg: RunConfig,
    source: _Source,
    sweep: LoadSweep,
    out_dir: Path,
    complete: bool,
    references: dict[str, list[int]] | None,
) -> dict[str, Any]:
    path = out_dir / RECORDS_FILE
    records = read_records(path) if path.exists() else []
    arms = {arm.name: arm.reference for arm in sweep.arms}
    if cfg.sampling.greedy and _has_reference_level(sweep):  # the batch-1 outputs were measured at level "1"
        references = references_from_level(records, _reference_arm(sweep.arms).name)
    summary: dict[str, Any] = {
        "schema_version": SUMMARY_SCHEMA_VERSION,
        "mode": "serving",
        "complete": complete,
        "requests": len(records),
        "errors": sum(1 for r in records if r.error),
        "error_reasons": sorted({r.error for r in records if r.error})[:20],
        "primary_arm": _primary(sweep.arms),
        "serve": dataclasses.asdict(cfg.serve),
        **serving_summary(
            records, sweep.levels, arms, sweep.steps, references, cfg.sampling.greedy, sweep.server_counters
        ),
        "conditions": source.conditions(sweep.arms),
    }
    summary["token_cost"] = serving_token_cost(cfg.bench.cost_per_hour, summary["serving"], arms)
    if summary.get("serving_exactness") and summary["serving_exactness"]["divergent"]:
        summary["serving_exactness"] = _classified(cfg, sweep, summary["serving_exactness"], records, references)
    write_json_atomic(out_dir / SUMMARY_FILE, summary)
    _report(out_dir)
    return summary


def _classified(cfg: RunConfig, sweep: LoadSweep, section: dict, records, references) -> dict[str, Any]:
    """The divergences replayed with the target alone (:mod:`spectoolkit.bench.load.exactness`); a failure
    there is reported in the section instead of losing the run."""
    engine = _reference_arm(sweep.arms).engine
    model = getattr(engine, "model", None)  # the target both arms run
    if not isinstance(model, torch.nn.Module) or references is None:
        return section
    # Batch-invariant as asked, or by construction (our kernels): then no divergence may be a near-tie.
    invariant = cfg.serve.batch_invariant or getattr(engine, "invariant", False)
    prompts = {case.case_id: case.prompt_ids for case in sweep.cases if case.prompt_ids}
    try:
        return classify_divergences(section, records, prompts, references, model, cfg.target.precision, cfg.kv.target,
                                    invariant)  # fmt: skip
    except Exception as exc:  # noqa: BLE001  the measurements are kept whatever the replay does
        return {**section, "classification_error": f"{type(exc).__name__}: {exc}"}


def _cell(value: Any, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if value is None else format(value * scale, spec) + suffix


def _speedup_text(stats: dict[str, Any]) -> str:
    """The speedup cell: "1.04x", with its repeats' range where they differ: "1.04x (0.98-1.10)"."""
    text, low, high = _cell(stats["speedup"], ".2f", suffix="x"), stats.get("speedup_low"), stats.get("speedup_high")
    if low is None or high is None or f"{low:.2f}" == f"{high:.2f}":
        return text
    return f"{text} ({low:.2f}-{high:.2f})"


def format_serving_table(summary: dict[str, Any]) -> str:
    """Level × arm: output tok/s, speedup, TTFT p99, TPOT p99 (ms), mean batch, α; then exactness."""
    columns = ("level", "arm", "reqs", "out tok/s", "speedup", "ttft p99 ms", "tpot p99 ms", "batch", "alpha")
    rows = []
    for level in summary.get("serving_levels", []):
        for arm, by_level in summary.get("serving", {}).items():
            stats = by_level.get(level["key"])
            if stats is None:
                continue
            rows.append([
                level["key"], arm, str(stats["num_requests"]), _cell(stats["output_throughput"], ".2f"),
                _speedup_text(stats), _cell(stats["ttft_p99"], ".1f", 1e3),
                _cell(stats["tpot_p99"], ".1f", 1e3), _cell(stats["mean_batch_size"], ".2f"),
                _cell(stats["acceptance_rate"], ".3f"),
            ])  # fmt: skip
    widths = [max([len(col), *(len(row[i]) for row in rows)]) for i, col in enumerate(columns)]
    lines = ["  ".join(col.rjust(w) for col, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    exact = summary.get("serving_exactness")
    exact_text = (
        f"{exact['checked'] - len(exact['divergent'])}/{exact['checked']} outputs equal {exact['reference']}"
        if exact else "n/a (sampling)"
    )  # fmt: skip
    lines.append(f"greedy exactness: {exact_text} | errors: {summary['errors']} | complete: {summary['complete']}")
    return "\n".join(lines)
