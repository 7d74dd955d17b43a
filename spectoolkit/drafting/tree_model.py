"""Growing a token tree with a draft model: static branching, or EAGLE-2's dynamic expansion.

The draft runs one forward per depth over that depth's expanded nodes (tree attention over its own
cache, :func:`~spectoolkit.models.tree_mask.tree_rows`), so a tree of depth d costs d draft forwards
(plus the catch-up of the verified tokens it has not seen), as a chain of d tokens does — and the trees of
every sequence of a step grow together (:func:`grow_trees`): depth d of all of them is one ragged forward.

Children of a node: greedy, the draft's top-k tokens (distinct, most probable first); sampling, k
draws i.i.d. from the node's processed draft distribution q (each node reports q, the distribution it
was drawn from). What is kept must never depend on a drawn child's own value when sampling, or the
siblings stop being i.i.d. draws from q and verification is no longer exact:

- ``static``: every node at depth d gets ``branching[d]`` children; the tree is cut to ``max_nodes``
  in breadth-first order (which depends on depths and draw indices only).
- ``dynamic``: at each depth the ``top_k`` frontier nodes with the highest cumulative draft
  log-probability are expanded with ``top_k`` children each, up to depth γ; then the ``max_nodes``
  nodes with the highest *key* are kept. A frontier node outside the best ``max_nodes`` keys so far is
  not expanded (keys only fall along a path, so none of its descendants could be kept): a confident
  draft feeds one node per depth, as a chain does. Greedy, a node's key is its cumulative log-probability
  (EAGLE-2's re-ranking). Sampling, the key of the j-th draw of node v is
  min(key(v), score(v) + j·log(SIBLING_DECAY)) — its parent's score and its draw index, never its
  own value — which still keeps every ancestor before its descendants and every earlier sibling
  (and its subtree's keys are below a later sibling's) so siblings stay a draw-order prefix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from spectoolkit.config import TreeConfig
from spectoolkit.drafting.tree import TokenTree
from spectoolkit.models.tree_mask import tree_rows
from spectoolkit.sampling import Processing, processed_probs, sample_from

SIBLING_DECAY = 0.5  # sampling: how much less a later i.i.d. draw of the same node is worth when keeping nodes


@dataclass
class _Node:
    token: int
    parent: int  # index into the grown list, -1 = root
    depth: int
    score: float  # cumulative draft log-probability of the path to this node
    key: float  # what the final cut ranks by (see the module doc)
    probs: torch.Tensor | None  # [V] the distribution the node was drawn from (sampling)
    slot: int | None = None  # draft cache slot once fed
    logits: torch.Tensor | None = field(default=None, repr=False)  # [V] draft logits after the node, once fed


@dataclass(frozen=True)
class Feed:
    """One sequence's nodes of one depth to feed the draft (tree attention over its own cache): their tokens,
    positions and visibility (:func:`~spectoolkit.models.tree_mask.tree_rows`, from ``start`` on), and each one's
    index and its parent's in the tree being grown (-1: the root), for a drafter whose rows carry a parent's state."""

    token_ids: list[int]
    positions: list[int]
    visible: torch.Tensor
    start: int
    nodes: list[int]
    parents: list[int]


class Growth:
    """One sequence's tree, grown a depth at a time: :meth:`next_feed` makes the next depth's children and says which
    of them to feed; :meth:`fed` takes their draft logits [m, V_draft]. Many growths share each draft forward
    (:func:`grow_trees`), so a step's trees cost one forward per depth, whatever the batch."""

    def __init__(
        self, root_logits: torch.Tensor, align: Callable[[torch.Tensor], torch.Tensor], tree: TreeConfig,
        sampling: Processing, max_depth: int, budget: int, eos_ids: frozenset[int],
        generator: torch.Generator | None, base: int, owner: object = None,
    ) -> None:  # fmt: skip
        """``base``: the draft cache's length after the verified tokens (the first node is fed there); ``owner``: the
        drafter's state of the sequence (what its feed writes to)."""
        self.owner = owner
        self.align, self.tree, self.sampling, self.budget = align, tree, sampling, budget
        self.eos_ids, self.generator, self.base, self.start = eos_ids, generator, base, base
        self.static = tree.kind == "static"
        self.depth_limit = min(max_depth, len(tree.branching)) if self.static else max_depth
        self.nodes: list[_Node] = []
        self.frontier = [(-1, root_logits, 0.0, 0.0)]  # (node, logits, score, key)
        self.depth = 0
        self.done = self.depth_limit <= 0 or budget <= 0
        self._expand: list[int] = []

    def next_feed(self) -> Feed | None:
        """Grow the next depth's children; the ones to feed before the depth after (None: the tree is complete)."""
        if self.done:
            return None
        tree, nodes = self.tree, self.nodes
        frontier = self.frontier if self.static else sorted(self.frontier, key=lambda item: -item[2])[: tree.top_k]
        count = tree.branching[self.depth] if self.static else tree.top_k
        level: list[int] = []
        for parent, logits, score, key in frontier:
            for token, probs, logq, index in _children(logits, count, self.sampling, self.generator):
                child_score = score + logq
                child_key = child_score if self.sampling.greedy else min(key, score + index * math.log(SIBLING_DECAY))
                nodes.append(_Node(token, parent, self.depth + 1, child_score, child_key, probs))
                level.append(len(nodes) - 1)
        self.depth += 1
        expand = [i for i in level if nodes[i].token not in self.eos_ids]
        if (self.static and len(nodes) >= self.budget) or self.depth == self.depth_limit or not expand:
            return self._finish()
        if not self.static:  # a node outside the best ``budget`` so far has no descendant in the final cut: skip it
            best = set(_cut(nodes, self.budget, by_key=True))
            expand = sorted((i for i in expand if i in best), key=lambda i: -nodes[i].score)[: tree.top_k]
            if not expand:
                return self._finish()
        self._expand = expand
        ancestors = []
        for index in expand:
            slots, parent = [], nodes[index].parent
            while parent >= 0:
                slots.append(nodes[parent].slot)
                parent = nodes[parent].parent
            ancestors.append(slots)
        positions, visible = tree_rows(ancestors, self.base, self.start)
        tokens, parents = [nodes[i].token for i in expand], [nodes[i].parent for i in expand]
        return Feed(tokens, positions, visible, self.start, list(expand), parents)

    def fed(self, logits: torch.Tensor) -> None:
        """The draft logits [m, V_draft] of the last :meth:`next_feed`'s nodes, fed at ``start`` on."""
        for row, index in enumerate(self._expand):
            self.nodes[index].slot = self.start + row
            self.nodes[index].logits = self.align(logits[row])
        self.start += len(self._expand)
        self.frontier = [(i, self.nodes[i].logits, self.nodes[i].score, self.nodes[i].key) for i in self._expand]

    def stop(self) -> None:
        """Grow no deeper (the draft's pool cannot hold the next depth): the nodes made so far are the tree."""
        self._finish()

    def _finish(self) -> None:
        self.done, self._expand = True, []
        return None

    def result(self) -> tuple[TokenTree, list[int | None]]:
        """The tree (at most ``budget`` nodes) and each node's draft cache slot (None: never fed)."""
        kept = _cut(self.nodes, self.budget, by_key=not self.static)
        return _as_tree(self.nodes, kept, self.sampling.greedy)


def grow_trees(
    growths: list[Growth],
    fits: Callable[[Growth, Feed], bool],
    feed: Callable[[list[tuple[Growth, Feed]]], torch.Tensor],
) -> None:
    """Grow every tree of ``growths`` to the end, one draft forward per depth over all of them: ``fits`` reserves a
    sequence's draft KV for its :class:`Feed` (False: its pool cannot hold it, and that tree stops growing);
    ``feed`` runs the draft over the feeds that fit and returns their logits, one after another [Σ m_i, V_draft]."""
    active = growths
    while active:
        feeds = []
        for growth in active:
            made = growth.next_feed()
            if made is not None and fits(growth, made):
                feeds.append((growth, made))
            elif made is not None:
                growth.stop()
        if not feeds:
            return
        logits, row = feed(feeds), 0
        for growth, made in feeds:
            growth.fed(logits[row : row + len(made.token_ids)])
            row += len(made.token_ids)
        active = [growth for growth, _ in feeds if not growth.done]


def _children(logits: torch.Tensor, count: int, sampling: Processing, generator):
    """(token, q [V] or None, log q(token), draw index) for ``count`` children of a node with ``logits`` [V]."""
    if sampling.greedy:
        logq = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(logq, min(count, int(torch.isfinite(logq).sum())))
        return [(int(t), None, float(v), i) for i, (v, t) in enumerate(zip(top.values, top.indices, strict=True))]
    probs = processed_probs(logits, sampling)  # [V] fp32
    out = []
    for index in range(count):
        token = sample_from(probs, torch.rand(1, generator=generator))  # i.i.d. draws from q
        out.append((token, probs, math.log(float(probs[token])), index))
    return out


def _cut(nodes: list[_Node], budget: int, by_key: bool) -> list[int]:
    """Indices of the kept nodes, ordered by (depth, creation): parents first, siblings in draw order."""
    order = list(range(len(nodes)))
    if by_key:  # ties keep the earlier (shallower, earlier-drawn) node, so ancestors precede descendants
        order = sorted(order, key=lambda i: (-nodes[i].key, nodes[i].depth, i))
    kept = set(order[:budget])
    return sorted(kept, key=lambda i: (nodes[i].depth, i))


def _as_tree(nodes: list[_Node], kept: list[int], greedy: bool) -> tuple[TokenTree, list[int | None]]:
    new_index = {old: new for new, old in enumerate(kept)}
    parents = [new_index[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in kept]
    probs = None if greedy or not kept else torch.stack([nodes[i].probs for i in kept])  # [n, V]
    return TokenTree([nodes[i].token for i in kept], parents, probs), [nodes[i].slot for i in kept]
