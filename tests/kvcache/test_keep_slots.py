"""Committing a tree's accepted path (``commit_slots``): the pool equals one that only ever saw the path.

After a tree verify forward the path's KV sits at scattered slots; ``LoneSequence.commit_slots`` moves it
next to the prefix (``PagedKVPool.move``) and drops every other tree slot (DESIGN §2). Every stored field
moves as stored, so for every KV precision (cast or quantized: codes, scales, zeros) the result must be
bit-identical to a sequence fed prefix + root + path as a chain. The target is a tiny Llama on the
reference linears (as ``load_model`` sets up) and a lone sequence computes each verify row as a decode
step, so every layer's KV agrees, not only layer 0's (which depends on token and position alone).

A draft model's ``commit`` moves its tree's path the same way. Its forwards run in ``plain`` row mode, where
a row's KV may differ from a decode step's by a last bit, so its path is checked against the bytes its own
tree stored, and its KV against a draft that saw the path by what each drafts next.
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.config import TreeConfig
from spectoolkit.drafting import Budget, Lone, ModelDrafter, lone_drafter
from spectoolkit.kernels.kernel_choice import choose_kernels
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.models.tree_mask import verify_rows
from spectoolkit.precisions import KV_PRECISIONS
from spectoolkit.runtime.lone import LONE_BLOCK, LoneSequence, lone_sequence
from spectoolkit.runtime.paged_kv import KINDS
from spectoolkit.sampling import GreedyChooser
from tests.serving.helpers import assert_same_bits, bits

VOCAB = 512
EOS = 2
BONUS = 77  # the target's token after an accepted path
PREFIX = [1, 17, 93, 250, 7, 41, 300, 12]
ROOT = 55
START = len(PREFIX)  # the root's position; node i sits at START + 1 + i
PARENTS = [-1, -1, 0, 1, 2, 0, 4]  # root -> {0, 1}; 0 -> {2, 5}; 1 -> 3; 2 -> 4 -> 6
NODE_IDS = [10, 11, 12, 13, 14, 15, 16]
PATHS = ([], [0], [1], [1, 3], [0, 2, 4, 6], [0, 5])  # [0] is contiguous; the others are scattered
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    model = tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0)
    choose_kernels(model, "reference")
    return model


def _assert_same_kv(got: LoneSequence, want: LoneSequence, layers: list[int] | None = None) -> None:
    """The stored fields of positions [0, num_computed) are bit-identical in ``layers`` (default: all)."""
    assert got.num_computed == want.num_computed
    got_slots, want_slots = (torch.tensor(s.table.slots(0, s.num_computed)) for s in (got, want))
    for layer in layers if layers is not None else range(len(got.runner.pool.layers)):
        for kind in KINDS:
            assert_same_bits(got.runner.pool.stored(layer, kind, got_slots),
                             want.runner.pool.stored(layer, kind, want_slots), f"layer {layer} {kind}")  # fmt: skip


def _tree_then_commit(model: torch.nn.Module, precision: str, path: list[int], prefix=PREFIX) -> LoneSequence:
    sequence = lone_sequence(model, precision)
    sequence.forward(prefix)
    start = len(prefix)
    positions, visible = verify_rows(PARENTS, start)
    sequence.forward_masked([ROOT] + NODE_IDS, positions, visible)
    sequence.commit_slots(start + 1, [start + 1 + node for node in path])
    return sequence


def _chain(model: torch.nn.Module, precision: str, path: list[int], prefix=PREFIX) -> LoneSequence:
    sequence = lone_sequence(model, precision)
    sequence.forward(prefix)
    sequence.forward([ROOT] + [NODE_IDS[node] for node in path])
    return sequence


def _ancestors_ok(path: list[int]) -> bool:
    return all(PARENTS[node] == (path[i - 1] if i else -1) for i, node in enumerate(path))


@pytest.mark.parametrize("precision", KV_PRECISIONS)
def test_committed_path_equals_a_sequence_that_only_saw_it(target, precision):
    for path in PATHS:
        assert _ancestors_ok(path)
        committed, chain = _tree_then_commit(target, precision, path), _chain(target, precision, path)
        assert committed.num_computed == START + 1 + len(path)
        _assert_same_kv(committed, chain, layers=[0])  # layer 0: token and position only
        _assert_same_kv(committed, chain)  # every layer: row-invariant kernels
        # ... and what comes next is computed as after the chain.
        assert torch.equal(committed.forward([99, 98]), chain.forward([99, 98]))
        _assert_same_kv(committed, chain)


def _raw(sequence: LoneSequence) -> dict[tuple[int, str, str], torch.Tensor]:
    """Every stored buffer of the pool over all its slots (what the sequence holds and what lies beyond)."""
    return {(index, kind, name): bits(buf).clone() for index, layer in enumerate(sequence.runner.pool.layers)
            for kind, fields in layer.items() for name, buf in fields.items()}  # fmt: skip


@pytest.mark.parametrize("precision", ["auto", "int4"])
def test_a_contiguous_path_is_only_a_truncation(target, precision):
    sequence = lone_sequence(target, precision)
    sequence.forward(PREFIX)
    positions, visible = verify_rows([-1, 0, 1, -1], START)  # a chain of 3 plus a sibling of its head
    sequence.forward_masked([ROOT, 10, 11, 12, 13], positions, visible)
    before = _raw(sequence)
    sequence.commit_slots(START + 1, [START + 1, START + 2])
    assert sequence.num_computed == START + 3
    after = _raw(sequence)  # nothing moved: slots past the end are untouched too
    assert all(torch.equal(after[key], before[key]) for key in before)


@pytest.mark.parametrize("precision", ["auto", "int4"])
def test_commit_of_a_tree_that_crossed_a_block_boundary(target, precision):
    """The tree's slots straddle two blocks (a block taken mid-forward); the path moves across them."""
    prefix = torch.randint(3, VOCAB, (LONE_BLOCK - 6,), generator=torch.Generator().manual_seed(0)).tolist()
    start = len(prefix)
    path = [0, 2, 4, 6]  # positions start + 1, +3, +5, +7 (the last one in the second block) -> start + 1..4
    assert start + 1 + path[-2] < LONE_BLOCK <= start + 1 + path[-1]  # guard: only the leaf crossed over
    committed = _tree_then_commit(target, precision, path, prefix)
    _assert_same_kv(committed, _chain(target, precision, path, prefix))
    assert len(committed.table.blocks) == 1  # the kept path fits the first block: the second one was freed


def test_empty_path_keeps_only_the_prefix_and_root(target):
    sequence = _tree_then_commit(target, "auto", [])
    assert sequence.num_computed == START + 1
    _assert_same_kv(sequence, _chain(target, "auto", []))
    sequence.commit_slots(3, [])  # also below the root: a plain truncation
    assert sequence.num_computed == 3


def test_commit_on_an_empty_sequence_is_a_no_op(target):
    sequence = lone_sequence(target, "int8")
    sequence.commit_slots(0, [])
    assert sequence.num_computed == 0 and sequence.table.blocks == []


def _tree_drafter(model: torch.nn.Module, precision: str, tree_cfg: TreeConfig) -> ModelDrafter:
    """A greedy drafter growing ``tree_cfg`` trees for lone sequences, its KV at ``precision``."""
    return lone_drafter(model, GreedyChooser(), VOCAB, VOCAB, frozenset({EOS}), 64, precision, tree_cfg)


def _draft_stored(drafter: ModelDrafter, seq: Lone, positions: list[int]) -> dict[tuple[int, str], dict]:
    """The stored fields of ``seq``'s draft KV at ``positions``, per (layer, kind): a copy."""
    slots = torch.tensor(drafter._states[id(seq)].table.slots_at(positions))
    return {(layer, kind): drafter.pool.stored(layer, kind, slots)
            for layer in range(len(drafter.pool.layers)) for kind in KINDS}  # fmt: skip


@pytest.mark.parametrize("precision", ["auto", "int8"])
def test_draft_commit_path_equals_a_draft_that_saw_the_path(target, precision):
    """The drafter keeps tokens + the path's fed nodes (a leaf was never fed), moved as stored, and drafts on as a
    draft that saw tokens + the path would."""
    tokens = PREFIX + [ROOT]
    tree_cfg = TreeConfig(kind="static", branching=(3, 2, 2), max_nodes=32)
    budget = Budget(nodes=32, depth=3)
    (tree,) = _tree_drafter(target, precision, tree_cfg).propose([Lone(tokens)], [budget])
    assert EOS not in tree.token_ids  # guard: every non-leaf was fed, one depth per forward, in tree order
    for node in (0, 4, 20, len(tree) - 1):  # depth 1, 2, 3 (a leaf), a late leaf
        drafter, seq = _tree_drafter(target, precision, tree_cfg), Lone(tokens)
        assert drafter.propose([seq], [budget]) == [tree]
        path = tree.path_to(node)
        fed = [i for i in path if tree.depths()[i] < 3]  # leaves (depth 3) have no KV
        kept = list(range(len(tokens))) + [len(tokens) + i for i in fed]  # node i was fed at len(tokens) + i
        want = _draft_stored(drafter, seq, kept)
        drafter.commit(seq, len(tokens), path)
        assert drafter._states[id(seq)].num_computed == len(tokens) + len(fed)
        got = _draft_stored(drafter, seq, list(range(len(kept))))
        for key in want:  # bit for bit: the path's KV moved next to the tokens, nothing re-encoded
            assert_same_bits(got[key], want[key], f"node {node}: layer {key[0]} {key[1]}")
        # ... and what comes next is drafted as by a draft that saw tokens + path (one prefill of them all).
        seq.tokens = tokens + [tree.token_ids[i] for i in path] + [BONUS]
        fresh = _tree_drafter(target, precision, tree_cfg)
        assert drafter.propose([seq], [budget]) == fresh.propose([Lone(seq.tokens)], [budget]), f"node {node}"
