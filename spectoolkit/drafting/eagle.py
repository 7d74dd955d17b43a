"""Drafting with a trained EAGLE-3 head (:class:`~spectoolkit.models.eagle3_head.Eagle3Head`) over the target's states.

The engine's target forward returns, for every row it computed, the residual stream entering the head's three
target layers (``capture``); the engine hands the drafter the rows it kept (:meth:`EagleDrafter.keep_states`).
The head's KV lives in its own paged pool, one layer, by position, and follows the KV rule (DESIGN §2):

- head position t holds the row (token x_{t+1}, the target's states at t): it exists once the target has
  verified position t and the token after it is known. A round first feeds every such row not fed yet (at least
  the pending token's: x_c beside the states of c - 1), which is the head's "verified" KV, ``num_computed``;
- its last row drafts x_{c+1}; draft step j feeds draft j at position c + j - 1 with the previous row's
  pre-norm output (``aux``) as its state, exactly as training unrolls it (:mod:`spectoolkit.training.ttt`);
- draft rows are never kept: ``commit`` truncates the head to its verified rows, and the next round feeds the
  accepted tokens again with the target's own states (as vLLM's EAGLE does);
- rows are held until a round feeds them, so a request the draft-length policy keeps from drafting (under
  load) costs the head nothing; a round whose sequences hold more than
  :data:`~spectoolkit.drafting.base.BACKLOG_ROWS` (a prompt, or the rounds a request sat out) first feeds those in
  one forward of its own, timed apart as its ``upkeep``, so
  what the policy measures of a draft forward is a draft forward; once :data:`MAX_HELD` rows are held (a bound
  on memory: 6.9 KB a row for the embedded model) those whose next token is known are fed at once;
- the head's blocks of verified rows are published like the target's (keyed by the tokens their rows depend on),
  so a prompt the engine starts from another's live shared prefix takes the head's rows of it too (or, where that
  sequence still holds them unfed, a copy of the target's states there).

Chains batch every sequence's rows into one head forward per draft step. Trees (EAGLE-2's dynamic trees, or
static ones; ``speculate.tree``) grow for every sequence together, one head forward per depth
(:func:`~spectoolkit.drafting.tree_model.grow_trees`): a node's state is its parent's ``aux``. Sampling, q is the
head's processed distribution scattered into the target vocabulary (ids outside the draft vocabulary have
q = 0 and are never drafted), so the stochastic acceptance test stays exact; a draft only proposes.
The head runs on our kernels: its linears packed in bf16 (:mod:`spectoolkit.quant.packing`; half the bytes of a
draft step, which are mostly its output rows), attention over the pool with ``spectoolkit::paged_attention``.
"""

from __future__ import annotations

import time

import torch

from spectoolkit.config import TreeConfig
from spectoolkit.drafting.base import Budget, Drafter, Drafting, OwnKV
from spectoolkit.drafting.model_drafter import draw_next
from spectoolkit.drafting.tree import TokenTree
from spectoolkit.drafting.tree_model import Feed, Growth, grow_trees
from spectoolkit.errors import SpecToolkitError
from spectoolkit.kernels import cpu_ops
from spectoolkit.models.eagle3_head import Eagle3Head
from spectoolkit.quant.packing import pack_model
from spectoolkit.runtime.attention import flat_key_slots, kernel_attends, kernel_attention, pool_stores, row_key_lists
from spectoolkit.runtime.blocks import BlockAllocator, BlockTable
from spectoolkit.runtime.paged_kv import PagedKVPool
from spectoolkit.runtime.step import Segment, build_step

MAX_HELD = 512  # held rows that are fed at once, when handed over, rather than in the next drafting round


class EagleHead:
    """A head ready to draft: packed linears, the target's input embeddings, and its one-layer paged pool."""

    def __init__(
        self, head: Eagle3Head, embeddings: torch.nn.Module, num_slots: int, weights: torch.dtype = torch.bfloat16
    ) -> None:
        """``weights``: the dtype its linears are packed in (bf16 by default: a draft step reads half the bytes, most
        of them the head's output rows; activations stay fp32, and a draft only proposes)."""
        shape = head.shape
        if embeddings.num_embeddings != shape.vocab_size or embeddings.embedding_dim != shape.hidden_size:
            raise SpecToolkitError(
                f"the draft head was trained for a target with vocabulary {shape.vocab_size} and hidden size "
                f"{shape.hidden_size}, not {embeddings.num_embeddings} and {embeddings.embedding_dim}: train one for "
                "this target (python -m spectoolkit.train_draft) or point draft.eagle_path at one"
            )
        self.head, self.embeddings, self.shape = head.eval(), embeddings, shape
        device = head.fc.weight.device
        self.pool = PagedKVPool(1, shape.num_key_value_heads, shape.head_dim, num_slots, "fp32", torch.float32, device)
        if not kernel_attends(self.pool, shape.head_dim):
            raise SpecToolkitError("+draft=eagle runs the head on our CPU kernels: use device=cpu")
        for module in head.modules():
            if isinstance(module, torch.nn.Linear):
                module.to(weights)
        pack_model(head)
        self.stores = pool_stores(self.pool, 0)
        self.isa = cpu_ops.best_isa()
        self.scaling = shape.head_dim**-0.5

    @torch.inference_mode()
    def rows(self, segments: list[Segment], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``segments`` (their rows' tokens, positions and visibility; the tables cover them) with each row's
        state ``hidden`` [T, H] -> (draft logits [R, Vd] of the segments' logit rows, aux [T, H])."""
        batch = build_step(segments, "invariant", hidden.device)
        head, attn = self.head, self.head.midlayer.self_attn
        x = head.layer_in(self.embeddings(batch.token_ids).float(), hidden)  # [T, 2H]
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in attn.qkv(x[None], batch.positions[None]))  # [T, H, D]
        key_slots, starts = flat_key_slots(row_key_lists(batch))
        out = kernel_attention(self.stores, q, k, v, batch.slots, key_slots, starts, self.scaling, self.isa)
        normed, aux = head.layer_out(attn.o_proj(out.reshape(out.shape[0], -1)), hidden)
        return head.draft_logits(normed[batch.logit_rows]), aux

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[Vd] -> fp32 [V]: the draft logits at their target ids, -inf elsewhere."""
        return self.head.scattered(draft_logits.float())


def _row_keys(tokens: list[int], end: int) -> list[tuple[int, int]]:
    """What head positions 0 .. end - 1 are shared under: (x_t, x_{t+1}), so a block's hash chain covers every token
    its rows depend on."""
    return list(zip(tokens[:end], tokens[1 : end + 1], strict=True))


class _State:
    def __init__(self, allocator: BlockAllocator, tokens: list[int]) -> None:
        self.table = BlockTable(allocator)
        self.tokens = tokens  # the sequence's own list (it grows in place): what a later prompt's prefix is matched to
        self.num_computed = 0  # head positions holding verified rows
        self.parts: list[torch.Tensor] = []  # the target's states of positions [num_computed, +pending), not fed yet
        self.pending = 0  # rows in parts: kept as the engine hands them and joined once, when fed (a request that
        # does not draft for many rounds must not copy its whole backlog every round)

    def keep(self, offset: int, states: torch.Tensor) -> None:
        """Hold ``states`` as the rows from ``offset`` on of the pending ones (later ones are dropped)."""
        if offset < self.pending:
            self.parts = [self.rows()[:offset]]
            self.pending = offset
        self.parts.append(states.detach().float())
        self.pending += len(states)

    def rows(self) -> torch.Tensor:
        if len(self.parts) > 1:
            self.parts = [torch.cat(self.parts)]
        return self.parts[0]

    def fed(self, count: int) -> None:
        """The first ``count`` held rows are in the head's KV now."""
        self.parts = [self.rows()[count:]]
        self.pending -= count
        self.num_computed += count

    def drop(self) -> None:
        self.parts, self.pending = [], 0


class EagleDrafter(OwnKV, Drafter):
    """Proposes chains or trees from a trained EAGLE-3 head for many sequences at once (module docstring)."""

    name = "eagle"

    def __init__(
        self, head: EagleHead, allocator: BlockAllocator, chooser, eos_ids: frozenset[int],
        stop_below: float | None = None, tree: TreeConfig | None = None,
    ) -> None:  # fmt: skip
        self.head, self.allocator, self.chooser, self.pool = head, allocator, chooser, head.pool
        self.eos_ids = eos_ids  # the head's vocabulary is the target's (EagleHead checks it)
        self.capture = head.shape.aux_layers  # the target layers whose input states the engine hands over
        self.stop_below = stop_below
        self.tree = tree if tree is not None and tree.enabled else None
        self._states: dict[int, _State] = {}
        self.fc = head.head.fc

    def variant(self, stop_below: float | None, tree: TreeConfig | None) -> EagleDrafter:
        return type(self)(self.head, self.allocator, self.chooser, self.eos_ids, stop_below, tree)

    def _state(self, seq: Drafting) -> _State:
        state = self._states.get(id(seq))
        if state is None:
            state = self._states[id(seq)] = _State(self.allocator, seq.tokens)
        return state

    # ---- what the engine tells it -------------------------------------------------------------

    def keep_states(self, seq: Drafting, start: int, states: torch.Tensor) -> None:
        """The target verified positions [start, start + n) of ``seq``; ``states`` [n, 3H] are its states there."""
        state = self._state(seq)
        if start > state.num_computed + state.pending and not self._adopt(seq, state, start):
            return
        if start < state.num_computed:  # the target recomputed positions the head holds: forget them
            self._truncate(state, start)
            state.drop()
        skip = max(0, state.num_computed - start)  # positions a shared block holds already
        state.keep(start + skip - state.num_computed, states[skip:])
        if state.pending >= MAX_HELD:
            self._feed_held([seq], MAX_HELD - 1)

    def _adopt(self, seq: Drafting, state: _State, start: int) -> bool:
        """The target took positions [0, start) of ``seq`` from another live sequence's identical prefix: take the
        head's blocks of that prefix too (their rows depend on its tokens only: position t on x_0 .. x_{t+1}, the
        key they are shared under), and the target's states of the positions past them from a live sequence that
        still holds them unfed (a request the policy kept from drafting under load; states at t depend on
        x_0 .. x_t only, so they serve even where the prompts part right after the prefix). False if neither
        covers the prefix, and then the head drafts nothing for ``seq``."""
        state.table.release()
        state.num_computed = 0
        state.drop()
        shared = state.table.share_prefix(_row_keys(seq.tokens, start), start)
        if shared == start:
            state.num_computed = start
            return True
        held = self._held_rows(seq.tokens, shared, start)
        if held is None:
            state.table.release()
            return False
        state.num_computed = shared
        state.keep(0, held)
        return True

    def _held_rows(self, tokens: list[int], start: int, end: int) -> torch.Tensor | None:
        """The target's states of positions [start, end) of ``tokens`` [end - start, 3H], copied from a live sequence
        with the same first ``end`` tokens that holds them unfed; None if none does."""
        for other in self._states.values():
            held = other.num_computed <= start < end <= other.num_computed + other.pending
            if held and other.tokens[:end] == tokens[:end]:  # a shorter list's slice never equals
                return other.rows()[start - other.num_computed : end - other.num_computed].clone()
        return None

    def _publish(self, seq: Drafting, state: _State) -> None:
        """Offer the head's blocks of verified rows to later sequences with the same prefix (:meth:`_adopt`)."""
        if (state.table.published + 1) * self.allocator.block_size <= state.num_computed:
            state.table.publish_committed(_row_keys(seq.tokens, state.num_computed), state.num_computed)

    def backlog(self, seq: Drafting) -> int:
        """Rows a round drafting for ``seq`` first feeds in a forward of its own (0: none, or a few the draft forward
        takes along)."""
        state = self._states.get(id(seq))
        return self._backlog(state.pending) if state is not None else 0

    def _feed_held(self, seqs: list[Drafting], more_than: int) -> int:
        """Feed, in one head forward, every sequence of ``seqs`` holding more than ``more_than`` rows: its rows whose
        next token is verified already, but the last (a round drafts from its logits; none if the pool is out of
        blocks). The rows fed (0: none)."""
        segments, hidden, fed = [], [], []
        for seq in seqs:
            state = self._states.get(id(seq))
            if state is None or state.pending <= more_than:
                continue
            count = min(state.pending - 1, len(seq.tokens) - 1 - state.num_computed)
            if count <= 0 or not self._reserve(state.table, state.num_computed + count):
                continue
            tokens = seq.tokens[state.num_computed + 1 : state.num_computed + 1 + count]
            segments.append(Segment(state.table, tokens, state.num_computed, []))
            hidden.append(state.rows()[:count])
            fed.append((seq, state, count))
        if not segments:
            return 0
        self.head.rows(segments, self.fc(torch.cat(hidden)))
        for seq, state, count in fed:
            state.fed(count)
            self._publish(seq, state)
        return sum(count for _, _, count in fed)

    def commit(self, seq: Drafting, num_prefix: int, path: list[int]) -> None:
        state = self._states.get(id(seq))
        if state is not None:  # draft rows are never kept: the accepted tokens are fed again with the target's states
            state.table.truncate(state.num_computed)

    # ---- proposing ----------------------------------------------------------------------------

    def propose(self, seqs: list[Drafting], budgets: list[Budget]) -> list[TokenTree]:
        began = time.perf_counter()
        rows = self._feed_held(
            [seq for seq, budget in zip(seqs, budgets, strict=True) if budget.nodes > 0], self._carried()
        )
        self._fed_backlogs(rows, began)
        if self.tree is not None:
            return self._trees(seqs, budgets)
        return self._chains(seqs, [min(budget.nodes, budget.depth) for budget in budgets])

    def _catch_up(self, seqs: list[Drafting], room: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Feed each sequence's verified rows not fed yet (reserving ``room`` draft positions past them): the
        sequences that can draft (indices), the draft logits [n, Vd] after each one's last row and their aux [n, H]."""
        chosen, segments, hidden, lasts = [], [], [], []
        row = 0
        for i, seq in enumerate(seqs):
            state = self._state(seq)
            count = state.pending
            if room[i] <= 0 or count == 0 or len(seq.tokens) != state.num_computed + count + 1:
                continue
            if not self._reserve(state.table, state.num_computed + count + room[i] - 1):
                continue
            chosen.append(i)
            tokens = seq.tokens[state.num_computed + 1 :]
            segments.append(Segment(state.table, tokens, state.num_computed, [count - 1]))
            hidden.append(state.rows())
            row += count
            lasts.append(row - 1)
        if not chosen:
            return [], torch.empty(0), torch.empty(0)
        logits, aux = self.head.rows(segments, self.fc(torch.cat(hidden)))
        for i in chosen:
            state = self._state(seqs[i])
            state.fed(state.pending)
            self._publish(seqs[i], state)
        return chosen, logits, aux[lasts]

    def _chains(self, seqs: list[Drafting], lengths: list[int]) -> list[TokenTree]:
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active, logits, aux = self._catch_up(seqs, lengths)
        step = 0
        while active:
            still, rows = [], []
            for row, i in enumerate(active):
                full = self.head.target_logits(logits[row])
                if draw_next(self, full, seqs[i], drafts[i], probs[i], lengths[i]):
                    still.append(i)
                    rows.append(row)
            if not still:
                break
            segments = []
            for i in still:
                state = self._state(seqs[i])
                segments.append(Segment(state.table, [drafts[i][-1]], state.num_computed + step, [0]))
            logits, aux = self.head.rows(segments, aux[rows])
            active, step = still, step + 1
        return [TokenTree.chain(ids, torch.stack(p) if p else None) for ids, p in zip(drafts, probs, strict=True)]

    def _trees(self, seqs: list[Drafting], budgets: list[Budget]) -> list[TokenTree]:
        """A token tree per sequence, grown together: the catch-up forward of every sequence, then one head forward
        per depth over that depth's expanded nodes of every tree, each node fed its parent's aux."""
        trees = [TokenTree([], [])] * len(seqs)
        wanted = [i for i, budget in enumerate(budgets) if budget.nodes > 0 and budget.depth > 0]
        if not wanted:
            return trees
        chosen, logits, aux = self._catch_up([seqs[i] for i in wanted], [budgets[i].nodes + 1 for i in wanted])
        align, growths = self.head.target_logits, []
        for row, j in enumerate(chosen):
            i, state = wanted[j], self._state(seqs[wanted[j]])
            growths.append(Growth(align(logits[row]), align, self.tree, (seqs[i].chooser or self.chooser).sampling,
                                  budgets[i].depth,
                                  budgets[i].nodes, self.eos_ids, seqs[i].generator, state.num_computed,
                                  _TreeRows(state, aux[row])))  # fmt: skip
        grow_trees(growths, lambda growth, feed: self._reserve(growth.owner.state.table, feed.start + len(feed.nodes)),
                   self._feed_nodes)  # fmt: skip
        for j, growth in zip(chosen, growths, strict=True):
            trees[wanted[j]] = growth.result()[0]
        return trees

    def _feed_nodes(self, feeds: list[tuple[Growth, Feed]]) -> torch.Tensor:
        """One head forward over every sequence's nodes of a depth (their blocks reserved), each with its parent's aux
        (the root's: the last verified row's): their logits one after another [Σ m_i, Vd]."""
        segments, hidden = [], []
        for growth, feed in feeds:
            rows = growth.owner
            logit_rows = list(range(len(feed.token_ids)))
            segments.append(Segment(rows.state.table, feed.token_ids, feed.start, logit_rows,
                                    (feed.positions, feed.visible)))  # fmt: skip
            hidden += [rows.root_aux if parent < 0 else rows.aux[parent] for parent in feed.parents]
        logits, aux = self.head.rows(segments, torch.stack(hidden))  # [Σ m_i, Vd], [Σ m_i, H]
        row = 0
        for growth, feed in feeds:
            for node in feed.nodes:
                growth.owner.aux[node] = aux[row]
                row += 1
        return logits

    def _truncate(self, state: _State, kept: int) -> None:
        shared = state.table.published * self.allocator.block_size  # published rows are never written again
        state.num_computed = min(state.num_computed, max(kept, shared))
        state.table.truncate(state.num_computed)

    def runners(self) -> dict:
        return {}

    def describe_tree(self) -> str | None:
        return self.tree.describe() if self.tree is not None else None


class _TreeRows:
    """One sequence's tree as the head grows it: the last verified row's aux (the root's state) and each fed node's
    aux (its children's state), by node index."""

    def __init__(self, state: _State, root_aux: torch.Tensor) -> None:
        self.state, self.root_aux = state, root_aux
        self.aux: dict[int, torch.Tensor] = {}
