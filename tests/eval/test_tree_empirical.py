"""Empirical exactness of token-tree sampling: chi-square per position, and the rank-siblings control.

As in test_stochastic_empirical.py: a tiny target with a 12-token vocabulary (spread-out
distributions, so 400 samples give the test power) is continued by the target alone and by the
speculative sampler drafting token trees (:func:`~spectoolkit.eval.stochastic_empirical.engine_exactness`
with ``tree=``; batch-1 arms of the one engine, :mod:`tests.eval.one_engines`). The real tree sampler
must not be rejected; the rank-siblings control (:mod:`spectoolkit.eval.tree_empirical`) must be, at
the same sample size. Seeds are fixed.
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.config import SamplingConfig, TreeConfig
from spectoolkit.drafting.tree import TokenTree
from spectoolkit.eval.stochastic_empirical import engine_exactness
from spectoolkit.eval.tree_empirical import (
    RankSiblingsModelDrafter,
    RankSiblingsNgramDrafter,
    rank_siblings,
    tree_negative_control,
)
from tests.eval import one_engines
from tests.eval.one_engines import EOS_IDS, PROMPT, T1, TOP_K_P, VOCAB

# Pairs (x, y) for ten tokens x, then (x, 5) for every token x != 5: whatever token x != 5 the target
# samples first, its latest continuation is 5 and an earlier one differs, so the trie has two or more
# children at the root, the first 5, and the rank control's bias (5 over-represented) does not
# average out over the contexts the per-position test mixes.
NGRAM_PROMPT = [3, 11, 9, 9, 4, 7, 11, 1, 6, 10, 8, 0, 10, 5, 0, 1, 1, 8, 7, 6,
                0, 5, 1, 5, 3, 5, 4, 5, 6, 5, 7, 5, 8, 5, 9, 5, 10, 5, 11, 5]  # fmt: skip
# LENGTH 4: the first round has room for 3 tokens, so its tree is γ = 2 deep (internal nodes are tested too).
SAMPLES, LENGTH, SIGNIFICANCE, GAMMA = 400, 4, 1e-3, 2
TREES = {
    "static-2x2": TreeConfig(kind="static", branching=(2, 2), max_nodes=6),
    "static-3x1": TreeConfig(kind="static", branching=(3, 1), max_nodes=6),
    "dynamic-top3": TreeConfig(kind="dynamic", top_k=3, max_nodes=6),
}
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return one_engines.tiny(0)


@pytest.fixture(scope="module")
def draft_model() -> torch.nn.Module:
    return one_engines.tiny(1)


def _arms(target, draft_model, kind: str, sampling: SamplingConfig, tree: TreeConfig) -> dict:
    """Batch-1 one-engine arms: the target alone, ``kind``'s tree sampler ("model" or "ngram"), its rank control."""
    drafter = one_engines.batched(draft_model if kind == "model" else None, sampling, VOCAB, EOS_IDS)
    control = tree_negative_control(drafter, sampling)
    return one_engines.arms(target, drafter, control, sampling, GAMMA, EOS_IDS, tree)


def _run(target, draft_model, kind: str, sampling: SamplingConfig, tree: TreeConfig) -> dict:
    engines = _arms(target, draft_model, kind, sampling, tree)
    prompt = PROMPT if kind == "model" else NGRAM_PROMPT
    return engine_exactness(engines.__getitem__, prompt, SAMPLES, LENGTH, 0, SIGNIFICANCE, tree)


def _assert_accepted_and_control_rejected(result: dict, tree: TreeConfig) -> None:
    assert result["tree"]["kind"] == tree.kind and result["samples"] == SAMPLES
    assert result["passed"] and result["min_p_value"] > result["threshold"], result["positions"]
    assert all(position["categories"] >= 2 for position in result["positions"][1:])  # something to compare
    assert 0 < result["acceptance_rate"] < 1  # acceptances and residual samples both happen
    assert result["control"]["rejected"] and result["power_shown"], result["control"]["positions"]
    assert result["control"]["min_p_value"] < 1e-5


@pytest.mark.parametrize(
    ("tree_name", "sampling"),
    [("static-2x2", T1), ("static-3x1", T1), ("dynamic-top3", T1), ("static-2x2", TOP_K_P)],
    ids=["static-2x2-T1", "static-3x1-T1", "dynamic-top3-T1", "static-2x2-top_k5-top_p0.9"],
)
def test_model_trees_accepted_rank_control_rejected(target, draft_model, tree_name, sampling):
    tree = TREES[tree_name]
    _assert_accepted_and_control_rejected(_run(target, draft_model, "model", sampling, tree), tree)


def test_ngram_trie_accepted_rank_control_rejected(target, draft_model):
    tree = TREES["static-2x2"]
    _assert_accepted_and_control_rejected(_run(target, draft_model, "ngram", T1, tree), tree)


@pytest.mark.parametrize("tree_name", [*TREES, "ngram"])
def test_first_rounds_draft_two_deep_trees(target, draft_model, tree_name):
    """What the chi-square tests see: the first round verifies a branching tree of depth γ = 2."""
    kind, tree = ("ngram", TREES["static-2x2"]) if tree_name == "ngram" else ("model", TREES[tree_name])
    arms = _arms(target, draft_model, kind, T1, tree)
    prompt = PROMPT if kind == "model" else NGRAM_PROMPT
    for arm in ("spec", "control"):  # the control drafts the same trees (then reports them wrongly)
        first_rounds = [arms[arm].generate(prompt, LENGTH, torch.Generator().manual_seed(seed)) for seed in range(5)]
        assert all(out.tree_depths[0] == GAMMA and out.draft_lengths[0] > GAMMA for out in first_rounds), arm


def test_rank_siblings_takes_the_top_tokens_of_q():
    """i.i.d. draws [3, 3] and [1] from their q become q's top-2 [0, 2] and top-1 [0]; rows stay q."""
    q_root, q_child = torch.tensor([0.4, 0.1, 0.3, 0.2]), torch.tensor([0.5, 0.2, 0.2, 0.1])
    tree = TokenTree([3, 3, 1], [-1, -1, 0], torch.stack([q_root, q_root, q_child]))
    ranked = rank_siblings(tree)
    assert ranked.token_ids == [0, 2, 0] and ranked.parents == tree.parents
    assert torch.equal(ranked.draft_probs, tree.draft_probs)


def test_rank_siblings_reports_an_ngram_trie_as_uniform():
    """One-hot continuations [7, 4] (and [9] below 7): tokens kept, each sibling reports their uniform mean."""
    one_hot = torch.eye(10)
    tree = TokenTree([7, 4, 9], [-1, -1, 0], one_hot[[7, 4, 9]])
    ranked = rank_siblings(tree)
    assert ranked.token_ids == [7, 4, 9]
    uniform = 0.5 * (one_hot[7] + one_hot[4])
    assert torch.equal(ranked.draft_probs[0], uniform) and torch.equal(ranked.draft_probs[1], uniform)
    assert torch.equal(ranked.draft_probs[2], one_hot[9])  # a single child: honest already


def test_tree_negative_control_per_drafter_kind(draft_model):
    model = one_engines.batched(draft_model, T1, VOCAB, EOS_IDS)
    control = tree_negative_control(model, T1)
    assert isinstance(control, RankSiblingsModelDrafter) and control.runner is model.runner  # same draft pool
    ngram = one_engines.batched(None, T1, VOCAB, EOS_IDS)
    assert isinstance(tree_negative_control(ngram, T1), RankSiblingsNgramDrafter)
    with pytest.raises(TypeError, match="TREE_NEGATIVE_CONTROLS"):
        tree_negative_control(object(), T1)
