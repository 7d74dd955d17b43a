"""``spectoolkit-lm-eval`` / ``python -m spectoolkit.eval.lmeval_cli``: lm-eval's own CLI, ready for us.

lm-eval 0.4.13 finds models only in its own table (its entry-point discovery came later), and tasks
only under ``--include_path``. This runs the steps of ``lm_eval.__main__.cli_evaluate`` (parse, then
execute) after importing :mod:`spectoolkit.eval.lmeval` (which registers ``--model spectoolkit``)
and adding the shipped task directory to ``--include_path``. Every lm-eval option works as
documented there, with two differences for our model:

- lm-eval fills a ``--device`` it was not given with ``cuda:0``; that is no choice of the user's, so
  ``--model spectoolkit`` gets ``auto`` instead (CUDA when there is one). A device given with
  ``--device``, in the ``--config`` YAML or as ``device=`` in ``--model_args`` is kept.
- A :class:`~spectoolkit.errors.SpecToolkitError` (a user mistake: bad model_args, ``--device cuda``
  without a GPU) prints one ``error:`` line and exits 1, like ``python -m spectoolkit``.
"""

from __future__ import annotations

import sys
from argparse import Namespace
from typing import Any

from spectoolkit.errors import run_cli

SUBCOMMANDS = ("run", "ls", "validate")


def lm_eval_argv(args: list[str], tasks_dir: str) -> list[str]:
    """lm-eval's argv for ``args``, with ``tasks_dir`` appended to the include path of run/ls/validate."""
    if args and args[0] in SUBCOMMANDS:
        subcommand, rest = args[0], args[1:]
    elif len(args) > 1:
        subcommand, rest = "run", args  # lm-eval's legacy form: `lm_eval --model ... --tasks ...`
    else:
        return ["lm_eval", *args]  # help and the like
    if "--include_path" not in rest:  # a user's own include path replaces ours (lm-eval takes one)
        rest = [*rest, "--include_path", tasks_dir]
    return ["lm_eval", subcommand, *rest]


def prefer_auto_device(args: Namespace, model_name: str) -> None:
    """Set ``args.device = "auto"`` for ``model_name`` when the user chose no device (in place).

    ``args`` is lm-eval's parsed command line: ``device`` is None unless ``--device`` was given;
    ``ls`` / ``validate`` have no ``device``. ``device=`` in model_args needs nothing here: it wins
    over ``--device`` in :meth:`SpecToolkitLM.create_from_arg_obj`.
    """
    if getattr(args, "device", "") is not None:
        return
    config = _yaml_config(args.config)
    if "device" not in config and (args.model or config.get("model")) == model_name:
        args.device = "auto"


def _yaml_config(path: str | None) -> dict[str, Any]:
    """The ``--config`` YAML as lm-eval reads it; {} without one, or for one lm-eval rejects itself later."""
    if not path:
        return {}
    from lm_eval.config.evaluate_config import EvaluatorConfig

    try:
        return EvaluatorConfig.load_yaml_config(path)
    except (OSError, ValueError, TypeError):
        return {}


def main(argv: list[str] | None = None) -> int:
    """Run lm-eval's CLI on ``argv`` (default ``sys.argv[1:]``); returns the exit status (1: user error)."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from spectoolkit.eval.lmeval import MODEL_NAME, TASKS_DIR

    sys.argv = lm_eval_argv(list(sys.argv[1:] if argv is None else argv), str(TASKS_DIR))
    setup_logging()
    parser = HarnessCLI()

    def work() -> None:
        args = parser.parse_args()  # reads sys.argv, as in cli_evaluate
        prefer_auto_device(args, MODEL_NAME)
        parser.execute(args)

    return run_cli(work)


if __name__ == "__main__":
    sys.exit(main())
