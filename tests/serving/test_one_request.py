"""Batch 1 on the one engine: OneRequestEngine decodes as the target alone and fills every record field."""

from __future__ import annotations

import pytest
import torch

from spectoolkit.config import TreeConfig
from spectoolkit.drafting import NgramDrafter
from spectoolkit.errors import SpecToolkitError
from spectoolkit.sampling import GreedyChooser
from spectoolkit.serving.one import OneRequestEngine
from tests.serving import helpers
from tests.serving.helpers import VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NEW = 24


@pytest.fixture(scope="module")
def target():
    return helpers.tiny()


@pytest.fixture(scope="module")
def batch():
    return helpers.prompts((6, 11, 17))


@pytest.fixture(scope="module")
def references(target, batch):
    return helpers.baseline_outputs(target, batch, MAX_NEW)


def _one(target, drafter=None, gamma: int = 0, **kwargs) -> OneRequestEngine:
    engine = helpers.engine(target, gamma=gamma, drafter=drafter, **kwargs)
    return OneRequestEngine(engine, "spec" if gamma else "baseline")


def test_the_target_alone_on_the_one_engine_is_the_batch_1_reference(target, batch, references):
    one = _one(target)
    for index, prompt in enumerate(batch):
        out = one.generate(prompt, MAX_NEW, None)
        assert out.output_ids == references[str(index)]
        assert out.verify_rounds == len(out.output_ids) - 1 and out.drafted_tokens == 0
        assert 0 < out.prefill_time == out.ttft <= out.total_time
        assert out.overhead_time >= 0 and out.verify_time > 0


@pytest.mark.parametrize("kind", ["ngram", "model", "tree"])
def test_speculation_on_the_one_engine_equals_the_target_alone(target, batch, references, kind):
    tree = None
    if kind == "ngram":
        drafter, gamma = NgramDrafter(3, 1, VOCAB, False), 4
    else:
        drafter, gamma = helpers.model_drafter(helpers.noisy_target(0.3, seed=5), GreedyChooser()), 4
    engine = helpers.engine(target, gamma=gamma, drafter=drafter)
    if kind == "tree":
        tree = TreeConfig(kind="static", branching=[2, 2, 1], max_nodes=6)
        engine = helpers.engine(target, gamma=6, drafter=drafter.variant(None, tree), depth=len(tree.branching))
        assert engine.trees and engine.policy.max_depth == 3
    one = OneRequestEngine(engine, "spec")
    for index, prompt in enumerate(batch):
        out = one.generate(prompt, MAX_NEW, torch.Generator().manual_seed(index))
        assert out.output_ids == references[str(index)], f"{kind}: prompt {index}"
        assert out.verify_rounds == len(out.draft_lengths) == len(out.accept_lengths) == len(out.chosen_lengths)
        assert sum(out.accept_lengths) == out.accepted_tokens <= out.drafted_tokens == sum(out.draft_lengths)
        assert out.proposed_rounds == sum(1 for k in out.draft_lengths if k)
        assert len(out.tree_depths) == (out.verify_rounds if tree else 0)
        if not tree:
            assert out.rollback_count == sum(a < k for a, k in zip(out.accept_lengths, out.draft_lengths, strict=True))
        assert out.total_time >= out.prefill_time + out.draft_time + out.verify_time > 0
    assert out.accepted_tokens > 0, f"{kind}: nothing accepted, the test shows nothing"
    assert one.peak_kv_bytes()["target_kv_bytes"] > 0 and not one.engine.has_work()


def test_its_target_is_the_engine_runner_driven_for_one_sequence(target, batch):
    one = _one(target)
    prompt = batch[0]
    lone = one.target
    first = lone.forward(prompt, last_only=True)  # [V]
    window = lone.forward([5, 6, 7])  # [3, V]
    lone.truncate(len(prompt))
    again = lone.forward([5, 6, 7])
    assert torch.equal(window, again), "a rolled-back window must compute again bit for bit"
    with torch.inference_mode():
        stock = target(torch.tensor([prompt + [5, 6, 7]])).logits[0]  # the stock forward: the reference
    torch.testing.assert_close(first, stock[len(prompt) - 1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(window, stock[len(prompt) :], rtol=1e-5, atol=1e-5)
    free = one.engine.allocator.num_free
    one.generate(prompt, 4, None)  # generate starts by giving the lone sequence's blocks back
    assert one.engine.allocator.num_free == one.engine.allocator.num_blocks > free


def test_a_request_the_engine_refuses_is_one_clear_error(target):
    with pytest.raises(SpecToolkitError, match="exceeds the model's context"):
        _one(target).generate([5] * 1000, 100, None)


def test_an_interrupted_generation_leaves_nothing_in_the_engine(target, batch, references):
    one = _one(target)

    def interrupt(token: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        one.generate(batch[0], MAX_NEW, None, on_token=interrupt)
    assert not one.engine.has_work() and one.engine.allocator.num_free == one.engine.allocator.num_blocks
    assert one.generate(batch[0], MAX_NEW, None).output_ids == references["0"]  # the next one runs as usual
