"""The interface every decode loop implements, as the protocol and the quality jobs use it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from spectoolkit.engine.output import GenerationOutput
from spectoolkit.models.cached import CachedModel


class Engine(Protocol):
    """Decodes one request at a time with a target (and, speculatively, a drafter)."""

    name: str
    target: CachedModel  # the target runner: its forward is what calibration times and divergences replay

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        generator: torch.Generator | None,
        on_token: Callable[[int], None] | None = None,
    ) -> GenerationOutput:
        """Decode up to ``max_new_tokens`` tokens after ``prompt_ids``; ``on_token(id)`` streams them."""

    def kv_bytes(self) -> dict[str, int]:
        """Allocated KV-cache bytes: ``{"target_kv_bytes": …, "draft_kv_bytes": …}``."""
