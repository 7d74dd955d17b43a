"""Greedy token-tree speculation at batch 1 on the one engine emits exactly the target-alone tokens (DESIGN §1, §2).

:class:`~spectoolkit.serving.one.OneRequestEngine` drafting trees (the wiring's tree arm: a fixed policy of up to
``max_nodes`` nodes, as deep as its policy says: :func:`~spectoolkit.policy.draft_depth`) over a tiny
random Llama target on the reference kernels, which a lone sequence runs in ``chosen`` row mode, so a tree row is
the decode step over prefix + path. Drafts: a bf16 copy (long accepted paths), a noisy copy (partial, often off the
first branch), another random model (almost every node rejected), and n-gram continuation tries. Besides the tokens
every test checks the round counters and, after every commit, the KV rule: the target keeps KV for everything but
the pending token (no block past it), the draft never more. The batched counterparts live in test_serving_trees.py.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import pytest
import torch

import spectoolkit.serving.engine as engine_module
from spectoolkit.config import SpeculateConfig, TreeConfig
from spectoolkit.drafting import NgramDrafter
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.policy import FixedPolicy, draft_depth
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.lone import lone_sequence
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import make_runner
from spectoolkit.sampling import GreedyChooser
from spectoolkit.serving.api import GenerationOutput
from spectoolkit.serving.engine import ContinuousEngine
from spectoolkit.serving.one import OneRequestEngine
from spectoolkit.serving.scheduler import SchedulerLimits
from spectoolkit.verify import GreedyVerifier
from tests.noise import noisy_copy
from tests.reference import alone_greedy
from tests.serving import helpers
from tests.serving.helpers import BLOCK, EOS, EOS_IDS, MAX_POSITIONS, VOCAB

MAX_NEW = 24
PROMPTS = (
    [1, 17, 93, 250, 7, 41, 300, 12],
    [1, 5, 5, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7],  # repetitive: n-gram lookup finds matches
    [1, 400, 3, 99, 123, 77],
)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return helpers.switched(tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0))


@pytest.fixture(scope="module")
def draft_models() -> dict[str, torch.nn.Module]:
    plain = tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0)  # the target's weights on the stock linears
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
            memo[key] = alone_greedy(target, prompt, max_new, EOS_IDS, kv_precision)
        return memo[key]

    return get


@pytest.fixture
def masked_widths(monkeypatch) -> list[int]:
    """Rows of every tree-masked segment of the engine's target forwards (a chain has no mask)."""
    widths, original = [], engine_module.build_step

    def build(segments, mode, device):
        widths.extend(len(segment.token_ids) for segment in segments if segment.tree is not None)
        return original(segments, mode, device)

    monkeypatch.setattr(engine_module, "build_step", build)
    return widths


@dataclass
class TreeArm:
    """A drafter growing a tree, and how deep the arm's policy lets it grow (γ's and the tree's)."""

    drafter: object
    depth: int


def _arm(drafter, tree: TreeConfig, gamma: int) -> TreeArm:
    return TreeArm(drafter, draft_depth(SpeculateConfig(gamma=gamma, tree=tree)))


def _drafter(name: str, draft_models: dict[str, torch.nn.Module], tree: TreeConfig, gamma: int, kv: str = "auto"):
    """The arm growing ``tree`` with ``gamma``: n-gram tries, or a draft model's trees."""
    if name == "ngram":
        return _arm(NgramDrafter(3, 1, VOCAB, False, tree), tree, gamma)
    return _arm(helpers.model_drafter(draft_models[name], GreedyChooser(), kv=kv).variant(None, tree), tree, gamma)


@dataclass
class Spy:
    """What the engine did: (ids, parents, path) per round with nodes (a chain-shaped tree comes to the chain
    verifier, its path the accepted prefix; any other to the tree verifier), and per commit (the prefill's token,
    then every round) the KV lengths when the drafter was told what the target kept."""

    results: list[tuple[list[int], list[int], list[int]]] = field(default_factory=list)
    commits: list[dict] = field(default_factory=list)


def _spy(one: OneRequestEngine) -> Spy:
    spy, eng, drafter = Spy(), one.engine, one.drafter
    verify_tree, verify_chain = eng.tree_verifier.verify_tree, eng.verifier.verify

    def verify(token_ids, parents, logits, draft_probs, generator):
        result = verify_tree(token_ids, parents, logits, draft_probs, generator)
        spy.results.append((list(token_ids), list(parents), list(result.path)))
        return result

    def chain(draft_ids, logits, draft_probs, generator):
        result = verify_chain(draft_ids, logits, draft_probs, generator)
        parents = list(range(-1, len(draft_ids) - 1))
        spy.results.append((draft_ids.tolist(), parents, list(range(result.num_accepted))))
        return result

    def told(method):
        def wrapped(seq, *args):
            method(seq, *args)
            state = getattr(drafter, "_states", {}).get(id(seq))
            table = seq.table
            spy.commits.append({
                "tokens": len(seq.tokens), "target": seq.num_computed, "blocks": len(table.blocks),
                "needed": max(table.blocks_for(seq.num_computed), table.published),
                "draft": None if state is None else state.num_computed,
            })  # fmt: skip

        return wrapped

    eng.tree_verifier.verify_tree, eng.verifier.verify = verify, chain
    drafter.commit = told(drafter.commit)
    return spy


def _one(target, arm: TreeArm, kv: str = "auto") -> OneRequestEngine:
    """The tree arm as the wiring builds it: up to ``max_nodes`` nodes a round, as deep as its policy says."""
    nodes = arm.drafter.tree.max_nodes
    limits = SchedulerLimits(64, 1, None, None)
    runner = make_runner(target, make_pool(target, kv, 200 * BLOCK))
    eng = ContinuousEngine(
        "spec", runner, BlockAllocator(200, BLOCK), GreedyVerifier(), limits, EOS_IDS, MAX_POSITIONS, arm.drafter,
        policy=FixedPolicy(nodes, arm.depth),
    )  # fmt: skip
    assert eng.trees, "a drafter with a tree makes a tree engine"
    return OneRequestEngine(eng, "spec")


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
    times = (out.ttft, out.prefill_time, out.draft_time, out.verify_time, out.overhead_time, out.total_time)
    assert all(t >= 0 for t in times), times


def _check_uncut(out: GenerationOutput, spy: Spy, max_new: int) -> None:
    """A generation that did not stop at EOS: every round's tokens were emitted, and after every commit the
    target kept KV for all but the pending token, no block past it, and the draft model no more."""
    assert len(out.output_ids) == max_new
    assert len(out.output_ids) == sum(out.accept_lengths) + out.verify_rounds + 1  # +1: the prefill token
    assert len(spy.commits) == out.verify_rounds + 1
    for commit in spy.commits:
        assert commit["target"] == commit["tokens"] - 1  # the last token is pending
        assert commit["blocks"] == commit["needed"], "blocks past num_computed were kept"
        assert commit["draft"] is None or commit["draft"] <= commit["target"]


def _depth_caps(out: GenerationOutput, limit: int, max_new: int = MAX_NEW) -> list[int]:
    """Each round's depth cap of an uncut run: the tree's depth limit, and room for the round's target token."""
    caps, emitted = [], 1  # the prefill token
    for accepted in out.accept_lengths:
        caps.append(min(limit, max_new - emitted - 1))
        emitted += accepted + 1
    return caps


def _run(target, arm: TreeArm, reference, prompts=PROMPTS, kv_precision="auto", max_new=MAX_NEW):
    """Generate every prompt with one engine; check tokens, counters, depths and KV; (out, its results) per prompt."""
    one = _one(target, arm, kv_precision)
    spy = _spy(one)
    tree, limit = arm.drafter.tree, arm.depth
    runs = []
    for prompt in prompts:
        spy.results.clear()
        spy.commits.clear()
        out = one.generate(prompt, max_new, None)
        expected = reference(prompt, kv_precision, max_new)
        assert EOS not in expected  # these prompts test the max_new_tokens stop
        assert out.output_ids == expected, f"prompt {prompt}: diverged from the target alone"
        _check_counters(out, limit, tree.max_nodes)
        _check_uncut(out, spy, max_new)
        caps = _depth_caps(out, limit, max_new)
        assert all(depth <= cap for depth, cap in zip(out.tree_depths, caps, strict=True)), (out.tree_depths, caps)
        runs.append((out, list(spy.results)))
    assert helpers.all_free(one.engine) and one.drafter.kv_bytes() == 0
    return runs


def _check_sizes(runs, limit: int, max_nodes: int, grown: list[int], max_new: int = MAX_NEW) -> None:
    """A model draft grows the whole tree to the round's depth cap (``grown[d]`` nodes at depth d + 1), then
    keeps ``max_nodes`` of them; fewer only where an EOS node was not expanded."""
    for out, results in runs:
        proposed = iter(results)  # the verifier sees the rounds that have nodes
        for nodes, cap in zip(out.draft_lengths, _depth_caps(out, limit, max_new), strict=True):
            expected = min(max_nodes, sum(grown[:cap]))
            if not nodes:
                assert expected == 0
                continue
            token_ids, _, _ = next(proposed)
            assert len(token_ids) == nodes
            assert nodes <= expected if EOS in token_ids else nodes == expected


def _off_first_branch(results) -> bool:
    """Some round accepted a node that is not its parent's first child: the tree beat its chain."""
    for _, parents, path in results:
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
def test_static_tree_output_equals_the_target_alone(
    target, draft_models, reference, masked_widths, drafter_name, branching, max_nodes, gamma
):
    tree = TreeConfig(kind="static", branching=branching, max_nodes=max_nodes)
    arm = _drafter(drafter_name, draft_models, tree, gamma)
    assert arm.depth == len(branching)
    runs = _run(target, arm, reference, PROMPTS[:2])
    grown = [math.prod(branching[: depth + 1]) for depth in range(len(branching))]
    _check_sizes(runs, len(branching), max_nodes, grown)
    if all(width == 1 for width in branching):
        assert masked_widths == []  # a chain never takes the tree forward
    else:
        assert masked_widths  # ... a real tree does


def test_noisy_draft_accepts_off_the_first_branch(target, draft_models, reference):
    """Guard: the grid really exercises paths through later siblings (what a chain could not accept)."""
    tree = TreeConfig(kind="static", branching=(3, 2, 1, 1), max_nodes=16)
    runs = _run(target, _drafter("noisy-copy", draft_models, tree, 4), reference)
    assert _off_first_branch([result for _, results in runs for result in results])


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
@pytest.mark.parametrize("drafter_name", DRAFTERS)
def test_dynamic_tree_output_equals_the_target_alone(
    target, draft_models, reference, drafter_name, max_nodes, top_k, max_depth, gamma
):
    tree = TreeConfig(kind="dynamic", max_nodes=max_nodes, top_k=top_k, max_depth=max_depth)
    arm = _drafter(drafter_name, draft_models, tree, gamma)
    limit = arm.depth
    assert limit == (max_depth or gamma)
    runs = _run(target, arm, reference, PROMPTS[::2])
    _check_sizes(runs, limit, max_nodes, [top_k] + [top_k * top_k] * (limit - 1))  # top_k expanded per depth


# ---- n-gram trees -----------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 2, 4, 6])
@pytest.mark.parametrize("max_nodes, max_depth", [(16, None), (4, 2)])
def test_ngram_tree_output_equals_the_target_alone(target, draft_models, reference, max_nodes, max_depth, gamma):
    tree = TreeConfig(kind="dynamic", max_nodes=max_nodes, max_depth=max_depth)
    runs = _run(target, _drafter("ngram", draft_models, tree, gamma), reference)
    assert any(nodes > 0 for out, _ in runs for nodes in out.draft_lengths)  # guard: lookups do find matches


def test_ngram_trees_branch_on_a_repetitive_prompt(target, draft_models, reference, masked_widths):
    """Guard: with several earlier matches the trie really branches (the masked verify forward runs)."""
    out = reference(PROMPTS[0])  # this target continues a token much as it did before, so:
    prompt = [1, *out[:2], 77, 78, *out[:2], 88, 89, *out[:2], 99, out[0]]  # out[:2] followed by 3 different tokens
    tree = TreeConfig(kind="dynamic", max_nodes=16)
    _run(target, _drafter("ngram", draft_models, tree, 4), reference, [prompt])
    assert masked_widths and max(masked_widths) > 2


def test_ngram_trie_is_as_deep_as_the_policy_says(target, draft_models, reference):
    """The policy holds the depth, whoever grows the tree: a static config's len(branching) whatever γ is, a dynamic
    one's γ (the same prompt's trie then reaches past 4)."""
    static = TreeConfig(kind="static", branching=(3, 2, 1, 1), max_nodes=16)
    dynamic = TreeConfig(kind="dynamic", max_nodes=16)
    for tree, gamma, depth in ((static, 1, 4), (static, 6, 4), (dynamic, 1, 1), (dynamic, 6, 6)):
        arm = _drafter("ngram", draft_models, tree, gamma)
        assert arm.depth == depth
        out = _one(target, arm).generate(PROMPTS[1], 40, None)
        assert out.output_ids == reference(PROMPTS[1], max_new=40)
        assert max(out.tree_depths) <= depth
        if depth == 6:
            assert max(out.tree_depths) > len(static.branching)


# ---- quantized target KV ----------------------------------------------------------------------

KV_CASES = [
    ("bf16-copy", TreeConfig(kind="static", branching=(3, 2, 1, 1), max_nodes=16), 4),
    ("noisy-copy", TreeConfig(kind="dynamic", max_nodes=8, top_k=4), 6),
    ("ngram", TreeConfig(kind="dynamic", max_nodes=8), 2),
]


@pytest.mark.parametrize("kv_precision", ["int8", "int4"])
@pytest.mark.parametrize("drafter_name, tree, gamma", KV_CASES, ids=[case[0] for case in KV_CASES])
def test_quantized_target_kv_equals_its_target_alone(
    target, draft_models, reference, kv_precision, drafter_name, tree, gamma
):
    """Committed paths keep their stored codes: the tree run equals the target alone at the same KV precision."""
    _run(target, _drafter(drafter_name, draft_models, tree, gamma), reference, PROMPTS[:2], kv_precision)


@pytest.mark.parametrize("kv_precision", ["auto", "int8"])
def test_trees_after_a_long_prompt_prefilled_in_chunks(target, draft_models, reference, kv_precision):
    """240 prompt tokens, prefilled in chunks of the step's 64-token budget; the draft (its KV at the same
    precision) catches up on all of them at its first tree, then rounds commit paths across many blocks."""
    prompt = torch.randint(3, VOCAB, (240,), generator=torch.Generator().manual_seed(0)).tolist()
    tree = TreeConfig(kind="static", branching=(3, 2, 1, 1), max_nodes=16)
    arm = _drafter("noisy-copy", draft_models, tree, 4, kv_precision)
    (run,) = _run(target, arm, reference, [prompt], kv_precision)
    assert run[0].accepted_tokens > 0


# ---- room cap and EOS -------------------------------------------------------------------------


@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 8])
def test_trees_shrink_to_the_room_left(target, draft_models, reference, max_new):
    tree = TreeConfig(kind="static", branching=(2, 1, 1, 1, 1, 1), max_nodes=12)  # 12 nodes: 6 deep
    runs = _run(target, _drafter("bf16-copy", draft_models, tree, 6), reference, PROMPTS[:1], max_new=max_new)
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
    return helpers.switched(biased)


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
    if drafter_name == "ngram":  # the target's EOS run from PROMPTS[0] earlier in the context: the trie proposes it
        prompt = PROMPTS[0] + alone_greedy(eos_target, PROMPTS[0], MAX_NEW, EOS_IDS) + [5] + PROMPTS[0]
    expected = alone_greedy(eos_target, prompt, MAX_NEW, EOS_IDS)
    assert 3 <= len(expected) < MAX_NEW and expected[-1] == EOS and EOS not in expected[:-1]  # guard
    models = {**draft_models, "eos-copy": tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0)}
    with torch.no_grad():
        models["eos-copy"].lm_head.weight.copy_(eos_target.lm_head.weight)
    one = _one(eos_target, _drafter(drafter_name, models, tree, 4))
    spy = _spy(one)
    out = one.generate(prompt, MAX_NEW, None)
    assert out.output_ids == expected
    _check_counters(out, draft_depth(SpeculateConfig(gamma=4, tree=tree)), tree.max_nodes)
    cut = sum(out.accept_lengths) + out.verify_rounds + 1 - len(out.output_ids)  # tokens emitted after EOS
    last_ids, _, last_path = spy.results[-1] if out.draft_lengths[-1] else ([], [], [])  # the last round's tree
    assert cut == (1 if last_path and last_ids[last_path[-1]] == EOS else 0)  # an accepted EOS node ends the path
    assert spy.commits[-1]["target"] == len(prompt) + len(out.output_ids) - 1 + cut  # ... and keeps its KV
    for token_ids, parents, _ in spy.results:  # an EOS node is never expanded
        assert all(parent < 0 or token_ids[parent] != EOS for parent in parents)
    assert any(EOS in token_ids for token_ids, _, _ in spy.results)  # guard: the draft does propose EOS
    assert helpers.all_free(one.engine) and one.drafter.kv_bytes() == 0


def test_larger_draft_vocab_never_puts_foreign_ids_in_a_tree(target, reference):
    extra = 64
    wide = tiny_llama(vocab_size=VOCAB + extra, seed=0, scale=4.0)
    plain = tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0)
    with torch.no_grad():
        for source, dest in zip(plain.parameters(), wide.parameters(), strict=True):
            dest[: source.shape[0]] = source  # embeddings and lm_head: the first VOCAB rows
        wide.lm_head.weight[VOCAB:] = 3.0 * plain.lm_head.weight[:extra]
    assert int(lone_sequence(wide).forward(PROMPTS[0], last_only=True).argmax()) >= VOCAB  # guard: unmasked, it would
    tree = TreeConfig(kind="dynamic", max_nodes=8, top_k=3)
    drafter = helpers.model_drafter(wide, GreedyChooser()).variant(None, tree)  # target vocab = shared = VOCAB
    proposed = helpers.record_proposed(drafter)
    _run(target, _arm(drafter, tree, 4), reference, PROMPTS[:1])
    assert proposed and max(proposed) < VOCAB
