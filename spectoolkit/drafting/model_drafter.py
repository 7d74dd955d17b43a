"""Draft-model proposer: another checkpoint, or the target checkpoint at another precision, batched.

The draft has its own paged KV pool and a block table per sequence (the same KV rule as the target,
DESIGN §2). Chains: the first ragged forward feeds each sequence's verified tokens the draft has not
seen (at least the pending one) and drafts one token; each further forward feeds the last draft of
every sequence still drafting. Trees (``speculate.tree``): the same first forward, then one draft forward
per depth over the expanded nodes of every sequence's tree together
(:func:`~spectoolkit.drafting.tree_model.grow_trees`). ``commit`` keeps the verified tokens and the accepted
path's fed nodes, moved next to them; everything after is forgotten. With
``stop_below`` (``speculate.policy=confidence``) a chain ends after the first token whose draft
probability is below it. When the draft pool is full a sequence simply gets no drafts this round (a tree: no
deeper nodes). A sequence with more than :data:`~spectoolkit.drafting.base.BACKLOG_ROWS` tokens unseen (its
prompt, or the rounds the policy kept it from drafting) first has them fed in a forward of their own, booked as
upkeep (:meth:`~spectoolkit.drafting.base.OwnKV.upkeep`), so what the engine measures of a draft forward is one.
"""

from __future__ import annotations

import time

import torch

from spectoolkit.config import TreeConfig
from spectoolkit.drafting.base import Budget, Drafter, Drafting, OwnKV
from spectoolkit.drafting.tree import TokenTree
from spectoolkit.drafting.tree_model import Feed, Growth, grow_trees
from spectoolkit.runtime.blocks import BlockAllocator, BlockTable
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import Runner, make_runner, run_segments
from spectoolkit.runtime.step import Segment
from spectoolkit.sampling import penalize

LONE_BLOCK = 16  # block size of a drafter built for lone sequences (:func:`lone_drafter`)


class _DraftState:
    def __init__(self, allocator: BlockAllocator) -> None:
        self.table = BlockTable(allocator)
        self.num_computed = 0
        self.tree_slots: list[int | None] | None = None  # position of each node of the last tree; None: none grown


class ModelDrafter(OwnKV, Drafter):
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
        tree: TreeConfig | None = None,
        vocab_ids: torch.Tensor | None = None,
        carry: int | None = None,
    ) -> None:
        """``tree`` (enabled): trees of its kind (a static one at most ``len(branching)`` deep), within each round's
        budget. ``vocab_ids`` [n]: the target id of each of the draft's logits (a head cut to frequent tokens); None:
        logit i is id i, for ids below ``shared_vocab_size``. ``carry``: the most unfed rows of a sequence its first
        draft forward takes along (None: :data:`~spectoolkit.drafting.base.BACKLOG_ROWS`); more are fed apart."""
        self.runner, self.model, self.pool = runner, runner.model, runner.pool
        self.chooser, self.allocator = chooser, allocator
        self.target_vocab_size, self.shared_vocab_size = target_vocab_size, shared_vocab_size
        self.eos_ids = eos_ids
        self.name = name
        self.stop_below = stop_below  # speculate.policy=confidence: stop a sequence's draft below this top probability
        self.tree = tree if tree is not None and tree.enabled else None
        self.vocab_ids = vocab_ids
        self.carry = carry
        self._states: dict[int, _DraftState] = {}

    def variant(self, stop_below: float | None, tree: TreeConfig | None) -> ModelDrafter:
        """Another arm's drafter on the same runner and pool (arms never run at once; each starts reset)."""
        return type(self)(self.runner, self.chooser, self.allocator, self.target_vocab_size, self.shared_vocab_size,
                          self.eos_ids, self.name, stop_below, tree, self.vocab_ids, self.carry)  # fmt: skip

    def _state(self, seq: Drafting) -> _DraftState:
        return self._states.setdefault(id(seq), _DraftState(self.allocator))

    def backlog(self, seq: Drafting) -> int:
        """Tokens a round drafting for ``seq`` first feeds in a forward of their own (0: none, or a few the first
        draft forward takes along)."""
        state = self._states.get(id(seq))
        return self._backlog(len(seq.tokens) - (state.num_computed if state is not None else 0))

    def propose(self, seqs: list[Drafting], budgets: list[Budget]) -> list[TokenTree]:
        self._catch_up([seq for seq, budget in zip(seqs, budgets, strict=True) if min(budget.nodes, budget.depth) > 0])
        if self.tree is not None:
            return self._trees(seqs, budgets)
        return self._chains(seqs, [min(budget.nodes, budget.depth) for budget in budgets])

    def _catch_up(self, seqs: list[Drafting]) -> None:
        """Feed, in one forward of its own, every sequence's unseen tokens but the pending one where it has a backlog
        (:meth:`backlog`; not if the pool cannot hold them)."""
        began, segments, fed = time.perf_counter(), [], []
        for seq in seqs:
            count, state = self.backlog(seq), self._state(seq)
            if count and self._reserve(state.table, state.num_computed + count):
                segments.append(Segment(state.table, seq.tokens[state.num_computed : -1], state.num_computed, []))
                fed.append((state, count))
        if not segments:
            return
        run_segments(self.runner, segments, "plain")
        for state, count in fed:
            state.num_computed += count
        self._fed_backlogs(sum(count for _, count in fed), began)

    def _chains(self, seqs: list[Drafting], lengths: list[int]) -> list[TokenTree]:
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, seq in enumerate(seqs) if lengths[i] > 0 and self._fits(seq, lengths[i])]
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
                if draw_next(self, self._aligned(logits[row]), seqs[i], drafts[i], probs[i], lengths[i]):
                    feeds[i] = [drafts[i][-1]]
                    still.append(i)
            active = still
        return [TokenTree.chain(ids, torch.stack(p) if p else None) for ids, p in zip(drafts, probs, strict=True)]

    def _trees(self, seqs: list[Drafting], budgets: list[Budget]) -> list[TokenTree]:
        """A token tree per sequence, grown together: one ragged forward catches every sequence up on its verified
        tokens, then one per depth feeds that depth's expanded nodes of every tree (tree attention per segment)."""
        trees = [TokenTree([], [])] * len(seqs)
        chosen = [i for i, (seq, budget) in enumerate(zip(seqs, budgets, strict=True))
                  if budget.nodes > 0 and budget.depth > 0 and self._fits(seq, budget.nodes + 1)]  # fmt: skip
        if not chosen:
            return trees
        segments = []
        for i in chosen:
            state = self._state(seqs[i])
            feed = seqs[i].tokens[state.num_computed :]
            segments.append(Segment(state.table, feed, state.num_computed, [len(feed) - 1]))
            state.num_computed += len(feed)
        roots = run_segments(self.runner, segments, "plain")  # [len(chosen), V_draft]
        growths = []
        for row, i in enumerate(chosen):
            state = self._state(seqs[i])
            growths.append(
                Growth(
                    self._aligned(roots[row]),
                    self._aligned,
                    self.tree,
                    (seqs[i].chooser or self.chooser).sampling,
                    budgets[i].depth,
                    budgets[i].nodes,
                    self.eos_ids,
                    seqs[i].generator,
                    state.num_computed,
                    state,
                )
            )
        grow_trees(growths, lambda growth, feed: self._reserve(growth.owner.table, feed.start + len(feed.token_ids)),
                   self._feed_nodes)  # fmt: skip
        for i, growth in zip(chosen, growths, strict=True):
            trees[i], growth.owner.tree_slots = growth.result()
        return trees

    def _feed_nodes(self, feeds: list[tuple[Growth, Feed]]) -> torch.Tensor:
        """One draft forward over every sequence's nodes of a depth (a segment each, tree attention within it, its
        blocks reserved): their logits one after another [Σ m_i, V_draft]."""
        segments = []
        for growth, feed in feeds:
            state = growth.owner
            rows = list(range(len(feed.token_ids)))
            segments.append(Segment(state.table, feed.token_ids, feed.start, rows, (feed.positions, feed.visible)))
            state.num_computed = feed.start + len(feed.token_ids)
        return run_segments(self.runner, segments, "plain")

    def commit(self, seq: Drafting, num_prefix: int, path: list[int]) -> None:
        state = self._states.get(id(seq))
        if state is None:
            return
        if state.tree_slots is None or state.num_computed < num_prefix:  # a chain (fed in place), or no tree grown
            self._truncate(state, num_prefix + len(path))
            return
        fed = [state.tree_slots[node] for node in path if state.tree_slots[node] is not None]  # positions
        self.pool.move(state.table.slots_at(fed), state.table.slots(num_prefix, num_prefix + len(fed)))
        state.num_computed = num_prefix + len(fed)
        state.table.truncate(state.num_computed)
        state.tree_slots = None

    def _truncate(self, state: _DraftState, num_kept: int) -> None:
        state.num_computed = min(state.num_computed, num_kept)
        state.table.truncate(state.num_computed)

    def _aligned(self, logits: torch.Tensor) -> torch.Tensor:
        return align_logits(logits, self.shared_vocab_size, self.target_vocab_size, self.vocab_ids)

    def _fits(self, seq: Drafting, budget: int) -> bool:
        """Reserve draft blocks for the sequence's tokens and its drafts; False (no drafts) when full."""
        return self._reserve(self._state(seq).table, len(seq.tokens) + budget - 1)  # the last draft is never fed

    def runners(self) -> dict[str, Runner]:
        return {"draft": self.runner}

    def describe_tree(self) -> str | None:
        return self.tree.describe() if self.tree is not None else None


def lone_drafter(
    model: torch.nn.Module, chooser, target_vocab_size: int, shared_vocab_size: int, eos_ids: frozenset[int],
    positions: int, kv_precision: str = "auto", tree: TreeConfig | None = None, vocab_ids: torch.Tensor | None = None,
) -> ModelDrafter:  # fmt: skip
    """A drafter with a pool of its own for one sequence of up to ``positions`` tokens at a time (analytic
    proofs and tests drive it with :class:`~spectoolkit.drafting.base.Lone`); ``vocab_ids``: as
    :class:`ModelDrafter`'s."""
    blocks = -(-positions // LONE_BLOCK)
    runner = make_runner(model, make_pool(model, kv_precision, blocks * LONE_BLOCK))
    allocator = BlockAllocator(blocks, LONE_BLOCK)
    return ModelDrafter(runner, chooser, allocator, target_vocab_size, shared_vocab_size, eos_ids, "model", None,
                        tree, vocab_ids)  # fmt: skip


def draw_next(drafter, logits: torch.Tensor, seq: Drafting, drafts: list[int], probs: list, length: int) -> bool:
    """Draw ``seq``'s chain's next token from ``logits`` [V_target] with its chooser (else ``drafter.chooser``) into
    ``drafts`` (and its q into ``probs`` when sampling), after its penalties as the target's row there gets them (the
    output so far, then the drafts before it); whether the chain goes on (not ``length`` long yet, no EOS, not
    ``unsure``)."""
    chooser = seq.chooser or drafter.chooser
    if chooser.sampling.penalized:
        output = seq.tokens[seq.prompt_len :]
        logits = penalize(logits[None], chooser.sampling, seq.tokens[: seq.prompt_len], output, [list(drafts)])[0]
    token, q = chooser.choose(logits, seq.generator)
    drafts.append(token)
    if q is not None:
        probs.append(q)
    done = token in drafter.eos_ids or unsure(logits, q, drafter.stop_below)  # nothing after EOS is emitted
    return len(drafts) < length and not done


def unsure(logits: torch.Tensor, probs: torch.Tensor | None, stop_below: float | None) -> bool:
    """The draft's top probability (``probs`` [V] when sampling, else softmax(``logits`` [V])) < ``stop_below``."""
    if stop_below is None:
        return False
    top = probs.max() if probs is not None else torch.softmax(logits, dim=-1).max()
    return float(top) < stop_below


def align_logits(logits: torch.Tensor, shared: int, target: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Draft logits [V_draft] -> fp32 [V_target]: ids past the ``shared`` range (with ``ids`` [V_draft]: the target id
    of each logit, ids not in it) can never be proposed."""
    logits = logits.float()
    if ids is None and logits.shape[-1] == target and shared == target:
        return logits
    aligned = logits.new_full((target,), float("-inf"))
    if ids is None:
        aligned[:shared] = logits[:shared]
    else:
        aligned[ids] = logits
    return aligned
