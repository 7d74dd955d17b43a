"""Token selection shared by drafters, verifiers and the baseline loop.

Temperature, top-k and top-p must be applied *identically* to the target and the draft
distributions before the acceptance test (DESIGN §1), so they live here, in one place that both
``drafting`` and ``verify`` import (they never import each other). Order follows transformers:
temperature → top-k → top-p, then softmax in fp32.
"""

from __future__ import annotations

import torch

from spectoolkit.config import SamplingConfig


def processed_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Next-token distribution after temperature/top-k/top-p.

    logits: [..., V] any float dtype. Returns [..., V] fp32 summing to 1 on the last axis.
    Requires ``sampling.temperature > 0`` (greedy selection never builds probabilities).
    """
    scaled = logits.float() / sampling.temperature  # [..., V]
    vocab = scaled.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sampling.top_p < 1.0:
        scaled = _top_p_mask(scaled, sampling.top_p)
    return torch.softmax(scaled, dim=-1)


def _top_p_mask(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of highest-probability tokens whose mass reaches ``top_p`` (HF rule)."""
    sorted_logits, sorted_idx = torch.sort(scaled, dim=-1, descending=False)  # [..., V]
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1 - top_p)
    remove_sorted[..., -1:] = False  # always keep the most likely token
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return scaled.masked_fill(remove, float("-inf"))


def sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> int:
    """Inverse-CDF sample from ``probs`` [V] with one uniform in [0, 1) (a 0-d or [1] tensor).

    ``searchsorted(right=True)`` returns the first index whose CDF exceeds u·total, which always has
    positive probability, so zero-probability tokens are never drawn even with rounding.
    """
    cdf = probs.float().cumsum(dim=-1)  # [V]
    threshold = uniform.reshape(1).to(cdf.device).float() * cdf[-1]
    index = int(torch.searchsorted(cdf, threshold, right=True).item())
    if index >= probs.shape[-1]:  # u·total rounded up to the total: take the last positive token
        index = int(torch.nonzero(probs > 0)[-1].item())
    return index


class GreedyChooser:
    """Greedy selection: the argmax in fp32 (first index on ties); no distribution is kept."""

    sampling = SamplingConfig(temperature=0.0)  # what a tree's children are chosen by (its top-k)

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> tuple[int, None]:
        """logits [V] -> (token, None)."""
        return int(torch.argmax(logits.float()).item()), None


class RandomChooser:
    """Sampling from the processed distribution with one uniform from the request's generator."""

    def __init__(self, sampling: SamplingConfig) -> None:
        self.sampling = sampling

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
        """logits [V] -> (token, probs [V] fp32: the distribution the token was drawn from)."""
        probs = processed_probs(logits, self.sampling)
        uniform = torch.rand(1, generator=generator)  # CPU generator: same stream on any device
        return sample_from(probs, uniform), probs


def make_chooser(sampling: SamplingConfig) -> GreedyChooser | RandomChooser:
    """The token chooser for ``sampling``, fixed once per run."""
    return GreedyChooser() if sampling.greedy else RandomChooser(sampling)
