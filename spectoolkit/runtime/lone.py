"""One sequence driven directly through a runner: feed tokens, get logits, roll back by length.

What calibration times (a verify forward of w rows on top of a context) and what the exactness
proof replays (the target alone at a divergence) must be the very forward the engine runs: this is
that runner and pool, for one sequence, in ``chosen`` row mode (a verify row computes as the decode
step at its position). ``num_computed`` positions have KV (DESIGN §2); :meth:`truncate` lowers it and
frees the blocks past it, and the next write overwrites the rejected slots.
"""

from __future__ import annotations

import torch

from spectoolkit.runtime.blocks import BlockAllocator, BlockTable
from spectoolkit.runtime.runner import Runner, run_segments
from spectoolkit.runtime.step import Segment


class LoneSequence:
    """A sequence's KV in ``runner``'s pool, blocks taken from ``allocator`` (released by :meth:`reset`)."""

    def __init__(self, runner: Runner, allocator: BlockAllocator) -> None:
        self.runner, self.allocator = runner, allocator
        self.device = runner.device
        self.table = BlockTable(allocator)
        self.num_computed = 0

    def reset(self) -> None:
        """Start a new sequence: every block goes back to the allocator."""
        self.table.release()
        self.num_computed = 0

    def truncate(self, length: int) -> None:
        self.num_computed = min(self.num_computed, length)
        self.table.truncate(self.num_computed)

    def forward(self, token_ids: list[int], last_only: bool = False) -> torch.Tensor:
        """Append ``token_ids`` (n) at positions [num_computed, num_computed+n): logits [n, V] ([V]: ``last_only``)."""
        rows = [len(token_ids) - 1] if last_only else list(range(len(token_ids)))
        logits = self._run(Segment(self.table, token_ids, self.num_computed, rows))
        return logits[0] if last_only else logits

    def _run(self, segment: Segment) -> torch.Tensor:
        end = segment.start + len(segment.token_ids)
        self.table.ensure(end)
        logits = run_segments(self.runner, [segment], "chosen")
        self.num_computed = end
        return logits
