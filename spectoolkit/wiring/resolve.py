"""Resolve once, at the door: a composed run config -> the resolved things the run loads.

:func:`resolve_run` is the one step between a run's config and its loaders (:func:`spectoolkit.wiring.setup.build`
calls it first): the device; the target's and the draft's checkpoints (the embedded model's directory, a GGUF file
or ``make pair`` model converted once, a local directory checked, a hub id looked up), from which the tokenizer
loads too; which drafters the run builds and whether one is a draft model; how the linears run (the kernel mode and
the widths they are timed at). Below it, loading, the compat check and the arm builders take these and never
resolve a spec again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectoolkit.checkpoints import Checkpoint, resolve_checkpoint
from spectoolkit.config import RunConfig, drafter_kinds
from spectoolkit.models.paths import resolve_device

DRAFT_WIDTHS = (1, 2)  # a draft model's kernels are timed at a decode step and a two-row catch-up


@dataclass(frozen=True)
class ResolvedRun:
    """What one run loads, resolved from its config once."""

    device: torch.device
    target: Checkpoint  # the target's weights; its tokenizer is the run's
    draft: Checkpoint  # a draft model's weights: the target's own for a self-draft (a precision, skip)
    separate_draft: bool  # model.draft_path names a checkpoint of its own: the compat check runs
    drafters: frozenset[str]  # the drafter kinds the run builds (:func:`~spectoolkit.config.drafter_kinds`)
    kernel_mode: str | None  # runtime.kernels for the loaders; None under runtime.compile (the graphs bring theirs)
    target_widths: tuple[int, int]  # a target's kernels timed at a decode step and the widest verify forward
    verify_sizes: tuple[int, ...]  # rows of the verify forwards the run's arms make

    @property
    def model_drafts(self) -> bool:
        """Whether a draft model runs (+draft=<precision>, or the hybrid with draft.hybrid_with=model)."""
        return "model" in self.drafters


def resolve_run(cfg: RunConfig) -> ResolvedRun:
    """The resolved things ``cfg`` loads; a user mistake (a missing model, no GPU) raises SpecToolkitError."""
    device = resolve_device(cfg.device)
    drafters = frozenset(drafter_kinds(cfg))
    target = resolve_checkpoint(cfg.model.target_path)
    separate = bool(cfg.model.draft_path and cfg.model.draft_path != cfg.model.target_path)
    draft = resolve_checkpoint(cfg.model.draft_path) if separate and "model" in drafters else target
    sizes = verify_sizes(cfg)
    return ResolvedRun(device, target, draft, separate, drafters, kernel_mode(cfg), (1, max(sizes)), sizes)


def kernel_mode(cfg: RunConfig) -> str | None:
    """``runtime.kernels`` for the loaders; None under ``runtime.compile`` (the compiled steps bring their own
    row-invariant kernels)."""
    return None if cfg.runtime.compiled else cfg.runtime.kernels


def verify_sizes(cfg: RunConfig) -> tuple[int, ...]:
    """Rows of the verify forwards the run's arms make: γ + 1 per drafting arm, max_nodes + 1 for a tree."""
    gammas = cfg.bench.gammas if cfg.bench.arms in ("gamma_sweep", "tree_chain") else (cfg.speculate.gamma,)
    tree = cfg.speculate.tree.max_nodes if cfg.speculate.tree.enabled else 0
    return tuple(sorted({g + 1 for g in gammas} | ({tree + 1} if tree else set())))
