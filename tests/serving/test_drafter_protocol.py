"""Drafters reach the engine only through the :class:`~spectoolkit.drafting.base.Drafter` protocol (issue 48).

A test double written against the protocol alone — it subclasses ``Drafter`` for the defaults and implements the
required methods, nothing else — runs in every engine configuration (chains and trees, fixed and adaptive
policies, one request and several at once, greedy and sampled), behind a guard that fails the test the moment
the engine asks it for anything the protocol does not declare. Greedy, its outputs equal the target alone's.
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.config import SamplingConfig, TreeConfig
from spectoolkit.drafting.base import Budget, Drafter, Drafting
from spectoolkit.drafting.tree import TokenTree
from spectoolkit.kernels.verifier import make_verifier
from spectoolkit.policy import AdaptivePolicy, FixedPolicy
from spectoolkit.serving.api import ServeRequest
from tests.serving import helpers
from tests.serving.helpers import VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NEW, DEPTH = 16, 3
TREE = TreeConfig(kind="dynamic", max_nodes=6, top_k=2)
# What the protocol declares: the engine may touch these and nothing else.
DECLARED = frozenset({
    "name", "tree", "capture", "ahead", "propose", "commit", "release", "reset", "runners", "kv_bytes", "describe_tree",
    "variant", "keep_states", "backlog", "upkeep", "observe_step",
})  # fmt: skip


def test_declared_is_the_protocol():
    """Guard: DECLARED lists the protocol's names (a method added to it must be added here, and vice versa)."""
    names = {name for name in vars(Drafter) if not name.startswith("_")} | set(Drafter.__annotations__)
    assert names == DECLARED


class Oracle(helpers.StatelessDrafter):
    """Proposes each request's known greedy continuation, its third token wrong (partial acceptance); a tree adds a
    decoy sibling before each true node. Only protocol methods (the bookkeeping ones do nothing): no extra public
    attributes."""

    def __init__(
        self, continuations: dict[tuple[int, ...], list[int]], tree: TreeConfig | None, ahead: bool = False
    ) -> None:  # fmt: skip
        self.name, self.tree, self.ahead = "oracle", tree, ahead
        self._continuations = continuations

    def propose(self, seqs: list[Drafting], budgets: list[Budget]) -> list[TokenTree]:
        out = []
        for seq, budget in zip(seqs, budgets, strict=True):
            known = self._continuations[tuple(seq.tokens[: seq.prompt_len])]
            emitted = len(seq.tokens) - seq.prompt_len
            truth = known[emitted : emitted + min(budget.depth, budget.nodes if self.tree is None else budget.depth)]
            truth = [t if i != 2 else 3 + (t + 1) % (VOCAB - 3) for i, t in enumerate(truth)]
            if self.tree is None:
                out.append(TokenTree.chain(truth[: budget.nodes]))
                continue
            ids, parents, parent = [], [], -1
            for token in truth:
                ids += [3 + (token + 7) % (VOCAB - 3), token]
                parents += [parent, parent]
                parent = len(ids) - 1
            out.append(TokenTree(ids, parents).truncated(budget.nodes))
        return out

    def describe_tree(self) -> str | None:
        return None if self.tree is None else self.tree.describe()

    def variant(self, stop_below: float | None, tree: TreeConfig | None) -> Oracle:
        return Oracle(self._continuations, tree, self.ahead)


class Guard:
    """The engine's view of a drafter: any name the protocol does not declare fails the test."""

    def __init__(self, drafter: Drafter) -> None:
        object.__setattr__(self, "_drafter", drafter)
        object.__setattr__(self, "asked", set())

    def __getattr__(self, name: str):
        if name not in DECLARED:
            raise AssertionError(
                f"the engine asked a drafter for {name!r}, which the Drafter protocol does not declare"
            )
        self.asked.add(name)
        return getattr(self._drafter, name)


class OneHot(Oracle):
    """The oracle when sampling: a deterministic proposal's q is one-hot (as a lookup's)."""

    def propose(self, seqs: list[Drafting], budgets: list[Budget]) -> list[TokenTree]:
        out = []
        for tree in super().propose(seqs, budgets):
            probs = torch.zeros(len(tree), VOCAB)
            probs[torch.arange(len(tree)), tree.token_ids] = 1.0
            out.append(TokenTree(tree.token_ids, tree.parents, probs if len(tree) else None))
        return out


@pytest.fixture(scope="module")
def target():
    return helpers.tiny()


@pytest.fixture(scope="module")
def prompts():
    return helpers.prompts((5, 9, 13, 7))


@pytest.fixture(scope="module")
def references(target, prompts):
    return helpers.baseline_outputs(target, prompts, MAX_NEW)


def _policy(kind: str, tree: TreeConfig | None):
    nodes = TREE.max_nodes if tree is not None else DEPTH
    if kind == "adaptive":
        return AdaptivePolicy(nodes, 0.9, 4, tree is not None, DEPTH)
    return FixedPolicy(nodes, DEPTH)


@pytest.mark.parametrize("ahead", [False, True], ids=["after", "ahead"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("concurrency", [1, 4])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_a_protocol_only_drafter_runs_in_every_engine_configuration(
    target, prompts, references, tree, policy, concurrency, sampled, ahead
):
    """``ahead``: it proposes before the policy chooses (as a lookup), and the engine verifies the plan's part."""
    continuations = {tuple(p): references[str(i)] for i, p in enumerate(prompts)}
    drafter = Guard((OneHot if sampled else Oracle)(continuations, tree, ahead))
    sampling = SamplingConfig(temperature=0.8 if sampled else 0.0, seed=0)
    eng = helpers.engine(target, drafter=drafter, policy=_policy(policy, tree), verifier=make_verifier(sampling),
                         stochastic=sampled)  # fmt: skip
    assert eng.trees == (tree is not None)
    requests = [ServeRequest(str(i), list(p), MAX_NEW, seed=i) for i, p in enumerate(prompts)]
    if concurrency == 1:
        done = {r.request_id: helpers.run(eng, [r])[r.request_id] for r in requests}
    else:
        done = helpers.run(eng, requests)
    outputs = helpers.outputs(done)
    if not sampled:
        assert outputs == references
        assert sum(r.accepted_tokens for r in done.values()) > 0  # guard: drafts were really verified
    assert {"propose", "commit"} <= drafter.asked and helpers.all_free(eng)
