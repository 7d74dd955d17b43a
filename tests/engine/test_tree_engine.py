"""Greedy token-tree speculative decoding emits exactly the target-alone tokens (DESIGN §1, §2).

The target is a tiny random Llama on row-invariant kernels (rowwise attention + reference linears,
what ``load_model`` installs for eager targets), so a tree row is the decode step over prefix + path.
Drafts: a bf16 copy (long accepted paths), a noisy copy (partial, often off the first branch),
another random model (almost every node rejected), and n-gram continuation tries. Besides the
tokens every test checks the round counters and the KV rule: the target keeps KV for everything but
the pending token, the draft never more.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import pytest
import torch

from spectoolkit.config import TreeConfig
from spectoolkit.drafting import ModelDrafter, NgramDrafter
from spectoolkit.engine import BaselineEngine, GenerationOutput, SpeculativeEngine
from spectoolkit.models.attention import use_rowwise_attention
from spectoolkit.models.cached import CachedModel
from spectoolkit.models.kernel_choice import choose_kernels
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.sampling import GreedyChooser
from spectoolkit.verify import GreedyVerifier
from tests.noise import noisy_copy

VOCAB = 512
EOS = 2
EOS_IDS = frozenset({EOS})
MAX_NEW = 24
PROMPTS = (
    [1, 17, 93, 250, 7, 41, 300, 12],
    [1, 5, 5, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7],  # repetitive: n-gram lookup finds matches
    [1, 400, 3, 99, 123, 77],
)
pytestmark = pytest.mark.usefixtures("one_thread")


def _switched(model: torch.nn.Module) -> torch.nn.Module:
    assert use_rowwise_attention(model)
    choose_kernels(model, "reference")
    return model


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return _switched(tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0))


@pytest.fixture(scope="module")
def draft_models() -> dict[str, torch.nn.Module]:
    plain = tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0)  # the target's weights on transformers' sdpa
    return {
        "bf16-copy": copy.deepcopy(plain).to(torch.bfloat16),
        "noisy-copy": noisy_copy(plain, sigma=0.2, seed=5),
        "other-seed": tiny_llama(vocab_size=VOCAB, seed=1, scale=4.0),
    }


@pytest.fixture(scope="module")
def reference(target):
    """reference(prompt, kv_precision, max_new) -> the target-alone greedy output (memoised)."""
    memo: dict[tuple, list[int]] = {}

    def get(prompt: list[int], kv_precision: str = "auto", max_new: int = MAX_NEW) -> list[int]:
        key = (tuple(prompt), kv_precision, max_new)
        if key not in memo:
            engine = BaselineEngine(CachedModel(target, kv_precision), GreedyVerifier(), EOS_IDS)
            memo[key] = engine.generate(prompt, max_new, None).output_ids
        return memo[key]

    return get


def _drafter(name: str, draft_models: dict[str, torch.nn.Module]):
    if name == "ngram":
        return NgramDrafter(max_n=3, min_n=1, target_vocab_size=VOCAB, one_hot_probs=False)
    return ModelDrafter(draft_models[name], GreedyChooser(), VOCAB, VOCAB, EOS_IDS, name=name)


@dataclass
class Spy:
    """What the target saw: widths of tree (masked) verify forwards, and the verifier's results per round."""

    masked_widths: list[int] = field(default_factory=list)
    results: list[tuple[list[int], list[int], list[int]]] = field(default_factory=list)  # (ids, parents, path)


def _engine(target, drafter, gamma: int, tree: TreeConfig, kv_precision: str = "auto"):
    runner = CachedModel(target, kv_precision)
    engine = SpeculativeEngine(runner, drafter, GreedyVerifier(), gamma, EOS_IDS, tree=tree)
    spy, forward_masked, verify_tree = Spy(), runner.forward_masked, engine.tree_verifier.verify_tree

    def masked(token_ids, positions, visible):
        spy.masked_widths.append(len(token_ids))
        return forward_masked(token_ids, positions, visible)

    def verify(token_ids, parents, logits, draft_probs, generator):
        result = verify_tree(token_ids, parents, logits, draft_probs, generator)
        spy.results.append((list(token_ids), list(parents), list(result.path)))
        return result

    runner.forward_masked = masked
    engine.tree_verifier.verify_tree = verify
    return engine, runner, spy


def _depth_limit(tree: TreeConfig, gamma: int, drafter) -> int:
    """How deep a round's tree may grow (TreeConfig's doc): a static model tree ``len(branching)`` (γ does not
    apply); a dynamic tree or an n-gram trie ``max_depth``, else γ."""
    if tree.kind == "static" and not isinstance(drafter, NgramDrafter):
        return len(tree.branching)
    return tree.max_depth or gamma


def _check_counters(out: GenerationOutput, limit: int, max_nodes: int) -> None:
    rounds = out.verify_rounds
    assert rounds == len(out.accept_lengths) == len(out.draft_lengths) == len(out.tree_depths)
    assert len(out.chosen_lengths) == rounds
    assert out.accepted_tokens == sum(out.accept_lengths)
    assert out.drafted_tokens == sum(out.draft_lengths)
    assert out.proposed_rounds == sum(d > 0 for d in out.draft_lengths)
    assert out.rollback_count == sum(a < depth for a, depth in zip(out.accept_lengths, out.tree_depths, strict=True))
    for accepted, nodes, depth in zip(out.accept_lengths, out.draft_lengths, out.tree_depths, strict=True):
        assert 0 <= accepted <= depth <= min(limit, nodes) and nodes <= max_nodes
        assert (depth == 0) == (nodes == 0)


def _check_uncut(out: GenerationOutput, prompt: list[int], engine: SpeculativeEngine, max_new: int) -> None:
    """A generation that did not stop at EOS: every round's tokens were emitted, and the KV rule holds."""
    assert len(out.output_ids) == max_new
    assert len(out.output_ids) == sum(out.accept_lengths) + out.verify_rounds + 1  # +1: the prefill token
    kept = len(prompt) + len(out.output_ids) - 1  # everything but the pending token
    assert engine.target.num_computed == kept
    runner = getattr(engine.drafter, "runner", None)
    if runner is not None:
        assert runner.num_computed <= kept


def _depth_caps(out: GenerationOutput, limit: int, max_new: int = MAX_NEW) -> list[int]:
    """Each round's depth cap of an uncut run: the tree's depth limit, and room for the round's target token."""
    caps, emitted = [], 1  # the prefill token
    for accepted in out.accept_lengths:
        caps.append(min(limit, max_new - emitted - 1))
        emitted += accepted + 1
    return caps


def _check_rooms(out: GenerationOutput, limit: int, max_new: int) -> None:
    """Each round's tree is no deeper than its cap."""
    assert all(depth <= cap for depth, cap in zip(out.tree_depths, _depth_caps(out, limit, max_new), strict=True))


def _run(target, drafter, gamma, tree, reference, prompts=PROMPTS, kv_precision="auto", max_new=MAX_NEW):
    """Generate every prompt with one engine; check tokens, counters and KV; returns (out, its rounds) per prompt."""
    engine, runner, spy = _engine(target, drafter, gamma, tree, kv_precision)
    runs = []
    for prompt in prompts:
        first_round = len(spy.results)
        out = engine.generate(prompt, max_new, None)
        expected = reference(prompt, kv_precision, max_new)
        assert EOS not in expected  # these prompts test the max_new_tokens stop
        assert out.output_ids == expected, f"prompt {prompt}: diverged from the target alone"
        _check_counters(out, _depth_limit(tree, gamma, drafter), tree.max_nodes)
        _check_uncut(out, prompt, engine, max_new)
        _check_rooms(out, _depth_limit(tree, gamma, drafter), max_new)
        runs.append((out, spy.results[first_round:]))
    return runs, spy


def _check_sizes(runs, limit: int, max_nodes: int, grown: list[int], max_new: int = MAX_NEW) -> None:
    """A model draft grows the whole tree to the round's depth cap (``grown[d]`` nodes at depth d + 1), then
    keeps ``max_nodes`` of them; fewer only where an EOS node was not expanded."""
    for out, rounds in runs:
        for nodes, cap, (token_ids, _, _) in zip(
            out.draft_lengths, _depth_caps(out, limit, max_new), rounds, strict=True
        ):
            expected = min(max_nodes, sum(grown[:cap]))
            assert nodes <= expected if EOS in token_ids else nodes == expected


def _off_first_branch(spy: Spy) -> bool:
    """Some round accepted a node that is not its parent's first child: the tree beat its chain."""
    for _, parents, path in spy.results:
        for node in path:
            if parents.index(parents[node]) != node:
                return True
    return False


# ---- static trees -----------------------------------------------------------------------------

DRAFTERS = ("bf16-copy", "noisy-copy", "other-seed")
STATIC = [  # (branching, max_nodes, gamma): a static tree is len(branching) deep whatever γ is
    ((1, 1, 1, 1), 8, 4),  # chain-shaped: the plain causal verify forward
    ((3, 2, 1, 1), 16, 4),
    ((3, 2, 1, 1), 8, 6),
    ((4,), 4, 1),
    ((2, 2, 2), 14, 2),
]


@pytest.mark.parametrize("branching, max_nodes, gamma", STATIC)
@pytest.mark.parametrize("drafter_name", DRAFTERS)
def test_static_tree_output_equals_baseline(target, draft_models, reference, drafter_name, branching, max_nodes, gamma):
    tree = TreeConfig(kind="static", branching=branching, max_nodes=max_nodes)
    runs, spy = _run(target, _drafter(drafter_name, draft_models), gamma, tree, reference, PROMPTS[:2])
    _check_sizes(
        runs, len(branching), max_nodes, [math.prod(branching[: depth + 1]) for depth in range(len(branching))]
    )
    if all(width == 1 for width in branching):
        assert spy.masked_widths == []  # a chain never takes the tree forward
    else:
        assert spy.masked_widths  # ... a real tree does


def test_noisy_draft_accepts_off_the_first_branch(target, draft_models, reference):
    """Guard: the grid really exercises paths through later siblings (what a chain could not accept)."""
    tree = TreeConfig(kind="static", branching=(3, 2, 1, 1), max_nodes=16)
    _, spy = _run(target, _drafter("noisy-copy", draft_models), 4, tree, reference)
    assert _off_first_branch(spy)


# ---- dynamic trees ----------------------------------------------------------------------------

DYNAMIC = [  # (max_nodes, top_k, max_depth, gamma): max_depth None = γ deep
    (8, 4, None, 4),
    (4, 2, None, 6),
    (16, 3, None, 2),
    (1, 1, None, 1),
    (12, 2, None, 6),
    (10, 2, 3, 1),  # max_depth, not γ
]


@pytest.mark.parametrize("max_nodes, top_k, max_depth, gamma", DYNAMIC)
@pytest.mark.parametrize("drafter_name", ("bf16-copy", "noisy-copy", "other-seed"))
def test_dynamic_tree_output_equals_baseline(
    target, draft_models, reference, drafter_name, max_nodes, top_k, max_depth, gamma
):
    tree = TreeConfig(kind="dynamic", max_nodes=max_nodes, top_k=top_k, max_depth=max_depth)
    runs, _ = _run(target, _drafter(drafter_name, draft_models), gamma, tree, reference, PROMPTS[::2])
    limit = _depth_limit(tree, gamma, None)
    _check_sizes(runs, limit, max_nodes, [top_k] + [top_k * top_k] * (limit - 1))  # top_k expanded per depth


# ---- n-gram trees -----------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 2, 4, 6])
@pytest.mark.parametrize("max_nodes, max_depth", [(16, None), (4, 2)])
def test_ngram_tree_output_equals_baseline(target, draft_models, reference, max_nodes, max_depth, gamma):
    tree = TreeConfig(kind="dynamic", max_nodes=max_nodes, max_depth=max_depth)
    runs, _ = _run(target, _drafter("ngram", draft_models), gamma, tree, reference)
    assert any(nodes > 0 for out, _ in runs for nodes in out.draft_lengths)  # guard: lookups do find matches


def test_ngram_trees_branch_on_a_repetitive_prompt(target, draft_models, reference):
    """Guard: with several earlier matches the trie really branches (the masked verify forward runs)."""
    out = reference(PROMPTS[0])  # this target continues a token much as it did before, so:
    prompt = [1, *out[:2], 77, 78, *out[:2], 88, 89, *out[:2], 99, out[0]]  # out[:2] followed by 3 different tokens
    tree = TreeConfig(kind="dynamic", max_nodes=16)
    _, spy = _run(target, _drafter("ngram", draft_models), 4, tree, reference, [prompt])
    assert spy.masked_widths and max(spy.masked_widths) > 2


def test_ngram_trie_is_gamma_deep_whatever_the_tree_kind(target, draft_models, reference):
    tree = TreeConfig(kind="static", branching=(3, 2, 1, 1), max_nodes=16)
    for gamma in (1, 6):
        engine, _, _ = _engine(target, _drafter("ngram", draft_models), gamma, tree)
        out = engine.generate(PROMPTS[1], 40, None)
        assert out.output_ids == reference(PROMPTS[1], max_new=40)
        assert max(out.tree_depths) <= gamma  # γ = 1: the trie got depth 4 (len(branching))
        if gamma == 6:
            assert max(out.tree_depths) > len(tree.branching)  # the same prompt's kind=dynamic trie reaches 6


# ---- quantized target KV ----------------------------------------------------------------------

KV_CASES = [
    ("bf16-copy", TreeConfig(kind="static", branching=(3, 2, 1, 1), max_nodes=16), 4),
    ("noisy-copy", TreeConfig(kind="dynamic", max_nodes=8, top_k=4), 6),
    ("ngram", TreeConfig(kind="dynamic", max_nodes=8), 2),
]


@pytest.mark.parametrize("kv_precision", ["int8", "int4"])
@pytest.mark.parametrize("drafter_name, tree, gamma", KV_CASES, ids=[case[0] for case in KV_CASES])
def test_quantized_target_kv_equals_its_baseline(
    target, draft_models, reference, kv_precision, drafter_name, tree, gamma
):
    """Committed paths keep their stored codes: the tree run equals the target alone at the same KV precision."""
    _run(target, _drafter(drafter_name, draft_models), gamma, tree, reference, PROMPTS[:2], kv_precision)


@pytest.mark.parametrize("kv_precision", ["auto", "int8"])
def test_trees_across_kv_cache_growth(target, draft_models, reference, kv_precision):
    """A long prompt: tree slots cross the cache's initial capacity (256) while rounds commit paths."""
    prompt = torch.randint(3, VOCAB, (240,), generator=torch.Generator().manual_seed(0)).tolist()
    tree = TreeConfig(kind="static", branching=(3, 2, 1, 1), max_nodes=16)
    drafter = ModelDrafter(
        draft_models["noisy-copy"], GreedyChooser(), VOCAB, VOCAB, EOS_IDS, kv_precision=kv_precision
    )
    _run(target, drafter, 4, tree, reference, [prompt], kv_precision)
    assert drafter.runner.cache.layers[0].capacity > 256


# ---- room cap and EOS -------------------------------------------------------------------------


@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 8])
def test_trees_shrink_to_the_room_left(target, draft_models, reference, max_new):
    tree = TreeConfig(kind="static", branching=(2, 1, 1, 1, 1, 1), max_nodes=12)  # 12 nodes: 6 deep
    runs, _ = _run(target, _drafter("bf16-copy", draft_models), 6, tree, reference, PROMPTS[:1], max_new=max_new)
    out = runs[0][0]
    if max_new == 1:
        assert out.verify_rounds == 0
    if max_new == 2:
        assert out.draft_lengths == [0] and out.tree_depths == [0]  # room for the target token only
    if max_new >= 3:
        assert out.tree_depths[0] == min(6, max_new - 2)


@pytest.fixture(scope="module")
def eos_target(reference) -> torch.nn.Module:
    """The target with EOS's lm_head row 1% above the row of its 6th greedy token: EOS wins there."""
    biased = tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0)
    with torch.no_grad():
        biased.lm_head.weight[EOS] = 1.01 * biased.lm_head.weight[reference(PROMPTS[0])[5]]
    return _switched(biased)


@pytest.mark.parametrize(
    "drafter_name, tree",
    [
        ("eos-copy", TreeConfig(kind="static", branching=(3, 2, 1), max_nodes=16)),
        ("eos-copy", TreeConfig(kind="dynamic", max_nodes=8, top_k=3)),
        ("ngram", TreeConfig(kind="dynamic", max_nodes=8)),
    ],
)
def test_eos_ends_the_output(eos_target, draft_models, drafter_name, tree):
    prompt = PROMPTS[0]
    expected = BaselineEngine(CachedModel(eos_target), GreedyVerifier(), EOS_IDS).generate(prompt, MAX_NEW, None)
    expected = expected.output_ids
    assert 3 <= len(expected) < MAX_NEW and expected[-1] == EOS and EOS not in expected[:-1]  # guard
    models = {**draft_models, "eos-copy": tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0)}
    with torch.no_grad():
        models["eos-copy"].lm_head.weight.copy_(eos_target.lm_head.weight)
    engine, runner, spy = _engine(eos_target, _drafter(drafter_name, models), 4, tree)
    out = engine.generate(prompt, MAX_NEW, None)
    assert out.output_ids == expected
    _check_counters(out, _depth_limit(tree, 4, engine.drafter), tree.max_nodes)
    cut = sum(out.accept_lengths) + out.verify_rounds + 1 - len(out.output_ids)  # tokens emitted after EOS
    last_ids, _, last_path = spy.results[-1]
    assert cut == (1 if last_path and last_ids[last_path[-1]] == EOS else 0)  # an accepted EOS node ends the path
    assert runner.num_computed == len(prompt) + len(out.output_ids) - 1 + cut  # ... and keeps its KV
    for token_ids, parents, _ in spy.results:  # an EOS node is never expanded
        assert all(parent < 0 or token_ids[parent] != EOS for parent in parents)
    if drafter_name == "eos-copy":
        assert any(EOS in token_ids for token_ids, _, _ in spy.results)  # guard: the draft does propose EOS


def test_larger_draft_vocab_never_puts_foreign_ids_in_a_tree(target, reference):
    extra = 64
    wide = tiny_llama(vocab_size=VOCAB + extra, seed=0, scale=4.0)
    plain = tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0)
    with torch.no_grad():
        for source, dest in zip(plain.parameters(), wide.parameters(), strict=True):
            dest[: source.shape[0]] = source  # embeddings and lm_head: the first VOCAB rows
        wide.lm_head.weight[VOCAB:] = 3.0 * plain.lm_head.weight[:extra]
    assert int(CachedModel(wide).forward(PROMPTS[0], last_only=True).argmax()) >= VOCAB  # guard: unmasked, it would
    drafter = ModelDrafter(wide, GreedyChooser(), VOCAB, VOCAB, EOS_IDS)
    tree = TreeConfig(kind="dynamic", max_nodes=8, top_k=3)
    proposed: list[int] = []
    original = drafter.propose_tree

    def propose_tree(tokens, tree_cfg, budget, max_depth, generator):
        grown = original(tokens, tree_cfg, budget, max_depth, generator)
        proposed.extend(grown.token_ids)
        return grown

    drafter.propose_tree = propose_tree
    _run(target, drafter, 4, tree, reference, PROMPTS[:1])
    assert proposed and max(proposed) < VOCAB
