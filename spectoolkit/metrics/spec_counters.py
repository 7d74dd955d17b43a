"""Speculation counters as a server exports them, and their change over a run (issue 17).

vLLM's convention (our server's ``/metrics`` follows it): a *draft* is a verify round with candidates;
acceptance_rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts, and
``accepted_per_position[j]`` counts the drafts whose candidate j was accepted. Read from ``/metrics`` by
:mod:`spectoolkit.backends.scrape`; a serving summary sums the per-run deltas per load level.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import zip_longest


@dataclass
class SpecCounters:
    """A server's speculation counters (vLLM's convention), or their change over a run."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_per_position: list[float] = field(default_factory=list)

    def minus(self, before: SpecCounters) -> SpecCounters:
        return self._combine(before, -1.0)

    def plus(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, 1.0)

    def _combine(self, other: SpecCounters, sign: float) -> SpecCounters:
        positions = zip_longest(self.accepted_per_position, other.accepted_per_position, fillvalue=0.0)
        return SpecCounters(self.drafts + sign * other.drafts, self.draft_tokens + sign * other.draft_tokens,
                            self.accepted_tokens + sign * other.accepted_tokens,
                            [mine + sign * theirs for mine, theirs in positions])  # fmt: skip

    def as_json(self) -> dict:
        rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else None
        length = 1 + self.accepted_tokens / self.drafts if self.drafts else None
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "accepted_per_position": self.accepted_per_position, "acceptance_rate": rate,
                "mean_accept_length": length}  # fmt: skip
