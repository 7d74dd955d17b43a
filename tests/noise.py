"""A draft that agrees with its model in part: the model's weights plus Gaussian noise."""

from __future__ import annotations

import copy

import torch


def noisy_copy(model: torch.nn.Module, sigma: float, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise (sigma × each tensor's std) on every weight: partial acceptance."""
    noisy = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in noisy.parameters():
            param.add_(sigma * param.std() * torch.randn(param.shape, generator=gen))
    return noisy
