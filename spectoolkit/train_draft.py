"""``python -m spectoolkit.train_draft``: train an EAGLE-3 draft head for a target on this machine (issue 30).

The run config (``model=``, ``+target=``, ...) plus the ``train/`` group (``conf/train/eagle3.yaml``)::

    python -m spectoolkit.train_draft                       # the embedded model, about 40 minutes on 2 cores
    python -m spectoolkit.train_draft +target=rtn-int4 train.steps=1000 train.out=/tmp/head

It prints the head's directory; ``+draft=eagle draft.eagle_path=DIR`` drafts with it here and
``backend=vllm backend.eagle_path=DIR`` serves it on vLLM. The same command again reuses the cached head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig

from spectoolkit.errors import run_cli

if TYPE_CHECKING:
    from spectoolkit.config import RunConfig
    from spectoolkit.training.job import TrainConfig


@hydra.main(version_base=None, config_path="pkg://spectoolkit.conf", config_name="train_draft")
def _app(cfg: DictConfig) -> None:
    from spectoolkit.__main__ import _quiet_transformers, _resolved
    from spectoolkit.config import run_config_from_dict
    from spectoolkit.training.job import train_config_from_dict, train_draft

    _quiet_transformers()

    def work() -> None:
        values = _resolved(cfg)
        train_cfg = train_config_from_dict(values.pop("train", None))
        run_cfg = run_config_from_dict(values)
        check_train_paths(run_cfg, train_cfg)
        print(train_draft(run_cfg, train_cfg))

    run_cli(work, exit=True)


def check_train_paths(run_cfg: RunConfig, train_cfg: TrainConfig) -> None:
    """Refuse, before any work, a path this job reads or writes that does not hold what it must
    (:mod:`spectoolkit.path_checks`): the target checkpoint, the training prompts, where the head is copied."""
    from spectoolkit.path_checks import check_paths

    jsonl_path = train_cfg.jsonl_path if "jsonl" in train_cfg.sources else None  # read only as a source
    check_paths({"model.target_path": run_cfg.model.target_path, "train.jsonl_path": jsonl_path,
                 "train.out": train_cfg.out})  # fmt: skip


def main() -> None:
    _app()


if __name__ == "__main__":
    main()
