"""Batched proposers: drafts for every sequence that may speculate this step, in one go.

- :class:`BatchNgramDrafter`: prompt lookup per sequence (:func:`spectoolkit.drafting.ngram.lookup`).
- :class:`BatchModelDrafter`: a draft model with its own paged KV pool and block tables (same KV rule
  as the target, DESIGN §2): the first ragged forward feeds each sequence's verified tokens the draft
  has not seen (at least the pending one) and drafts one token; each further forward feeds the last
  draft of every sequence still drafting. ``rollback`` lowers a sequence's draft length to what the
  target kept. When the draft pool is full a sequence simply gets no drafts this step.

Both return one :class:`~spectoolkit.drafting.base.Proposal` per sequence (ids and, when sampling,
the q rows [k, V_target] the ids were drawn from) — the typed batch proposal the verifier consumes.
"""

from __future__ import annotations

import torch

from spectoolkit.drafting.base import Proposal
from spectoolkit.drafting.model_drafter import align_logits, unsure
from spectoolkit.drafting.ngram import NgramDrafter
from spectoolkit.serving.blocks import BlockAllocator, BlockTable
from spectoolkit.serving.paged_kv import PagedKVPool
from spectoolkit.serving.ragged import Segment, ragged_forward, use_ragged_attention
from spectoolkit.serving.sequence import Sequence


class BatchNgramDrafter:
    """Prompt lookup for each sequence (:class:`~spectoolkit.drafting.ngram.NgramDrafter`); q one-hot when sampling."""

    def __init__(self, max_n: int, min_n: int, target_vocab_size: int, one_hot_probs: bool) -> None:
        self.single = NgramDrafter(max_n, min_n, target_vocab_size, one_hot_probs)
        self.name = self.single.name

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        return [self.single.propose(seq.tokens, budget, None) for seq, budget in zip(seqs, budgets, strict=True)]

    def rollback(self, seq: Sequence, num_kept: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def reset(self) -> None:
        pass

    def kv_bytes(self) -> int:
        return 0


class _DraftState:
    def __init__(self, allocator: BlockAllocator) -> None:
        self.table = BlockTable(allocator)
        self.num_computed = 0


class BatchModelDrafter:
    """A draft model proposing for many sequences at once through ragged forwards over its own pool."""

    def __init__(
        self,
        model: torch.nn.Module,
        chooser,
        pool: PagedKVPool,
        allocator: BlockAllocator,
        target_vocab_size: int,
        shared_vocab_size: int,
        eos_ids: frozenset[int],
        name: str = "model",
        stop_below: float | None = None,
    ) -> None:
        use_ragged_attention(model)
        self.model, self.chooser, self.pool, self.allocator = model, chooser, pool, allocator
        self.target_vocab_size, self.shared_vocab_size = target_vocab_size, shared_vocab_size
        self.eos_ids = eos_ids
        self.name = name
        self.stop_below = stop_below  # speculate.policy=confidence: stop a sequence's draft below this top probability
        self._states: dict[int, _DraftState] = {}

    def _state(self, seq: Sequence) -> _DraftState:
        return self._states.setdefault(id(seq), _DraftState(self.allocator))

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, seq in enumerate(seqs) if budgets[i] > 0 and self._fits(seq, budgets[i])]
        feeds = {i: seqs[i].tokens[self._state(seqs[i]).num_computed :] for i in active}
        while active:
            segments = []
            for i in active:
                state = self._state(seqs[i])
                segments.append(Segment(state.table, feeds[i], state.num_computed, [len(feeds[i]) - 1]))
            logits = ragged_forward(self.model, self.pool, segments, invariant=False)  # [len(active), V_draft]
            still = []
            for row, i in enumerate(active):
                state = self._state(seqs[i])
                state.num_computed += len(feeds[i])
                aligned = align_logits(logits[row], self.shared_vocab_size, self.target_vocab_size)
                token, q = self.chooser.choose(aligned, seqs[i].generator)
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
                done = token in self.eos_ids or unsure(aligned, q, self.stop_below)
                if len(drafts[i]) < budgets[i] and not done:
                    feeds[i] = [token]
                    still.append(i)
            active = still
        return [Proposal(ids, torch.stack(p) if p else None) for ids, p in zip(drafts, probs, strict=True)]

    def _fits(self, seq: Sequence, budget: int) -> bool:
        """Reserve draft blocks for the sequence's tokens and its drafts; False (no drafts) when full."""
        table = self._state(seq).table
        needed = len(seq.tokens) + budget - 1  # the last draft is never fed
        if table.missing(needed) > self.allocator.num_free:
            return False
        table.ensure(needed)
        return True

    def rollback(self, seq: Sequence, num_kept: int) -> None:
        state = self._states.get(id(seq))
        if state is not None:
            state.num_computed = min(state.num_computed, num_kept)
            state.table.truncate(state.num_computed)

    def release(self, seq: Sequence) -> None:
        state = self._states.pop(id(seq), None)
        if state is not None:
            state.table.release()

    def reset(self) -> None:
        for state in self._states.values():
            state.table.release()
        self._states.clear()

    def kv_bytes(self) -> int:
        used = self.allocator.num_blocks - self.allocator.num_free
        return used * self.allocator.block_size * self.pool.slot_bytes()
