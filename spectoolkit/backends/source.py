"""What a serving run measures when its arms are servers: ``backend=endpoint``, ``vllm`` or ``llamacpp`` (issue 17).

:func:`server_source` yields a :class:`ServerSource` — the tokenizer and context that prompts are
encoded and checked with, the probed :class:`~spectoolkit.backends.arms.EndpointArm` s (each with what
its server reports about itself), and how managed servers were started — and on exit closes the HTTP
clients and stops every server it started (``backend=vllm|llamacpp``), Ctrl-C included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from spectoolkit.backends.arms import Declared, EndpointArm, endpoint_arms, max_model_len
from spectoolkit.backends.endpoint import LoopThread
from spectoolkit.backends.wire import LLAMACPP, OPENAI
from spectoolkit.config import RunConfig
from spectoolkit.wiring.loading import load_tokenizer
from spectoolkit.wiring.resolve import resolve_run

UNKNOWN_CONTEXT = 1 << 30  # no server said: the servers refuse what does not fit, one request at a time


@dataclass
class Encoding:
    tokenizer: Any
    max_positions: int


@dataclass
class ServerSource:
    encoding: Encoding
    arms: list[EndpointArm]
    managed: dict[str, Any]  # backend=vllm|llamacpp: how each server was started (command, log); empty otherwise


@contextlib.contextmanager
def server_source(cfg: RunConfig) -> Iterator[ServerSource]:
    """The arms of ``cfg.backend`` (endpoint: the given URLs; vllm: servers started here), closed on exit. Servers
    started here take the config resolved once, as a local run's is (:func:`~spectoolkit.wiring.resolve.resolve_run`:
    their target and draft checkpoints); an endpoint's servers are someone else's, and only the target's
    tokenizer is resolved for it."""
    run = resolve_run(cfg) if cfg.backend.kind in ("vllm", "llamacpp") else None
    tokenizer = load_tokenizer(run.target if run is not None else cfg.model.target_path)
    loop = LoopThread()
    with contextlib.ExitStack() as stack:
        stack.callback(loop.close)
        managed: dict[str, Any] = {}
        declared: dict[str, Declared] | None = None
        if run is not None:  # backend=vllm|llamacpp: the servers are ours to start
            from spectoolkit.backends.managed import start_llamacpp_servers, start_vllm_servers

            start = start_vllm_servers if cfg.backend.kind == "vllm" else start_llamacpp_servers
            cfg, managed, declared = start(cfg, stack, run)
        wire = LLAMACPP if cfg.backend.kind == "llamacpp" else OPENAI
        arms = endpoint_arms(cfg, loop, tokenizer, declared, wire)
        for arm in arms:
            stack.callback(arm.engine.close)
        context = max_model_len([arm.server for arm in arms]) or _tokenizer_context(tokenizer)
        yield ServerSource(Encoding(tokenizer, context), arms, managed)


def _tokenizer_context(tokenizer: Any) -> int:
    length = getattr(tokenizer, "model_max_length", None)
    return length if isinstance(length, int) and 0 < length < UNKNOWN_CONTEXT else UNKNOWN_CONTEXT
