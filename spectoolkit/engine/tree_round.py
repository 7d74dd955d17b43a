"""One token-tree round at batch size 1: grow a tree, verify it in one forward, commit the accepted path.

The target scores [pending, nodes…] with tree attention (:func:`~spectoolkit.models.tree_mask.verify_rows`:
node positions are prefix length + depth; each node sees the prefix, its ancestors and itself). The
verifier (:mod:`spectoolkit.verify.tree`) walks from the root and returns the accepted path. KV rule
(DESIGN §2) for a path: the path's KV sits at scattered tree slots, so it is moved next to the prefix
(``commit_slots``) and every other tree slot is dropped — the next round sees exactly prefix + pending
+ path, as a run that only ever saw the path would. The drafter commits its own copy the same way.
A tree that is a chain (or empty) goes through the plain causal forward, exactly as a chain round.
"""

from __future__ import annotations

import time

import torch

from spectoolkit.drafting.tree import TokenTree
from spectoolkit.engine.output import GenerationOutput, cut
from spectoolkit.models.cached import synchronize
from spectoolkit.models.tree_mask import verify_rows

_EMPTY = TokenTree([], [])


def tree_depth(tree, gamma: int, drafter_tree: str | None = None) -> int:
    """How deep a round's tree may grow: ``len(branching)`` (a static model tree), ``max_depth`` or γ (a dynamic
    tree, or a drafter with its own kind of tree, ``drafter_tree``: the n-gram trie)."""
    if tree.kind == "static" and not drafter_tree:
        return len(tree.branching)
    return tree.max_depth or gamma


def tree_round(
    engine, tokens: list[int], room: int, generator: torch.Generator | None, out: GenerationOutput
) -> list[int]:
    """One round of ``engine`` (a :class:`~spectoolkit.engine.speculative.SpeculativeEngine` with a tree)."""
    t0 = time.perf_counter()
    depth = min(
        tree_depth(engine.tree, engine.gamma, getattr(engine.drafter, "tree_kind", None)), room - 1
    )  # the round always emits one target token on top
    budget = engine.tree.max_nodes if depth > 0 else 0
    tree = engine.drafter.propose_tree(tokens, engine.tree, budget, depth, generator) if budget else _EMPTY
    synchronize(engine.target.device)
    t1 = time.perf_counter()
    start = len(tokens) - 1  # the pending token's slot
    rows = [tokens[-1], *tree.token_ids]
    if tree.is_chain():
        logits = engine.target.forward(rows)  # [n+1, V]
    else:
        positions, visible = verify_rows(tree.parents, start)
        logits = engine.target.forward_masked(rows, positions, visible)  # [n+1, V]
    synchronize(engine.target.device)
    t2 = time.perf_counter()
    result = engine.tree_verifier.verify_tree(tree.token_ids, tree.parents, logits, tree.draft_probs, generator)
    engine.target.commit_slots(start + 1, [start + 1 + node for node in result.path])
    t3 = time.perf_counter()
    engine.drafter.commit_path(len(tokens), result.path)
    t4 = time.perf_counter()
    out.draft_time += t1 - t0 + (t4 - t3)
    out.verify_time += t2 - t1
    accepted = result.num_accepted
    out.verify_rounds += 1
    out.drafted_tokens += len(tree)
    out.accepted_tokens += accepted
    out.proposed_rounds += len(tree) > 0
    out.rollback_count += accepted < max(tree.depths(), default=0)
    out.accept_lengths.append(accepted)
    out.draft_lengths.append(len(tree))
    out.chosen_lengths.append(budget)
    out.tree_depths.append(max(tree.depths(), default=0))
    emitted = [tree.token_ids[node] for node in result.path] + [result.next_token]
    return cut(emitted, room, engine.eos_ids)
