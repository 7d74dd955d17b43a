"""Tree attention rows: positions and masks, and a tree forward that equals one chain forward per node.

SpecInfer's tree attention: a node sees the prefix, its ancestors and itself, at position prefix +
depth. A lone sequence computes each verify row as a decode step (``chosen`` row mode); with the
reference linears (what ``load_model`` installs) a tree row is then the very computation a chain forward
over prefix + that node's path makes, so the comparison is ``torch.equal``; a mask that leaks a sibling
must fail the same comparison.
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.kernels.kernel_choice import choose_kernels
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.models.tree_mask import tree_rows, verify_rows
from spectoolkit.runtime.lone import lone_sequence

VOCAB = 512
PREFIX = [1, 17, 93, 250, 7, 41, 300, 12]
ROOT = 55  # the pending token: row 0 of a verify forward
#          root
#        /   |   \
#       0    1    2
#      / \   |
#     3   4  5
#     |
#     6
PARENTS = [-1, -1, -1, 0, 0, 1, 3]
NODE_IDS = [10, 11, 12, 13, 14, 15, 16]
pytestmark = pytest.mark.usefixtures("one_thread")


def _path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


# ---- positions and masks ----------------------------------------------------------------------


def test_tree_rows_of_a_hand_made_tree():
    # base 3 (prefix), tokens at slots 5, 6, 7; slots 3 and 4 hold earlier tree tokens.
    positions, visible = tree_rows([[3], [4, 3], []], base=3, start=5)
    assert positions == [4, 5, 3]
    expected = torch.tensor(
        [
            [1, 1, 1, 1, 0, 1, 0, 0],  # sees slot 3 and itself (5)
            [1, 1, 1, 1, 1, 0, 1, 0],  # sees 3, 4 and itself (6)
            [1, 1, 1, 0, 0, 0, 0, 1],  # a child of the root: prefix and itself
        ],
        dtype=torch.bool,
    )
    assert visible.dtype == torch.bool and torch.equal(visible, expected)


def test_tree_rows_of_a_chain_is_the_causal_mask():
    positions, visible = tree_rows([[], [4], [4, 5]], base=4, start=4)
    assert positions == [4, 5, 6]
    assert torch.equal(visible, torch.ones(3, 7, dtype=torch.bool).tril(4))


@pytest.mark.parametrize(
    "ancestors, base, start",
    [
        ([[2]], 3, 5),  # inside the committed prefix
        ([[5]], 3, 5),  # its own slot
        ([[], [6]], 3, 5),  # a later token's slot (6 is its own)
        ([[9]], 3, 5),  # past the forward
    ],
)
def test_tree_rows_refuses_slots_outside_the_tree(ancestors, base, start):
    with pytest.raises(ValueError, match="ancestor slots"):
        tree_rows(ancestors, base, start)


def test_verify_rows_of_a_hand_made_tree():
    start = 4  # root at slot 4, node i at slot 5 + i
    positions, visible = verify_rows(PARENTS, start)
    depths = [len(_path(PARENTS, node)) for node in range(len(PARENTS))]
    assert positions == [start] + [start + depth for depth in depths]
    assert visible.shape == (len(PARENTS) + 1, start + len(PARENTS) + 1)
    for row in range(len(PARENTS) + 1):
        seen = set(range(start + 1)) | {start + 1 + node for node in _path(PARENTS, row - 1)}
        assert set(torch.nonzero(visible[row]).flatten().tolist()) == seen, f"row {row}"


def test_verify_rows_of_a_chain_and_of_no_nodes():
    positions, visible = verify_rows([-1, 0, 1], start=2)
    assert positions == [2, 3, 4, 5]
    assert torch.equal(visible, torch.ones(4, 6, dtype=torch.bool).tril(2))
    positions, visible = verify_rows([], start=3)
    assert positions == [3] and torch.equal(visible, torch.ones(1, 4, dtype=torch.bool))


# ---- a tree forward equals chain forwards -----------------------------------------------------


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    model = tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0)
    choose_kernels(model, "reference")
    return model


def _chain_logits(model: torch.nn.Module, node: int, kv_precision: str = "auto") -> torch.Tensor:
    """Logits [V] after PREFIX + ROOT + the path to ``node`` (-1: the root), from a fresh sequence."""
    runner = lone_sequence(model, kv_precision)
    runner.forward(PREFIX)
    return runner.forward([ROOT] + [NODE_IDS[i] for i in _path(PARENTS, node)])[-1]


def _tree_logits(model: torch.nn.Module, visible: torch.Tensor | None = None, kv_precision: str = "auto"):
    """Verify-forward logits [n+1, V] over ROOT + the tree after PREFIX (``visible``: a mask to use instead)."""
    runner = lone_sequence(model, kv_precision)
    runner.forward(PREFIX)
    positions, rows = verify_rows(PARENTS, len(PREFIX))
    logits = runner.forward_masked([ROOT] + NODE_IDS, positions, rows if visible is None else visible)
    assert runner.num_computed == len(PREFIX) + 1 + len(NODE_IDS)
    return logits


@pytest.mark.parametrize("kv_precision", ["auto", "int8"])
def test_every_tree_row_equals_the_chain_forward_of_its_path(target, kv_precision):
    logits = _tree_logits(target, kv_precision=kv_precision)  # [n+1, V]
    assert logits.shape == (len(NODE_IDS) + 1, VOCAB) and logits.dtype == torch.float32
    for row in range(len(NODE_IDS) + 1):
        assert torch.equal(logits[row], _chain_logits(target, row - 1, kv_precision)), f"row {row}"


def test_a_mask_that_leaks_a_sibling_is_detected(target):
    """Negative control: node 4 also seeing its sibling 3 changes its row, and only rows that see it."""
    start = len(PREFIX)
    _, visible = verify_rows(PARENTS, start)
    leaky = visible.clone()
    leaky[1 + 4, start + 1 + 3] = True  # row of node 4, slot of node 3
    logits = _tree_logits(target, leaky)
    rows_changed = [
        row for row in range(len(NODE_IDS) + 1) if not torch.equal(logits[row], _chain_logits(target, row - 1))
    ]
    assert rows_changed == [1 + 4]


def test_a_tree_forward_after_earlier_tree_slots_sees_only_its_base(target):
    """Draft-side rows (base < start): stale slots between the prefix and the new tokens are never attended."""
    runner = lone_sequence(target)
    runner.forward(PREFIX + [ROOT])
    runner.forward([40, 41])  # slots 9, 10: tokens of an earlier depth, not ancestors of the new ones
    positions, visible = tree_rows([[], []], base=len(PREFIX) + 1, start=runner.num_computed)
    logits = runner.forward_masked([NODE_IDS[0], NODE_IDS[1]], positions, visible)  # two children of the root
    assert torch.equal(logits[0], _chain_logits(target, 0))
    assert torch.equal(logits[1], _chain_logits(target, 1))


def test_tree_rows_are_close_to_chains_without_row_invariant_linears():
    """Plain linears (draft models in tests): row-wise attention alone gives the same rows up to fp32 rounding."""
    model = tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0)
    logits = _tree_logits(model)
    for row in range(len(NODE_IDS) + 1):
        torch.testing.assert_close(logits[row], _chain_logits(model, row - 1), rtol=1e-5, atol=1e-5)
