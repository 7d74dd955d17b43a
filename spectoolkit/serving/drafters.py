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

from spectoolkit.config import SamplingConfig, TreeConfig
from spectoolkit.drafting.base import Proposal
from spectoolkit.drafting.model_drafter import align_logits, unsure
from spectoolkit.drafting.ngram import NgramDrafter
from spectoolkit.drafting.tree import TokenTree
from spectoolkit.drafting.tree_model import grow_tree
from spectoolkit.runtime.blocks import BlockAllocator, BlockTable
from spectoolkit.runtime.runner import Runner, run_segments
from spectoolkit.runtime.step import Segment
from spectoolkit.serving.sequence import Sequence


class BatchNgramDrafter:
    """Prompt lookup for each sequence (:class:`~spectoolkit.drafting.ngram.NgramDrafter`); q one-hot when sampling."""

    def __init__(self, max_n: int, min_n: int, target_vocab_size: int, one_hot_probs: bool) -> None:
        self.single = NgramDrafter(max_n, min_n, target_vocab_size, one_hot_probs)
        self.name = self.single.name
        self.tree_kind = self.single.tree_kind

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        return [self.single.propose(seq.tokens, budget, None) for seq, budget in zip(seqs, budgets, strict=True)]

    def propose_tree(self, seqs: list[Sequence], budgets: list[int], tree: TreeConfig, depths: list[int]):
        """A trie of continuations per sequence (:meth:`NgramDrafter.propose_tree`)."""
        return [self.single.propose_tree(seq.tokens, tree, budget, depth, None)
                for seq, budget, depth in zip(seqs, budgets, depths, strict=True)]  # fmt: skip

    def rollback(self, seq: Sequence, num_kept: int) -> None:
        pass

    def commit_path(self, seq: Sequence, num_prefix: int, path: list[int]) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def reset(self) -> None:
        pass

    def runners(self) -> dict[str, Runner]:
        return {}  # a lookup: no model runs

    def kv_bytes(self) -> int:
        return 0


class _DraftState:
    def __init__(self, allocator: BlockAllocator) -> None:
        self.table = BlockTable(allocator)
        self.num_computed = 0
        self.tree_slots: list[int | None] = []  # position of each node of the last tree in the draft's table


class _PagedRunner:
    """One sequence's draft KV as the runner :func:`grow_tree` expects (ragged forwards of one segment)."""

    def __init__(self, drafter: BatchModelDrafter, state: _DraftState) -> None:
        self.drafter, self.state = drafter, state

    @property
    def num_computed(self) -> int:
        return self.state.num_computed

    def forward(self, token_ids: list[int]) -> torch.Tensor:
        """Feed a chain; the logits [V_draft] after its last token."""
        return self._run(Segment(self.state.table, token_ids, self.num_computed, [len(token_ids) - 1]))[0]

    def forward_masked(self, token_ids: list[int], positions: list[int], visible: torch.Tensor) -> torch.Tensor:
        """Feed tree nodes (:func:`~spectoolkit.models.tree_mask.tree_rows`' ``visible``); logits [n, V_draft]."""
        rows = list(range(len(token_ids)))
        return self._run(Segment(self.state.table, token_ids, self.num_computed, rows, (positions, visible)))

    def _run(self, segment: Segment) -> torch.Tensor:
        end = segment.start + len(segment.token_ids)
        table = self.state.table
        if table.missing(end) > self.drafter.allocator.num_free:
            raise _DraftFull
        table.ensure(end)
        logits = run_segments(self.drafter.runner, [segment], "plain")
        self.state.num_computed = end
        return logits


class _DraftFull(Exception):
    """The draft pool cannot hold a tree's next depth."""


class BatchModelDrafter:
    """A draft model proposing for many sequences at once through ragged forwards over its own pool."""

    def __init__(
        self,
        runner: Runner,
        chooser,
        allocator: BlockAllocator,
        target_vocab_size: int,
        shared_vocab_size: int,
        eos_ids: frozenset[int],
        name: str = "model",
        stop_below: float | None = None,
    ) -> None:
        self.runner, self.model, self.pool = runner, runner.model, runner.pool
        self.chooser, self.allocator = chooser, allocator
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
            logits = run_segments(self.runner, segments, "plain")  # [len(active), V_draft]
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

    def propose_tree(
        self, seqs: list[Sequence], budgets: list[int], tree: TreeConfig, depths: list[int]
    ) -> list[TokenTree]:
        """A token tree per sequence (:func:`~spectoolkit.drafting.tree_model.grow_tree`), grown one sequence at
        a time over its paged draft KV: the tree's depths are not batched across sequences (not built yet)."""
        out = []
        sampling = getattr(self.chooser, "sampling", None) or SamplingConfig(temperature=0.0)
        for seq, budget, depth in zip(seqs, budgets, depths, strict=True):
            if budget <= 0 or depth <= 0 or not self._fits(seq, budget + 1):
                out.append(TokenTree([], []))
                continue
            state = self._state(seq)
            runner = _PagedRunner(self, state)
            try:
                root = self._aligned(runner.forward(seq.tokens[state.num_computed :]))
                grown, state.tree_slots = grow_tree(
                    runner, root, self._aligned, tree, sampling, depth, budget, self.eos_ids, seq.generator
                )
            except _DraftFull:  # the draft pool is full: no drafts this step (as for a chain)
                self.rollback(seq, len(seq.tokens) - 1)
                grown, state.tree_slots = TokenTree([], []), []
            out.append(grown)
        return out

    def commit_path(self, seq: Sequence, num_prefix: int, path: list[int]) -> None:
        """Keep the sequence's first ``num_prefix`` tokens and the accepted ``path``'s fed nodes, moved after them."""
        state = self._states.get(id(seq))
        if state is None:
            return
        if state.num_computed < num_prefix:  # the tree was not grown (no room): only the chain rule applies
            self.rollback(seq, num_prefix)
            return
        fed = [state.tree_slots[node] for node in path if state.tree_slots[node] is not None]  # positions
        self.pool.move(state.table.slots_at(fed), state.table.slots(num_prefix, num_prefix + len(fed)))
        state.num_computed = num_prefix + len(fed)
        state.table.truncate(state.num_computed)

    def _aligned(self, logits: torch.Tensor) -> torch.Tensor:
        return align_logits(logits, self.shared_vocab_size, self.target_vocab_size)

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

    def runners(self) -> dict[str, Runner]:
        return {"draft": self.runner}

    def kv_bytes(self) -> int:
        used = self.allocator.num_blocks - self.allocator.num_free
        return used * self.allocator.block_size * self.pool.slot_bytes()
