"""Build the serving arms of a run: the same continuous-batching engine with and without a drafter.

Both arms run the run's target model object, each with its own paged KV pool (and the spec arm's
draft model its own), so baseline and speculation see the same weights and kernels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from spectoolkit.config import RunConfig, ServeConfig
from spectoolkit.drafting import ModelDrafter, NgramDrafter, SuffixDrafter, SuffixSettings
from spectoolkit.drafting.eagle import EagleDrafter, EagleHead
from spectoolkit.drafting.hybrid import HybridDrafter
from spectoolkit.errors import SpecToolkitError
from spectoolkit.kernels.batched_kernels import choose_batched_kernels
from spectoolkit.kernels.verifier import make_verifier
from spectoolkit.models.eagle3_head import Eagle3Head
from spectoolkit.models.layer_skip import draft_model_name
from spectoolkit.policy import FixedPolicy, make_policy
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import make_runner
from spectoolkit.sampling import make_chooser
from spectoolkit.serving.engine import ContinuousEngine
from spectoolkit.serving.scheduler import SchedulerLimits

DEFAULT_SEQ_SLOTS = 2048  # KV slots per sequence assumed when serve.max_kv_tokens is null


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


def kv_slots(serve: ServeConfig, max_positions: int) -> int:
    """Slots of a pool: ``serve.max_kv_tokens``, else room for the sequences the largest level runs."""
    if serve.max_kv_tokens is not None:
        return serve.max_kv_tokens
    sequences = min(serve.max_num_seqs, max((*serve.concurrency, 16)))
    return sequences * min(max_positions, DEFAULT_SEQ_SLOTS)


def serving_arms(cfg: RunConfig, setup) -> list[ServingArm]:
    """ "baseline" (the target alone, continuous batching), with a drafter "spec" (fixed γ) and, when
    ``speculate.policy`` is not fixed, "spec-<policy>" beside it (sharing the spec arm's KV pools: arms
    never run at once, and every run starts from a reset engine)."""
    slots = _prepare(cfg, setup)
    arms = [_arm(cfg, setup, "baseline", None, slots, FixedPolicy(0))]
    if cfg.draft.kind == "none":
        return arms
    drafter = batched_drafter(cfg, setup.models, slots)
    arms.append(_arm(cfg, setup, "spec", drafter, slots, _fixed(cfg)))
    policy = make_policy(cfg.speculate)
    if policy.name != "fixed":
        sibling = drafter.variant(policy.stop_below, drafter.tree, cfg.speculate.gamma)
        arms.append(_arm(cfg, setup, f"spec-{policy.name}", sibling, slots, policy, share=arms[-1].engine))
    return arms


def served_arm(cfg: RunConfig, setup) -> ServingArm:
    """The one arm a server runs (``python -m spectoolkit.serve``): the target with the configured drafter
    and draft-length policy, named as in a serving run ("spec", "spec-<policy>"); "baseline" for draft=none."""
    slots = _prepare(cfg, setup)
    if cfg.draft.kind == "none":
        return _arm(cfg, setup, "baseline", None, slots, FixedPolicy(0))
    policy = make_policy(cfg.speculate) if cfg.speculate.policy != "fixed" else _fixed(cfg)
    name = "spec" if policy.name == "fixed" else f"spec-{policy.name}"
    drafter = batched_drafter(cfg, setup.models, slots)
    if policy.stop_below is not None:  # confidence: the draft model stops below the threshold
        drafter = drafter.variant(policy.stop_below, drafter.tree, cfg.speculate.gamma)
    return _arm(cfg, setup, name, drafter, slots, policy)


def _fixed(cfg: RunConfig):
    """The fixed policy: γ drafts per round, or with ``speculate.tree`` up to ``max_nodes`` tree nodes."""
    return make_policy(cfg.speculate, "fixed")


def _prepare(cfg: RunConfig, setup) -> int:
    """Measure the many-row kernels of the loaded models (``runtime.kernels=auto``); the KV slots per pool."""
    models = setup.models
    for loaded in (models.target, models.draft):  # the kernel of a many-row step, measured here
        if loaded is not None and cfg.runtime.kernels == "auto":
            choose_batched_kernels(loaded.model)
    return kv_slots(cfg.serve, models.max_positions)


def _arm(cfg: RunConfig, setup, name: str, drafter, slots: int, policy, share: ContinuousEngine | None = None):
    models, serve = setup.models, cfg.serve
    gamma = policy.max_gamma if drafter is not None else 0
    blocks = max(1, slots // serve.block_size)
    limits = SchedulerLimits(serve.max_num_tokens, serve.max_num_seqs, gamma, serve.spec_max_batch,
                             serve.max_draft_tokens)  # fmt: skip
    target = models.target.model
    runner = share.runner if share else make_runner(target, make_pool(target, cfg.kv.target, blocks * serve.block_size),
                                                    cfg.runtime.compiled)  # fmt: skip
    allocator = share.allocator if share else BlockAllocator(blocks, serve.block_size)
    engine = ContinuousEngine(
        name, runner, allocator, make_verifier(cfg.sampling, models.device), limits,
        models.eos_ids, models.max_positions, drafter, not cfg.sampling.greedy, serve.batch_invariant, policy,
    )  # fmt: skip
    # The loaded draft's precision (a layer-skip draft: the target's, or draft.skip_precision); None for n-gram.
    draft_precision = models.draft.label if drafter is not None and models.draft is not None else None
    drafter_name = drafter.name if drafter is not None else "none"
    reference = "baseline" if drafter is not None else None
    return ServingArm(name, engine, gamma, drafter_name, models.target.label, draft_precision, reference,
                      policy.name if drafter is not None else "none")  # fmt: skip


def eagle_drafter(cfg: RunConfig, models, slots: int) -> EagleDrafter:
    """The EAGLE-3 head of ``draft.eagle_path`` over the target's embeddings, its KV in a pool of ``slots``."""
    if not cfg.draft.eagle_path:
        raise SpecToolkitError("+draft=eagle needs a trained head: set draft.eagle_path=DIR "
                               "(python -m spectoolkit.train_draft prints one)")  # fmt: skip
    head = Eagle3Head.load(cfg.draft.eagle_path)
    target = models.target
    layers = target.model.config.get_text_config().num_hidden_layers
    if max(head.shape.aux_layers) >= layers:
        raise SpecToolkitError(
            f"the draft head at {cfg.draft.eagle_path} reads target layers {head.shape.aux_layers}; this target has "
            f"{layers}: train a head for it (python -m spectoolkit.train_draft)"
        )
    blocks = max(1, slots // cfg.serve.block_size)
    ready = EagleHead(head, target.model.get_input_embeddings(), blocks * cfg.serve.block_size)
    allocator = BlockAllocator(blocks, cfg.serve.block_size)
    return EagleDrafter(ready, allocator, make_chooser(cfg.sampling), models.eos_ids, None, cfg.speculate.tree,
                        cfg.speculate.gamma)  # fmt: skip


def batched_drafter(cfg: RunConfig, models, slots: int):
    """The batched drafter ``cfg.draft`` asks for — n-gram lookup, suffix decoding, an EAGLE head, the hybrid of the
    two, or the loaded draft model over a pool of ``slots`` — growing ``speculate.tree`` (kind none: chains)."""
    target, tree, gamma = models.target, cfg.speculate.tree, cfg.speculate.gamma
    if cfg.draft.kind == "ngram":
        return NgramDrafter(cfg.draft.ngram_max, cfg.draft.ngram_min, target.vocab_size, not cfg.sampling.greedy,
                            tree, gamma)  # fmt: skip
    if cfg.draft.kind == "hybrid":
        suffix = batched_drafter(dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, kind="suffix")), models,
                                 slots)  # fmt: skip
        return HybridDrafter(suffix, eagle_drafter(cfg, models, slots))
    if cfg.draft.kind == "suffix":
        d = cfg.draft
        settings = SuffixSettings(
            depth=max(32, 2 * d.suffix_max_match), max_match=d.suffix_max_match, min_match=d.suffix_min_match,
            factor=d.suffix_factor,
            min_prob=d.suffix_min_prob, cache_tokens=d.suffix_cache_tokens,
        )  # fmt: skip
        return SuffixDrafter(settings, target.vocab_size, not cfg.sampling.greedy, tree, gamma)
    if cfg.draft.kind == "eagle":
        return eagle_drafter(cfg, models, slots)
    draft = models.draft
    blocks = max(1, slots // cfg.serve.block_size)
    pool = make_pool(draft.model, cfg.kv.draft, blocks * cfg.serve.block_size)
    shared = min(target.vocab_size, draft.vocab_size)
    allocator = BlockAllocator(blocks, cfg.serve.block_size)
    name, chooser = draft_model_name(cfg.draft, draft.model, target.model), make_chooser(cfg.sampling)
    runner = make_runner(draft.model, pool, cfg.runtime.compiled)
    return ModelDrafter(runner, chooser, allocator, target.vocab_size, shared, models.eos_ids, name, None, tree, gamma)
