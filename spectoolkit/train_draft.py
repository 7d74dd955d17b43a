"""``python -m spectoolkit.train_draft``: train an EAGLE-3 draft head for a target on this machine (issue 30).

The run config (``model=``, ``+target=``, ...) plus the ``train/`` group (``conf/train/eagle3.yaml``)::

    python -m spectoolkit.train_draft                       # the embedded model, about 40 minutes on 2 cores
    python -m spectoolkit.train_draft +target=rtn-int4 train.steps=1000 train.out=/tmp/head

It prints the head's directory; ``+draft=eagle draft.eagle_path=DIR`` drafts with it here and
``backend=vllm backend.eagle_path=DIR`` serves it on vLLM. The same command again reuses the cached head.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from spectoolkit.errors import SpecToolkitError


@hydra.main(version_base=None, config_path="pkg://spectoolkit.conf", config_name="train_draft")
def _app(cfg: DictConfig) -> None:
    from spectoolkit.__main__ import _quiet_transformers, _resolved
    from spectoolkit.config import run_config_from_dict
    from spectoolkit.training.job import train_config_from_dict, train_draft

    _quiet_transformers()
    try:
        values = _resolved(cfg)
        train_cfg = train_config_from_dict(values.pop("train", None))
        path = train_draft(run_config_from_dict(values), train_cfg)
    except SpecToolkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    print(path)


def main() -> None:
    _app()


if __name__ == "__main__":
    main()
