"""Running totals of a serving engine, the numbers a ``/metrics`` endpoint exports (issue 17).

The convention is vLLM v1's spec-decode metrics: a *draft* is one verify round in which at least one
candidate was proposed; ``draft_tokens`` counts the candidates, ``accepted_tokens`` the accepted ones,
and ``accepted_per_position[j]`` the drafts whose candidate j (0-based) was accepted, so
mean acceptance length = 1 + accepted_tokens / drafts. Ours beside them: rounds with a rollback (a
candidate rejected), preemptions, verify rounds, and step / draft seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
