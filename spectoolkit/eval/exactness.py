"""Greedy exactness report: spec output vs the target alone at the same precision (DESIGN §1).

For every (case, repeat) pair the output ids are compared. At a divergence the report records the
position, both tokens, and the reference's top-2 logit margin there (the target alone, recomputed
over prompt + reference prefix), and classifies it:

- ``near_tie``: the margin is within the numerical resolution of the case — a verify forward over
  k tokens rounds differently from a 1-token step (bf16 logits, activations rounded inside quantized
  matmuls, K/V rounded to fp8/int8/int4), so a margin that small can flip the argmax legitimately;
- ``near_tie`` also when the margin is larger but the target alone, at the same precision, emits the
  spec token when that position is scored inside a k-token forward (k = 2..γ+1, as verification
  scores it): the rounding difference is then shown, not assumed (``flip_width`` = that k);
- ``unexplained``: otherwise — speculation changed the output. It fails the verdict.

The thresholds are dtype-aware (the largest of the target's and the KV format's) and stated in
the report beside every margin.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from spectoolkit.metrics.summary import first_divergence
from spectoolkit.models.cached import CachedModel

# Largest top-2 logit margin a 1-token vs k-token rounding difference can flip, per target precision.
TARGET_TIE = {"fp32": 1e-3, "float32": 1e-3, "auto": 1e-3, "bf16": 0.5, "fp16": 0.06}  # bf16 ulp at ~20: 0.125
QUANT_TARGET_TIE = 0.1  # activations rounded to bf16/int8 inside the quantized matmuls
KV_TIE = {"auto": 0.0, "fp32": 0.0, "bf16": 0.05, "fp16": 0.01, "int8": 0.25, "fp8": 0.5, "int4": 0.5}
NEAR_TIE, UNEXPLAINED = "near_tie", "unexplained"
EXACT, EXACT_UP_TO_TIES, FAILED = "exact", "exact up to near-ties", "unexplained divergence"


def near_tie_threshold(target_precision: str, kv: str = "auto") -> float:
    """The largest top-2 margin that counts as a numerical near-tie for this target and KV format."""
    return max(TARGET_TIE.get(target_precision, QUANT_TARGET_TIE), KV_TIE.get(kv, 0.5))


def classify(margin: float, threshold: float) -> str:
    return NEAR_TIE if margin <= threshold else UNEXPLAINED


@dataclass(frozen=True)
class Divergence:
    """One diverging (case, repeat) of a drafting arm against its reference arm."""

    arm: str
    case_id: str
    repeat_idx: int
    position: int
    reference_token: int | None
    spec_token: int | None
    margin: float | None  # None: not examined (past the cap of margins computed)
    threshold: float
    classification: str
    flip_width: int | None = None  # a k-token forward of the target alone that emits the spec token


@torch.inference_mode()
def top2_margin(runner: CachedModel, prompt_ids: Sequence[int], reference_prefix: Sequence[int]) -> float:
    """Top-1 minus top-2 logit of the target alone after prompt + ``reference_prefix`` (cache reset first)."""
    runner.reset()
    logits = runner.forward(list(prompt_ids) + list(reference_prefix), last_only=True).float()  # [V]
    runner.reset()
    top2 = torch.topk(logits, 2).values
    return float(top2[0] - top2[1])


def divergence(
    runner: CachedModel,
    prompt_ids: Sequence[int],
    reference: Sequence[int],
    output: Sequence[int],
    threshold: float,
    *,
    arm: str = "spec",
    case_id: str = "",
    repeat_idx: int = 0,
    max_width: int = 1,
) -> Divergence | None:
    """The classified first divergence of ``output`` from ``reference`` (None when identical).

    A length difference (one stopped at EOS earlier) is judged at the shorter end like a token: the
    margin there decides whether EOS vs another token was a near-tie. ``max_width`` = γ + 1 enables
    the flip check (1: margin only).
    """
    position = first_divergence(reference, output)
    if position is None:
        return None
    margin = top2_margin(runner, prompt_ids, reference[:position])
    token = lambda ids: int(ids[position]) if position < len(ids) else None  # noqa: E731
    context = list(prompt_ids) + list(reference[:position])
    flip = None
    if margin > threshold and token(output) is not None:
        flip = flip_width(runner, context, token(output), max_width)
    classification = NEAR_TIE if flip else classify(margin, threshold)
    return Divergence(arm, case_id, repeat_idx, position, token(reference), token(output), margin, threshold,
                      classification, flip)  # fmt: skip


@torch.inference_mode()
def flip_width(runner: CachedModel, context: Sequence[int], token: int, max_width: int) -> int | None:
    """The smallest k in 2..``max_width`` for which the target alone, scoring the next position with the
    last k context tokens in one forward (as a verify round does), picks ``token``; None if none does."""
    for width in range(2, min(max_width, len(context) - 1) + 1):
        runner.reset()
        runner.forward(list(context[:-width]), last_only=True)
        logits = runner.forward(list(context[-width:]))[-1]  # [V] the prediction after the whole context
        runner.reset()
        if int(torch.argmax(logits)) == token:
            return width
    return None


def verdict(pairs: int, divergences: Iterable[Divergence]) -> dict[str, Any]:
    """The exactness section: counts, the verdict, and every divergence with its margin and class."""
    found = list(divergences)
    unexplained = sum(d.classification == UNEXPLAINED for d in found)
    ties = len(found) - unexplained
    result = EXACT if not found else (FAILED if unexplained else EXACT_UP_TO_TIES)
    return {
        "verdict": result,
        "passed": unexplained == 0,
        "pairs": pairs,
        "identical": pairs - len(found),
        "near_ties": ties,
        "unexplained": unexplained,
        "divergences": [asdict(d) for d in found],
    }
