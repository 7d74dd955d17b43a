"""The embedded model for integration tests, loaded once per session per precision (shared by the files)."""

from __future__ import annotations

from functools import cache

import torch

from spectoolkit.config import TreeConfig
from spectoolkit.drafting import ModelDrafter, NgramDrafter
from spectoolkit.policy import FixedPolicy
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.compiled import CompiledRunner
from spectoolkit.runtime.eager import EagerRunner
from spectoolkit.runtime.lone import LoneSequence
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import Runner
from spectoolkit.sampling import GreedyChooser, make_chooser
from spectoolkit.serving.engine import ContinuousEngine
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
def model(precision: str, compiled: bool = False) -> LoadedModel:
    """The embedded model at ``precision``; for the compiled runner without eager kernel choices (as a run loads it)."""
    return load_model(None, precision, torch.device("cpu"), kernels=None if compiled else "auto")


@cache
def encoded(prompts: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Chat-templated prompt ids of ``prompts``."""
    return tuple(tuple(encode_prompt(tokenizer(), Request(str(i), "qa", p), True)) for i, p in enumerate(prompts))


SLOTS, BLOCK = 8 * 1024, 16  # per pool: four requests of a chat prompt + 64 tokens, and more
COMPILED_WIDTHS = (1, 8, 32)  # a decode step, a verify window, a batched step or prompt chunk: three graphs per runner


def runner(precision: str, kv: str, compiled: bool = False) -> tuple[Runner, BlockAllocator]:
    """The embedded model's runner over a fresh pool of KV at ``kv``, and the pool's allocator; a compiled one
    is built once per session and key (its graphs take minutes) and shared by the engines built on it."""
    if compiled:
        return _compiled_runner(precision, kv)
    loaded = model(precision).model
    return EagerRunner(loaded, make_pool(loaded, kv, SLOTS)), BlockAllocator(SLOTS // BLOCK, BLOCK)


@cache
def _compiled_runner(precision: str, kv: str) -> tuple[Runner, BlockAllocator]:
    loaded = model(precision, True).model
    built = CompiledRunner(loaded, make_pool(loaded, kv, SLOTS), COMPILED_WIDTHS)
    return built, BlockAllocator(SLOTS // BLOCK, BLOCK)


def drafter(draft: str, target: LoadedModel, kv_draft: str | None, eos: frozenset[int], sampling=None,
            compiled: bool = False):  # fmt: skip
    """A batched drafter: n-gram lookup (``draft="ngram"``) or the embedded model at precision ``draft``."""
    if draft == "ngram":
        return NgramDrafter(3, 2, target.vocab_size, one_hot_probs=False)
    draft_runner, allocator = runner(draft, kv_draft or "auto", compiled)
    chooser = make_chooser(sampling) if sampling is not None else GreedyChooser()
    return ModelDrafter(draft_runner, chooser, allocator, target.vocab_size, target.vocab_size, eos)


def engine(target: LoadedModel, kv: str, eos: frozenset[int], drafted=None, gamma: int = 0, *, invariant: bool = False,
           policy=None, tree: TreeConfig | None = None, max_seqs: int = 1,
           compiled: bool = False) -> ContinuousEngine:  # fmt: skip
    """The one engine on ``target`` (KV at ``kv``; the session's runner for it) with ``drafted`` (or none), greedy;
    ``tree`` (enabled): ``gamma`` is its node budget."""
    limits = SchedulerLimits(2048, max_seqs, None, None)
    positions = target.model.config.get_text_config().max_position_embeddings
    if drafted is not None and tree is not None:
        drafted = drafted.variant(None, tree)
    target_runner, allocator = runner(target.precision, kv, compiled)
    return ContinuousEngine("test", target_runner, allocator, GreedyVerifier(), limits, eos, positions, drafted,
                            False, invariant, policy or FixedPolicy(gamma))  # fmt: skip


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


def assert_greedy_identical(baseline, spec, prompts: tuple[str, ...], max_new: int, label: str) -> None:
    """For every prompt, ``spec``'s output ids equal ``baseline``'s (the target alone), and something was drafted
    over the prompts (else the check shows nothing)."""
    drafted = 0
    for prompt in encoded(prompts):
        reference = baseline.generate(list(prompt), max_new, None).output_ids
        out = spec.generate(list(prompt), max_new, None)
        assert out.output_ids == reference, (
            f"{label}: divergence on prompt {prompt[:8]}…: {out.output_ids} vs {reference}"
        )
        drafted += out.drafted_tokens
    assert drafted > 0, f"{label}: nothing drafted, the test shows nothing"
