"""The one exception type for mistakes a user can make (bad config, missing file, incompatible pair).

Every CLI entry point runs its work through :func:`run_cli`, which prints its message as one ``error:`` line
without a traceback and exits non-zero; everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class SpecToolkitError(Exception):
    """A user-facing error: the message says what is wrong and what to change."""


def first_line(exc: BaseException, with_type: bool = False) -> str:
    """The first line of ``exc``'s message, for one-line user errors.

    An empty message gives the type name; ``with_type`` prefixes it always ("OSError: ...").
    """
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    if with_type:
        return f"{type(exc).__name__}: {line}"
    return line or type(exc).__name__


def run_cli(work: Callable[[], int | None], exit: bool = False) -> int:
    """Run an entry point's ``work``; returns its exit status (None: 0). A :class:`SpecToolkitError` (a user's
    mistake) prints one ``error: <message>`` line on stderr and gives status 1. With ``exit`` a non-zero status
    exits the process (a ``@hydra.main`` function cannot return one; a sweep's job passes False to let the others
    run)."""
    try:
        status = work() or 0
    except SpecToolkitError as exc:
        print(f"error: {' '.join(line.strip() for line in str(exc).splitlines())}", file=sys.stderr)
        status = 1
    if status and exit:
        sys.exit(status)
    return status
