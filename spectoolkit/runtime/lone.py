"""One sequence driven directly through a runner: feed tokens, get logits, roll back by length.

What calibration times (a verify forward of w rows on top of a context) and what the exactness
proof replays (the target alone at a divergence) must be the very forward the engine runs: this is
that runner and pool, for one sequence, in ``chosen`` row mode (a verify row computes as the decode
step at its position). ``num_computed`` positions have KV (DESIGN §2); :meth:`truncate` lowers it and
frees the blocks past it, and the next write overwrites the rejected slots.

It is also the batch-1 runner of what drives one sequence outside the engine: the batch-1 draft model of
the analytic exactness proofs, the divergence replays of a load run, and the kernel choice's timed steps.
"""

from __future__ import annotations

import torch

from spectoolkit.runtime.blocks import BlockAllocator, BlockTable
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import Runner, make_runner, run_segments, synchronize
from spectoolkit.runtime.step import Segment

LONE_BLOCK = 16  # block size of a lone sequence's own pool


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
        self.num_computed = max(0, min(self.num_computed, length))
        self.table.truncate(self.num_computed)

    def forward(self, token_ids: list[int], last_only: bool = False) -> torch.Tensor:
        """Append ``token_ids`` (n) at positions [num_computed, num_computed+n): logits [n, V] ([V]: ``last_only``)."""
        rows = [len(token_ids) - 1] if last_only else list(range(len(token_ids)))
        logits = self._run(Segment(self.table, token_ids, self.num_computed, rows))
        return logits[0] if last_only else logits

    def forward_masked(self, token_ids: list[int], positions: list[int], visible: torch.Tensor) -> torch.Tensor:
        """Append ``token_ids`` (n) at slots [num_computed, +n), rotary ``positions``, each attending the slots
        ``visible`` [n, num_computed+n] sets (a token tree); logits [n, V]."""
        segment = Segment(self.table, token_ids, self.num_computed, list(range(len(token_ids))), (positions, visible))
        return self._run(segment)

    def commit_slots(self, start: int, slots: list[int]) -> None:
        """Keep positions [0, start), then positions ``slots`` (ascending, >= start) moved to [start, +len(slots)):
        a tree's accepted path next to its prefix, stored bytes copied as they are."""
        kept = start + len(slots)
        self.runner.pool.move(self.table.slots_at(slots), self.table.slots(start, kept))
        self.truncate(kept)

    def kv_bytes(self) -> int:
        """Bytes of the blocks this sequence holds."""
        return len(self.table.blocks) * self.allocator.block_size * self.runner.pool.slot_bytes()

    def _run(self, segment: Segment) -> torch.Tensor:
        end = segment.start + len(segment.token_ids)
        self.table.ensure(end)
        logits = run_segments(self.runner, [segment], "chosen")
        self.num_computed = end
        return logits


def lone_sequence(model: torch.nn.Module, kv_precision: str = "auto", positions: int = 1 << 15,
                  compiled: bool = False) -> LoneSequence:  # fmt: skip
    """A sequence of up to ``positions`` tokens on ``model`` over a pool of its own (KV at ``kv_precision``;
    pages are touched only when written, so the size costs nothing until used)."""
    blocks = -(-positions // LONE_BLOCK)
    runner = make_runner(model, make_pool(model, kv_precision, blocks * LONE_BLOCK), compiled)
    return LoneSequence(runner, BlockAllocator(blocks, LONE_BLOCK))


def model_step(model: torch.nn.Module, context_len: int = 64):
    """``step(w)``: one forward of ``w`` tokens on top of a ``context_len``-token context of ``model`` (synthetic
    ids) on the eager runner, rolled back after, as a decode step (w = 1) or a verify window does; for timing
    kernel choices (:func:`~spectoolkit.kernels.kernel_choice.choose_kernels`). The context is prefilled at the
    first call, so a model whose choices are all cached pays nothing."""
    sequences: list[LoneSequence] = []
    vocab = model.get_input_embeddings().num_embeddings
    context = [(7 + 13 * index) % vocab for index in range(context_len)]

    @torch.inference_mode()
    def step(width: int) -> object:
        if not sequences:
            sequences.append(lone_sequence(model, positions=2 * context_len))
            sequences[0].forward(context, last_only=True)
        sequences[0].forward(context[:width])
        sequences[0].truncate(context_len)
        synchronize(sequences[0].device)  # a CUDA step is timed to its end, not to its launch

    return step
