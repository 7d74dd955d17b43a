"""The conditions every number of a run holds under: hardware, software, precisions, memory."""

from __future__ import annotations

import dataclasses
import os
import platform
from typing import Any

import torch

from spectoolkit.config import RunConfig


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


def memory(setup) -> dict[str, Any]:
    """Weights + KV bytes of target and draft; the memory delta is what speculation adds."""
    target_weights = setup.target.weight_bytes()
    draft_weights = setup.draft.weight_bytes() if setup.draft else 0
    draft_kv = setup.spec.drafter.runner.cache.allocated_bytes() if setup.draft and setup.spec else 0
    target_kv = setup.baseline.target.cache.allocated_bytes()
    return {
        "target_weight_bytes": target_weights,
        "draft_weight_bytes": draft_weights,
        "target_kv_bytes": target_kv,
        "draft_kv_bytes": draft_kv,
        "memory_delta_bytes": draft_weights + draft_kv,
    }


def run_conditions(cfg: RunConfig, setup) -> dict[str, Any]:
    """Everything a reader needs to know before trusting a number of this run."""
    import transformers

    return {
        "hardware": hardware(setup.device),
        "software": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },  # fmt: skip
        "target": {"path": setup.target.path, "precision": cfg.target.precision, "group_size": cfg.target.group_size},
        "draft": {
            "kind": cfg.draft.kind,
            "name": setup.drafter_name,
            "path": setup.draft.path if setup.draft else None,
            "precision": cfg.draft.precision if setup.draft else None,
        },  # fmt: skip
        "kv": dataclasses.asdict(cfg.kv),
        "sampling": dataclasses.asdict(cfg.sampling),
        "gamma": cfg.speculate.gamma,
        "batch_size": 1,
        "concurrency": 1,
        "workload": dataclasses.asdict(cfg.workload),
        "bench": dataclasses.asdict(cfg.bench),
        "memory": memory(setup),
        "compat_warnings": setup.compat_warnings,
    }
