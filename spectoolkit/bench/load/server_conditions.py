"""The conditions of a serving run whose arms are servers (``backend=endpoint|vllm``, issue 17).

The client side is measured here (this machine, its software); the server side is what each server
reports about itself (``/v1/models``, ``/version``, ours ``/info``) and, for ``backend=vllm``, how we
started it. Vocabulary agreement is stated only as far as a client can know it.
"""

from __future__ import annotations

import dataclasses
import platform
from typing import Any

import torch

from spectoolkit.bench.protocol.conditions import hardware
from spectoolkit.config import RunConfig


def server_conditions(cfg: RunConfig, arms: list, managed: dict[str, Any]) -> dict[str, Any]:
    """The conditions of a run on servers: the client side measured here, the server side as reported."""
    import transformers

    return {
        "backend": {
            "kind": cfg.backend.kind,
            "baseline_url": next((a.url for a in arms if a.name == "baseline"), None),
            "spec_url": next((a.url for a in arms if a.name == "spec"), None),
            "managed": managed,
        },
        "servers": {arm.name: arm.server for arm in arms},
        "hardware": {**hardware(torch.device("cpu")), "measured_on": "the client (the servers report theirs)"},
        "software": {"client_python": platform.python_version(), "client_transformers": transformers.__version__},
        "target": {"path": cfg.model.target_path or cfg.model.name, "precision": _reported(arms, "target_precision")},
        "draft": {"kind": cfg.draft.kind, "name": next((a.drafter for a in arms if a.gamma), None)},
        "kv": dataclasses.asdict(cfg.kv),
        "arms": [
            {
                "name": a.name,
                "target_precision": a.target_precision,
                "drafter": a.drafter,
                "gamma": a.gamma,
                "policy": a.policy,
                "reference": a.reference,
                "url": a.url,
            }
            for a in arms
        ],  # fmt: skip
        "primary_arm": next((a.name for a in arms if a.gamma > 0), None),
        "sampling": dataclasses.asdict(cfg.sampling),
        "gamma": cfg.speculate.gamma,
        "policy": cfg.speculate.policy,
        "workload": dataclasses.asdict(cfg.workload),
        "bench": dataclasses.asdict(cfg.bench),
        "serve": dataclasses.asdict(cfg.serve),
        "batch_size": None,
        "concurrency": None,
        "ids_from_text": {a.name: a.engine.ids_from_text for a in arms},
        "compat": _compat(cfg),
        "compat_warnings": [],
    }


def _compat(cfg: RunConfig) -> dict[str, Any]:
    """Target/draft vocabulary agreement as far as the client can know it (the servers load the models)."""
    if cfg.draft.kind in ("ngram", "suffix"):
        return {"checked": True, "note": f"{cfg.draft.kind} lookup proposes the target's own token ids"}
    if cfg.backend.kind == "vllm" and cfg.draft.kind == "model" and not cfg.model.draft_path:
        return {"checked": True, "note": "self-draft: the draft is the target checkpoint, same tokenizer"}
    return {"checked": False, "note": "the servers' draft and target vocabularies were not checked by this client"}


def _reported(arms: list, key: str) -> str:
    values = sorted({str(getattr(arm, key)) for arm in arms})
    return values[0] if len(values) == 1 else ", ".join(values)
