"""Committing a tree's accepted path (``keep_slots``): the cache equals one that only ever saw the path.

After a tree verify forward the path's KV sits at scattered slots; ``commit_slots`` moves it next to
the prefix and drops every other tree slot (DESIGN §2). Every stored buffer moves as stored, so for
every KV precision (cast or quantized: codes, scales, zeros) the result must be bit-identical to a
cache fed prefix + root + path as a chain. The target is a tiny Llama on row-invariant kernels
(rowwise attention + reference linears, as ``load_model`` sets up), so every layer's KV agrees, not
only layer 0's (which depends on token and position alone).
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.config import TreeConfig
from spectoolkit.drafting import ModelDrafter
from spectoolkit.kvcache.cache import _INITIAL_CAPACITY
from spectoolkit.models.attention import use_rowwise_attention
from spectoolkit.models.cached import CachedModel
from spectoolkit.models.kernel_choice import choose_kernels
from spectoolkit.models.kv_cache import make_kv_cache
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.models.tree_mask import verify_rows
from spectoolkit.precisions import KV_PRECISIONS
from spectoolkit.sampling import GreedyChooser

VOCAB = 512
PREFIX = [1, 17, 93, 250, 7, 41, 300, 12]
ROOT = 55
START = len(PREFIX)  # the root's slot; node i sits at START + 1 + i
PARENTS = [-1, -1, 0, 1, 2, 0, 4]  # root -> {0, 1}; 0 -> {2, 5}; 1 -> 3; 2 -> 4 -> 6
NODE_IDS = [10, 11, 12, 13, 14, 15, 16]
PATHS = ([], [0], [1], [1, 3], [0, 2, 4, 6], [0, 5])  # [0] is contiguous; the others are scattered
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    model = tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0)
    assert use_rowwise_attention(model)
    choose_kernels(model, "reference")
    return model


def _require(precision: str) -> None:
    """Skip a precision whose storage format this platform cannot hold (e.g. no float8 dtype)."""
    try:
        make_kv_cache(1, precision).layers[0].update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16))
    except (RuntimeError, TypeError, NotImplementedError, AttributeError) as exc:
        pytest.skip(f"KV precision {precision} unavailable here: {exc}")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bitwise (torch.equal has no CPU kernel for float8 in torch 2.13).
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _assert_same_cache(got: CachedModel, want: CachedModel, layers: list[int] | None = None) -> None:
    assert got.num_computed == want.num_computed
    for index in layers if layers is not None else range(got.num_layers):
        got_storage, want_storage = got.cache.layers[index].storage(), want.cache.layers[index].storage()
        assert got_storage.keys() == want_storage.keys() and got_storage
        for name, stored in got_storage.items():
            assert _same_bits(stored, want_storage[name]), f"layer {index} {name}"


def _tree_then_commit(model: torch.nn.Module, precision: str, path: list[int]) -> CachedModel:
    runner = CachedModel(model, precision)
    runner.forward(PREFIX)
    positions, visible = verify_rows(PARENTS, START)
    runner.forward_masked([ROOT] + NODE_IDS, positions, visible)
    runner.commit_slots(START + 1, [START + 1 + node for node in path])
    return runner


def _chain(model: torch.nn.Module, precision: str, path: list[int]) -> CachedModel:
    runner = CachedModel(model, precision)
    runner.forward(PREFIX)
    runner.forward([ROOT] + [NODE_IDS[node] for node in path])
    return runner


def _ancestors_ok(path: list[int]) -> bool:
    return all(PARENTS[node] == (path[i - 1] if i else -1) for i, node in enumerate(path))


@pytest.mark.parametrize("precision", KV_PRECISIONS)
def test_committed_path_equals_a_cache_that_only_saw_it(target, precision):
    _require(precision)
    for path in PATHS:
        assert _ancestors_ok(path)
        committed, chain = _tree_then_commit(target, precision, path), _chain(target, precision, path)
        assert committed.num_computed == START + 1 + len(path)
        _assert_same_cache(committed, chain, layers=[0])  # layer 0: token and position only
        _assert_same_cache(committed, chain)  # every layer: row-invariant kernels
        # ... and what comes next is computed as after the chain.
        assert torch.equal(committed.forward([99, 98]), chain.forward([99, 98]))
        _assert_same_cache(committed, chain)


@pytest.mark.parametrize("precision", ["auto", "int4"])
def test_a_contiguous_path_is_only_a_truncation(target, precision):
    runner = CachedModel(target, precision)
    runner.forward(PREFIX)
    positions, visible = verify_rows([-1, 0, 1, -1], START)  # a chain of 3 plus a sibling of its head
    runner.forward_masked([ROOT, 10, 11, 12, 13], positions, visible)
    before = {
        (index, name): buf.clone()
        for index, layer in enumerate(runner.cache.layers)
        for name, buf in _raw(layer).items()
    }
    runner.commit_slots(START + 1, [START + 1, START + 2])
    assert runner.num_computed == START + 3
    for index, layer in enumerate(runner.cache.layers):  # nothing moved: slots past the end are untouched too
        for name, buf in _raw(layer).items():
            assert _same_bits(buf, before[(index, name)]), f"layer {index} {name}"


def _raw(layer) -> dict[str, torch.Tensor]:
    """Every stored buffer over its whole capacity (the valid prefix and what lies beyond)."""
    return {name: getattr(layer, name) for name in layer._buffer_names}


@pytest.mark.parametrize("precision", ["auto", "int4"])
def test_commit_after_a_tree_forward_that_grew_the_cache(target, precision):
    """The tree's slots cross the initial capacity (every buffer reallocated mid-forward); the commit still matches."""
    prefix = torch.randint(3, VOCAB, (_INITIAL_CAPACITY - 4,), generator=torch.Generator().manual_seed(0)).tolist()
    start = len(prefix)
    path = [0, 2, 4, 6]  # slots start + 1, +3, +5, +7: the last two past the old capacity
    runner, chain = CachedModel(target, precision), CachedModel(target, precision)
    runner.forward(prefix)
    positions, visible = verify_rows(PARENTS, start)
    runner.forward_masked([ROOT] + NODE_IDS, positions, visible)
    assert runner.cache.layers[0].capacity > _INITIAL_CAPACITY
    runner.commit_slots(start + 1, [start + 1 + node for node in path])
    chain.forward(prefix)
    chain.forward([ROOT] + [NODE_IDS[node] for node in path])
    _assert_same_cache(runner, chain)


def test_empty_path_keeps_only_the_prefix_and_root(target):
    runner = _tree_then_commit(target, "auto", [])
    assert runner.num_computed == START + 1
    _assert_same_cache(runner, _chain(target, "auto", []))
    runner.commit_slots(3, [])  # also below the root: a plain truncation
    assert runner.num_computed == 3


def test_keep_slots_on_an_empty_cache_is_a_no_op():
    cache = make_kv_cache(2, "int8")
    cache.keep_slots(0, [])
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("precision", ["auto", "int8"])
def test_draft_commit_path_equals_a_draft_that_saw_the_path(target, precision):
    """The drafter keeps tokens + the path's fed nodes (a leaf was never fed), as a chain-fed draft would."""
    tokens = PREFIX + [ROOT]
    tree_cfg = TreeConfig(kind="static", branching=(3, 2, 2), max_nodes=32)
    probe = ModelDrafter(target, GreedyChooser(), VOCAB, VOCAB, frozenset({2}), kv_precision=precision)
    probe.begin(PREFIX)
    tree = probe.propose_tree(tokens, tree_cfg, 32, 3, None)
    for node in (0, 4, 20, len(tree) - 1):  # depth 1, 2, 3 (a leaf), a late leaf
        drafter = ModelDrafter(target, GreedyChooser(), VOCAB, VOCAB, frozenset({2}), kv_precision=precision)
        drafter.begin(PREFIX)
        assert drafter.propose_tree(tokens, tree_cfg, 32, 3, None) == tree
        path = tree.path_to(node)
        drafter.commit_path(len(tokens), path)
        fed = [tree.token_ids[i] for i in path if tree.depths()[i] < 3]  # leaves (depth 3) have no KV
        chain = CachedModel(target, precision)
        chain.forward(tokens, last_only=True)
        if fed:
            chain.forward(fed)
        _assert_same_cache(drafter.runner, chain)
