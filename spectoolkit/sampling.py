"""Token selection shared by drafters, verifiers and the baseline loop.

Temperature, top-k, top-p and min-p must be applied *identically* to the target and the draft
distributions before the acceptance test (DESIGN §1), so they live here, in one place that both
``drafting`` and ``verify`` import (they never import each other). Order follows transformers:
temperature → top-k → top-p → min-p, then softmax in fp32. Repetition, presence and frequency
penalties (vLLM's definitions) change the logits before that, from the tokens a row follows.

A run's :class:`~spectoolkit.config.SamplingConfig` is the default; a request may bring its own
:class:`SamplingParams` (the server's per-request settings), validated on construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Protocol

import torch

from spectoolkit.config import SamplingConfig
from spectoolkit.errors import SpecToolkitError

MIN_TEMPERATURE = 1e-5  # below this (but > 0) the scaled logits overflow: send 0 for greedy (vLLM's epsilon)
MAX_LOGPROBS = 20  # top alternatives per emitted token (OpenAI's limit)


class SamplingError(SpecToolkitError):
    """A per-request sampling value out of range; ``field`` names it (the server's 400 ``param``)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    """One request's token rule: what shapes each next-token distribution (vLLM's ``SamplingParams``, that part),
    and how many log-probabilities come back per emitted token. ``temperature == 0`` is greedy (the argmax of the
    penalized logits)."""

    temperature: float = 0.0
    top_p: float = 1.0  # 1.0: off
    top_k: int = 0  # 0 (or -1, vLLM's spelling): off
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0  # subtracted once from every token the output holds (OpenAI: -2..2)
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output (OpenAI: -2..2)
    repetition_penalty: float = 1.0  # tokens of prompt or output: logit / rp if > 0 else logit * rp (1: off)
    logprobs: int | None = None  # None: none; k: the emitted token's log-probability and the k most likely

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise SamplingError(f"{item.name}={value!r} must be a number", item.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise SamplingError(f"{item.name}={value} must be finite", item.name)
        _check(self.temperature == 0 or self.temperature >= MIN_TEMPERATURE, "temperature",
               f"temperature={self.temperature} must be 0 (greedy) or >= {MIN_TEMPERATURE:g}")  # fmt: skip
        _check(0 < self.top_p <= 1, "top_p", f"top_p={self.top_p} must be in (0, 1] (1 disables it)")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k",
               f"top_k={self.top_k} must be an integer >= 1, or 0 / -1 to disable it")  # fmt: skip
        object.__setattr__(self, "top_k", max(0, int(self.top_k)))
        _check(0 <= self.min_p <= 1, "min_p", f"min_p={self.min_p} must be in [0, 1] (0 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            _check(-2 <= getattr(self, name) <= 2, name, f"{name}={getattr(self, name)} must be in [-2, 2]")
        _check(self.repetition_penalty > 0, "repetition_penalty",
               f"repetition_penalty={self.repetition_penalty} must be > 0 (1 disables it)")  # fmt: skip
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"logprobs={self.logprobs} must be an integer in [0, {MAX_LOGPROBS}]")  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (then each row's history matters)."""
        return bool(self.active_penalties())

    def active_penalties(self) -> list[tuple[str, float]]:
        """(name, the value that turns it off) of every penalty in use."""
        penalties = (("presence_penalty", self.presence_penalty, 0.0), ("frequency_penalty", self.frequency_penalty,
                     0.0), ("repetition_penalty", self.repetition_penalty, 1.0))  # fmt: skip
        return [(name, off) for name, value, off in penalties if value != off]

    @property
    def mode(self) -> str:
        """ "greedy" or "T=0.7": how records and reports group requests by sampling."""
        return "greedy" if self.greedy else f"T={self.temperature:g}"

    @classmethod
    def of(cls, sampling: SamplingConfig | SamplingParams) -> SamplingParams:
        """``sampling`` as per-request params (a run config's: no penalties, no logprobs)."""
        if isinstance(sampling, SamplingParams):
            return sampling
        return cls(sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p)


def _check(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise SamplingError(message, field)


Processing = SamplingConfig | SamplingParams  # what the distribution of a row is processed by


def processed_probs(logits: torch.Tensor, sampling: Processing) -> torch.Tensor:
    """Next-token distribution after temperature/top-k/top-p/min-p.

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
    if sampling.min_p > 0:
        probs = torch.softmax(scaled, dim=-1)  # [..., V]
        scaled = scaled.masked_fill(probs < sampling.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return torch.softmax(scaled, dim=-1)


def _top_p_mask(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of highest-probability tokens whose mass reaches ``top_p`` (HF rule)."""
    sorted_logits, sorted_idx = torch.sort(scaled, dim=-1, descending=False)  # [..., V]
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1 - top_p)
    remove_sorted[..., -1:] = False  # always keep the most likely token
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return scaled.masked_fill(remove, float("-inf"))


def penalize(
    logits: torch.Tensor, sampling: SamplingParams, prompt_ids: list[int], output_ids: list[int],
    appended: list[list[int]],
) -> torch.Tensor:  # fmt: skip
    """Rows [R, V] after ``sampling``'s penalties (vLLM's rules), row r following prompt + output + ``appended[r]``
    (a verify row after r drafts, or a draft's row after the drafts before it). fp32 [R, V]; the logits themselves
    when nothing is penalized.

    Repetition: every token of the prompt or the row's output, logit / rp if positive else logit x rp. Presence and
    frequency (output tokens only): minus presence once, minus frequency per occurrence.
    """
    if not sampling.penalized:
        return logits
    rows, vocab = logits.shape
    device = logits.device
    base = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab]  # [V]
    counts = base.to(device).float().repeat(rows, 1)  # [R, V]
    for row, extra in enumerate(appended):
        if extra:
            counts[row].index_add_(0, torch.tensor(extra, dtype=torch.long, device=device),
                                   torch.ones(len(extra), device=device))  # fmt: skip
    out = logits.float().clone()  # [R, V]
    if sampling.repetition_penalty != 1:
        seen = counts > 0  # [R, V]
        if prompt_ids:
            seen[:, torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        rp = sampling.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / rp, out * rp), out)
    return out - sampling.frequency_penalty * counts - sampling.presence_penalty * (counts > 0).float()


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

    greedy = True

    def __init__(self, sampling: Processing | None = None) -> None:
        """``sampling``: a greedy request's penalties (what a draft model applies before its argmax); None: none."""
        self.sampling = SamplingParams.of(sampling) if sampling is not None else SamplingParams()

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> tuple[int, None]:
        """logits [V] -> (token, None)."""
        return int(torch.argmax(logits.float()).item()), None


class RandomChooser:
    """Sampling from the processed distribution with one uniform from the request's generator."""

    greedy = False

    def __init__(self, sampling: Processing) -> None:
        self.sampling = SamplingParams.of(sampling)

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
        """logits [V] -> (token, probs [V] fp32: the distribution the token was drawn from)."""
        probs = processed_probs(logits, self.sampling)
        uniform = torch.rand(1, generator=generator)  # CPU generator: same stream on any device
        return sample_from(probs, uniform), probs


class Chooser(Protocol):
    """Picks a token from a row of logits (a draft's, or the baseline's), reporting what it drew from."""

    greedy: bool
    sampling: SamplingParams  # its settings (a greedy chooser: the penalties a draft model applies first)

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
        """logits [V] -> (token, the distribution [V] it was drawn from; None for an argmax)."""
        ...


def make_chooser(sampling: Processing) -> Chooser:
    """The token chooser for ``sampling``, fixed once per run (or per request)."""
    return GreedyChooser(sampling) if sampling.greedy else RandomChooser(sampling)
