"""The batch-1 arms of a run on the one engine: each arm a continuous-batching engine with one request in flight.

Engines are assembled by the one :class:`~spectoolkit.serving.assemble.EngineBuilder`, sized for one request at a
time (:func:`~spectoolkit.serving.assemble.lone_sizing`): every arm of a target shares that target's paged pool
(arms never run at once, and each generation starts from an empty engine), and the drafting arms share one
batched drafter and its draft pool — the same pieces a server runs. A lone sequence's pool holds a whole
context plus one more for the arm's :class:`~spectoolkit.runtime.lone.LoneSequence` (calibration and
divergence replays); pages are touched only when written, so the size costs nothing until used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from spectoolkit.config import RunConfig, TreeConfig
from spectoolkit.drafting.base import Drafter
from spectoolkit.policy import DraftLengthPolicy, FixedPolicy, make_policy
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.compiled import bucket
from spectoolkit.runtime.runner import Runner
from spectoolkit.serving.assemble import EngineBuilder, lone_sizing
from spectoolkit.serving.one import OneRequestEngine
from spectoolkit.verify.base import Verifier

MAX_LONE_POSITIONS = 1 << 15  # a model without a stated context: a lone sequence's pool holds this many positions


@dataclass
class OneEngines:
    """Builds the batch-1 arms' engines of a run (``models``: its :class:`~spectoolkit.wiring.setup.LoadedModels`)."""

    cfg: RunConfig
    models: object
    verifier: Verifier
    builder: EngineBuilder = field(init=False)

    def __post_init__(self) -> None:
        self.builder = EngineBuilder(self.cfg, self.models, self.verifier, lone_sizing(self.cfg, self.positions))

    @property
    def positions(self) -> int:
        return min(self.models.max_positions, MAX_LONE_POSITIONS)

    def target_alone(self, name: str, model: torch.nn.Module) -> OneRequestEngine:
        return OneRequestEngine(self.builder.engine(name, None, FixedPolicy(0), model), "baseline")

    def drafting(self, name: str, model: torch.nn.Module, policy: DraftLengthPolicy, tree: TreeConfig, drafter=None):
        """A drafting arm's engine and its drafter (default: the run's) growing ``tree`` (kind none: chains); a
        tree arm's policy budgets tree nodes (``tree.max_nodes``)."""
        nodes = tree.max_nodes if tree.enabled else policy.max_gamma
        speculate = dataclasses.replace(self.cfg.speculate, tree=tree)  # the arm's tree: its depth is the policy's
        policy = make_policy(speculate, policy.name, nodes, tree.enabled)
        drafter = (drafter or self.drafter()).variant(policy.stop_below, tree)
        return OneRequestEngine(self.builder.engine(name, drafter, policy, model), "spec"), drafter

    def drafter_of(self, kind: str) -> Drafter:
        """A drafter of ``kind`` (n-gram, suffix, eagle, hybrid) with the run's settings, whatever ``draft.kind``
        says."""
        return self.builder.drafter_of(kind)

    def drafter(self) -> Drafter:
        """The run's batched drafter (built once, on first use)."""
        return self.builder.drafter()

    def runner(self, model: torch.nn.Module) -> tuple[Runner, BlockAllocator]:
        """``model``'s runner over its pool (one per model, shared by its arms) and the pool's allocator."""
        return self.builder.runner(model)

    def warm_compiled(self, verify_sizes: tuple[int, ...], each: bool) -> None:
        """``runtime.compile``: compile now every width the arms' calls take — targets a decode step and the widest
        verify (``each``: every verify size at its own width, so a tree-vs-chain run measures each at its own);
        the draft model a step, a catch-up feed, a prompt chunk and a tree's widest level."""
        buckets = {bucket(size) for size in (verify_sizes if each else (max(verify_sizes),))}
        drafter = self.builder.drafter() if self.cfg.draft.kind != "none" else None
        capture = drafter.capture if drafter is not None else ()  # a head's target states: graphs that return them
        for runner in self.builder.runners():
            runner.warm((1, *buckets))
            if capture:
                runner.warm((1, *buckets), capture)
        draft = drafter.runners().get("draft") if drafter is not None else None
        tree = self.cfg.speculate.tree
        if draft is not None:
            draft.warm((1, 2, 8, *((bucket(tree.max_nodes),) if tree.enabled else ())))
