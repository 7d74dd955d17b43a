"""Batch-1 arms of the one engine for the distribution tests: the target alone, a sampler, its negative control."""

from __future__ import annotations

import torch

from spectoolkit.config import SamplingConfig, TreeConfig
from spectoolkit.drafting import ModelDrafter, NgramDrafter
from spectoolkit.kernels.verifier import make_verifier
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.policy import FixedPolicy
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import make_runner
from spectoolkit.sampling import make_chooser
from spectoolkit.serving.engine import ContinuousEngine
from spectoolkit.serving.one import OneRequestEngine
from spectoolkit.serving.scheduler import SchedulerLimits

BLOCKS, BLOCK, POSITIONS = 64, 8, 256
VOCAB = 12  # the distribution tests' tiny vocabulary: every token's probability is estimated from samples
EOS_IDS = frozenset({2})
PROMPT = [1, 5, 7, 3, 9, 4, 11, 6, 8, 10, 0, 3, 5, 7]  # every non-EOS id occurs: n-gram lookup proposes
T1 = SamplingConfig(temperature=1.0)
TOP_K_P = SamplingConfig(temperature=1.0, top_k=5, top_p=0.9)


def tiny(seed: int) -> torch.nn.Module:
    """A one-layer random Llama over :data:`VOCAB` ids: seed 0 is the distribution tests' target, seed 1 their draft."""
    return tiny_llama(vocab_size=VOCAB, seed=seed, num_layers=1, hidden=32, scale=3.0)


def batched(draft: torch.nn.Module | None, sampling: SamplingConfig, vocab: int, eos_ids: frozenset[int]):
    """A batched model drafter over its own pool, or (``draft=None``) n-gram lookup with one-hot q."""
    if draft is None:
        return NgramDrafter(3, 1, vocab, True)
    pool, allocator = make_pool(draft, "auto", BLOCKS * BLOCK), BlockAllocator(BLOCKS, BLOCK)
    return ModelDrafter(make_runner(draft, pool), make_chooser(sampling), allocator, vocab, vocab, eos_ids)


def arms(model, drafter, control, sampling: SamplingConfig, gamma: int, eos_ids: frozenset[int],
         tree: TreeConfig | None = None) -> dict[str, OneRequestEngine]:  # fmt: skip
    """{"baseline", "spec", "control"}: stochastic one-request engines sharing ``model``'s pool; with ``tree``
    the drafting arms draft trees of at most ``tree.max_nodes`` nodes, ``gamma`` deep (dynamic, n-gram)."""
    runner, allocator = make_runner(model, make_pool(model, "auto", BLOCKS * BLOCK)), BlockAllocator(BLOCKS, BLOCK)

    def engine(name: str, chosen, budget: int) -> OneRequestEngine:
        chosen = chosen.variant(None, tree) if chosen is not None else None
        limits = SchedulerLimits(POSITIONS, 1, None, None)
        return OneRequestEngine(ContinuousEngine(name, runner, allocator, make_verifier(sampling), limits,
                                                 eos_ids, POSITIONS, chosen, True, False, FixedPolicy(budget, depth)),
                                name)  # fmt: skip

    budget, depth = (tree.max_nodes if tree is not None else gamma), gamma
    return {"baseline": engine("baseline", None, 0), "spec": engine("spec", drafter, budget),
            "control": engine("control", control, budget)}  # fmt: skip
