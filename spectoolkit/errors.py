"""The one exception type for mistakes a user can make (bad config, missing file, incompatible pair).

The CLI entry points catch it and print its message without a traceback; everything else is a bug
and keeps its traceback.
"""

from __future__ import annotations


class SpecToolkitError(Exception):
    """A user-facing error: the message says what is wrong and what to change."""
