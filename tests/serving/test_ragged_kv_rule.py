"""The KV-commit rule under batching (DESIGN §2, §6): verified is not committed, rejected is never read.

A batch of sequences runs through the real :class:`ContinuousEngine` and ragged forwards, with a
scripted drafter (random k_i per sequence per step, random tokens) and a scripted verifier (a random
number of accepted drafts, a random correction/bonus token). After every commit each running
sequence's stored KV fields of positions [0, num_computed) are snapshotted; at the end they must equal,
bit for bit, the KV a fresh pool gets when only the sequence's committed tokens are fed to the target
alone. The logits the verifier saw for every committed position must equal the target-alone logits
there too (a stale rejected slot read by attention would change them). Both hold in batch-invariant
mode, where no row depends on the others; it is checked for every KV precision. Along the way the
block bookkeeping is checked every step: each block's reference count equals the number of running
tables that hold it (a shared prefix block is never freed while referenced, and nothing leaks).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from spectoolkit.config import SamplingConfig
from spectoolkit.drafting import TokenTree
from spectoolkit.drafting.base import Drafter
from spectoolkit.precisions import KV_PRECISIONS
from spectoolkit.runtime.blocks import BlockAllocator, BlockTable
from spectoolkit.runtime.paged_kv import KINDS, make_pool
from spectoolkit.runtime.step import Segment
from spectoolkit.serving.api import ServeRequest
from spectoolkit.verify.base import VerifyResult
from tests.serving import helpers
from tests.serving.helpers import BLOCK, EOS, VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")
GAMMA = 4


class ScriptedDrafter(Drafter):
    """Random proposals: k_i uniform in [0, budget] of random non-EOS tokens (greedy: no q)."""

    name = "scripted"
    tree = None  # chains

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.released: list[str] = []

    def propose(self, seqs, budgets):
        lengths = [self.rng.randint(0, min(b.nodes, b.depth)) for b in budgets]
        return [TokenTree.chain([self.rng.randrange(3, VOCAB) for _ in range(k)]) for k in lengths]

    def commit(self, seq, num_prefix: int, path: list[int]) -> None:
        assert num_prefix + len(path) == seq.num_computed

    def release(self, seq) -> None:
        self.released.append(seq.request.request_id)

    def reset(self) -> None:
        pass

    def kv_bytes(self) -> int:
        return 0


class ScriptedVerifier:
    """Accepts a random number of drafts (all, none or some) and emits a random non-EOS token."""

    sampling = SamplingConfig(temperature=0.0)

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def select(self, logits, generator=None) -> int:
        return self.rng.randrange(3, VOCAB)

    def verify(self, draft_ids, target_logits, draft_probs=None, generator=None) -> VerifyResult:
        gamma = draft_ids.shape[0]
        accepted = self.rng.choice([0, gamma, self.rng.randint(0, gamma)])
        return VerifyResult(accepted, self.rng.randrange(3, VOCAB))


def _stored(pool, table: BlockTable, length: int) -> list[dict[str, torch.Tensor]]:
    """[layer x kind] raw stored fields of positions [0, length) of ``table``."""
    slots = torch.tensor(table.slots(0, length), dtype=torch.long)
    return [pool.stored(layer, kind, slots) for layer in range(len(pool.layers)) for kind in KINDS]


def _assert_same_bits(got: list[dict], expected: list[dict], what: str) -> None:
    for index, (first, second) in enumerate(zip(got, expected, strict=True)):
        helpers.assert_same_bits(first, second, f"{what}, layer/kind {index} vs the target-alone KV")


class _Reference:
    """The target alone over a sequence's committed tokens, in a fresh pool of the same precision."""

    def __init__(self, model, precision: str, tokens: list[int]) -> None:
        blocks = -(-len(tokens) // BLOCK)
        self.pool = make_pool(model, precision, blocks * BLOCK)
        self.table = BlockTable(BlockAllocator(blocks, BLOCK))
        self.table.ensure(len(tokens))
        segment = Segment(self.table, tokens, 0, list(range(len(tokens))))
        self.logits = helpers.paged_forward(model, self.pool, [segment], invariant=True)  # [L, V]

    def kv(self, length: int) -> list[dict[str, torch.Tensor]]:
        return _stored(self.pool, self.table, length)


def _check_blocks(eng) -> None:
    """Every block's refcount == the running tables holding it; no other block is referenced."""
    holders = Counter(block for seq in eng.scheduler.running for block in seq.table.blocks)
    allocator = eng.allocator
    for block in range(allocator.num_blocks):
        assert allocator.refcount(block) == holders[block], f"block {block}: refcount vs holders"
    for seq in eng.scheduler.running:
        table = seq.table
        assert len(table.blocks) == max(table.blocks_for(seq.num_computed), table.published), "blocks past KV kept"
        if seq.decoding:
            assert seq.num_computed == len(seq.tokens) - 1, "the pending token must have no KV"


@pytest.fixture(scope="module")
def target():
    model = helpers.tiny()
    return model


def _run(target, precision: str, seed: int):
    """Drive the engine; returns (final tokens by id, KV snapshots, verifier-row records, results by id)."""
    drafter, verifier = ScriptedDrafter(seed), ScriptedVerifier(seed + 1)
    eng = helpers.engine(target, gamma=GAMMA, drafter=drafter, verifier=verifier, num_blocks=64, max_num_tokens=24,
                         kv=precision, invariant=True)  # fmt: skip
    shared_prompt = helpers.prompts((10,), seed=seed)[0]  # 25 tokens: 3 full blocks
    gen = torch.Generator().manual_seed(seed)
    others = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 17, 30)]
    arrivals = {  # step -> requests submitted before it
        0: [ServeRequest("A", shared_prompt, 6), ServeRequest("x0", others[0], 14), ServeRequest("x1", others[1], 12)],
        2: [ServeRequest("B", shared_prompt, 20)],  # shares A's published prompt blocks
        5: [ServeRequest("x2", others[2], 10)],  # allocates (and writes) after A has finished
    }
    prompts = {r.request_id: r.prompt_ids for batch in arrivals.values() for r in batch}
    snapshots, rows_seen, done = [], [], {}
    original_commit = eng._commit

    def commit(seq, work, proposal, rows, now, states=None):
        before = len(seq.tokens)
        result = original_commit(seq, work, proposal, rows, now, states)
        accepted = seq.num_computed - before
        rows_seen.append((seq.request.request_id, before - 1, rows[: accepted + 1].clone()))
        return result

    eng._commit = commit
    shared, outlived, beside = None, False, False  # B's blocks from A; B ran on them after A left; x2 beside B
    for step in range(200):
        for request in arrivals.get(step, []):
            eng.submit(request)
        if not eng.has_work() and step > max(arrivals):
            break
        for result in eng.step():
            done[result.request_id] = result
        _check_blocks(eng)
        running = {seq.request.request_id: seq for seq in eng.scheduler.running}
        if "B" in running and shared is None:
            b_seq, a_seq = running["B"], running["A"]
            assert b_seq.table.published == 3 and b_seq.table.blocks[:3] == a_seq.table.blocks[:3], "no sharing"
            shared = b_seq.table.blocks[:3]
        if "B" in running and "A" in done:
            outlived = True
            assert [eng.allocator.refcount(block) for block in shared] == [1, 1, 1]  # A's release dropped one each
            assert running["B"].table.blocks[:3] == shared
        if "x2" in running:
            assert not set(running["x2"].table.blocks) & set(shared), "a block still shared was handed out again"
            beside = beside or "B" in running
        for rid, seq in running.items():
            snapshots.append((rid, seq.num_computed, _stored(eng.pool, seq.table, seq.num_computed)))
    assert set(done) == set(prompts) and all(r.error is None for r in done.values())
    assert outlived and beside and "A" in drafter.released and done["A"].finish < done["x2"].finish
    tokens = {rid: prompts[rid] + done[rid].output_ids for rid in done}
    assert helpers.all_free(eng)
    return tokens, snapshots, rows_seen, done


@pytest.mark.parametrize("precision", KV_PRECISIONS)
def test_committed_kv_equals_target_alone_kv_after_every_commit(target, precision):
    tokens, snapshots, rows_seen, done = _run(target, precision, seed=11)
    accepted = [length for r in done.values() for length in r.accept_lengths]
    drafted = [length for r in done.values() for length in r.draft_lengths]
    rounds = list(zip(accepted, drafted, strict=True))
    assert any(a == 0 < d for a, d in rounds), "the script must reject every draft in some round"
    assert any(0 < a < d for a, d in rounds), "the script must accept some drafts in some round"
    assert any(a == d > 0 for a, d in rounds), "the script must accept all drafts in some round"
    assert len(set(drafted)) > 2, "k_i must differ between sequences and steps"
    references = {rid: _Reference(target, precision, ids[:-1]) for rid, ids in tokens.items()}
    for rid, length, stored in snapshots:
        _assert_same_bits(stored, references[rid].kv(length), f"{precision} {rid} at num_computed={length}")
    for rid, position, rows in rows_seen:
        expected = references[rid].logits[position : position + len(rows)]
        assert torch.equal(rows, expected), f"{precision} {rid}: verify logits at {position} differ from target alone"


def test_rejected_candidates_leave_nothing_behind_in_a_direct_ragged_forward(target):
    """Two sequences in one ragged forward: candidates written then rejected (length reset) and overwritten
    by other tokens give the same KV and logits as a sequence that never saw them."""
    gen = torch.Generator().manual_seed(5)
    first, second = (torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (9, 14))
    pool = make_pool(target, "int8", 16 * BLOCK)
    allocator = BlockAllocator(16, BLOCK)
    tables = [BlockTable(allocator), BlockTable(allocator)]
    for table, ids in zip(tables, (first, second), strict=True):
        table.ensure(len(ids) + 6)
    prefill = [Segment(tables[0], first, 0, [8]), Segment(tables[1], second, 0, [13])]
    helpers.paged_forward(target, pool, prefill, invariant=True)
    rejected = [Segment(tables[0], [7, 8, 9, 10, 11], 9, [0]), Segment(tables[1], [EOS + 1, 40], 14, [1])]
    helpers.paged_forward(target, pool, rejected, invariant=True)  # both rejected entirely: lengths stay 9 and 14
    kept = [Segment(tables[0], [100, 101], 9, [0, 1]), Segment(tables[1], [200], 14, [0])]
    logits = helpers.paged_forward(target, pool, kept, invariant=True)  # [3, V]
    for index, (table, ids, new) in enumerate(zip(tables, (first, second), ([100, 101], [200]), strict=True)):
        reference = _Reference(target, "int8", ids + new)
        _assert_same_bits(_stored(pool, table, len(ids) + len(new)), reference.kv(len(ids) + len(new)), f"seq {index}")
        rows = logits[:2] if index == 0 else logits[2:]
        assert torch.equal(rows, reference.logits[len(ids) :]), f"seq {index}: logits read a rejected slot"
    assert allocator.refcount(tables[0].blocks[0]) == 1
