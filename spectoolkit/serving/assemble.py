"""The one place engines are assembled: benchmark arms at batch 1 and under load, the server, eval and training.

An :class:`EngineBuilder` holds a run's loaded models, its verifier and a :class:`Sizing` — how many KV slots
each pool holds and what a step may carry. Everything else is the same for every engine it builds:

- one runner over one paged pool per model, shared by every arm of that model (arms never run at once, and
  each run starts from a reset engine; a freed block leaves the prefix index, so no arm inherits another's KV);
- the run's batched drafter (built once, over its own pools of the same size) and its variants per arm;
- the draft-length policy, the one holder of how many nodes and how deep a round drafts.

:func:`serving_arms` (a load benchmark) and :func:`served_arm` (the server, training's target states) size
engines for many sequences (:func:`serving_sizing`); :class:`~spectoolkit.wiring.one_engine.OneEngines`
(batch-1 arms, exactness jobs) for one request at a time (:func:`lone_sizing`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from spectoolkit.config import RunConfig, ServeConfig
from spectoolkit.drafting.base import Drafter
from spectoolkit.kernels.batched_kernels import choose_batched_kernels
from spectoolkit.kernels.verifier import make_verifier
from spectoolkit.policy import DraftLengthPolicy, FixedPolicy, make_policy
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import Runner, make_runner
from spectoolkit.serving.engine import ContinuousEngine
from spectoolkit.serving.factory import batched_drafter
from spectoolkit.serving.scheduler import SchedulerLimits
from spectoolkit.verify.base import Verifier

DEFAULT_SEQ_SLOTS = 2048  # KV slots per sequence assumed when serve.max_kv_tokens is null


@dataclass(frozen=True)
class Sizing:
    """What the engines of one builder hold: KV slots per pool (a multiple of ``block_size``) and a step's limits."""

    slots: int
    block_size: int
    limits: SchedulerLimits
    invariant: bool = False  # serve.batch_invariant: fixed per-row reductions whatever the runner
    prefix_caching: bool = False  # serve.prefix_caching: freed full blocks stay cached (where rows are invariant)


def kv_slots(serve: ServeConfig, max_positions: int) -> int:
    """Slots of a pool: ``serve.max_kv_tokens``, else room for the sequences the largest level runs."""
    if serve.max_kv_tokens is not None:
        return serve.max_kv_tokens
    sequences = min(serve.max_num_seqs, max((*serve.concurrency, 16)))
    return sequences * min(max_positions, DEFAULT_SEQ_SLOTS)


def serving_sizing(cfg: RunConfig, max_positions: int) -> Sizing:
    """Many sequences at once, as ``serve`` says (a load benchmark, the server)."""
    serve = cfg.serve
    slots = max(1, kv_slots(serve, max_positions) // serve.block_size) * serve.block_size
    limits = SchedulerLimits(serve.max_num_tokens, serve.max_num_seqs, serve.spec_max_batch, serve.max_draft_tokens)
    return Sizing(slots, serve.block_size, limits, serve.batch_invariant, serve.prefix_caching)


def lone_sizing(cfg: RunConfig, positions: int) -> Sizing:
    """One request of up to ``positions`` tokens at a time, plus a lone sequence of as many (calibration and
    divergence replays); a step carries the whole request (its prompt in one chunk) and any draft."""
    block = cfg.serve.block_size
    slots = -(-2 * (positions + 1) // block) * block
    # A round's drafts: a chain within the request's room, a tree within max_nodes (far below a context).
    limits = SchedulerLimits(2 * positions + 1, 1, None, None)
    return Sizing(slots, block, limits)


@dataclass
class EngineBuilder:
    """Assembles a run's engines (module docstring); ``models``: its :class:`~spectoolkit.wiring.setup.LoadedModels`."""

    cfg: RunConfig
    models: object
    verifier: Verifier
    sizing: Sizing
    _runners: dict[int, tuple[Runner, BlockAllocator]] = field(default_factory=dict)
    _drafter: Drafter | None = None

    def runner(self, model: torch.nn.Module) -> tuple[Runner, BlockAllocator]:
        """``model``'s runner over its pool (one per model, shared by its arms) and the pool's allocator."""
        if id(model) not in self._runners:
            sizing = self.sizing
            runner = make_runner(model, make_pool(model, self.cfg.kv.target, sizing.slots), self.cfg.runtime.compiled)
            # A cached prefix must have the bits a recompute would: only where every row is computed by itself.
            cache = sizing.prefix_caching and (sizing.invariant or runner.row_exact)
            blocks = sizing.slots // sizing.block_size
            self._runners[id(model)] = (runner, BlockAllocator(blocks, sizing.block_size, cache))
        return self._runners[id(model)]

    def runners(self) -> list[Runner]:
        return [runner for runner, _ in self._runners.values()]

    def drafter(self) -> Drafter:
        """The run's batched drafter (``cfg.draft``; built once, on first use)."""
        if self._drafter is None:
            self._drafter = batched_drafter(self.cfg, self.models, self.sizing.slots)
        return self._drafter

    def drafter_of(self, kind: str) -> Drafter:
        """A drafter of ``kind`` (n-gram, suffix, eagle, hybrid) with the run's settings, whatever ``draft.kind``
        says."""
        cfg = dataclasses.replace(self.cfg, draft=dataclasses.replace(self.cfg.draft, kind=kind))
        return batched_drafter(cfg, self.models, self.sizing.slots)

    def engine(
        self, name: str, drafter: Drafter | None, policy: DraftLengthPolicy, model: torch.nn.Module | None = None
    ) -> ContinuousEngine:
        """An engine named ``name`` on ``model`` (default: the target) drafting with ``drafter`` (None: the target
        alone) under ``policy``."""
        models, cfg = self.models, self.cfg
        runner, allocator = self.runner(models.target.model if model is None else model)
        return ContinuousEngine(
            name, runner, allocator, self.verifier, self.sizing.limits, models.eos_ids, models.max_positions,
            drafter, not cfg.sampling.greedy, self.sizing.invariant, policy if drafter is not None else None,
            lambda sampling: make_verifier(sampling, models.device),
        )  # fmt: skip


# ---- arms under load ------------------------------------------------------------------------------


@dataclass
class ServingArm:
    name: str
    engine: ContinuousEngine
    gamma: int
    drafter: str
    target_precision: str
    draft_precision: str | None
    reference: str | None
    policy: str = "fixed"  # the draft-length policy (spectoolkit.policy); "none" without a drafter

    def snapshot(self) -> None:
        """No counters of its own beyond its records (``ServingArmLike.snapshot``: a server's /metrics)."""
        return None


def serving_arms(cfg: RunConfig, setup) -> list[ServingArm]:
    """ "baseline" (the target alone, continuous batching), with a drafter "spec" (fixed γ) and, when
    ``speculate.policy`` is not fixed, "spec-<policy>" beside it (every arm on the one target pool). With
    ``bench.arms=gamma_sweep``: "spec-gN" (fixed γ = N) per N in ``bench.gammas`` and "spec-adaptive" (at most
    max(gammas)), as a batch-1 gamma sweep has them: the adaptive policy against every fixed γ, interleaved."""
    builder = _serving_builder(cfg, setup)
    arms = [_arm(builder, "baseline", None, FixedPolicy(0))]
    if cfg.draft.kind == "none":
        return arms
    drafter = builder.drafter()
    if cfg.bench.arms == "gamma_sweep":
        for gamma in cfg.bench.gammas:
            variant = drafter.variant(None, drafter.tree)
            arms.append(_arm(builder, f"spec-g{gamma}", variant, make_policy(cfg.speculate, "fixed", gamma)))
        adaptive = make_policy(cfg.speculate, "adaptive", max(cfg.bench.gammas))
        return arms + [_arm(builder, "spec-adaptive", drafter, adaptive)]
    arms.append(_arm(builder, "spec", drafter, make_policy(cfg.speculate, "fixed")))
    policy = make_policy(cfg.speculate)
    if policy.name != "fixed":
        sibling = drafter.variant(policy.stop_below, drafter.tree)
        arms.append(_arm(builder, f"spec-{policy.name}", sibling, policy))
    return arms


def served_arm(cfg: RunConfig, setup) -> ServingArm:
    """The one arm a server runs (``python -m spectoolkit.serve``): the target with the configured drafter
    and draft-length policy, named as in a serving run ("spec", "spec-<policy>"); "baseline" for draft=none."""
    builder = _serving_builder(cfg, setup)
    if cfg.draft.kind == "none":
        return _arm(builder, "baseline", None, FixedPolicy(0))
    policy = make_policy(cfg.speculate)
    name = "spec" if policy.name == "fixed" else f"spec-{policy.name}"
    drafter = builder.drafter()
    if policy.stop_below is not None:  # confidence: the draft model stops below the threshold
        drafter = drafter.variant(policy.stop_below, drafter.tree)
    return _arm(builder, name, drafter, policy)


def _serving_builder(cfg: RunConfig, setup) -> EngineBuilder:
    """Measure the many-row kernels of the loaded models (``runtime.kernels=auto``); a builder sized for load."""
    models = setup.models
    for loaded in (models.target, models.draft):  # the kernel of a many-row step, measured here
        if loaded is not None and cfg.runtime.kernels == "auto":
            choose_batched_kernels(loaded.model)
    verifier = make_verifier(cfg.sampling, models.device)
    return EngineBuilder(cfg, models, verifier, serving_sizing(cfg, models.max_positions))


def _arm(builder: EngineBuilder, name: str, drafter: Drafter | None, policy: DraftLengthPolicy) -> ServingArm:
    models = builder.models
    engine = builder.engine(name, drafter, policy)
    # The loaded draft's precision (a layer-skip draft: the target's, or draft.skip_precision); None for n-gram.
    draft_precision = models.draft.label if drafter is not None and models.draft is not None else None
    if drafter is None:
        return ServingArm(name, engine, 0, "none", models.target.label, None, None, "none")
    return ServingArm(name, engine, policy.max_gamma, drafter.name, models.target.label, draft_precision, "baseline",
                      policy.name)  # fmt: skip
