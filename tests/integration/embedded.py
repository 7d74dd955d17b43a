"""The embedded model for integration tests, loaded once per session per precision (shared by the files)."""

from __future__ import annotations

from functools import cache

import torch

from spectoolkit.config import TreeConfig
from spectoolkit.engine.tree_round import tree_depth
from spectoolkit.policy import FixedPolicy
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.lone import LoneSequence
from spectoolkit.sampling import GreedyChooser, make_chooser
from spectoolkit.serving.drafters import BatchModelDrafter, BatchNgramDrafter
from spectoolkit.serving.engine import ContinuousEngine
from spectoolkit.serving.factory import make_pool
from spectoolkit.serving.one import OneRequestEngine
from spectoolkit.serving.scheduler import SchedulerLimits
from spectoolkit.verify import GreedyVerifier
from spectoolkit.wiring.loading import LoadedModel, load_model, load_tokenizer
from spectoolkit.wiring.setup import eos_ids_of
from spectoolkit.workloads.prompts import Request, encode_prompt


@cache
def tokenizer():
    return load_tokenizer(None)


@cache
def model(precision: str) -> LoadedModel:
    return load_model(None, precision, torch.device("cpu"))


@cache
def encoded(prompts: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Chat-templated prompt ids of ``prompts``."""
    return tuple(tuple(encode_prompt(tokenizer(), Request(str(i), "qa", p), True)) for i, p in enumerate(prompts))


SLOTS, BLOCK = 8 * 1024, 16  # per pool: four requests of a chat prompt + 64 tokens, and more


def drafter(draft: str, target: LoadedModel, kv_draft: str | None, eos: frozenset[int], sampling=None):
    """A batched drafter: n-gram lookup (``draft="ngram"``) or the embedded model at precision ``draft``."""
    if draft == "ngram":
        return BatchNgramDrafter(3, 2, target.vocab_size, one_hot_probs=False)
    draft_model = model(draft).model
    pool, allocator = make_pool(draft_model, kv_draft or "auto", SLOTS), BlockAllocator(SLOTS // BLOCK, BLOCK)
    chooser = make_chooser(sampling) if sampling is not None else GreedyChooser()
    return BatchModelDrafter(draft_model, chooser, pool, allocator, target.vocab_size, target.vocab_size, eos)


def engine(target: LoadedModel, kv: str, eos: frozenset[int], drafted=None, gamma: int = 0, *, invariant: bool = False,
           policy=None, tree: TreeConfig | None = None, max_seqs: int = 1) -> ContinuousEngine:  # fmt: skip
    """The one engine on ``target`` (KV at ``kv``) with ``drafted`` (or none), greedy; ``tree`` (enabled): ``gamma``
    is its node budget."""
    limits = SchedulerLimits(2048, max_seqs, gamma, None, None)
    positions = target.model.config.get_text_config().max_position_embeddings
    depth = tree_depth(tree, gamma, getattr(drafted, "tree_kind", None)) if tree is not None else 0
    pool, allocator = make_pool(target.model, kv, SLOTS), BlockAllocator(SLOTS // BLOCK, BLOCK)
    return ContinuousEngine("test", target.model, pool, allocator, GreedyVerifier(), limits, eos, positions, drafted,
                            False, invariant, policy or FixedPolicy(gamma), tree, depth)  # fmt: skip


def greedy_engines(
    target_precision: str, draft: str, kv_target: str, kv_draft: str | None, gamma: int
) -> tuple[LoneSequence, OneRequestEngine, OneRequestEngine]:
    """The target's lone-sequence runner, the target alone and greedy speculation with ``draft`` (a precision or
    "ngram"): batch-1 arms of the one engine, as a run builds them."""
    target = model(target_precision)
    eos = eos_ids_of(tokenizer(), target.model)
    baseline = OneRequestEngine(engine(target, kv_target, eos), "baseline")
    spec = OneRequestEngine(engine(target, kv_target, eos, drafter(draft, target, kv_draft, eos), gamma), "spec")
    return baseline.target, baseline, spec
