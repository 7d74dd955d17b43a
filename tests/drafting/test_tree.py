"""Token trees: TokenTree geometry, the n-gram continuation trie, and trees grown with a draft model.

Model trees are checked against direct forwards: the draft (a tiny Llama on the reference linears, as
``load_model`` sets up) run fresh over prefix + a node's path by a lone sequence, whose rows are computed as
decode steps, gives the logits the tree forward gave that node, so each node's children can be recomputed:
greedy, the top-k tokens, compared exactly; sampling, the processed distribution they were drawn from,
compared to fp32 rounding (the drafter runs a depth's rows in one batched ``plain`` attention, which may
differ from a decode step by a last bit) while i.i.d. siblings must share it bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.config import SamplingConfig, TreeConfig
from spectoolkit.drafting import Budget, Lone, ModelDrafter, NgramDrafter, lone_drafter
from spectoolkit.drafting.ngram import continuation_trie
from spectoolkit.drafting.tree import TokenTree
from spectoolkit.kernels.kernel_choice import choose_kernels
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.runtime.lone import lone_sequence
from spectoolkit.sampling import GreedyChooser, RandomChooser, processed_probs

VOCAB = 128
EOS = 2
EOS_IDS = frozenset({EOS})
PROMPT = [1, 17, 93, 50, 7, 41, 100, 12]
PENDING = 33
TOKENS = PROMPT + [PENDING]  # verified tokens; the draft has seen none of them yet
SAMPLING = SamplingConfig(temperature=0.8, top_k=20)
POSITIONS = 128  # the drafter's pool: TOKENS and every tree's fed nodes fit
pytestmark = pytest.mark.usefixtures("one_thread")


def _switched(model: torch.nn.Module) -> torch.nn.Module:
    """Row-invariant linears: a row's linears do not depend on the other rows of its forward (the lone sequence's
    attention is row-wise too; the drafter's batched attention may differ from it by a last bit)."""
    choose_kernels(model, "reference")
    return model


@pytest.fixture(scope="module")
def draft_model() -> torch.nn.Module:
    return _switched(tiny_llama(vocab_size=VOCAB, seed=4, scale=4.0))


@pytest.fixture(scope="module")
def eos_model() -> torch.nn.Module:
    """The draft with EOS's lm_head row just above the row of its argmax after TOKENS: EOS is a root child."""
    model = tiny_llama(vocab_size=VOCAB, seed=4, scale=4.0)
    top = int(lone_sequence(model).forward(TOKENS, last_only=True).argmax())
    with torch.no_grad():
        model.lm_head.weight[EOS] = 1.01 * model.lm_head.weight[top]
    return _switched(model)


# ---- TokenTree --------------------------------------------------------------------------------


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 0, 3, 1], [-2]])
def test_parents_must_precede_their_children(parents):
    with pytest.raises(ValueError, match="parents must precede"):
        TokenTree(list(range(len(parents))), parents)


def test_tokens_and_parents_must_have_one_length():
    with pytest.raises(ValueError, match="2 tokens but 3 parents"):
        TokenTree([5, 6], [-1, 0, 0])


def test_geometry_of_a_hand_made_tree():
    #        root
    #      /  |   \
    #     0   1    2
    #    / \   \
    #   3   4   5
    #   |
    #   6
    tree = TokenTree([10, 11, 12, 13, 14, 15, 16], [-1, -1, -1, 0, 0, 1, 3])
    assert len(tree) == 7
    assert tree.depths() == [1, 1, 1, 2, 2, 2, 3]
    assert tree.shape() == [3, 3, 1]
    assert not tree.is_chain()
    assert tree.path_to(6) == [0, 3, 6] and tree.path_to(5) == [1, 5] and tree.path_to(2) == [2]
    assert tree.path_to(-1) == []
    cut = tree.truncated(4)
    assert (cut.token_ids, cut.parents) == ([10, 11, 12, 13], [-1, -1, -1, 0])
    assert tree.truncated(7) is tree and tree.truncated(100) is tree


def test_chain_is_the_tree_of_consecutive_parents():
    probs = torch.rand(4, VOCAB)
    chain = TokenTree.chain([7, 8, 9, 10], probs)
    assert chain.parents == [-1, 0, 1, 2] and chain.is_chain()
    assert chain.depths() == [1, 2, 3, 4] and chain.shape() == [1, 1, 1, 1]
    assert chain.path_to(3) == [0, 1, 2, 3]
    assert torch.equal(chain.truncated(2).draft_probs, probs[:2])
    empty = TokenTree.chain([])
    assert len(empty) == 0 and empty.is_chain() and empty.depths() == [] and empty.shape() == []


# ---- n-gram continuation trie -----------------------------------------------------------------

# Suffix [5, 6] matched at 4 (-> 3, 5, 6); suffix [6] also at 1 (-> 1, 2, 5) and at 5 (-> 3, 5: the same).
TRIE_TOKENS = [4, 6, 1, 2, 5, 6, 3, 5, 6]


def _trie(tokens, max_n=2, min_n=1, depth=2, budget=16) -> tuple[list[int], list[int]]:
    return continuation_trie(torch.tensor(tokens), max_n, min_n, depth, budget)


def test_trie_holds_each_distinct_continuation_once_longest_suffix_first():
    assert _trie(TRIE_TOKENS) == ([3, 5, 1, 2], [-1, 0, -1, 2])
    assert _trie(TRIE_TOKENS, min_n=2) == ([3, 5], [-1, 0])  # only the 2-gram's match
    assert _trie(TRIE_TOKENS, max_n=1) == ([3, 5, 1, 2], [-1, 0, -1, 2])  # [6] at 5 (most recent) first


def test_trie_most_recent_match_first():
    # Suffix [3] matched at 0 (-> 10, 11) and at 3 (-> 20, 21): the later one's branch comes first.
    assert _trie([3, 10, 11, 3, 20, 21, 3], max_n=1) == ([20, 21, 10, 11], [-1, 0, -1, 2])


def test_trie_budget_and_depth_cap():
    assert _trie(TRIE_TOKENS, budget=3) == ([3, 5, 1], [-1, 0, -1])
    assert _trie(TRIE_TOKENS, budget=1) == ([3], [-1])
    assert _trie(TRIE_TOKENS, budget=0) == ([], [])
    assert _trie(TRIE_TOKENS, depth=1) == ([3, 1], [-1, -1])
    assert _trie(TRIE_TOKENS, depth=3) == ([3, 5, 6, 1, 2, 5], [-1, 0, 1, -1, 3, 4])


def test_trie_without_a_match_is_empty():
    assert _trie([4, 5, 6, 7, 8]) == ([], [])
    assert _trie([4]) == ([], [])


@pytest.mark.parametrize("seed", range(6))
def test_trie_paths_are_exactly_the_earlier_continuations(seed):
    """Random sequences over 4 symbols: the trie's paths = prefixes of every match's continuation."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 4, (30,), generator=gen)
    max_n, min_n, depth = 3, 1, 3
    token_ids, parents = continuation_trie(tokens, max_n, min_n, depth, budget=1000)
    tree = TokenTree(token_ids, parents)  # validates: parents come first
    paths = [tuple(token_ids[i] for i in tree.path_to(node)) for node in range(len(tree))]
    assert len(set(paths)) == len(paths)  # distinct: no two siblings carry the same token
    seq = tokens.tolist()
    expected = set()
    for n in range(min_n, max_n + 1):
        for start in range(len(seq) - n):  # a match ends before the last token
            if seq[start : start + n] == seq[len(seq) - n :]:
                follow = seq[start + n : start + n + depth]
                expected.update(tuple(follow[:k]) for k in range(1, len(follow) + 1))
    assert set(paths) == expected
    for budget in (1, 5, len(tree) - 1):
        assert continuation_trie(tokens, max_n, min_n, depth, budget) == (token_ids[:budget], parents[:budget])


def _ngram_tree(one_hot_probs: bool) -> TokenTree:
    """The tree an n-gram drafter with a (static) tree config, γ = 2, proposes after TRIE_TOKENS."""
    drafter = NgramDrafter(2, 1, VOCAB, one_hot_probs, TreeConfig(kind="static"))
    (tree,) = drafter.propose([Lone(TRIE_TOKENS)], [Budget(nodes=16, depth=2)])
    return tree


def test_ngram_propose_tree_is_the_trie_with_one_hot_probs():
    tree = _ngram_tree(one_hot_probs=True)
    assert (tree.token_ids, tree.parents) == _trie(TRIE_TOKENS)
    expected = torch.zeros(len(tree), VOCAB)
    expected[torch.arange(len(tree)), tree.token_ids] = 1.0
    assert torch.equal(tree.draft_probs, expected)
    assert _ngram_tree(one_hot_probs=False).draft_probs is None


# ---- trees grown with a draft model -----------------------------------------------------------


def _logits_after(model: torch.nn.Module, path_ids: list[int]) -> torch.Tensor:
    """Draft logits [V] fp32 after TOKENS + ``path_ids``, from a fresh sequence (the prefill the drafter makes)."""
    runner = lone_sequence(model)
    logits = runner.forward(TOKENS, last_only=True)
    if path_ids:
        logits = runner.forward(path_ids)[-1]
    return logits.float()


def _tree_drafter(model, tree_cfg: TreeConfig, chooser=None) -> ModelDrafter:
    """A drafter growing ``tree_cfg`` trees for lone sequences (as deep as each round's budget)."""
    return lone_drafter(model, chooser or GreedyChooser(), VOCAB, VOCAB, EOS_IDS, POSITIONS, tree=tree_cfg)


def _propose(model, tree_cfg: TreeConfig, budget: int, max_depth: int, chooser=None, seed: int | None = None):
    """(drafter, the tree of at most ``budget`` nodes and ``max_depth`` depths it grows after TOKENS)."""
    drafter = _tree_drafter(model, tree_cfg, chooser)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    (tree,) = drafter.propose([Lone(list(TOKENS), generator)], [Budget(budget, max_depth)])
    return drafter, tree


def _children(tree: TokenTree) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parents):
        children.setdefault(parent, []).append(node)
    return children


def _path_ids(tree: TokenTree, node: int) -> list[int]:
    return [tree.token_ids[i] for i in tree.path_to(node)]


def _top_k(logits: torch.Tensor, count: int) -> list[int]:
    return torch.topk(torch.log_softmax(logits, dim=-1), count).indices.tolist()


@pytest.mark.parametrize(
    "branching, max_depth, expected_shape",
    [((3, 2, 2), 3, [3, 6, 12]), ((2, 2, 2, 2), 2, [2, 4]), ((4,), 5, [4]), ((1, 1, 1), 3, [1, 1, 1])],
)
def test_static_tree_has_the_branching_product_per_depth(draft_model, branching, max_depth, expected_shape):
    cfg = TreeConfig(kind="static", branching=branching, max_nodes=32)
    _, tree = _propose(draft_model, cfg, budget=32, max_depth=max_depth)
    assert tree.shape() == expected_shape
    assert tree.is_chain() == all(b == 1 for b in branching)
    assert tree.draft_probs is None
    for node, kids in _children(tree).items():  # greedy children: the draft's top-k at the node, best first
        depth = len(tree.path_to(node))
        expected = _top_k(_logits_after(draft_model, _path_ids(tree, node)), branching[depth])
        assert [tree.token_ids[k] for k in kids] == expected, f"children of node {node}"


@pytest.mark.parametrize("budget", [1, 3, 5, 10, 20])
def test_static_tree_is_cut_to_the_budget_in_breadth_first_order(draft_model, budget):
    cfg = TreeConfig(kind="static", branching=(3, 2, 2), max_nodes=32)
    _, full = _propose(draft_model, cfg, budget=32, max_depth=3)
    _, cut = _propose(draft_model, cfg, budget=budget, max_depth=3)
    assert (cut.token_ids, cut.parents) == (full.token_ids[:budget], full.parents[:budget])
    assert full.depths() == sorted(full.depths())  # breadth first: depth never decreases


def test_static_tree_costs_one_draft_forward_per_depth(draft_model):
    drafter = _tree_drafter(draft_model, TreeConfig(kind="static", branching=(3, 2, 2), max_nodes=32))
    widths: list[int] = []
    original = drafter.runner.forward

    def forward(batch):
        if batch.visible[0] is not None:  # a tree forward (the catch-up of TOKENS is a causal chain)
            widths.append(len(batch.token_ids))
        return original(batch)

    drafter.runner.forward = forward
    seq = Lone(list(TOKENS))
    (tree,) = drafter.propose([seq], [Budget(32, 3)])
    assert widths == [3, 6]  # depths 1 and 2 are fed; the leaves (depth 3) never are
    assert drafter._states[id(seq)].num_computed == len(TOKENS) + 9
    assert len(tree) == 21


def _reference_dynamic(model, top_k: int, max_depth: int, budget: int) -> tuple[list[int], list[int]]:
    """EAGLE-2 from direct forwards: expand the top_k frontier nodes by cumulative log-prob, keep the best."""
    grown: list[tuple[int, int, int, float, list[int]]] = []  # (token, parent, depth, score, path ids)
    frontier = [(-1, [], 0.0)]  # (node, path ids, score)
    for depth in range(1, max_depth + 1):
        level = []
        for parent, path, score in frontier:
            logq = torch.log_softmax(_logits_after(model, path), dim=-1)
            top = torch.topk(logq, top_k)
            for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                grown.append((token, parent, depth, score + value, path + [token]))
                level.append(len(grown) - 1)
        expand = sorted((i for i in level if grown[i][0] not in EOS_IDS), key=lambda i: -grown[i][3])[:top_k]
        frontier = [(i, grown[i][4], grown[i][3]) for i in expand]
        if not frontier:
            break
    kept = sorted(sorted(range(len(grown)), key=lambda i: (-grown[i][3], grown[i][2], i))[:budget])
    kept = sorted(kept, key=lambda i: (grown[i][2], i))
    index = {old: new for new, old in enumerate(kept)}
    return [grown[i][0] for i in kept], [index[grown[i][1]] if grown[i][1] >= 0 else -1 for i in kept]


@pytest.mark.parametrize("top_k, max_depth, max_nodes", [(2, 3, 5), (3, 3, 8), (3, 4, 16), (4, 2, 32), (1, 4, 3)])
def test_dynamic_tree_keeps_the_best_nodes_of_the_eagle2_expansion(draft_model, top_k, max_depth, max_nodes):
    cfg = TreeConfig(kind="dynamic", top_k=top_k, max_nodes=max_nodes)
    _, tree = _propose(draft_model, cfg, budget=max_nodes, max_depth=max_depth)
    assert len(tree) == min(max_nodes, sum(top_k ** min(d, 2) for d in range(1, max_depth + 1)))
    assert max(tree.depths()) <= max_depth
    paths = {tuple(tree.path_to(node)) for node in range(len(tree))}
    assert all(path[:-1] in paths or len(path) == 1 for path in paths)  # ancestor-closed
    assert (tree.token_ids, tree.parents) == _reference_dynamic(draft_model, top_k, max_depth, max_nodes)


@pytest.mark.parametrize(
    "cfg", [TreeConfig(kind="static", branching=(3, 2, 2)), TreeConfig(kind="dynamic", top_k=3, max_nodes=16)]
)
def test_eos_nodes_are_never_expanded(eos_model, cfg):
    drafter, tree = _propose(eos_model, cfg, budget=cfg.max_nodes, max_depth=3)
    assert EOS in tree.token_ids, "guard: the biased draft must put EOS in the tree"
    assert all(parent < 0 or tree.token_ids[parent] != EOS for parent in tree.parents)
    if cfg.kind == "static":
        eos_at = [len(tree.path_to(i)) for i, token in enumerate(tree.token_ids) if token == EOS]
        assert tree.shape()[1] == 2 * (3 - eos_at.count(1))  # a depth-1 EOS has no children
    else:
        assert (tree.token_ids, tree.parents) == _reference_dynamic(eos_model, 3, 3, 16)


@pytest.mark.parametrize(
    "cfg, max_depth",
    [
        (TreeConfig(kind="static", branching=(3, 2, 1), max_nodes=32), 3),
        (TreeConfig(kind="dynamic", top_k=3, max_nodes=10), 3),
    ],
)
def test_sampled_nodes_report_their_parents_processed_distribution(draft_model, cfg, max_depth):
    chooser = RandomChooser(SAMPLING)
    _, tree = _propose(draft_model, cfg, cfg.max_nodes, max_depth, chooser, seed=3)
    probs = tree.draft_probs  # [n, V]
    assert probs is not None and probs.shape == (len(tree), VOCAB) and probs.dtype == torch.float32
    for parent, kids in _children(tree).items():
        expected = processed_probs(_logits_after(draft_model, _path_ids(tree, parent)), SAMPLING)  # [V]
        for kid in kids:  # i.i.d. siblings: every one was drawn from the same q
            assert torch.equal(probs[kid], probs[kids[0]]), f"node {kid}"
            assert torch.equal(probs[kid] > 0, expected > 0), f"node {kid}: the support (top-k) of q"
            torch.testing.assert_close(probs[kid], expected, rtol=0, atol=1e-6, msg=f"node {kid}")
            assert probs[kid, tree.token_ids[kid]] > 0
    assert ((probs > 0).sum(dim=-1) <= SAMPLING.top_k).all()
    if cfg.kind == "static":
        assert tree.shape() == [3, 6, 6]
    else:
        assert len(tree) <= cfg.max_nodes


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_sampled_trees_are_reproducible_from_the_generator_seed(draft_model, kind):
    cfg = TreeConfig(kind=kind, branching=(3, 2, 1), top_k=3, max_nodes=12)
    trees = [_propose(draft_model, cfg, 12, 3, RandomChooser(SAMPLING), seed=seed)[1] for seed in (5, 5, 6)]
    first, again, other = trees
    assert (again.token_ids, again.parents) == (first.token_ids, first.parents)
    assert torch.equal(again.draft_probs, first.draft_probs)
    assert other.token_ids != first.token_ids  # guard: the draws do depend on the generator


def test_dynamic_sampled_keys_keep_siblings_a_draw_order_prefix(draft_model):
    """Sampling cut: a node's kept children are its first draws (keys fall with the draw index)."""
    cfg = TreeConfig(kind="dynamic", top_k=4, max_nodes=7)
    full_cfg = TreeConfig(kind="dynamic", top_k=4, max_nodes=32)
    _, cut = _propose(draft_model, cfg, 7, 2, RandomChooser(SAMPLING), seed=11)
    _, full = _propose(draft_model, full_cfg, 32, 2, RandomChooser(SAMPLING), seed=11)
    full_children = _children(full)
    for parent, kids in _children(cut).items():
        full_parent = -1 if parent < 0 else _match(full, cut, parent)
        expected = [full.token_ids[k] for k in full_children[full_parent][: len(kids)]]
        assert [cut.token_ids[k] for k in kids] == expected
    assert len(cut) == 7


def _match(full: TokenTree, cut: TokenTree, node: int) -> int:
    """The node of ``full`` with the same draw position as ``node`` of ``cut`` (same path of draw indices)."""
    index = -1
    for step in cut.path_to(node):
        parent = cut.parents[step]
        rank = _children(cut)[parent].index(step)
        index = _children(full)[index][rank]
    return index
