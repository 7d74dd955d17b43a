"""The conditions every number of a run holds under: hardware, software, precisions, memory."""

from __future__ import annotations

import dataclasses
import os
import platform
from typing import Any

import torch

from spectoolkit.config import RunConfig
from spectoolkit.kernels.runtime import kernels_usable


def hardware(device: torch.device) -> dict[str, Any]:
    """CPU model and threads, and the accelerator's name when one is used."""
    info: dict[str, Any] = {
        "device": str(device),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


def arm_memory(arm) -> dict[str, int]:
    """Weights + KV bytes (allocated, after the run) of one arm's target and draft."""
    target_kv = arm.engine.target.cache.allocated_bytes()
    drafter_runner = getattr(getattr(arm.engine, "drafter", None), "runner", None)
    draft_kv = drafter_runner.cache.allocated_bytes() if drafter_runner is not None else 0
    parts = {
        "target_weight_bytes": arm.target.weight_bytes(),
        "draft_weight_bytes": arm.draft.weight_bytes() if arm.draft else 0,
        "target_kv_bytes": target_kv,
        "draft_kv_bytes": draft_kv,
    }
    return {**parts, "total_bytes": sum(parts.values())}


def memory(setup) -> dict[str, Any]:
    """Per-arm footprints and each arm's delta against the baseline; top-level keys: the primary arm.

    On CPU these are the bytes the arm holds (weights + allocated KV); on an accelerator the
    records also carry the measured ``gpu_mem_peak`` per request.
    """
    by_arm = {arm.name: arm_memory(arm) for arm in setup.arms}
    base_total = by_arm[setup.arms[0].name]["total_bytes"]
    for footprint in by_arm.values():
        footprint["delta_bytes"] = footprint["total_bytes"] - base_total
    primary = by_arm[setup.primary] if setup.primary else by_arm[setup.arms[0].name]
    keys = ("target_weight_bytes", "draft_weight_bytes", "target_kv_bytes", "draft_kv_bytes")
    return {**{key: primary[key] for key in keys}, "memory_delta_bytes": primary["delta_bytes"], "arms": by_arm}


def _compat(cfg: RunConfig, setup) -> dict[str, Any]:
    """Whether target and draft vocabularies/tokenizers were checked, and why it holds."""
    if setup.compat_checked:
        return {"checked": True, "note": "separate draft checkpoint passed the vocab/tokenizer check"}
    if cfg.draft.kind == "model":
        return {"checked": True, "note": "self-draft: the draft is the target checkpoint, same tokenizer"}
    if cfg.draft.kind == "ngram":
        return {"checked": True, "note": "n-gram lookup proposes the target's own token ids"}
    return {"checked": False, "note": "no drafter"}


def run_conditions(cfg: RunConfig, setup) -> dict[str, Any]:
    """Everything a reader needs to know before trusting a number of this run."""
    import transformers

    return {
        "hardware": hardware(setup.device),
        "software": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "triton_kernels": kernels_usable(setup.device),  # verify, rtn-* matmul, quantized-KV attention
        },  # fmt: skip
        "target": {"path": setup.target.path, "precision": cfg.target.precision, "group_size": cfg.target.group_size},
        "draft": {
            "kind": cfg.draft.kind,
            "name": setup.drafter_name,
            "path": setup.draft.path if setup.draft else None,
            "precision": cfg.draft.precision if setup.draft else None,
        },  # fmt: skip
        "kv": dataclasses.asdict(cfg.kv),
        "compat": _compat(cfg, setup),
        "arms": [
            {
                "name": arm.name,
                "target_precision": arm.target_precision,
                "drafter": arm.drafter,
                "gamma": arm.gamma,
                "reference": arm.reference,
            }
            for arm in setup.arms
        ],  # fmt: skip
        "primary_arm": setup.primary,
        "sampling": dataclasses.asdict(cfg.sampling),
        "gamma": cfg.speculate.gamma,
        "batch_size": 1,
        "concurrency": 1,
        "workload": dataclasses.asdict(cfg.workload),
        "bench": dataclasses.asdict(cfg.bench),
        "memory": memory(setup),
        "compat_warnings": setup.compat_warnings,
    }
