"""The training loop of a draft head: AdamW, warm-up then cosine learning rate, gradient clipping, and
checkpoints a run resumes from with the very weights an uninterrupted run reaches.

The sequence of step ``s`` is a pure function of (seed, s) — epoch e visits the sequences in the order of
``randperm`` seeded with seed + e — so resuming needs only the weights, the optimizer state and the step.
A checkpoint is written to a temporary file and renamed, so an interruption never leaves half of one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from spectoolkit.models.eagle3_head import Eagle3Head
from spectoolkit.training.ttt import Sequence, ttt_loss

CHECKPOINT = "train_state.pt"


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 300
    lr: float = 1e-3
    warmup: int = 20
    ttt_steps: int = 3  # draft steps unrolled per anchor
    decay: float = 0.8  # weight of step k's loss: decay ** k
    clip: float = 0.5
    seed: int = 0
    save_every: int = 50  # steps between checkpoints (0: none)


def sequence_at(step: int, count: int, seed: int) -> int:
    """The index of the sequence step ``step`` trains on."""
    epoch, offset = divmod(step, count)
    return int(torch.randperm(count, generator=torch.Generator().manual_seed(seed + epoch))[offset])


def learning_rate(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    done = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))


def train(
    head: Eagle3Head, embeddings: torch.Tensor, sequences: list[Sequence], settings: TrainSettings,
    checkpoint_dir: Path | None = None, stop_after: int | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:  # fmt: skip
    """Train ``head`` in place for ``settings.steps`` steps (resuming from ``checkpoint_dir``'s checkpoint when
    there is one); ``stop_after`` stops early (an interruption, for tests). Returns this call's step losses."""
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    start = 0
    path = None if checkpoint_dir is None else Path(checkpoint_dir) / CHECKPOINT
    if path is not None and path.is_file():
        state = torch.load(path, weights_only=True)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    head.train()
    losses = []
    for step in range(start, settings.steps):
        if stop_after is not None and step >= stop_after:
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, settings)
        seq = sequences[sequence_at(step, len(sequences), settings.seed)]
        loss, _ = ttt_loss(head, embeddings, seq, settings.ttt_steps, settings.decay)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings.clip)
        optimizer.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
        if path is not None and settings.save_every and (step + 1) % settings.save_every == 0:
            _save(path, head, optimizer, step + 1)
    if path is not None and losses:
        _save(path, head, optimizer, start + len(losses))
    head.eval()
    return losses


def _save(path: Path, head: Eagle3Head, optimizer: torch.optim.Optimizer, step: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def agreement(head: Eagle3Head, embeddings: torch.Tensor, sequences: list[Sequence], steps: int) -> list[float]:
    """Per draft step, the share of answer positions where the head's top token is the target's."""
    totals = [[0, 0] for _ in range(steps)]
    for seq in sequences:
        for k, (agree, counted) in enumerate(ttt_loss(head, embeddings, seq, steps)[1]):
            totals[k][0] += agree
            totals[k][1] += counted
    return [agree / max(1, counted) for agree, counted in totals]
