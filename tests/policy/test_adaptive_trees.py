"""The adaptive policy on token trees: node budgets from each node's hit rate, draft cost from tree depth."""

from __future__ import annotations

import pytest

from spectoolkit.config import SpeculateConfig, TreeConfig
from spectoolkit.policy import AdaptivePolicy, make_policy
from spectoolkit.policy.acceptance import AcceptanceModel, NodeAcceptance
from spectoolkit.policy.allocate import best_lengths

NODES = 8
STEP_BASE, STEP_PER_TOKEN, DRAFT_FORWARD = 0.010, 0.0003, 0.001  # seconds


def _policy(nodes: int = NODES) -> AdaptivePolicy:
    policy = AdaptivePolicy(nodes, 0.9, 8, tree=True)
    policy.seed({n: STEP_BASE + STEP_PER_TOKEN * n for n in (1, 2, 4, 8, 16, 32)})
    policy.observe_step(2, 0, STEP_BASE + STEP_PER_TOKEN * 2, 0.0, sequences=2)  # a batch's first step is plain
    policy.draft_cost.observe(1, DRAFT_FORWARD)
    return policy


def test_make_policy_gives_a_tree_arm_node_budgets():
    speculate = SpeculateConfig(gamma=3, policy="adaptive", tree=TreeConfig(kind="static", max_nodes=10))
    policy = make_policy(speculate)
    assert isinstance(policy, AdaptivePolicy) and policy.max_gamma == 10
    assert isinstance(policy.acceptance, NodeAcceptance)
    chain = make_policy(speculate, tree=False)
    assert chain.max_gamma == 3 and type(chain.acceptance) is AcceptanceModel


def test_node_gains_are_hit_rates_made_non_increasing():
    model = NodeAcceptance(4, decay=1.0)
    for _ in range(200):  # node 0 always on the path, its sibling 1 never, 0's child 2 always, 3 half the time
        model.observe("r", 4, 2, [0, 2])
        model.observe("r", 4, 3, [0, 2, 3])
    gains = model.survival("r", 4)
    assert gains == sorted(gains, reverse=True)
    assert gains[0] == pytest.approx(1.0, abs=0.01)
    assert gains[1] == pytest.approx(gains[2]) == pytest.approx(0.5, abs=0.01)  # 0 and 1 pooled: E(3) exact
    assert sum(gains[:3]) == pytest.approx(2.0, abs=0.02) and gains[3] == pytest.approx(0.5, abs=0.01)


def test_node_rounds_outside_the_budget_are_refused():
    with pytest.raises(ValueError, match="outside"):
        NodeAcceptance(4, 0.9).observe("r", 2, 1, [3])


def test_a_tree_whose_deep_nodes_hit_gets_its_whole_budget_and_one_that_never_hits_none():
    policy = _policy()
    for _ in range(30):
        policy.observe("good", NODES, NODES, 4, [0, 2, 4, 6], depth=4)
        policy.observe("bad", NODES, NODES, 0, [], depth=4)
    good, bad = policy.choose(["good", "bad"], [NODES, NODES], 2, 2 * NODES)
    assert good >= 6 and bad == 0


def test_tree_draft_cost_is_its_depth_not_its_nodes():
    policy = _policy()
    assert policy.forwards(3) == [0, 1, 1, 1]  # nothing seen: the least a tree can be (one forward), to be tried
    policy.observe("r", 8, 8, 2, [0, 3], depth=2)
    policy.observe("r", 8, 8, 2, [0, 3], depth=4)
    assert policy.forwards(8)[8] == pytest.approx(3.0) and policy.forwards(8)[5] == 1
    policy.observe("r", 4, 4, 2, [0, 3], depth=2)
    assert policy.forwards(8)[4:] == [2.0, 2.0, 2.0, 2.0, 3.0]  # unseen sizes: no shallower than a smaller one seen
    assert make_policy(SpeculateConfig(gamma=3, policy="adaptive")).forwards(3) == [0, 1, 2, 3]  # a chain: k


def test_a_shallow_tree_is_cheaper_to_draft_than_a_chain_of_its_nodes():
    """With an expensive draft forward, 4 nodes of depth 1 pay where a 4-chain at the same gains does not."""
    gains = [[0.6, 0.2, 0.1, 0.05]]
    times = lambda n: STEP_BASE + STEP_PER_TOKEN * n  # noqa: E731
    chain = best_lengths(gains, 1, 4, times, draft_forward=0.004)
    shallow = best_lengths(gains, 1, 4, times, draft_forward=0.004, forwards=[0, 1, 1, 1, 1])
    assert shallow[0] > chain[0]
