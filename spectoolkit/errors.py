"""The one exception type for mistakes a user can make (bad config, missing file, incompatible pair).

The CLI entry points catch it and print its message without a traceback; everything else is a bug
and keeps its traceback.
"""

from __future__ import annotations


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
