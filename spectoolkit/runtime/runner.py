"""The one interface every model runner implements: ``forward(batch) -> logits rows``.

A runner owns a model's forward over a paged KV pool; everything a forward needs to know about the
step (tokens, positions, slots, which rows see which keys, how linears run rows) is the
:class:`~spectoolkit.runtime.step.StepBatch` it is given, never state set somewhere else.
"""

from __future__ import annotations

from typing import Protocol

import torch

from spectoolkit.runtime.paged_kv import PagedKVPool
from spectoolkit.runtime.step import Segment, StepBatch, build_step


class Runner(Protocol):
    """A model over its pool."""

    model: torch.nn.Module
    pool: PagedKVPool
    device: torch.device
    row_exact: bool  # every row's result is independent of the step's other rows (our CPU kernels throughout)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Write the batch's KV to the pool; the logits [R, V] of ``batch.logit_rows``."""

    def forward_states(self, batch: StepBatch, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``, and the residual stream entering each of ``layers`` for every row, side by side
        [T, len(layers) * E] (what a draft head reads)."""


def make_runner(model: torch.nn.Module, pool: PagedKVPool, compiled: bool = False) -> Runner:
    """The runner ``runtime.compile`` asks for over ``pool``: compiled graphs, or the eager loop."""
    from spectoolkit.runtime.compiled import CompiledRunner  # torch.compile's import cost only when asked
    from spectoolkit.runtime.eager import EagerRunner

    return CompiledRunner(model, pool) if compiled else EagerRunner(model, pool)


def run_segments(runner: Runner, segments: list[Segment], mode: str) -> torch.Tensor:
    """``runner.forward`` of ``segments`` in row ``mode``: logits [R, V] of every segment's ``logit_rows``, in order."""
    return runner.forward(build_step(segments, mode, runner.device))


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so wall-clock timings are honest on CUDA (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
