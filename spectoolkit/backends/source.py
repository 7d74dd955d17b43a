"""What a serving run measures when its arms are servers: ``backend=endpoint`` and ``backend=vllm`` (issue 17).

:func:`server_source` yields a :class:`ServerSource` — the tokenizer and context that prompts are
encoded and checked with, the probed :class:`~spectoolkit.backends.arms.EndpointArm` s, and the run's
conditions (this client's machine and software, and what each server reports about itself) — and on
exit closes the HTTP clients and stops every server it started (``backend=vllm``), Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from spectoolkit.backends.arms import Declared, EndpointArm, endpoint_arms, max_model_len
from spectoolkit.backends.endpoint import LoopThread
from spectoolkit.config import RunConfig
from spectoolkit.models.loading import load_tokenizer

UNKNOWN_CONTEXT = 1 << 30  # no server said: the servers refuse what does not fit, one request at a time


@dataclass
class Encoding:
    tokenizer: Any
    max_positions: int


@dataclass
class ServerSource:
    encoding: Encoding
    arms: list[EndpointArm]
    managed: dict[str, Any]  # backend=vllm: how each server was started (command, log); empty otherwise

    def conditions(self, cfg: RunConfig) -> dict[str, Any]:
        return server_conditions(cfg, self.arms, self.managed)


@contextlib.contextmanager
def server_source(cfg: RunConfig) -> Iterator[ServerSource]:
    """The arms of ``cfg.backend`` (endpoint: the given URLs; vllm: servers started here), closed on exit."""
    tokenizer = load_tokenizer(cfg.model.target_path)
    loop = LoopThread()
    with contextlib.ExitStack() as stack:
        stack.callback(loop.close)
        managed: dict[str, Any] = {}
        declared: dict[str, Declared] | None = None
        if cfg.backend.kind == "vllm":
            from spectoolkit.backends.managed import start_vllm_servers

            cfg, managed, declared = start_vllm_servers(cfg, stack)
        arms = endpoint_arms(cfg, loop, tokenizer, declared)
        for arm in arms:
            stack.callback(arm.engine.close)
        context = max_model_len([arm.server for arm in arms]) or _tokenizer_context(tokenizer)
        yield ServerSource(Encoding(tokenizer, context), arms, managed)


def _tokenizer_context(tokenizer: Any) -> int:
    length = getattr(tokenizer, "model_max_length", None)
    return length if isinstance(length, int) and 0 < length < UNKNOWN_CONTEXT else UNKNOWN_CONTEXT


def server_conditions(cfg: RunConfig, arms: list[EndpointArm], managed: dict[str, Any]) -> dict[str, Any]:
    """The conditions of a run on servers: the client side measured here, the server side as reported."""
    import transformers

    from spectoolkit.bench.protocol.conditions import hardware

    return {
        "backend": {
            "kind": cfg.backend.kind,
            "baseline_url": cfg.backend.baseline_url,
            "spec_url": cfg.backend.spec_url,
            "managed": managed,
        },  # fmt: skip
        "servers": {arm.name: arm.server for arm in arms},
        "hardware": {"client": hardware(torch.device("cpu")), "note": "the client's machine; servers: see servers"},
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
    if cfg.draft.kind == "ngram":
        return {"checked": True, "note": "n-gram lookup proposes the target's own token ids"}
    if cfg.backend.kind == "vllm" and cfg.draft.kind == "model" and not cfg.model.draft_path:
        return {"checked": True, "note": "self-draft: the draft is the target checkpoint, same tokenizer"}
    return {"checked": False, "note": "the servers' draft and target vocabularies were not checked by this client"}


def _reported(arms: list[EndpointArm], key: str) -> str:
    values = sorted({str(getattr(arm, key)) for arm in arms})
    return values[0] if len(values) == 1 else ", ".join(values)
