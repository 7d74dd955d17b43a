"""The continuous-batching scheduler through the engine on a tiny model (spectoolkit.serving.scheduler).

Budgets (tokens, KV slots, drafts, speculation under load) are checked on every step's StepStats;
preemption by recompute must not change a greedy output; admission is first come first served with
no starvation; a request that cannot run, or whose logits are not finite, fails alone.
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.drafting import NgramDrafter
from spectoolkit.serving.api import ServeRequest
from spectoolkit.serving.engine import finite_rows
from tests.serving import helpers
from tests.serving.helpers import BLOCK, VOCAB, StepLog

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NEW = 16


@pytest.fixture(scope="module")
def target():
    return helpers.tiny()


def _ngram() -> NgramDrafter:
    return NgramDrafter(3, 1, VOCAB, one_hot_probs=False)


def _logged(eng) -> StepLog:
    log = StepLog()
    eng.on_step = log
    return log


@pytest.fixture(scope="module")
def batch():
    return helpers.prompts((5, 13, 21, 40, 7, 9))  # 15..85 tokens


@pytest.fixture(scope="module")
def references(target, batch):
    return helpers.baseline_outputs(target, batch, MAX_NEW)


def test_token_and_kv_budgets_hold_every_step(target, batch, references):
    eng = helpers.engine(target, gamma=4, drafter=_ngram(), num_blocks=40, max_num_tokens=16)
    log = _logged(eng)
    assert helpers.outputs(helpers.run(eng, helpers.requests(batch, MAX_NEW))) == references
    capacity = eng.allocator.num_blocks * BLOCK
    assert log.steps and all(s.num_tokens <= 16 for s in log.steps)
    assert all(s.used_kv_tokens <= capacity for s in log.steps)
    assert any(s.prefill_tokens > 0 and s.draft_tokens > 0 for s in log.steps), "drafts and prefill never mixed"
    assert max(s.num_tokens for s in log.steps) == 16, "the budget was never the binding limit"
    assert helpers.all_free(eng)


def test_speculation_stops_above_spec_max_batch(target, batch, references):
    limit = 2  # a lookup asked after the plan: the plan's drafts are counted whether or not it finds a match
    drafter = helpers.NgramAfterPlan(3, 1, VOCAB, one_hot_probs=False)
    eng = helpers.engine(target, gamma=4, drafter=drafter, spec_max_batch=limit)
    schedule, running = eng.scheduler.schedule, []

    def recorded(on_preempt):
        plan = schedule(on_preempt)
        running.append(len(eng.scheduler.running))  # no preemption here (large pool): the count it planned for
        return plan

    eng.scheduler.schedule = recorded
    log = _logged(eng)
    lengths = {str(i): 4 + 2 * i for i in range(len(batch))}  # staggered ends: the batch shrinks below the limit
    requests = [ServeRequest(rid, batch[int(rid)], n) for rid, n in lengths.items()]
    expected = {rid: references[rid][: lengths[rid]] for rid in lengths}
    assert helpers.outputs(helpers.run(eng, requests)) == expected
    assert len(running) == len(log.steps)
    for count, stats in zip(running, log.steps, strict=True):
        if count > limit:
            assert not stats.speculating and stats.draft_tokens == 0, f"speculated with {count} running"
        else:
            assert stats.speculating
    assert any(c > limit for c in running), "the limit was never exceeded"
    assert any(s.draft_tokens > 0 for s in log.steps), "nothing was ever drafted at or below the limit"


def test_max_draft_tokens_caps_each_step(target, batch, references):
    eng = helpers.engine(target, gamma=4, drafter=_ngram(), max_draft_tokens=3)
    log = _logged(eng)
    assert helpers.outputs(helpers.run(eng, helpers.requests(batch, MAX_NEW))) == references
    assert all(s.draft_tokens <= 3 for s in log.steps)
    assert any(s.draft_tokens == 3 for s in log.steps), "the cap was never reached"
    assert sum(s.draft_tokens for s in log.steps) > 0


def test_a_lookup_is_planned_within_what_it_proposed(target, batch, references):
    """A lookup proposes before the policy chooses: every step reserves exactly the candidates it verifies. Asked
    after the plan, the same lookup leaves reserved candidates unproposed (the test's guard that it can fail)."""
    unproposed = {}
    for drafter in (_ngram(), helpers.NgramAfterPlan(3, 1, VOCAB, one_hot_probs=False)):
        eng = helpers.engine(target, gamma=4, drafter=drafter)
        log = _logged(eng)
        assert helpers.outputs(helpers.run(eng, helpers.requests(batch, MAX_NEW))) == references
        assert sum(sum(s.drafted) for s in log.steps) > 0
        unproposed[drafter.ahead] = sum(s.draft_tokens - sum(s.drafted) for s in log.steps)
    assert unproposed[True] == 0 < unproposed[False]


@pytest.mark.parametrize("gamma", [0, 3])
def test_preemption_by_recompute_keeps_outputs(target, batch, gamma):
    requests = helpers.requests(batch, 24)
    drafter = _ngram() if gamma else None
    large = helpers.engine(target, gamma=gamma, drafter=drafter, num_blocks=200, invariant=True)
    expected = helpers.outputs(helpers.run(large, requests))
    small = helpers.engine(target, gamma=gamma, drafter=_ngram() if gamma else None, num_blocks=20, invariant=True)
    log = _logged(small)
    done = helpers.run(small, helpers.requests(batch, 24))
    assert sum(r.preemptions for r in done.values()) > 0, "the small pool never preempted"
    assert helpers.outputs(done) == expected
    assert all(s.used_kv_tokens <= 20 * BLOCK for s in log.steps)
    assert helpers.all_free(small)


def test_closed_loop_admits_first_come_first_served_without_starvation(target):
    clients, total, max_seqs = 5, 14, 3
    pool = helpers.prompts(tuple(3 + (7 * i) % 23 for i in range(total)), seed=7)
    eng = helpers.engine(target, gamma=3, drafter=_ngram(), max_num_seqs=max_seqs)
    submitted, first_running, done = [], {}, {}

    def submit_next():
        index = len(submitted)
        eng.submit(ServeRequest(f"r{index:02d}", pool[index], 6 + index % 5))
        submitted.append(f"r{index:02d}")

    for _ in range(clients):
        submit_next()
    for step in range(2000):
        if not eng.has_work():
            break
        finished = eng.step()
        assert len(eng.scheduler.running) <= max_seqs
        for seq in eng.scheduler.running:
            first_running.setdefault(seq.request.request_id, step)
        for result in finished:
            first_running.setdefault(result.request_id, step)
            done[result.request_id] = result
            if len(submitted) < total:
                submit_next()  # a client sends its next request when the previous one ends
    assert sorted(done) == submitted, "some request never finished"
    expected = helpers.baseline_outputs(target, pool, 10)  # greedy: a shorter max_new gives a prefix
    assert {rid: r.output_ids for rid, r in done.items()} == {
        f"r{int(i):02d}": ids[: 6 + int(i) % 5] for i, ids in expected.items()
    }
    order = [first_running[rid] for rid in submitted]
    assert order == sorted(order), f"admission is not FCFS: {order}"
    assert any(r.scheduled - r.arrival > 0 for r in done.values()), "nobody ever waited: not more requests than seqs"
    assert helpers.all_free(eng)


def test_request_too_long_for_the_pool_fails_alone(target, batch, references):
    eng = helpers.engine(target, gamma=4, drafter=_ngram(), num_blocks=14)  # 112 slots
    requests = helpers.requests(batch[:3], MAX_NEW) + [ServeRequest("long", list(range(3, 103)), 20)]
    done = helpers.run(eng, requests)
    assert "serve.max_kv_tokens" in done["long"].error and done["long"].output_ids == []
    assert {rid: done[rid].output_ids for rid in "012"} == {rid: references[rid] for rid in "012"}
    assert all(done[rid].error is None for rid in "012")


@pytest.mark.parametrize(
    "prompt, max_new, message",
    [([], 4, "empty prompt"), ([5, VOCAB, 7], 4, "outside the vocabulary"), ([5, -1], 4, "outside the vocabulary"),
     ([5, 6], 0, "max_new_tokens"), ([5] * 1020, 8, "context")],
)  # fmt: skip
def test_unusable_request_fails_alone(target, batch, references, prompt, max_new, message):
    eng = helpers.engine(target, gamma=2, drafter=_ngram(), num_blocks=400)
    requests = [*helpers.requests(batch[:2], MAX_NEW), ServeRequest("bad", prompt, max_new)]
    done = helpers.run(eng, requests)
    assert message in done["bad"].error
    assert {rid: done[rid].output_ids for rid in "01"} == {rid: references[rid] for rid in "01"}
    assert helpers.all_free(eng)


def test_finite_rows_is_isfinite_all_per_row():
    """The step's one check: a NaN, an inf of either sign, or both in a row make it non-finite; finite values whose
    fp32 sum overflows (a sum alone would call them non-finite) do not."""
    logits = torch.randn(7, 1000)
    logits[1, 3] = float("nan")
    logits[2, 999] = float("inf")
    logits[3, 0] = -float("inf")
    logits[4, 5], logits[4, 6] = float("inf"), -float("inf")
    logits[5, :4] = 3e38  # finite, sums to inf
    logits[6, :2] = torch.tensor([3e38, -3e38])
    expected = torch.isfinite(logits).all(dim=-1).tolist()
    assert expected == [True, False, False, False, False, True, True]
    assert finite_rows(logits) == expected
    assert finite_rows(logits.to(torch.bfloat16)) == expected


@pytest.mark.parametrize("after_tokens", [0, 5])
def test_non_finite_logits_fail_that_request_alone(target, batch, references, after_tokens):
    eng = helpers.engine(target, gamma=3, drafter=_ngram())
    forward = eng._forward

    def poisoned(works, proposals):
        logits, states, firsts = forward(works, proposals)
        logits = logits.clone()  # [R, V]
        row = 0
        for work, proposal in zip(works, proposals, strict=True):
            seq = work.seq
            if seq.num_computed + work.feed != len(seq.tokens):
                continue  # a prefill chunk: no rows
            width = 1 + len(proposal)
            if seq.request.request_id == "1" and len(seq.output_ids) >= after_tokens:
                logits[row + width - 1] = float("nan")  # only its last row: a partial NaN is caught too
            row += width
        return logits, states, firsts

    eng._forward = poisoned
    done = helpers.run(eng, helpers.requests(batch[:4], MAX_NEW))
    assert "non-finite" in done["1"].error
    assert done["1"].output_ids == references["1"][: len(done["1"].output_ids)]
    assert len(done["1"].output_ids) == after_tokens
    assert {rid: done[rid].output_ids for rid in "023"} == {rid: references[rid] for rid in "023"}
    assert helpers.all_free(eng)


def test_identical_prompts_share_prefix_blocks_and_match(target, references, batch):
    """A request arriving after an identical one shares its published prompt blocks and decodes the same."""
    eng = helpers.engine(target, gamma=3, drafter=_ngram())
    prompt = batch[3]  # 85 tokens: 10 full blocks
    eng.submit(ServeRequest("first", prompt, MAX_NEW))
    eng.step()
    eng.step()  # 64 + 21 prompt tokens: its prefill spans two steps
    eng.submit(ServeRequest("second", prompt, MAX_NEW))
    eng.scheduler._admit()
    second = next(s for s in eng.scheduler.running if s.request.request_id == "second")
    assert second.num_computed == (len(prompt) - 1) // BLOCK * BLOCK
    shared = second.table.blocks[:]
    assert all(eng.allocator.refcount(b) == 2 for b in shared)
    done = {}
    while eng.has_work():
        done.update({r.request_id: r for r in eng.step()})
    assert done["first"].output_ids == done["second"].output_ids == references["3"]
    assert helpers.all_free(eng)


def test_reset_mid_run_drops_everything(target, batch, references):
    eng = helpers.engine(target, gamma=3, drafter=_ngram())
    for request in helpers.requests(batch, MAX_NEW):
        eng.submit(request)
    for _ in range(3):
        eng.step()
    assert eng.has_work() and not helpers.all_free(eng)
    eng.reset()
    assert not eng.has_work() and helpers.all_free(eng)
    assert helpers.outputs(helpers.run(eng, helpers.requests(batch, MAX_NEW))) == references


def test_queued_request_holding_shared_prefix_blocks_does_not_deadlock(target):
    eng = helpers.engine(target, num_blocks=8, max_num_tokens=256)  # 64 slots
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, VOCAB, (16,), generator=gen).tolist()  # two full blocks
    eng.submit(ServeRequest("S", shared, 4))  # 3 blocks
    eng.submit(ServeRequest("L", torch.randint(3, VOCAB, (30,), generator=gen).tolist(), 33))  # grows to 8 blocks
    eng.step()  # S publishes its two prompt blocks
    # A shares S's two blocks, needs 3 more while 1 is free: it waits in the queue, holding the two.
    eng.submit(ServeRequest("A", shared + torch.randint(3, VOCAB, (20,), generator=gen).tolist(), 2))
    done = {}
    for _ in range(400):
        if not eng.has_work():
            break
        done.update({r.request_id: r for r in eng.step()})
    # L preempts itself when it needs its 7th block; A, waiting, must not hold the blocks L needs back
    assert sorted(done) == ["A", "L", "S"], f"stuck: queue {[s.request.request_id for s in eng.scheduler.queue]}"


@pytest.mark.parametrize("prompt_len, budget", [(9, 4), (1, 64)])
def test_prefill_tokens_count_every_prompt_token(target, prompt_len, budget):
    eng = helpers.engine(target, max_num_tokens=budget)
    log = _logged(eng)
    helpers.outputs(helpers.run(eng, [ServeRequest("a", list(range(3, 3 + prompt_len)), 3)]))
    assert sum(s.prefill_tokens for s in log.steps) == prompt_len
