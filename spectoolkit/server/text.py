"""Output text as a stream: incremental detokenization and OpenAI ``stop`` strings (issue 17).

Text is always the decode of *all* output ids so far (a token's text can depend on its neighbours),
and a delta is what that decode adds. Held back until the next token: a trailing replacement character
(half a UTF-8 sequence) and, while stop strings are set, the last ``len(longest stop) - 1`` characters
(they may be the start of a stop string). When a stop string appears, the text ends before it.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class TextStream:
    """Feed output ids with :meth:`add`; read the new text it returns; :meth:`flush` at the end."""

    def __init__(self, tokenizer: Any, stops: list[str], eos_ids: frozenset[int]) -> None:
        self.tokenizer, self.stops, self.eos_ids = tokenizer, stops, eos_ids
        self.ids: list[int] = []
        self.sent = ""  # text already returned
        self.stopped = False  # a stop string was found: nothing more is returned
        self._hold = max((len(s) for s in stops), default=1) - 1

    def add(self, ids: list[int]) -> str:
        """The new text after ``ids`` (may be empty while characters are held back)."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        text = self._decode()
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._take(text[:cut])
        visible = text[: max(len(self.sent), len(text) - self._hold)] if self.stops else text
        if visible.endswith(REPLACEMENT):
            visible = visible[: len(visible) - 1]
        return self._take(visible)

    def flush(self) -> str:
        """Whatever was held back, once no token follows."""
        if self.stopped:
            return ""
        return self._take(self._decode())

    @property
    def text(self) -> str:
        return self.sent

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _stop_at(self, text: str) -> int | None:
        found = [text.find(stop, max(0, len(self.sent) - len(stop))) for stop in self.stops]
        found = [i for i in found if i >= 0]
        return min(found) if found else None

    def _take(self, visible: str) -> str:
        if not visible.startswith(self.sent):  # a later token re-spelled earlier text: keep what was sent
            return ""
        delta, self.sent = visible[len(self.sent) :], visible
        return delta
