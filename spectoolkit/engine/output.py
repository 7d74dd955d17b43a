"""What one generation returns: the tokens and the counters/timings the records are built from."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from spectoolkit.models.cached import synchronize


@dataclass
class GenerationOutput:
    """Counters follow DESIGN §3; times are wall-clock seconds measured inside the loop."""

    output_ids: list[int] = field(default_factory=list)
    ttft: float = 0.0  # request start -> first output token available
    total_time: float = 0.0
    draft_time: float = 0.0  # proposer work (draft forwards, n-gram lookup, draft KV rollback)
    verify_time: float = 0.0  # target forwards after the prefill (baseline: decode steps incl. selection)
    overhead_time: float = 0.0  # the rest: acceptance test, KV commit, loop (total - prefill - draft - verify)
    prefill_time: float = 0.0
    verify_rounds: int = 0  # target forwards after the prefill (baseline: decode steps)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rollback_count: int = 0  # rounds with >= 1 rejected draft token
    proposed_rounds: int = 0  # rounds in which the drafter proposed >= 1 token
    accept_lengths: list[int] = field(default_factory=list)  # accepted drafts per round
    draft_lengths: list[int] = field(default_factory=list)  # proposed drafts per round
    chosen_lengths: list[int] = field(default_factory=list)  # k the draft-length policy asked for, per round
    tree_depths: list[int] = field(default_factory=list)  # token trees: each round's tree depth (nodes: draft_lengths)


def finished(output_ids: list[int], max_new_tokens: int, eos_ids: frozenset[int]) -> bool:
    """Generation stops at ``max_new_tokens`` or right after an EOS token."""
    return len(output_ids) >= max_new_tokens or (bool(output_ids) and output_ids[-1] in eos_ids)


def cut(new_ids: list[int], room: int, eos_ids: frozenset[int]) -> list[int]:
    """The part of a round's tokens that is emitted: at most ``room`` tokens, up to the first EOS."""
    kept = new_ids[:room]
    for index, token in enumerate(kept):
        if token in eos_ids:
            return kept[: index + 1]
    return kept


def prefill(target, verifier, prompt_ids: list[int], generator, out: GenerationOutput, start: float, on_token) -> int:
    """Reset ``target``, prefill the prompt and emit the first token (records TTFT); returns it.

    Both arms start this way: the first token always comes from the target alone.
    """
    target.reset()
    token = verifier.select(target.forward(prompt_ids, last_only=True), generator)
    synchronize(target.device)
    out.ttft = out.prefill_time = time.perf_counter() - start
    out.output_ids.append(token)
    if on_token:
        on_token(token)
    return token
