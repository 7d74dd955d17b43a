"""Target-alone decoding: prefill, then one target forward per token. The reference arm."""

from __future__ import annotations

import time

import torch

from spectoolkit.engine.output import GenerationOutput, finished, prefill
from spectoolkit.models.cached import CachedModel, synchronize
from spectoolkit.verify.base import Verifier


class BaselineEngine:
    """Plain autoregressive decoding with the same token selection as the verifier."""

    name = "baseline"

    def __init__(self, target: CachedModel, verifier: Verifier, eos_ids: frozenset[int]) -> None:
        self.target = target
        self.verifier = verifier
        self.eos_ids = eos_ids

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, generator: torch.Generator | None, on_token=None
    ) -> GenerationOutput:
        """Decode up to ``max_new_tokens`` tokens after ``prompt_ids``; ``on_token(id)`` streams them."""
        out = GenerationOutput()
        start = time.perf_counter()
        token = prefill(self.target, self.verifier, prompt_ids, generator, out, start, on_token)
        while not finished(out.output_ids, max_new_tokens, self.eos_ids):
            token = self.verifier.select(self.target.forward([token], last_only=True), generator)
            out.output_ids.append(token)
            out.verify_rounds += 1
            if on_token:
                on_token(token)
        synchronize(self.target.device)
        out.total_time = time.perf_counter() - start
        out.verify_time = out.total_time - out.prefill_time
        return out

    def kv_bytes(self) -> dict[str, int]:
        return {"target_kv_bytes": self.target.cache.allocated_bytes(), "draft_kv_bytes": 0}
