"""``python -m spectoolkit.serve``: an OpenAI-compatible server on our continuous-batching engine (issue 17).

Same Hydra config as ``python -m spectoolkit`` (``+target=``, ``+draft=``, ``kv=``, ``speculate.*``,
``serve.*``) plus ``server.host``/``server.port`` (default 127.0.0.1:8000)::

    python -m spectoolkit.serve +draft=ngram speculate.gamma=4 server.port=8001

Ctrl-C or SIGTERM: no new requests; in-flight ones get ``server.shutdown_timeout_s`` to finish, then are
cancelled. A config mistake prints one line and exits 1.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from spectoolkit.errors import run_cli


@hydra.main(version_base=None, config_path="pkg://spectoolkit.conf", config_name="config")
def _app(cfg: DictConfig) -> None:
    from spectoolkit.__main__ import _quiet_transformers, checked, config_from_hydra
    from spectoolkit.training.job import with_trained_head

    _quiet_transformers()
    run_cli(lambda: serve(with_trained_head(checked(config_from_hydra(cfg), "serve"))), exit=True)


def serve(config) -> None:
    """Build the server for ``config`` and run it until Ctrl-C / SIGTERM."""
    import uvicorn

    from spectoolkit.server.build import build_server
    from spectoolkit.wiring.setup import freeze_heap

    built = build_server(config)
    freeze_heap()  # served until the process exits: the loaded heap never needs scanning
    server = config.server
    print(f"serving '{built.served.name}' ({built.arm.name}: drafter {built.arm.drafter}, gamma {built.arm.gamma}, "
          f"policy {built.arm.policy}) on http://{server.host}:{server.port}/v1", flush=True)  # fmt: skip
    uvicorn.run(built.app, host=server.host, port=server.port, log_level="info",
                timeout_graceful_shutdown=server.shutdown_timeout_s)  # fmt: skip


def main() -> None:
    _app()


if __name__ == "__main__":
    main()
