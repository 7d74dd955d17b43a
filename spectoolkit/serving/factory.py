"""Build a run's batched drafter: n-gram lookup, suffix decoding, an EAGLE head, a hybrid, or a draft model over
its own paged pool (engines are assembled in :mod:`spectoolkit.serving.assemble`)."""

from __future__ import annotations

import dataclasses

from spectoolkit.config import RunConfig
from spectoolkit.drafting import ModelDrafter, NgramDrafter, SuffixDrafter, SuffixSettings
from spectoolkit.drafting.eagle import EagleDrafter, EagleHead
from spectoolkit.drafting.hybrid import MODEL_CARRY, HybridDrafter
from spectoolkit.errors import SpecToolkitError
from spectoolkit.models.eagle3_head import Eagle3Head
from spectoolkit.models.layer_skip import draft_model_name
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import make_runner
from spectoolkit.sampling import make_chooser


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
    allocator = BlockAllocator(blocks, cfg.serve.block_size, cfg.serve.prefix_caching)  # its rows of a cached prefix
    return EagleDrafter(ready, allocator, make_chooser(cfg.sampling), models.eos_ids, None, cfg.speculate.tree)


def _of_kind(cfg: RunConfig, kind: str) -> RunConfig:
    """``cfg`` with ``draft.kind`` set to ``kind`` (a hybrid's part)."""
    return dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, kind=kind))


def batched_drafter(cfg: RunConfig, models, slots: int, carry: int | None = None):
    """The batched drafter ``cfg.draft`` asks for — n-gram lookup, suffix decoding, an EAGLE head, a hybrid of suffix
    decoding with a head or the draft model, or the loaded draft model over a pool of ``slots`` — growing
    ``speculate.tree`` (kind none: chains). ``carry``: the draft model's (:class:`ModelDrafter`)."""
    target, tree = models.target, cfg.speculate.tree
    if cfg.draft.kind == "ngram":
        return NgramDrafter(cfg.draft.ngram_max, cfg.draft.ngram_min, target.vocab_size, not cfg.sampling.greedy, tree)
    if cfg.draft.kind == "hybrid":  # suffix decoding beside the head, or the loaded draft model (draft.hybrid_with)
        lookup = batched_drafter(_of_kind(cfg, "suffix"), models, slots)
        model = batched_drafter(_of_kind(cfg, cfg.draft.hybrid_with), models, slots, MODEL_CARRY)
        return HybridDrafter(lookup, model, "hybrid" if cfg.draft.hybrid_with == "eagle" else "hybrid-model")
    if cfg.draft.kind == "suffix":
        d = cfg.draft
        settings = SuffixSettings(
            depth=max(32, 2 * d.suffix_max_match), max_match=d.suffix_max_match, min_match=d.suffix_min_match,
            factor=d.suffix_factor,
            min_prob=d.suffix_min_prob, cache_tokens=d.suffix_cache_tokens,
        )  # fmt: skip
        return SuffixDrafter(settings, target.vocab_size, not cfg.sampling.greedy, tree)
    if cfg.draft.kind == "eagle":
        return eagle_drafter(cfg, models, slots)
    draft = models.draft
    blocks = max(1, slots // cfg.serve.block_size)
    pool = make_pool(draft.model, cfg.kv.draft, blocks * cfg.serve.block_size)
    shared = min(target.vocab_size, draft.vocab_size)
    allocator = BlockAllocator(blocks, cfg.serve.block_size)
    name, chooser = draft_model_name(cfg.draft, draft.model, target.model), make_chooser(cfg.sampling)
    runner = make_runner(draft.model, pool, cfg.runtime.compiled)
    return ModelDrafter(runner, chooser, allocator, target.vocab_size, shared, models.eos_ids, name, None, tree,
                        draft.vocab_ids, carry)  # fmt: skip
