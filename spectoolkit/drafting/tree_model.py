"""Growing a token tree with a draft model: static branching, or EAGLE-2's dynamic expansion.

The draft runs one forward per depth over that depth's expanded nodes (tree attention over its own
cache, :func:`~spectoolkit.models.tree_mask.tree_rows`), so a tree of depth d costs d draft forwards
(plus the catch-up of the verified tokens it has not seen), as a chain of d tokens does.

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

from spectoolkit.config import SamplingConfig, TreeConfig
from spectoolkit.drafting.tree import TokenTree
from spectoolkit.models.tree_mask import tree_rows
from spectoolkit.sampling import processed_probs, sample_from

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


def grow_tree(
    runner,
    root_logits: torch.Tensor,
    align: Callable[[torch.Tensor], torch.Tensor],
    tree: TreeConfig,
    sampling: SamplingConfig,
    max_depth: int,
    budget: int,
    eos_ids: frozenset[int],
    generator: torch.Generator | None,
) -> tuple[TokenTree, list[int | None]]:
    """A tree of at most ``budget`` nodes below the root whose draft logits [V_target] are ``root_logits``.

    ``runner`` (a :class:`~spectoolkit.runtime.lone.LoneSequence`) holds the verified tokens and nothing after them;
    expanded nodes are appended to it. Returns the tree and each node's draft cache slot (None: never fed).
    """
    base = runner.num_computed
    nodes: list[_Node] = []
    frontier = [(-1, root_logits, 0.0, 0.0)]  # (node, logits, score, key)
    static = tree.kind == "static"
    depth_limit = min(max_depth, len(tree.branching)) if static else max_depth
    for depth in range(depth_limit):
        if not static:
            frontier = sorted(frontier, key=lambda item: -item[2])[: tree.top_k]
        count = tree.branching[depth] if static else tree.top_k
        level: list[int] = []
        for parent, logits, score, key in frontier:
            for token, probs, logq, index in _children(logits, count, sampling, generator):
                child_score = score + logq
                if sampling.greedy:
                    child_key = child_score
                else:
                    child_key = min(key, score + index * math.log(SIBLING_DECAY))
                nodes.append(_Node(token, parent, depth + 1, child_score, child_key, probs))
                level.append(len(nodes) - 1)
        if static and len(nodes) >= budget:
            break
        expand = [i for i in level if nodes[i].token not in eos_ids]
        if depth + 1 == depth_limit or not expand:
            break
        if not static:  # a node outside the best ``budget`` so far has no descendant in the final cut: skip it
            best = set(_cut(nodes, budget, by_key=True))
            expand = sorted((i for i in expand if i in best), key=lambda i: -nodes[i].score)[: tree.top_k]
            if not expand:
                break
        _feed(runner, nodes, expand, base, align)
        frontier = [(i, nodes[i].logits, nodes[i].score, nodes[i].key) for i in expand]
    kept = _cut(nodes, budget, by_key=not static)
    return _as_tree(nodes, kept, sampling.greedy)


def _children(logits: torch.Tensor, count: int, sampling: SamplingConfig, generator):
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


def _feed(runner, nodes: list[_Node], expand: list[int], base: int, align) -> None:
    """One draft forward over the ``expand`` nodes (tree attention); stores each one's slot and logits."""
    start = runner.num_computed
    ancestors = []
    for index in expand:
        slots, parent = [], nodes[index].parent
        while parent >= 0:
            slots.append(nodes[parent].slot)
            parent = nodes[parent].parent
        ancestors.append(slots)
    positions, visible = tree_rows(ancestors, base, start)
    logits = runner.forward_masked([nodes[i].token for i in expand], positions, visible)  # [m, V_draft]
    for row, index in enumerate(expand):
        nodes[index].slot = start + row
        nodes[index].logits = align(logits[row])


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
