"""``python -m spectoolkit``: compose the Hydra config, run the protocol, print the summary table.

A thin wrapper (lightning-hydra-template style): all work happens in
:func:`spectoolkit.bench.runner.run`, which tests call directly with a typed config.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from spectoolkit.errors import SpecToolkitError


def config_from_hydra(cfg: DictConfig):
    """Turn a composed Hydra config into a validated :class:`RunConfig`."""
    from spectoolkit.config import run_config_from_dict

    try:
        values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as exc:
        raise SpecToolkitError(f"{exc.full_key} must be set (e.g. {exc.full_key}=VALUE on the command line)") from None
    return run_config_from_dict(values)


@hydra.main(version_base=None, config_path="pkg://spectoolkit.conf", config_name="config")
def _app(cfg: DictConfig) -> None:
    from spectoolkit.bench.runner import run
    from spectoolkit.bench.table import format_summary

    _quiet_transformers()
    try:
        config = config_from_hydra(cfg)
        text = _eval_job(config) if config.eval.kind != "none" else format_summary(run(config))
    except SpecToolkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted: finished records and summary.json (complete: false) were kept", file=sys.stderr)
        sys.exit(130)
    print(text)


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
