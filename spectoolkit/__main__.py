"""``python -m spectoolkit``: compose the Hydra config, run the protocol, print the summary table.

A thin wrapper (lightning-hydra-template style): all work happens in
:func:`spectoolkit.bench.protocol.runner.run`, which tests call directly with a typed config.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from spectoolkit.bench.sweep.jobs import COMPLETE, config_hash, end_job, finished_before, start_job
from spectoolkit.config import RunConfig, run_config_from_dict
from spectoolkit.config_checks import Entry, check_config, override_keys
from spectoolkit.errors import SpecToolkitError, run_cli
from spectoolkit.path_checks import check_run_paths


def config_from_hydra(cfg: DictConfig):
    """Turn a composed Hydra config into a validated :class:`RunConfig`."""
    return run_config_from_dict(_resolved(cfg))


def _resolved(cfg: DictConfig) -> dict:
    """The composed config as plain values (what identifies a job; see spectoolkit.bench.sweep.jobs)."""
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as exc:
        raise SpecToolkitError(f"{exc.full_key} must be set (e.g. {exc.full_key}=VALUE on the command line)") from None


def checked(config: RunConfig, entry: Entry) -> RunConfig:
    """Refuse settings of ``config`` that would do nothing or less than asked (:mod:`spectoolkit.config_checks`),
    judged by the keys on this command line, and paths that do not hold what they must
    (:mod:`spectoolkit.path_checks`); print its warnings. Returns ``config``."""
    from hydra.core.hydra_config import HydraConfig

    given = override_keys(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None
    warnings = check_config(config, given, entry)
    check_run_paths(config, entry)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return config


@hydra.main(version_base=None, config_path="pkg://spectoolkit.conf", config_name="config")
def _app(cfg: DictConfig) -> None:
    _quiet_transformers()
    run_cli(lambda: _run(cfg), exit=not _in_multirun())  # a sweep goes on with its other jobs (job.json: failed)


def _run(cfg: DictConfig) -> None:
    values = _resolved(cfg)
    config = checked(run_config_from_dict(values), "run")
    text = _run_job(config, values)
    if text is not None:
        print(text)


def _run_job(config, values: dict) -> str | None:
    """Run one job unless its directory already holds it, complete; keep job.json up to date."""
    out_dir, digest = Path(config.output_dir), config_hash(values)
    done = finished_before(out_dir, digest) if config.resume else None
    if done:
        return f"skipped: {out_dir} already holds this job, complete since {done['finished']} (resume=false reruns it)"
    job = start_job(out_dir, digest, "bench" if config.eval.kind == "none" else config.eval.kind, values)
    try:
        from spectoolkit.training.job import with_trained_head

        config = with_trained_head(config)  # +draft=eagle without a head: train (or reuse) the default one
        text = _eval_job(config) if config.eval.kind != "none" else _bench_job(config)
    except SpecToolkitError as exc:
        end_job(out_dir, job, "failed", str(exc))
        raise
    except KeyboardInterrupt:
        end_job(out_dir, job, "interrupted")
        print("interrupted: finished records and summary.json (complete: false) were kept", file=sys.stderr)
        sys.exit(130)
    except BaseException as exc:
        end_job(out_dir, job, "failed", f"{type(exc).__name__}: {exc}")
        raise
    end_job(out_dir, job, COMPLETE)
    return text


def _bench_job(config) -> str:
    if config.backend.kind != "local" and not config.serve.enabled:
        raise SpecToolkitError(f"backend={config.backend.kind} measures servers under load: add "
                               "experiment=concurrency_sweep (or serve.enabled=true)")  # fmt: skip
    if config.serve.enabled:  # serving under load: load levels instead of one request at a time
        from spectoolkit.bench.load.runner import format_serving_table, run_serving

        return format_serving_table(run_serving(config))
    from spectoolkit.bench.protocol.runner import run
    from spectoolkit.bench.protocol.table import format_summary

    return format_summary(run(config))


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _eval_job(config) -> str:
    """Run the quality job of ``+eval=...``; returns the text to print."""
    if config.eval.kind == "exactness":
        from spectoolkit.eval.exactness_job import run_exactness_job

        return run_exactness_job(config)
    from spectoolkit.eval.lmeval_job import run_lmeval_job

    return run_lmeval_job(config)


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def main() -> None:
    _app()


if __name__ == "__main__":
    main()
