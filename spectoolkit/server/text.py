"""Output text as a stream: incremental detokenization and OpenAI ``stop`` strings (issue 17).

Text is always the decode of *all* output ids so far (a token's text can depend on its neighbours),
and a delta is what that decode adds. Held back until the next token: a trailing replacement character
(half a UTF-8 sequence) and, while stop strings are set, the last ``len(longest stop) - 1`` characters
(they may be the start of a stop string). When a stop string appears, the text ends before it and the
ids end with the token that completed it (as vLLM does).
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
        self.kept = 0  # of the ids of the last add(): how many are output (fewer when a stop string ends it)
        self._hold = max((len(s) for s in stops), default=1) - 1

    def add(self, ids: list[int]) -> str:
        """The new text after ``ids`` (may be empty while characters are held back). When a stop string
        completes, ``kept`` says how many of ``ids`` it took (the ids after it are not output)."""
        if self.stopped:
            return ""
        before = len(self.ids)
        self.ids.extend(ids)
        text = self._decode()
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            self.kept = self._ids_to_stop(before, len(ids))
            return self._take(text[:cut])
        self.kept = len(ids)
        complete = text[:-1] if text.endswith(REPLACEMENT) else text  # half a character is not text yet
        visible = complete[: max(len(self.sent), len(complete) - self._hold)] if self.stops else complete
        return self._take(visible)

    def _ids_to_stop(self, before: int, added: int) -> int:
        """The fewest of the ``added`` ids whose text completes the stop string (the rest are dropped)."""
        ids = self.ids
        for kept in range(1, added):
            self.ids = ids[: before + kept]
            if self._stop_at(self._decode()) is not None:
                return kept
        self.ids = ids
        return added

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
