"""Running totals of a serving engine, the numbers a ``/metrics`` endpoint exports (issue 17).

The convention is vLLM v1's spec-decode metrics: a *draft* is one verify round in which at least one
candidate was proposed; ``draft_tokens`` counts the candidates, ``accepted_tokens`` the accepted ones,
and ``accepted_per_position[j]`` the drafts whose candidate j (0-based) was accepted, so
mean acceptance length = 1 + accepted_tokens / drafts. Prefix caching as vLLM counts it, in tokens:
``prefix_cache_queries`` looked up at each admission (a sequence's tokens), ``prefix_cache_hits`` found
there (their KV shared, live or cached). Ours beside them: rounds with a rollback (a candidate rejected),
preemptions, verify rounds, step / draft seconds, and finished requests by what they got
(:func:`request_kind`: greedy or sampled, speculation on, capped or off).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from spectoolkit.serving.api import FinishedRequest


def request_kind(done: FinishedRequest) -> tuple[str, str]:
    """(sampling, speculation) of a finished request: "greedy"/"sampled"; "on" (as the policy said), "capped" (it
    asked for fewer drafts per round) or "off" (it asked for none)."""
    sampling = "greedy" if done.sampling is None or done.sampling.greedy else "sampled"
    cap = done.draft_cap
    return sampling, "on" if cap is None else "off" if cap == 0 else "capped"


@dataclass
class EngineCounters:
    """Monotone totals since the engine was built (never reset with the engine's requests)."""

    prompt_tokens: int = 0  # prompt tokens of requests admitted to a first forward
    generation_tokens: int = 0  # output tokens emitted
    verify_rounds: int = 0  # decode rounds (target forwards that emitted tokens after the prefill)
    drafts: int = 0  # verify rounds with at least one candidate
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [max draft length seen]
    rollback_rounds: int = 0  # drafts in which a candidate was rejected (its temporary KV rolled back)
    preemptions: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    draft_seconds: float = 0.0
    finished_requests: int = 0
    failed_requests: int = 0
    aborted_requests: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix index at admissions
    prefix_cache_hits: int = 0  # tokens whose KV was found there
    requests_by_kind: Counter = field(default_factory=Counter)  # (sampling, speculation) -> finished requests
    drafted_by_kind: Counter = field(default_factory=Counter)  # (sampling, speculation) -> their draft tokens
    accepted_by_kind: Counter = field(default_factory=Counter)  # (sampling, speculation) -> their accepted drafts

    def count_admission(self, tokens: int, cached: int) -> None:
        """A sequence of ``tokens`` joined the batch with ``cached`` of them found in the prefix index."""
        self.prefix_cache_queries += tokens
        self.prefix_cache_hits += cached

    def count_request(self, done: FinishedRequest) -> None:
        """A request that finished without error, by what it got (:func:`request_kind`)."""
        if done.error is not None:
            return
        kind = request_kind(done)
        self.requests_by_kind[kind] += 1
        self.drafted_by_kind[kind] += done.drafted_tokens
        self.accepted_by_kind[kind] += done.accepted_tokens

    def count_round(self, drafted: int, accepted: int) -> None:
        """One verify round of one sequence with ``drafted`` candidates, ``accepted`` of them kept."""
        self.verify_rounds += 1
        if drafted <= 0:
            return
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for position in range(accepted):
            self.accepted_per_position[position] += 1
        if accepted < drafted:
            self.rollback_rounds += 1
