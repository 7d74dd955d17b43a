"""A server from a run config: load the models as a run does, build the one serving arm, wrap it (issue 17).

:func:`build_server` returns the ASGI app with its runner and metrics; :class:`BackgroundServer` runs
it with uvicorn on a thread (tests, and benchmarks of our server through HTTP), on an ephemeral port
when ``port=0``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import uvicorn
from fastapi import FastAPI

from spectoolkit.config import RunConfig
from spectoolkit.errors import SpecToolkitError
from spectoolkit.runtime.compiled import compiled_runners
from spectoolkit.server.app import create_app
from spectoolkit.server.metrics import ServerMetrics
from spectoolkit.server.model import ServedModel
from spectoolkit.server.runner import EngineRunner
from spectoolkit.server.scoring import score_tokens

STARTUP_TIMEOUT_S = 60.0


@dataclass
class BuiltServer:
    app: FastAPI
    runner: EngineRunner
    metrics: ServerMetrics
    served: ServedModel
    arm: Any  # spectoolkit.serving.assemble.ServingArm


def build_server(cfg: RunConfig) -> BuiltServer:
    """Load ``cfg``'s models and serve its arm (drafter and policy as configured; the target alone for
    draft=none). User mistakes raise SpecToolkitError."""
    from spectoolkit.serving.assemble import served_arm
    from spectoolkit.wiring.setup import build

    setup = build(cfg, arms=False)
    arm = served_arm(cfg, setup)
    for compiled in compiled_runners([arm.engine]).values():  # runtime.compile: every width, before serving
        compiled.warm()
    models = setup.models
    name = cfg.server.model_name or cfg.model.name
    target = models.target.model
    served = ServedModel(
        name, models.tokenizer, models.target.vocab_size, models.max_positions, models.eos_ids, cfg.sampling,
        lambda ids, top: score_tokens(target, ids, top), _info(cfg, arm, name), cfg.server.default_max_tokens,
        arm.engine.allocator.num_blocks * arm.engine.allocator.block_size, arm.engine.unsupported,
    )  # fmt: skip
    runner = EngineRunner(arm.engine)
    metrics = ServerMetrics(arm.engine, name)
    app = create_app(runner, served, metrics, cfg.server.request_timeout_s, cfg.server.shutdown_timeout_s)
    return BuiltServer(app, runner, metrics, served, arm)


def _info(cfg: RunConfig, arm, name: str) -> dict[str, Any]:
    """What ``/info`` reports: the arm, precisions, drafter, policy, KV and scheduler limits."""
    try:
        package_version = version("spectoolkit")
    except PackageNotFoundError:
        package_version = "unknown"
    return {
        "engine": "spectoolkit", "version": package_version, "model": name, "arm": arm.name,
        "target_path": cfg.model.target_path, "draft_path": cfg.model.draft_path,
        "target_precision": arm.target_precision, "drafter": arm.drafter, "draft_precision": arm.draft_precision,
        "gamma": arm.gamma, "policy": arm.policy, "kv": dataclasses.asdict(cfg.kv),
        "sampling": dataclasses.asdict(cfg.sampling), "serve": dataclasses.asdict(cfg.serve),
        "device": cfg.device, "kernels": cfg.runtime.kernels,
    }  # fmt: skip


class BackgroundServer:
    """``with BackgroundServer(built, host, port) as server: server.base_url`` — uvicorn on a thread."""

    def __init__(self, built: BuiltServer, host: str = "127.0.0.1", port: int = 0, drain_s: float = 5.0) -> None:
        config = uvicorn.Config(built.app, host=host, port=port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=drain_s)  # fmt: skip
        self.built, self.server = built, uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # the main thread keeps its own handlers
        self._thread = threading.Thread(target=self.server.run, name="spectoolkit-server", daemon=True)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise SpecToolkitError("the spectoolkit server did not start (is the port in use?)")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=60)

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def base_url(self) -> str:
        host = self.server.config.host
        return f"http://{host}:{self.port}/v1"
