"""The batch-1 arms of a run on the one engine: each arm a continuous-batching engine with one request in flight.

Every arm of a target shares that target's paged pool (arms never run at once, and each generation
starts from an empty engine), and the drafting arms share one batched drafter and its draft pool — the
same pieces a server runs (:mod:`spectoolkit.serving.factory`). A lone sequence's pool holds a whole
context plus one more for the arm's :class:`~spectoolkit.runtime.lone.LoneSequence` (calibration and
divergence replays); pages are touched only when written, so the size costs nothing until used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from spectoolkit.config import RunConfig, TreeConfig
from spectoolkit.policy import DraftLengthPolicy, FixedPolicy, make_policy
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.compiled import bucket
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import Runner, make_runner
from spectoolkit.serving.engine import ContinuousEngine
from spectoolkit.serving.factory import batched_drafter
from spectoolkit.serving.one import OneRequestEngine
from spectoolkit.serving.scheduler import SchedulerLimits
from spectoolkit.verify.base import Verifier

MAX_LONE_POSITIONS = 1 << 15  # a model without a stated context: a lone sequence's pool holds this many positions


@dataclass
class OneEngines:
    """Builds the batch-1 arms' engines of a run (``models``: its :class:`~spectoolkit.wiring.setup.LoadedModels`)."""

    cfg: RunConfig
    models: object
    verifier: Verifier
    _runners: dict[int, tuple[Runner, BlockAllocator]] = field(default_factory=dict)
    _drafter: object = None

    @property
    def positions(self) -> int:
        return min(self.models.max_positions, MAX_LONE_POSITIONS)

    def target_alone(self, name: str, model: torch.nn.Module) -> OneRequestEngine:
        return OneRequestEngine(self._engine(name, model, None, FixedPolicy(0)), "baseline")

    def drafting(self, name: str, model: torch.nn.Module, policy: DraftLengthPolicy, tree: TreeConfig, drafter=None):
        """A drafting arm's engine and its drafter (default: the run's) growing ``tree`` (kind none: chains); a
        tree arm's policy budgets tree nodes (``tree.max_nodes``)."""
        nodes = tree.max_nodes if tree.enabled else policy.max_gamma
        policy = make_policy(self.cfg.speculate, policy.name, nodes, tree.enabled)
        drafter = (drafter or self.drafter()).variant(policy.stop_below, tree, self.cfg.speculate.gamma)
        return OneRequestEngine(self._engine(name, model, drafter, policy), "spec"), drafter

    def drafter_of(self, kind: str):
        """A drafter of ``kind`` (n-gram, suffix, eagle, hybrid) with the run's settings, whatever ``draft.kind``
        says."""
        cfg = dataclasses.replace(self.cfg, draft=dataclasses.replace(self.cfg.draft, kind=kind))
        return batched_drafter(cfg, self.models, self._slots())

    def drafter(self):
        """The run's batched drafter (built once, on first use)."""
        if self._drafter is None:
            self._drafter = batched_drafter(self.cfg, self.models, self._slots())
        return self._drafter

    def warm_compiled(self, verify_sizes: tuple[int, ...], each: bool) -> None:
        """``runtime.compile``: compile now every width the arms' calls take — targets a decode step and the widest
        verify (``each``: every verify size at its own width, so a tree-vs-chain run measures each at its own);
        the draft model a step, a catch-up feed, a prompt chunk and a tree's widest level."""
        buckets = {bucket(size) for size in (verify_sizes if each else (max(verify_sizes),))}
        capture = tuple(getattr(self._drafter, "capture", ()))  # a head's target states: graphs that return them
        for runner, _ in self._runners.values():
            runner.warm((1, *buckets))
            if capture:
                runner.warm((1, *buckets), capture)
        draft = self._drafter.runners().get("draft") if self._drafter is not None else None
        tree = self.cfg.speculate.tree
        if draft is not None:
            draft.warm((1, 2, 8, *((bucket(tree.max_nodes),) if tree.enabled else ())))

    def _slots(self) -> int:
        block = self.cfg.serve.block_size
        return -(-2 * (self.positions + 1) // block) * block  # a request and a lone sequence, whole blocks

    def runner(self, model: torch.nn.Module) -> tuple[Runner, BlockAllocator]:
        """``model``'s runner over its pool (one per model, shared by its arms) and the pool's allocator."""
        if id(model) not in self._runners:
            slots, block = self._slots(), self.cfg.serve.block_size
            runner = make_runner(model, make_pool(model, self.cfg.kv.target, slots), self.cfg.runtime.compiled)
            self._runners[id(model)] = (runner, BlockAllocator(slots // block, block))
        return self._runners[id(model)]

    def _engine(self, name: str, model, drafter, policy: DraftLengthPolicy):
        cfg, models = self.cfg, self.models
        runner, allocator = self.runner(model)
        gamma = policy.max_gamma if drafter is not None else 0
        limits = SchedulerLimits(self.positions + gamma + 1, 1, gamma, None, None)
        return ContinuousEngine(
            name, runner, allocator, self.verifier, limits, models.eos_ids, models.max_positions, drafter,
            not cfg.sampling.greedy, False, policy,
        )  # fmt: skip
