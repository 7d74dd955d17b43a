"""Greedy exactness under continuous batching (DESIGN §1, §6) on a tiny model.

A batch of mixed prompt lengths with drafters whose k_i differ per sequence and step must emit, per
request, exactly the batch-1 target-alone output (a lone sequence on the same runner). In batch-invariant
mode no row depends on the others, so for every KV precision the batch outputs must be identical to
the engine's own concurrency-1 outputs, with and without speculation. ``reset`` between runs (and in
the middle of one) must give the same outputs again.
"""

from __future__ import annotations

import pytest

from spectoolkit.drafting import NgramDrafter, SuffixDrafter, SuffixSettings
from spectoolkit.sampling import GreedyChooser
from spectoolkit.serving.api import ServeRequest
from tests.serving import helpers
from tests.serving.helpers import VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NEW = 24
GAMMA = 4


@pytest.fixture(scope="module")
def target():
    return helpers.tiny()


@pytest.fixture(scope="module")
def batch():
    return helpers.prompts((5, 13, 21, 40, 7, 9, 3))  # 13..85 tokens


@pytest.fixture(scope="module")
def references(target, batch):
    return helpers.baseline_outputs(target, batch, MAX_NEW)


DRAFTERS = {
    "ngram": lambda: NgramDrafter(3, 1, VOCAB, one_hot_probs=False),
    "suffix": lambda: SuffixDrafter(SuffixSettings(), VOCAB, one_hot_probs=False),
    "model-other-seed": lambda: helpers.model_drafter(helpers.tiny(seed=1), GreedyChooser()),  # rejects ~all
    "model-noisy": lambda: helpers.model_drafter(helpers.noisy_target(0.2, seed=5), GreedyChooser()),  # accepts some
}


def _assert_mixed_rounds(done) -> None:
    """The batch really speculated, with k_i that differ and partial acceptances."""
    drafted = [k for r in done.values() for k in r.draft_lengths]
    assert sum(drafted) > 0
    assert len({tuple(r.draft_lengths) for r in done.values()}) > 1, "every request drafted alike"


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_batch_equals_batch1_target_alone(target, batch, references, drafter, invariant):
    eng = helpers.engine(target, gamma=GAMMA, drafter=DRAFTERS[drafter](), invariant=invariant)
    lengths = [MAX_NEW - 3 * i for i in range(len(batch))]  # the room caps k_i differently near each end
    requests = [ServeRequest(str(i), p, n) for i, (p, n) in enumerate(zip(batch, lengths, strict=True))]
    done = helpers.run(eng, requests)
    assert helpers.outputs(done) == {rid: ids[: lengths[int(rid)]] for rid, ids in references.items()}
    _assert_mixed_rounds(done)
    assert max(max(r.batch_sizes) for r in done.values()) == len(batch), "the requests never ran together"
    assert helpers.all_free(eng) and eng.drafter.kv_bytes() == 0, "KV left behind (target or draft)"
    accepted = sum(r.accepted_tokens for r in done.values())
    drafted = sum(r.drafted_tokens for r in done.values())
    if drafter == "model-noisy":
        assert 0 < accepted < drafted


@pytest.mark.parametrize("kv", ["auto", "int8", "int4", "fp8"])
def test_invariant_batch_equals_its_own_concurrency_one(target, batch, kv):
    requests = helpers.requests(batch, MAX_NEW)
    spec = helpers.engine(target, gamma=GAMMA, drafter=DRAFTERS["ngram"](), kv=kv, invariant=True, max_num_tokens=48)
    batched = helpers.run(spec, requests)
    _assert_mixed_rounds(batched)
    outputs = helpers.outputs(batched)
    assert outputs == helpers.alone(spec, requests), f"kv={kv}: batch != concurrency 1 (spec arm)"
    plain = helpers.engine(target, kv=kv, invariant=True, max_num_tokens=48)
    assert outputs == helpers.alone(plain, requests), f"kv={kv}: batch spec != concurrency-1 baseline arm"
    assert outputs == helpers.outputs(helpers.run(plain, requests)), f"kv={kv}: batch spec != batch baseline arm"
    assert outputs == helpers.baseline_outputs(target, batch, MAX_NEW, kv)  # a lone sequence, same KV format


@pytest.mark.parametrize("drafter", ["ngram", "model-noisy"])
def test_reset_between_runs_gives_the_same_outputs(target, batch, references, drafter):
    eng = helpers.engine(target, gamma=GAMMA, drafter=DRAFTERS[drafter](), num_blocks=60)
    first = helpers.outputs(helpers.run(eng, helpers.requests(batch, MAX_NEW)))
    eng.reset()
    second = helpers.outputs(helpers.run(eng, helpers.requests(batch, MAX_NEW)))
    for request in helpers.requests(batch, MAX_NEW):  # a run cut short: KV and drafter state half-built
        eng.submit(request)
    for _ in range(4):
        eng.step()
    eng.reset()
    assert helpers.all_free(eng) and eng.drafter.kv_bytes() == 0
    third = helpers.outputs(helpers.run(eng, helpers.requests(batch, MAX_NEW)))
    assert first == second == third == references
