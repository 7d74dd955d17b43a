"""The embedded model for integration tests, loaded once per session per precision (shared by the files)."""

from __future__ import annotations

from functools import cache

import torch

from spectoolkit.drafting import ModelDrafter, NgramDrafter
from spectoolkit.engine import BaselineEngine, SpeculativeEngine
from spectoolkit.models.cached import CachedModel
from spectoolkit.sampling import GreedyChooser
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


def greedy_engines(
    target_precision: str, draft: str, kv_target: str, kv_draft: str | None, gamma: int
) -> tuple[CachedModel, BaselineEngine, SpeculativeEngine]:
    """The target runner, the target alone and greedy speculation with ``draft`` (a precision or "ngram")."""
    target = model(target_precision)
    eos = eos_ids_of(tokenizer(), target.model)
    runner = CachedModel(target.model, kv_target)
    if draft == "ngram":
        drafter = NgramDrafter(3, 2, target.vocab_size, one_hot_probs=False)
    else:
        drafter = ModelDrafter(model(draft).model, GreedyChooser(), target.vocab_size, target.vocab_size, eos,
                               kv_precision=kv_draft)  # fmt: skip
    return (
        runner,
        BaselineEngine(runner, GreedyVerifier(), eos),
        SpeculativeEngine(runner, drafter, GreedyVerifier(), gamma, eos),
    )
