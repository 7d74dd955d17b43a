"""The conditions every number of a run holds under: hardware, software, precisions, memory."""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from typing import Any

import torch

from spectoolkit.config import AUTO_COMPILE, RunConfig
from spectoolkit.config_checks import config_warnings
from spectoolkit.errors import SpecToolkitError
from spectoolkit.kernels import cpu_ops, prefetch
from spectoolkit.kernels.kernel_choice import cpu_flags, cpu_model
from spectoolkit.kernels.placement import streaming_buffer
from spectoolkit.kernels.runtime import kernels_usable
from spectoolkit.runtime.compiled import compiled_runners
from spectoolkit.wiring.setup import ArmSet, RunFacts, RunSetup


def hardware(device: torch.device) -> dict[str, Any]:
    """CPU model, the instruction-set flags that choose our kernels' path and the path they took (DESIGN §7:
    every path gives the same bits, so this says which produced the times), threads, and the accelerator."""
    info: dict[str, Any] = {
        "device": str(device),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        **_kernel_paths(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _kernel_paths() -> dict[str, Any]:
    """The path our kernels take here, every path this CPU runs (None when they cannot be built here) and how far
    ahead the linears prefetch their weights (:mod:`~spectoolkit.kernels.prefetch`)."""
    try:
        return {"kernel_path": cpu_ops.isa_name(), "kernel_paths_by_kind": cpu_ops.kernel_paths(),
                "kernel_paths_available": list(cpu_ops.available_isas()),
                "weight_prefetch": prefetch.current().as_record()}  # fmt: skip
    except SpecToolkitError as exc:
        return {"kernel_path": None, "kernel_paths_by_kind": {}, "kernel_paths_available": [], "kernel_build": str(exc)}


def host_rss_bytes() -> int | None:
    """Resident memory of this process now (Linux /proc), else its peak (getrusage); None if neither."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (ImportError, OSError):
        return None


def read_bandwidth_gbs(mib: int = 512, repeats: int = 3) -> float:
    """GB/s of one pass reading a ``mib`` MiB buffer on this process's threads with our kernels' read loop
    (``spectoolkit::read_words``; best of ``repeats``, after one untimed pass) in the memory the packed weights live in
    (huge pages where offered: :func:`~spectoolkit.kernels.placement.streaming_buffer`): the rate a decode step's
    weight stream can reach here, measured in the process that runs it."""
    cpu_ops.load()
    buffer = streaming_buffer(mib * 2**20)
    torch.ops.spectoolkit.read_words(buffer)
    best = min(_timed(lambda: torch.ops.spectoolkit.read_words(buffer)) for _ in range(repeats))
    return buffer.numel() / best / 1e9


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def memory(arm_set: ArmSet, bandwidth_gbs: float | None = None) -> dict[str, Any]:
    """Per-arm footprints and each arm's delta against the baseline; top-level keys: the primary arm.

    On CPU these are the bytes the arm holds (weights + allocated KV); on an accelerator the
    records also carry the measured ``gpu_mem_peak`` per request. Beside them, the bytes of weights a decode step
    streams (target, draft) and, with the measured read ``bandwidth_gbs``, the target step's floor in ms.
    """
    by_arm = {arm.name: arm.memory() for arm in arm_set.arms}
    base_total = by_arm[arm_set.baseline.name]["total_bytes"]
    for footprint in by_arm.values():
        footprint["delta_bytes"] = footprint["total_bytes"] - base_total
    primary = by_arm[arm_set.primary or arm_set.baseline.name]
    keys = ("target_weight_bytes", "draft_weight_bytes", "target_kv_bytes", "draft_kv_bytes", "target_streamed_bytes",
            "draft_streamed_bytes")  # fmt: skip
    floor = None if not bandwidth_gbs else primary["target_streamed_bytes"] / (bandwidth_gbs * 1e6)
    return {**{key: primary[key] for key in keys}, "memory_delta_bytes": primary["delta_bytes"],
            "stream_bandwidth_gbs": bandwidth_gbs, "target_step_floor_ms": floor, "arms": by_arm}  # fmt: skip


def _compat(cfg: RunConfig, facts: RunFacts) -> dict[str, Any]:
    """Whether target and draft vocabularies/tokenizers were checked, and why it holds."""
    if facts.compat_checked:
        return {"checked": True, "note": "separate draft checkpoint passed the vocab/tokenizer check"}
    if cfg.draft.kind == "skip":
        return {"checked": True, "note": "layer-skip self-draft: the target's own layers and tokenizer"}
    if cfg.draft.kind == "model":
        return {"checked": True, "note": "self-draft: the draft is the target checkpoint, same tokenizer"}
    if cfg.draft.kind in ("ngram", "suffix"):
        return {"checked": True, "note": f"{cfg.draft.kind} lookup proposes the target's own token ids"}
    return {"checked": False, "note": "no drafter"}


def _compile(cfg: RunConfig, arm_set: ArmSet) -> dict[str, Any]:
    """``runtime.compile``: the graphs each compiled runner built and what compiling took. They are built at
    setup, before warm-up, so measured times exclude them; ``compiled_after_warm_up`` > 0 says otherwise."""
    runners = compiled_runners(arm.engine for arm in arm_set.arms)
    why = {"why": AUTO_COMPILE} if cfg.runtime.compile == "auto" else {}
    stats = {role: r.compile_stats.as_dict() for role, r in runners.items()}
    return {"setting": cfg.runtime.compile, "enabled": cfg.runtime.compiled, **why, **stats}


def run_conditions(cfg: RunConfig, setup: RunSetup) -> dict[str, Any]:
    """Everything a reader needs to know before trusting a number of this run."""
    import transformers

    models, arm_set, facts = setup.models, setup.arm_set, setup.facts
    return {
        "hardware": hardware(models.device),
        "software": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "triton_kernels": kernels_usable(models.device),  # verify, rtn-* matmul, quantized-KV attention
            "kernels": cfg.runtime.kernels,  # linear kernel variants: measured here (auto) or the reference
        },  # fmt: skip
        "kernels": {  # linear shape -> the row-invariant variant it runs (spectoolkit.kernels.kernel_choice)
            "target": models.target.kernels,
            "draft": models.draft.kernels if models.draft else {},
        },
        "target": {
            "path": models.target.path,
            "precision": cfg.target.precision,
            "group_size": cfg.target.group_size,
            "activations": models.target.activations,
            "label": models.target.label,
        },  # fmt: skip
        "draft": {
            "kind": cfg.draft.kind,
            "name": facts.drafter_name,
            "path": models.draft.path if models.draft else None,
            "precision": cfg.draft.precision if models.draft else None,
            "activations": models.draft.activations if models.draft else None,
        },  # fmt: skip
        "kv": dataclasses.asdict(cfg.kv),
        "compile": _compile(cfg, arm_set),
        "compat": _compat(cfg, facts),
        "arms": [
            {
                "name": arm.name,
                "target_precision": arm.target_precision,
                "drafter": arm.drafter,
                "gamma": arm.gamma,
                "policy": arm.policy,
                "reference": arm.reference,
            }
            for arm in arm_set.arms
        ],  # fmt: skip
        "primary_arm": arm_set.primary,
        "sampling": dataclasses.asdict(cfg.sampling),
        "gamma": cfg.speculate.gamma,
        "policy": cfg.speculate.policy,
        "batch_size": 1,
        "concurrency": 1,
        "workload": dataclasses.asdict(cfg.workload),
        "bench": dataclasses.asdict(cfg.bench),
        "serve": dataclasses.asdict(cfg.serve),  # serve.slo_tpot_ms: the TPOT rule of alerts.yml
        "memory": memory(arm_set, read_bandwidth_gbs() if models.device.type == "cpu" else None),
        "compat_warnings": facts.compat_warnings,
        "warnings": config_warnings(cfg),  # what the run does less than its settings say, by design (tree_chain cuts)
    }
