"""One request inside the engine: its tokens, how many have KV, its blocks, its token rule and what it has done so far.

``tokens`` is prompt + output. ``num_computed`` positions have target KV; every token after them is
fed at the next step(s): a new request's prompt (in chunks), a preempted one's whole history (the
recompute), or — when decoding — only the pending last token, which then carries the drafts.

A request's :class:`Rule` is chosen once, when it is submitted: its sampling settings, the verifier of its rows
(greedy argmax, or the exact rejection rule under its settings), its tree verifier, and the chooser a draft model
draws its drafts with (None: the drafter's own, which is the engine's default rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spectoolkit.runtime.blocks import BlockTable
from spectoolkit.sampling import Chooser, SamplingParams
from spectoolkit.serving.api import FinishedRequest, ServeRequest
from spectoolkit.verify.base import Verifier
from spectoolkit.verify.tree import TreeVerifier


@dataclass(frozen=True)
class Rule:
    """How one request's tokens are chosen and verified (fixed for its life)."""

    sampling: SamplingParams
    verifier: Verifier  # its chain rows (and a round without drafts: ``select``)
    tree_verifier: TreeVerifier
    chooser: Chooser | None  # what a draft model samples its drafts with; None: the drafter's own
    sampled: bool  # draws from a generator (a sampled rule, or the engine's stochastic default)


@dataclass(eq=False)
class Sequence:
    request: ServeRequest
    table: BlockTable
    generator: torch.Generator | None
    order: int  # admission order (preemption takes the latest first)
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    result: FinishedRequest = field(default_factory=lambda: FinishedRequest(""))
    rule: Rule | None = None
    leader: Sequence | None = None  # another sample of the same prompt whose prompt KV it waits for (n > 1)
    done: bool = False  # left the engine (finished, failed, aborted, reset)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def room(self) -> int:
        """Output tokens it may still emit."""
        return self.request.max_new_tokens - (len(self.tokens) - self.prompt_len)

    @property
    def uncomputed(self) -> int:
        """Tokens without KV (1 when decoding: the pending token)."""
        return len(self.tokens) - self.num_computed

    @property
    def decoding(self) -> bool:
        return self.uncomputed == 1 and len(self.tokens) > self.prompt_len

    @property
    def chooser(self) -> Chooser | None:
        """What a draft model draws this request's drafts with (None: the drafter's own)."""
        return self.rule.chooser if self.rule is not None else None

    @property
    def sampling(self) -> SamplingParams | None:
        return self.rule.sampling if self.rule is not None else None

    @property
    def waiting(self) -> bool:
        """Held back from admission while its leader computes the prompt it will share (then it starts after it)."""
        if self.leader is not None and (self.leader.done or self.leader.num_computed >= self.leader.prompt_len):
            self.leader = None
        return self.leader is not None

    def draft_cap(self, cap: int) -> int:
        """``cap`` within the request's own ``draft_cap`` (0: it asked for no speculation)."""
        asked = self.request.draft_cap
        return cap if asked is None else min(cap, asked)


def new_sequence(request: ServeRequest, table: BlockTable, order: int, rule: Rule) -> Sequence:
    generator = (request.generator or torch.Generator().manual_seed(request.seed)) if rule.sampled else None
    result = FinishedRequest(request.request_id, arrival=request.arrival or 0.0, prompt_len=len(request.prompt_ids))
    result.sampling, result.draft_cap = rule.sampling, request.draft_cap
    return Sequence(request, table, generator, order, list(request.prompt_ids), 0, result, rule)
