"""``spectoolkit-lm-eval`` / ``python -m spectoolkit.eval.lmeval_cli``: lm-eval's own CLI, ready for us.

lm-eval 0.4.13 finds models only in its own table (its entry-point discovery came later), and tasks
only under ``--include_path``. This runs ``lm_eval.__main__.cli_evaluate`` unchanged, after
importing :mod:`spectoolkit.eval.lmeval` (which registers ``--model spectoolkit``) and adding the
shipped task directory to ``--include_path``. Every lm-eval option works as documented there.
"""

from __future__ import annotations

import sys

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


def main(argv: list[str] | None = None) -> None:
    from lm_eval.__main__ import cli_evaluate

    from spectoolkit.eval.lmeval import TASKS_DIR

    sys.argv = lm_eval_argv(list(sys.argv[1:] if argv is None else argv), str(TASKS_DIR))
    cli_evaluate()


if __name__ == "__main__":
    main()
