"""Token trees under continuous batching (DESIGN §1, §2, §6): tree segments, the accepted path's KV, exactness.

- **Segments:** one ragged forward over a tree segment, a chain, a plain decode and a prefill chunk gives
  every row the logits a batch-1 lone sequence gets for prefix + that row's path (bit for bit in
  batch-invariant mode, within 1e-5 padded); a mask that lets a node see its sibling is caught.
- **KV:** with random trees and random accepted paths, after every commit a sequence's stored KV of
  [0, num_computed) equals, bit for bit and for every KV precision, a fresh pool fed only the committed
  tokens as a chain; the verifier's rows equal the target-alone logits; blocks past num_computed go
  back; published shared prefix blocks are never written.
- **Engine:** greedy outputs with static, dynamic and n-gram trees equal the batch-1 target alone, padded
  and invariant, with a cramped draft pool, a small token budget, EOS inside an accepted path, int8 KV.
- **Sampling:** trees with a RandomChooser draft and the StochasticVerifier are reproducible per seed,
  and in invariant mode a request's output under concurrency equals its output alone.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import torch

from spectoolkit.config import SamplingConfig, SpeculateConfig, TreeConfig
from spectoolkit.drafting import Budget, NgramDrafter, SuffixDrafter, SuffixSettings
from spectoolkit.drafting.tree import TokenTree
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.policy import FixedPolicy, draft_depth
from spectoolkit.precisions import KV_PRECISIONS
from spectoolkit.runtime.blocks import BlockAllocator, BlockTable
from spectoolkit.runtime.lone import lone_sequence
from spectoolkit.runtime.paged_kv import KINDS, make_pool
from spectoolkit.runtime.runner import make_runner
from spectoolkit.runtime.step import Segment, tree_layout
from spectoolkit.sampling import GreedyChooser, RandomChooser
from spectoolkit.serving.api import ServeRequest
from spectoolkit.serving.engine import ContinuousEngine
from spectoolkit.serving.scheduler import SchedulerLimits
from spectoolkit.serving.sequence import new_sequence
from spectoolkit.verify import GreedyVerifier, StochasticVerifier
from spectoolkit.verify.base import VerifyResult
from spectoolkit.verify.tree import TreeVerifyResult, children_of
from tests.reference import alone_greedy
from tests.serving import helpers
from tests.serving.helpers import BLOCK, EOS_IDS, MAX_POSITIONS, VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")
GAMMA = 4  # speculate.gamma: the depth of dynamic and n-gram trees
MAX_NEW = 20
SAMPLING = SamplingConfig(temperature=1.0)
SMALL_VOCAB = 24


@pytest.fixture(scope="module")
def target():
    model = helpers.tiny()
    return model


@pytest.fixture(scope="module")
def draft():
    return helpers.noisy_target(0.3, seed=5)  # agrees with the target in part


@pytest.fixture(scope="module")
def batch():
    return helpers.prompts((6, 10, 14, 9, 3))  # 9..33 tokens


@pytest.fixture(scope="module")
def references(target, batch):
    return helpers.baseline_outputs(target, batch, MAX_NEW)


@pytest.fixture(scope="module")
def small():
    """(target, prompts, references) over a vocabulary of 24: tokens recur, so n-gram tries branch."""
    model = helpers.switched(tiny_llama(vocab_size=SMALL_VOCAB, seed=0, scale=3.0))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, SMALL_VOCAB, (n,), generator=gen).tolist() for n in (10, 16, 22, 13, 7)]
    return model, prompts, helpers.baseline_outputs(model, prompts, MAX_NEW)


def tree_engine(target, drafter, *, invariant: bool, kv: str = "auto", num_blocks: int = 200,
                max_num_tokens: int = 64, max_draft_tokens: int | None = None, verifier=None, stochastic=False,
                eos_ids=EOS_IDS, max_num_seqs: int = 8) -> ContinuousEngine:  # fmt: skip
    """The serving factory's spec arm with ``speculate.tree`` (the drafter's): a fixed policy of up to
    ``max_nodes`` drafts."""
    nodes = drafter.tree.max_nodes
    limits = SchedulerLimits(max_num_tokens, max_num_seqs, None, max_draft_tokens)
    eng = ContinuousEngine(
        "tree", make_runner(target, make_pool(target, kv, num_blocks * BLOCK)), BlockAllocator(num_blocks, BLOCK),
        verifier or GreedyVerifier(), limits, eos_ids, MAX_POSITIONS, drafter, stochastic, invariant,
        FixedPolicy(nodes, draft_depth(SpeculateConfig(gamma=GAMMA, tree=drafter.tree))),
    )  # fmt: skip
    assert eng.trees, "a drafter with a tree makes a tree engine"
    return eng


class Recorded:
    """A drafter whose every ``propose`` answer is kept as (budget, tree)."""

    def __init__(self, inner) -> None:
        self.inner, self.trees = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, seqs, budgets):
        out = self.inner.propose(seqs, budgets)
        self.trees.extend(zip(budgets, out, strict=True))
        return out

    def branched(self) -> int:
        return sum(len(t) > 0 and not t.is_chain() for _, t in self.trees)


def run_with_arrivals(eng, arrivals: dict[int, list[ServeRequest]], after_step=None, max_steps: int = 400):
    """Submit ``arrivals[step]`` before each step until idle; ``after_step(eng, done)`` after each; results by id."""
    done = {}
    for step in range(max_steps):
        for request in arrivals.get(step, []):
            eng.submit(request)
        if not eng.has_work() and step > max(arrivals):
            break
        for result in eng.step():
            done[result.request_id] = result
        if after_step is not None:
            after_step(eng, done)
    assert not eng.has_work(), "the engine did not drain"
    return done


# ---- 1. segments -------------------------------------------------------------------------------

PARENTS = [-1, 0, 0, 1, 1, 2, 3]  # row 0 the pending token; 2 children, 3 grandchildren, 1 great-grandchild
SIBLING_ROW, SIBLING_OF = 4, 3  # rows 3 and 4 are siblings (both children of row 1)


def _path(tokens: list[int], parents: list[int], row: int) -> list[int]:
    """Tokens from the tree's first row down to ``row``."""
    rows = []
    while row >= 0:
        rows.append(row)
        row = parents[row]
    return [tokens[r] for r in reversed(rows)]


def _mixed_step(target, mode: str, sees_sibling: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill four sequences, then one ragged forward of a tree, a chain, a decode and a prefill chunk
    (``lone``: the tree alone); (its logits [R, V], the batch-1 logits of each row: a lone sequence fed its
    prefix + path)."""
    gen = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(3, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    prefixes = [rand(11), rand(9), rand(13), rand(7)]
    fed = [rand(len(PARENTS)), rand(4), rand(1), rand(6)]  # tree rows, pending + 3 drafts, decode, chunk
    pool, allocator = make_pool(target, "auto", 32 * BLOCK), BlockAllocator(32, BLOCK)
    tables = [BlockTable(allocator) for _ in prefixes]
    for table, prefix, ids in zip(tables, prefixes, fed, strict=True):
        table.ensure(len(prefix) + len(ids))
    helpers.paged_forward(target, pool, [Segment(t, p, 0, [len(p) - 1]) for t, p in zip(tables, prefixes, strict=True)],
                   invariant=True)  # fmt: skip
    positions, visible = tree_layout(PARENTS, len(prefixes[0]))
    assert positions == [11 + depth for depth in (0, 1, 1, 2, 2, 2, 3)]
    if sees_sibling:  # BUG on purpose: a node attends its sibling's slot
        visible = visible.clone()
        visible[SIBLING_ROW, len(prefixes[0]) + SIBLING_OF] = True
    segments = [Segment(tables[0], fed[0], len(prefixes[0]), list(range(len(PARENTS))), (positions, visible))]
    segments += [Segment(t, ids, len(p), list(range(len(ids)))) for t, p, ids in zip(tables[1:], prefixes[1:], fed[1:],
                                                                                     strict=True)]  # fmt: skip
    segments = segments[:1] if mode == "lone" else segments
    logits = helpers.paged_forward(target, pool, segments, invariant=mode == "invariant")
    paths = [prefixes[0] + _path(fed[0], PARENTS, row) for row in range(len(PARENTS))]
    paths += [p + ids[: i + 1] for p, ids in zip(prefixes[1:], fed[1:], strict=True) for i in range(len(ids))]
    expected = [lone_sequence(target).forward(ids)[-1] for ids in paths[: len(logits)]]
    return logits, expected


def _same(got: torch.Tensor, expected: torch.Tensor, mode: str) -> bool:
    return torch.equal(got, expected) if mode == "invariant" else torch.allclose(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ["invariant", "padded", "lone"])
def test_every_row_of_a_mixed_step_equals_batch1_prefix_plus_its_path(target, mode):
    logits, expected = _mixed_step(target, mode, sees_sibling=False)
    assert len(logits) == (len(PARENTS) if mode == "lone" else len(PARENTS) + 4 + 1 + 6)
    wrong = [row for row, (got, ref) in enumerate(zip(logits, expected, strict=True)) if not _same(got, ref, mode)]
    assert wrong == [], f"{mode}: rows {wrong} differ from the batch-1 target over prefix + path"


@pytest.mark.parametrize("mode", ["invariant", "padded", "lone"])
def test_a_node_that_sees_its_sibling_is_caught(target, mode):
    """Negative control: the comparison above has the power to see a leaking tree mask."""
    logits, expected = _mixed_step(target, mode, sees_sibling=True)
    wrong = [row for row, (got, ref) in enumerate(zip(logits, expected, strict=True)) if not _same(got, ref, mode)]
    assert wrong == [SIBLING_ROW]


# ---- 2. the accepted path's KV -------------------------------------------------------------------


class RandomTreeDrafter(helpers.StatelessDrafter):
    """Random trees of 0..budget random non-EOS nodes within its depth and the depth the engine allows."""

    name = "random-tree"

    def __init__(self, seed: int, tree: TreeConfig) -> None:
        self.rng = random.Random(seed)
        self.tree = tree

    def propose(self, seqs, budgets):
        return [self._tree(budget.nodes, budget.depth) for budget in budgets]

    def _tree(self, budget: int, max_depth: int) -> TokenTree:
        parents, depths = [], []
        for _ in range(self.rng.randint(0, budget)):
            parent = self.rng.choice([-1] + [node for node, depth in enumerate(depths) if depth < max_depth])
            parents.append(parent)
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return TokenTree([self.rng.randrange(3, VOCAB) for _ in parents], parents)

    def commit(self, seq, num_prefix, path) -> None:
        assert seq.num_computed == num_prefix + len(path)

    def describe_tree(self) -> str:
        return self.tree.describe()


class RandomPaths:
    """Tree verifier and chain verifier in one: a random walk down the tree (a chain-shaped one comes to the chain
    verifier, the fast path), random non-EOS tokens."""

    sampling = SamplingConfig(temperature=0.0)

    def __init__(self, seed: int) -> None:
        self.rng, self.paths = random.Random(seed), []

    def select(self, logits, generator=None) -> int:
        return self.rng.randrange(3, VOCAB)

    def verify(self, draft_ids, target_logits, draft_probs, generator) -> VerifyResult:
        result = self.verify_tree(draft_ids.tolist(), list(range(-1, len(draft_ids) - 1)), target_logits, None, None)
        return VerifyResult(len(result.path), result.next_token)

    def verify_tree(self, token_ids, parents, target_logits, draft_probs, generator) -> TreeVerifyResult:
        assert target_logits.shape[0] == len(token_ids) + 1
        children, path, node = children_of(parents), [], -1
        while children.get(node) and self.rng.random() < 0.8:
            node = self.rng.choice(children[node])
            path.append(node)
        self.paths.append(path)
        return TreeVerifyResult(path, self.rng.randrange(3, VOCAB))


def _stored(pool, slots: list[int]) -> list[dict[str, torch.Tensor]]:
    index = torch.tensor(slots, dtype=torch.long)
    return [pool.stored(layer, kind, index) for layer in range(len(pool.layers)) for kind in KINDS]


def _same_bits(got, expected, what: str) -> None:
    for index, (first, second) in enumerate(zip(got, expected, strict=True)):
        helpers.assert_same_bits(first, second, f"{what}, layer/kind {index}")


def _check_blocks(eng) -> None:
    """Refcounts match the running tables; nothing past num_computed is held; the rest is free."""
    holders = Counter(block for seq in eng.scheduler.running for block in seq.table.blocks)
    allocator = eng.allocator
    assert all(allocator.refcount(block) == holders[block] for block in range(allocator.num_blocks))
    assert allocator.num_free == allocator.num_blocks - len(holders), "a block leaked"
    for seq in eng.scheduler.running:
        table = seq.table
        assert len(table.blocks) == max(table.blocks_for(seq.num_computed), table.published), "rejected blocks kept"


def _chain_reference(target, precision: str, tokens: list[int]):
    """A fresh pool fed ``tokens`` as one chain (invariant): (its table, pool, logits [L, V])."""
    blocks = -(-len(tokens) // BLOCK)
    pool, table = make_pool(target, precision, blocks * BLOCK), BlockTable(BlockAllocator(blocks, BLOCK))
    table.ensure(len(tokens))
    logits = helpers.paged_forward(target, pool, [Segment(table, tokens, 0, list(range(len(tokens))))], invariant=True)
    return table, pool, logits


@pytest.mark.parametrize("precision", KV_PRECISIONS)
def test_committed_kv_after_tree_rounds_equals_a_chain_of_the_committed_tokens(target, precision):
    verifier = RandomPaths(seed=2)
    tree = TreeConfig(kind="dynamic", max_nodes=8, top_k=4)
    eng = tree_engine(target, RandomTreeDrafter(1, tree), invariant=True, kv=precision, num_blocks=48,
                      max_num_tokens=24, verifier=verifier)  # fmt: skip
    eng.tree_verifier = verifier
    eng.default_rule = dataclasses.replace(eng.default_rule, tree_verifier=verifier)  # what requests verify with
    moves = []
    original_move, original_commit = eng.pool.move, eng._commit
    eng.pool.move = lambda sources, targets: (moves.append(sources != targets), original_move(sources, targets))
    seen = []  # (request id, position of the pending token, the rows the verifier chose from)

    def commit(seq, work, proposal, rows, now, states=None):
        before = len(seq.tokens)
        result = original_commit(seq, work, proposal, rows, now, states)
        path = verifier.paths.pop() if len(proposal) else []
        seen.append((seq.request.request_id, before - 1, rows[[0] + [node + 1 for node in path]].clone()))
        assert seq.num_computed == before + len(path)
        return result

    eng._commit = commit
    shared_prompt = helpers.prompts((10,), seed=4)[0]  # 25 tokens: 3 full blocks
    others = helpers.prompts((3, 12), seed=5)
    arrivals = {0: [ServeRequest("A", shared_prompt, 10), ServeRequest("x0", others[0], 16)],
                2: [ServeRequest("B", shared_prompt, 18), ServeRequest("x1", others[1], 12)]}  # fmt: skip
    snapshots, shared = [], {}

    def after_step(eng, done):
        _check_blocks(eng)
        running = {seq.request.request_id: seq for seq in eng.scheduler.running}
        if "B" in running and not shared:
            assert running["B"].table.blocks[:3] == running["A"].table.blocks[:3], "the prompt blocks were not shared"
            slots = [b * BLOCK + i for b in running["B"].table.blocks[:3] for i in range(BLOCK)]
            shared.update(slots=slots, stored=_stored(eng.pool, slots))
        if "B" in running:
            _same_bits(_stored(eng.pool, shared["slots"]), shared["stored"], f"{precision}: a shared block was written")
        for rid, seq in running.items():
            snapshots.append((rid, seq.num_computed, _stored(eng.pool, seq.table.slots(0, seq.num_computed))))

    done = run_with_arrivals(eng, arrivals, after_step)
    prompts = {r.request_id: r.prompt_ids for batch in arrivals.values() for r in batch}
    assert helpers.all_free(eng) and set(done) == set(prompts)
    assert any(moves), "no accepted path had to move"
    assert any(0 < a < d for r in done.values() for a, d in zip(r.accept_lengths, r.draft_lengths, strict=True))
    references = {rid: _chain_reference(target, precision, prompts[rid] + r.output_ids[:-1]) for rid, r in done.items()}
    for rid, length, stored in snapshots:
        table, pool, _ = references[rid]
        _same_bits(stored, _stored(pool, table.slots(0, length)), f"{precision} {rid} at num_computed={length}")
    for rid, position, rows in seen:
        expected = references[rid][2][position : position + len(rows)]
        assert torch.equal(rows, expected), f"{precision} {rid}: the verifier's rows at {position} != chain logits"


def test_shared_prompt_blocks_are_never_written_by_tree_rounds(target, draft):
    prompt = helpers.prompts((20,), seed=6)[0]  # 45 tokens: 5 full blocks
    reference = helpers.baseline_outputs(target, [prompt], 24)["0"]
    tree = TreeConfig(kind="static", branching=(3, 2, 1), max_nodes=8)
    drafter = Recorded(helpers.model_drafter(draft, GreedyChooser()).variant(None, tree))
    eng = tree_engine(target, drafter, invariant=False)
    shared = {}

    def after_step(eng, done):
        running = {seq.request.request_id: seq for seq in eng.scheduler.running}
        if "B" in running and not shared:
            assert running["B"].table.blocks[:5] == running["A"].table.blocks[:5], "the prompt blocks were not shared"
            slots = [b * BLOCK + i for b in running["B"].table.blocks[:5] for i in range(BLOCK)]
            shared.update(slots=slots, stored=_stored(eng.pool, slots))
        if shared and running:
            _same_bits(_stored(eng.pool, shared["slots"]), shared["stored"], "a shared prompt block was written")

    done = run_with_arrivals(eng, {0: [ServeRequest("A", prompt, 16)], 2: [ServeRequest("B", prompt, 24)]}, after_step)
    assert helpers.outputs(done) == {"A": reference[:16], "B": reference}
    assert shared and drafter.branched() > 0 and helpers.all_free(eng)


def test_draft_commit_path_moves_the_fed_path_nodes_next_to_the_prefix(target, draft, batch):
    """ModelDrafter: the accepted path's fed nodes are copied byte for byte to the positions after the
    prefix, the rest of the tree's draft blocks are freed, and the next tree is the one a fresh draft grows."""
    tree = TreeConfig(kind="dynamic", max_nodes=8, top_k=4)
    drafter = helpers.model_drafter(draft, GreedyChooser(), num_blocks=40).variant(None, tree)
    prompt = batch[2]
    seq = new_sequence(
        ServeRequest("0", prompt, MAX_NEW), BlockTable(BlockAllocator(1, BLOCK)), 0, helpers.default_rule()
    )
    seq.tokens.append(helpers.baseline_outputs(target, [prompt], 1)["0"][0])  # decoding: the pending token
    (grown,) = drafter.propose([seq], [Budget(8, GAMMA)])
    state = drafter._states[id(seq)]
    last_fed = max(node for node, slot in enumerate(state.tree_slots) if slot is not None)
    path, prefix = grown.path_to(last_fed), len(seq.tokens)
    fed = [state.tree_slots[node] for node in path]  # draft positions of the path's nodes
    assert len(path) >= 2 and fed != list(range(prefix, prefix + len(path))), "the path must need moving"
    before = _stored(drafter.pool, state.table.slots_at(fed))
    drafter.commit(seq, prefix, path)
    assert state.num_computed == prefix + len(path)
    _same_bits(_stored(drafter.pool, state.table.slots(prefix, prefix + len(path))), before, "moved draft KV")
    assert len(state.table.blocks) == state.table.blocks_for(state.num_computed), "the rest of the tree kept blocks"
    seq.tokens += [grown.token_ids[node] for node in path] + [7]  # the path and a correction token
    fresh = new_sequence(
        ServeRequest("1", prompt, MAX_NEW), BlockTable(BlockAllocator(1, BLOCK)), 0, helpers.default_rule()
    )
    fresh.tokens = list(seq.tokens)
    other = helpers.model_drafter(draft, GreedyChooser(), num_blocks=40).variant(None, tree)
    assert drafter.propose([seq], [Budget(8, GAMMA)]) == other.propose([fresh], [Budget(8, GAMMA)])
    drafter.release(seq)
    assert drafter.kv_bytes() == 0


# ---- 3. greedy exactness ---------------------------------------------------------------------------

TREES = {
    "static-321": (TreeConfig(kind="static", branching=(3, 2, 1), max_nodes=8), "model"),
    "static-222": (TreeConfig(kind="static", branching=(2, 2, 2), max_nodes=8), "model"),
    "dynamic-4-2": (TreeConfig(kind="dynamic", max_nodes=4, top_k=2), "model"),
    "dynamic-8-3": (TreeConfig(kind="dynamic", max_nodes=8, top_k=3), "model"),
    "ngram-trie": (TreeConfig(kind="dynamic", max_nodes=8), "ngram"),
    "suffix-tree": (TreeConfig(kind="dynamic", max_nodes=8), "suffix"),
    "static-111": (TreeConfig(kind="static", branching=(1, 1, 1), max_nodes=4), "model"),  # chains: go as chains
}


def _drafter(kind: str, draft, tree: TreeConfig, num_blocks: int = 200, chooser=None):
    """A recorded drafter growing ``tree`` (γ = GAMMA): n-gram tries over the small vocabulary, or the draft model."""
    if kind == "ngram":
        return Recorded(NgramDrafter(3, 1, SMALL_VOCAB, chooser is not None, tree))
    if kind == "suffix":
        return Recorded(SuffixDrafter(SuffixSettings(min_match=1), SMALL_VOCAB, chooser is not None, tree))
    model = helpers.model_drafter(draft, chooser or GreedyChooser(), num_blocks=num_blocks)
    return Recorded(model.variant(None, tree))


def _lengths(batch) -> list[int]:
    return [MAX_NEW - 3 * i for i in range(len(batch))]  # the room caps depths differently near each end


@pytest.mark.parametrize("invariant", [False, True], ids=["padded", "invariant"])
@pytest.mark.parametrize("name", TREES)
def test_tree_batch_equals_batch1_target_alone(target, draft, batch, references, small, name, invariant):
    tree, kind = TREES[name]
    if kind in ("ngram", "suffix"):
        target, batch, references = small
    drafter = _drafter(kind, draft, tree)
    eng = tree_engine(target, drafter, invariant=invariant)
    lengths = _lengths(batch)
    done = helpers.run(eng, [ServeRequest(str(i), p, n) for i, (p, n) in enumerate(zip(batch, lengths, strict=True))])
    assert helpers.outputs(done) == {rid: ids[: lengths[int(rid)]] for rid, ids in references.items()}
    assert max(max(r.batch_sizes) for r in done.values()) == len(batch), "the requests never ran together"
    chains = max(tree.branching) == 1 and tree.kind == "static"
    assert (drafter.branched() == 0) if chains else (drafter.branched() > 0), "trees of the wrong shape"
    assert max(len(t) for _, t in drafter.trees) <= tree.max_nodes
    assert sum(r.accepted_tokens for r in done.values()) > 0
    assert helpers.all_free(eng) and drafter.kv_bytes() == 0, "KV left behind (target or draft)"


@pytest.mark.parametrize("concurrency", [1, 4, 7])
@pytest.mark.parametrize("name", ["static-222", "dynamic-8-3"])
def test_model_trees_grow_depth_by_depth_across_the_batch(target, draft, batch, references, name, concurrency):
    """A step's trees cost one draft forward per depth however many sequences grow one (the catch-up of every
    sequence, then one forward per fed depth holding every tree's nodes of that depth), and the outputs equal the
    target alone's at concurrency 1, 4 and 7."""
    tree, _ = TREES[name]
    drafter = _drafter("model", draft, tree, num_blocks=400)
    inner = drafter.inner
    forwards: list[list[int]] = []  # per propose: the tree segments of each draft forward (0: the catch-up)
    backlogs: list[int] = []  # rows of the forwards that feed a backlog apart (no logits: upkeep, not drafting)
    forward, propose = inner.runner.forward, inner.propose

    def counted_forward(step):
        if len(step.logit_rows) == 0:
            backlogs.append(len(step.token_ids))
        else:
            forwards[-1].append(sum(visible is not None for visible in step.visible))
        return forward(step)

    def counted_propose(seqs, budgets):
        forwards.append([])
        return propose(seqs, budgets)

    inner.runner.forward, inner.propose = counted_forward, counted_propose
    prompts = (batch + batch)[:7]
    eng = tree_engine(target, drafter, invariant=False, max_num_seqs=concurrency, num_blocks=400)
    done = helpers.run(eng, [ServeRequest(str(i), p, MAX_NEW) for i, p in enumerate(prompts)])
    expected = {str(i): references[str(i % len(batch))] for i in range(len(prompts))}
    assert helpers.outputs(done) == expected
    depth = draft_depth(SpeculateConfig(gamma=GAMMA, tree=tree))
    assert all(len(calls) <= depth for calls in forwards)  # the catch-up, then depth - 1 fed depths at most
    assert all(calls[0] == 0 for calls in forwards if calls)  # the catch-up is a causal chain per sequence
    together = max(max(calls[1:], default=0) for calls in forwards)
    assert together <= 1 if concurrency == 1 else together > 1, together  # several sequences' trees in one forward
    assert sum(backlogs) == inner.upkeep().rows
    assert helpers.all_free(eng) and drafter.kv_bytes() == 0


def test_trees_stay_exact_when_the_draft_pool_or_the_target_pool_is_nearly_full(target, draft, batch, references):
    """Some sequences get no tree (empty: plain decode: the draft pool cannot hold their budget) and the target
    preempts; outputs unchanged."""
    tree, _ = TREES["dynamic-8-3"]
    drafter = _drafter("model", draft, tree, num_blocks=10)
    eng = tree_engine(target, drafter, invariant=False, num_blocks=16)
    lengths = _lengths(batch)
    done = helpers.run(eng, [ServeRequest(str(i), p, n) for i, (p, n) in enumerate(zip(batch, lengths, strict=True))])
    assert helpers.outputs(done) == {rid: ids[: lengths[int(rid)]] for rid, ids in references.items()}
    assert any(budget.nodes > 0 and not len(t) for budget, t in drafter.trees), "every sequence got a tree"
    assert drafter.branched() > 0
    assert sum(r.preemptions for r in done.values()) > 0, "the target pool never ran out"
    assert helpers.all_free(eng) and drafter.kv_bytes() == 0


def test_a_tree_that_outgrows_the_draft_pool_stops_growing(target, draft, batch, references, monkeypatch):
    """A deeper level that no longer fits the draft pool stops that tree: the nodes grown so far are its proposal
    (they need no KV of their own), the output stays exact and the draft KV follows the verified tokens: forced by
    reserving nothing beyond the verified tokens' blocks."""
    tree, _ = TREES["static-222"]
    drafter = _drafter("model", draft, tree, num_blocks=12)
    inner = drafter.inner

    def fits_tokens_only(seq, budget):
        table = inner._state(seq).table
        if table.missing(len(seq.tokens)) > inner.allocator.num_free:
            return False
        table.ensure(len(seq.tokens))
        hogged.extend(inner.allocator.allocate() for _ in range(inner.allocator.num_free))  # the rest goes elsewhere
        return True

    hogged: list[int] = []

    monkeypatch.setattr(inner, "_fits", fits_tokens_only)
    eng = tree_engine(target, drafter, invariant=False)
    done = helpers.run(eng, [ServeRequest("0", batch[0], MAX_NEW)])
    assert helpers.outputs(done) == {"0": references["0"][:MAX_NEW]}
    grown = [t for _, t in drafter.trees if len(t)]
    assert grown, "no tree was proposed"
    # A level fits only in the slots left in the last verified block: where none are left, the tree is its first
    # level (from the catch-up's logits, never fed).
    assert any(max(t.depths()) == 1 and len(t) == tree.branching[0] for t in grown)
    for block in hogged:
        inner.allocator.free(block)
    assert helpers.all_free(eng) and drafter.kv_bytes() == 0


def test_small_token_budget_mixes_trees_plain_decodes_and_prefill_chunks(target, draft, references, batch):
    tree, _ = TREES["dynamic-4-2"]
    drafter = _drafter("model", draft, tree)
    eng = tree_engine(target, drafter, invariant=False, max_num_tokens=14, max_draft_tokens=6)
    kinds = []
    original_forward = eng._forward

    def forward(works, proposals):
        step = set()
        for work, proposal in zip(works, proposals, strict=True):
            seq = work.seq
            if seq.num_computed + work.feed < len(seq.tokens):
                step.add("prefill")
            elif not len(proposal):
                step.add("plain")
            else:
                step.add("chain" if proposal.is_chain() else "tree")
        kinds.append(step)
        return original_forward(works, proposals)

    eng._forward = forward
    requests = helpers.requests(batch, MAX_NEW)
    done = run_with_arrivals(eng, {0: requests[:3], 3: requests[3:]})
    assert helpers.outputs(done) == references
    assert any({"tree", "plain", "prefill"} <= step for step in kinds), f"no step mixed all kinds: {kinds}"


class OracleTreeDrafter(helpers.StatelessDrafter):
    """Trees whose second child at every depth is the target's own continuation (known in advance), the first
    a decoy: the accepted path runs through non-first children and past any stop token in it."""

    name = "oracle"

    def __init__(self, continuations: dict[str, list[int]], tree: TreeConfig) -> None:
        self.continuations = continuations  # request id -> prompt + target tokens
        self.tree = tree

    def propose(self, seqs, budgets):
        out = []
        for seq, budget in zip(seqs, budgets, strict=True):
            depth = budget.depth
            truth = self.continuations[seq.request.request_id][len(seq.tokens) : len(seq.tokens) + depth]
            token_ids, parents, parent = [], [], -1
            for token in truth:
                token_ids += [3 + (token + 1) % (VOCAB - 3), token]  # decoy first, then the truth
                parents += [parent, parent]
                parent = len(token_ids) - 1
            out.append(TokenTree(token_ids, parents).truncated(budget.nodes))
        return out

    def commit(self, seq, num_prefix, path) -> None:
        pass

    def describe_tree(self) -> str:
        return self.tree.describe()


@pytest.mark.parametrize("invariant", [False, True], ids=["padded", "invariant"])
def test_a_stop_token_inside_an_accepted_path_ends_the_request_there(target, batch, invariant):
    long = {str(i): p + alone_greedy(target, list(p), MAX_NEW) for i, p in enumerate(batch)}
    first = long["0"][len(batch[0]) :]
    # A stop token mid-output; rounds accepting every node emit outputs [1 + 5r, 5 + 5r]: not the path's last.
    stop = next(t for i, t in enumerate(first) if i % (GAMMA + 1) in (1, 2) and i > 1 and t not in first[:i])
    expected = {str(i): alone_greedy(target, list(p), MAX_NEW, frozenset({stop})) for i, p in enumerate(batch)}
    assert expected["0"][-1] == stop and len(expected["0"]) < MAX_NEW
    tree = TreeConfig(kind="dynamic", max_nodes=12)
    eng = tree_engine(target, OracleTreeDrafter(long, tree), invariant=invariant, eos_ids=frozenset({stop}))
    paths = []
    original = eng.tree_verifier.verify_tree

    def verify_tree(token_ids, parents, *args):
        result = original(token_ids, parents, *args)
        paths.append([token_ids[node] for node in result.path])
        return result

    eng.tree_verifier.verify_tree = verify_tree
    done = helpers.run(eng, helpers.requests(batch, MAX_NEW))
    assert helpers.outputs(done) == expected
    assert any(stop in ids[:-1] for ids in paths), "the stop token was never inside an accepted path"
    assert helpers.all_free(eng)


def test_int8_target_kv_with_trees_equals_batch1_target_alone_at_int8(target, draft, batch):
    tree, _ = TREES["static-321"]
    drafter = _drafter("model", draft, tree)
    eng = tree_engine(target, drafter, invariant=True, kv="int8")
    done = helpers.run(eng, helpers.requests(batch, MAX_NEW))
    assert helpers.outputs(done) == helpers.baseline_outputs(target, batch, MAX_NEW, "int8")  # the same format
    assert drafter.branched() > 0 and helpers.all_free(eng)


# ---- 4. sampling ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["model", "ngram"])
def test_sampled_trees_are_reproducible_and_independent_of_concurrency(target, draft, batch, small, kind):
    tree = TreeConfig(kind="static", branching=(3, 2, 1), max_nodes=8)
    if kind == "ngram":
        target, batch, _ = small
    requests = helpers.requests(batch[:4], 12, seed=7)

    def make(invariant: bool):
        drafter = _drafter(kind, draft, tree, chooser=RandomChooser(SAMPLING))
        verifier = StochasticVerifier(SAMPLING)
        return tree_engine(target, drafter, invariant=invariant, verifier=verifier, stochastic=True), drafter

    for invariant in (False, True):
        eng, drafter = make(invariant)
        first = helpers.outputs(helpers.run(eng, requests))
        assert helpers.all_free(eng) and drafter.kv_bytes() == 0
        assert helpers.outputs(helpers.run(make(invariant)[0], requests)) == first, "not reproducible per seed"
        assert drafter.branched() > 0, "no sampled tree had a branch"
        if invariant:  # no row depends on the others: each request's draws depend on its seed alone
            assert helpers.alone(make(True)[0], requests) == first
