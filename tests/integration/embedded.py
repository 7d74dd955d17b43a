"""The embedded model for integration tests, loaded once per session per precision (shared by the files)."""

from __future__ import annotations

from functools import cache

import torch

from spectoolkit.models.loading import LoadedModel, load_model, load_tokenizer
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
