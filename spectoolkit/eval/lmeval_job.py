"""The lm-eval quality job (``+eval=lmeval``): the reference target and the speculative configuration
on the same tasks, scores side by side.

The reference is the target alone at its own precision (DESIGN §1: the exact reference of a
quantized target is the quantized target); the speculative configuration adds the run's drafter,
γ, KV and sampling. Both are arms of one :func:`spectoolkit.wiring.setup.build`, so they share the
loaded target. In greedy mode every score (and every generated text) must be identical; a
difference is flagged in the table and in ``lmeval.json`` as a bug to explain.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from pathlib import Path
from typing import Any

from spectoolkit.config import RunConfig
from spectoolkit.errors import SpecToolkitError
from spectoolkit.eval.lmeval import TASKS_DIR, SpecToolkitLM
from spectoolkit.eval.lmeval_args import model_args_of
from spectoolkit.metrics.records import write_json_atomic
from spectoolkit.wiring.setup import build

RESULT_FILE = "lmeval.json"


def run_lmeval_job(config: RunConfig) -> str:
    """Run ``config.eval.tasks`` for both configurations; writes ``<output_dir>/lmeval.json``, returns the table."""
    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its per-stage INFO lines would bury the table
    logging.getLogger("lm_eval.api.task").setLevel(logging.ERROR)  # "custom kwargs" advice on every custom_dataset
    task_manager = task_manager_for(config.eval.tasks)
    check_tasks(task_manager, config.eval.tasks, config.eval.allow_code_execution)
    config = dataclasses.replace(config, bench=dataclasses.replace(config.bench, arms="standard"))
    setup = build(config)
    reference_lm = SpecToolkitLM.from_setup(setup, "baseline", config)
    scores = {"reference": _evaluate(reference_lm, config, task_manager)}
    if setup.arm_set.primary:
        speculative_lm = SpecToolkitLM.from_setup(setup, setup.arm_set.primary, config)
        scores["speculative"] = _evaluate(speculative_lm, config, task_manager)
    else:  # draft=none: the speculative configuration is the reference itself
        scores["speculative"] = scores["reference"]
    reference_args = {**model_args_of(config), "draft": "none"}
    payload = {
        "tasks": list(config.eval.tasks),
        "limit": config.eval.limit,
        "greedy": config.sampling.greedy,
        "reference": reference_args,
        "speculative": {**model_args_of(config), "drafter": setup.facts.drafter_name},
        "rows": compare(scores["reference"], scores["speculative"]),
    }
    payload["identical"] = all(row["identical"] for row in payload["rows"])
    payload["greedy_mismatch"] = payload["greedy"] and not payload["identical"]
    Path(config.output_dir).mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(config.output_dir) / RESULT_FILE, payload)
    if payload["greedy_mismatch"]:
        print("error: greedy speculative decoding changed lm-eval results (see lmeval.json)", file=sys.stderr)
    return format_table(payload, Path(config.output_dir) / RESULT_FILE)


def task_manager_for(tasks: tuple[str, ...]):
    """A TaskManager over the shipped tasks; lm-eval's own (thousands of YAMLs, seconds to index)
    are indexed only when a requested name is not one of ours."""
    from lm_eval.tasks import TaskManager

    shipped = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    if all(task in shipped.task_index for task in tasks):
        return shipped
    return TaskManager(include_path=str(TASKS_DIR))


def check_tasks(task_manager, tasks: tuple[str, ...], allow_code_execution: bool) -> None:
    """User mistakes before any model loads: no tasks, unknown names, code tasks without opt-in."""
    if not tasks:
        raise SpecToolkitError("eval.tasks is empty: name lm-eval tasks, e.g. eval.tasks=[spectoolkit_shortqa]")
    unknown = [task for task in tasks if task not in task_manager.task_index]
    if unknown:
        shipped = sorted(name for name in task_manager.all_tasks if name.startswith("spectoolkit_"))
        raise SpecToolkitError(
            f"unknown lm-eval task(s): {', '.join(unknown)}; the offline tasks shipped with spectoolkit are "
            f"{', '.join(shipped)} (lm-eval's own tasks download their datasets)"
        )
    unsafe = [task for task in tasks if (task_manager.task_index[task].cfg or {}).get("unsafe_code")]
    if unsafe and not allow_code_execution:
        raise SpecToolkitError(
            f"task(s) {', '.join(unsafe)} run model-written code: opt in with eval.allow_code_execution=true "
            "(each program runs in a subprocess with a timeout)"
        )


def _evaluate(lm, config: RunConfig, task_manager) -> dict[str, Any]:
    """lm-eval's simple_evaluate on a built model: {task: {"metrics": {name: value}, "outputs": {doc_id: resp}}}."""
    import lm_eval

    try:
        results = lm_eval.simple_evaluate(
            model=lm, tasks=list(config.eval.tasks), limit=config.eval.limit, task_manager=task_manager,
            confirm_run_unsafe_code=config.eval.allow_code_execution, log_samples=True, bootstrap_iters=0,
        )  # fmt: skip
    except ValueError as exc:  # lm-eval's own refusals (an unsafe subtask of a group, a bad task config)
        raise SpecToolkitError(f"lm-eval: {exc}") from None
    scores = {}
    for task, metrics in results["results"].items():
        values = {key: value for key, value in metrics.items() if "," in key and "_stderr," not in key}
        samples = results.get("samples", {}).get(task, [])
        outputs = {str(sample["doc_id"]): _plain(sample["filtered_resps"]) for sample in samples}
        scores[task] = {"metrics": {key: _plain(value) for key, value in values.items()}, "outputs": outputs}
    return scores


def compare(reference: dict[str, Any], speculative: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task and metric; ``identical`` needs equal scores and equal outputs per document."""
    rows = []
    for task in sorted(reference):
        ref_task, spec_task = reference[task], speculative.get(task, {"metrics": {}, "outputs": {}})
        differing = sorted(
            doc for doc in ref_task["outputs"] if ref_task["outputs"][doc] != spec_task["outputs"].get(doc)
        )
        for metric in sorted(ref_task["metrics"]):
            ref_value, spec_value = ref_task["metrics"][metric], spec_task["metrics"].get(metric)
            same = ref_value == spec_value or (_is_nan(ref_value) and _is_nan(spec_value))
            rows.append({
                "task": task, "metric": metric, "reference": ref_value, "speculative": spec_value,
                "identical": bool(same and not differing), "differing_outputs": differing,
            })  # fmt: skip
    return rows


def format_table(payload: dict[str, Any], path: Path) -> str:
    ref, spec = payload["reference"], payload["speculative"]
    mode = "greedy" if payload["greedy"] else f"sampling T={spec['temperature']}"
    lines = [
        f"lm-eval ({mode}, limit {payload['limit']}): reference = target {ref['target']} alone; "
        f"speculative = target {spec['target']} + {spec['drafter']} (gamma {spec['gamma']})",
        f"{'task':<28} {'metric':<24} {'reference':>10} {'speculative':>12}  identical",
    ]
    for row in payload["rows"]:
        flag = "yes" if row["identical"] else "NO"
        if not row["identical"] and row["differing_outputs"]:
            flag += f" ({len(row['differing_outputs'])} outputs differ)"
        reference, speculative = _fmt(row["reference"]), _fmt(row["speculative"])
        lines.append(f"{row['task']:<28} {row['metric']:<24} {reference:>10} {speculative:>12}  {flag}")
    if payload["greedy_mismatch"]:
        lines.append(
            "!! GREEDY MISMATCH: speculative decoding must reproduce the target's output exactly; this is a bug"
        )
    lines.append(f"written: {path}")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _plain(value: Any) -> Any:
    """numpy scalars and nested lists → JSON values."""
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if hasattr(value, "item"):
        return value.item()
    return value
