"""One request inside the engine: its tokens, how many have KV, its blocks and what it has done so far.

``tokens`` is prompt + output. ``num_computed`` positions have target KV; every token after them is
fed at the next step(s): a new request's prompt (in chunks), a preempted one's whole history (the
recompute), or — when decoding — only the pending last token, which then carries the drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spectoolkit.runtime.blocks import BlockTable
from spectoolkit.serving.api import FinishedRequest, ServeRequest


@dataclass(eq=False)
class Sequence:
    request: ServeRequest
    table: BlockTable
    generator: torch.Generator | None
    order: int  # admission order (preemption takes the latest first)
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    result: FinishedRequest = field(default_factory=lambda: FinishedRequest(""))

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


def new_sequence(request: ServeRequest, table: BlockTable, order: int, stochastic: bool) -> Sequence:
    generator = (request.generator or torch.Generator().manual_seed(request.seed)) if stochastic else None
    result = FinishedRequest(request.request_id, arrival=request.arrival or 0.0, prompt_len=len(request.prompt_ids))
    return Sequence(request, table, generator, order, list(request.prompt_ids), 0, result)
