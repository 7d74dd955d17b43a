"""Hydra callback that aggregates a sweep while it runs (``hydra.callbacks`` in conf/config.yaml).

After every job (multirun only) ``sweep_summary.csv`` is rewritten from whatever has finished, so an
interrupted sweep still has its table; at the end of the sweep ``sweep_report.md`` and its plots are
written too. Aggregation reads files only; a failure to aggregate warns and never fails a job.
With parallel launchers (joblib, submitit) ``on_job_end`` runs in the worker: each rewrite is atomic,
so concurrent writers leave one complete table (the last writer's, which is the most up to date).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from spectoolkit.errors import SpecToolkitError


class SweepCallback(Callback):
    """Writes ``sweep_summary.csv`` after each job and ``sweep_report.md`` when the sweep ends."""

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            from spectoolkit.bench.sweep.table import write_sweep_csv

            _quietly(write_sweep_csv, Path(HydraConfig.get().sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from spectoolkit.bench.sweep.report import write_sweep_report

        path = _quietly(write_sweep_report, Path(config.hydra.sweep.dir))
        if path:
            print(f"sweep report: {path}")


def _quietly(write, sweep_dir: Path) -> Path | None:
    try:
        return write(sweep_dir)
    except (SpecToolkitError, OSError, ValueError) as exc:
        print(f"warning: sweep aggregation of {sweep_dir} failed ({exc}); rerun `python -m spectoolkit.report "
              f"{sweep_dir}`", file=sys.stderr)  # fmt: skip
        return None
