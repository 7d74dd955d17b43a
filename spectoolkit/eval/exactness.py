"""Greedy exactness report: spec output vs the target alone at the same precision (DESIGN §1, §6).

For every (case, repeat) pair the output ids are compared. At the first divergence the report
records the position, both tokens and the reference's top-2 logit margin there (the target alone,
recomputed over prompt + reference prefix, for information), and then *reproduces* instead of
inferring: :func:`replay_round` recomputes, with the target alone, the spec run's own schedule — the
prefill, every earlier round at its width with its KV truncation, and the round that emitted the
diverging token at its window start and width, on the same runner (same KV precision). Classes:

- ``near_tie``: the replay emits the spec token. The target alone, computing exactly that round,
  does what speculation did, so the divergence is the numerics of a k-row window vs 1-row steps —
  shown, not assumed;
- ``unexplained``: otherwise, whatever the margin — speculation changed the output. A length
  difference (one output a strict prefix of the other) is always unexplained: with the same
  ``max_new_tokens`` and EOS set both stop rules agree, so rounding cannot produce it.

Records without round data (``draft_lengths`` / ``accept_lengths`` empty or not matching the output,
as written before they were recorded) cannot be replayed: they fall back to the width scan
(:func:`flip_width`, widths 2..``max_width``), which reproduces the spec token with the target alone
but not the spec run's KV history; without a flip they are unexplained. The margin alone never
excuses a divergence; the dtype-aware threshold is still stated beside every margin.

The verdict counts divergent pairs plainly: reproduced divergences in more than ``MAX_TIE_SHARE``
of the pairs are "diverges by rounding" and fail, never "exact up to near-ties".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from spectoolkit.metrics.summary import first_divergence
from spectoolkit.runtime.lone import LoneSequence

# Largest top-2 logit margin a 1-token vs k-token rounding difference can flip, per target precision.
TARGET_TIE = {"fp32": 1e-3, "float32": 1e-3, "auto": 1e-3, "bf16": 0.5, "fp16": 0.06}  # bf16 ulp at ~20: 0.125
QUANT_TARGET_TIE = 0.1  # activations rounded to bf16/int8 inside the quantized matmuls
KV_TIE = {"auto": 0.0, "fp32": 0.0, "bf16": 0.05, "fp16": 0.01, "int8": 0.25, "fp8": 0.5, "int4": 0.5}
NEAR_TIE, UNEXPLAINED = "near_tie", "unexplained"
EXACT, EXACT_UP_TO_TIES, FAILED = "exact", "exact up to near-ties", "unexplained divergence"
DIVERGENT_ROUNDING = "diverges by rounding"  # every divergence reproduced, but in too many pairs
MAX_TIE_SHARE = 0.1  # largest share of divergent pairs that can still be "exact up to near-ties"


def near_tie_threshold(target_precision: str, kv: str = "auto") -> float:
    """The largest top-2 margin that counts as a numerical near-tie for this target and KV format
    (reported beside each margin for information; it no longer classifies)."""
    return max(TARGET_TIE.get(target_precision, QUANT_TARGET_TIE), KV_TIE.get(kv, 0.5))


@dataclass(frozen=True)
class ReplayResult:
    """The target alone recomputing the spec round that emitted one output position."""

    position: int  # output index replayed
    replayed_token: int  # the target alone's argmax there
    spec_token: int  # what the spec run emitted there
    round: int  # 0: the prefill; r >= 1: the r-th verify round
    window_start: int  # absolute position of that forward's first input (the pending token; prefill: 0)
    width: int  # inputs of that forward: k_r + 1 (prefill: the prompt length)
    reproduced: bool  # replayed_token == spec_token


@dataclass(frozen=True)
class Divergence:
    """One diverging (case, repeat) of a drafting arm against its reference arm."""

    arm: str
    case_id: str
    repeat_idx: int
    position: int
    reference_token: int | None
    spec_token: int | None
    margin: float | None  # None: not examined (past the cap of divergences examined)
    threshold: float
    classification: str
    flip_width: int | None = None  # fallback without round data: a k-token forward that emits the spec token
    replayed_token: int | None = None  # the target alone's token in the replayed spec round
    replay_round: int | None = None  # 0: prefill, r >= 1: verify round r; None: not replayed
    replay_window_start: int | None = None
    replay_width: int | None = None
    reproduced: bool = False  # the target alone emitted the spec token there (replay, else width scan)


def round_of(position: int, accept_lengths: Sequence[int]) -> tuple[int, int] | None:
    """(round, first output position that round emitted) for output ``position``; None past the rounds.

    The prefill emits position 0; verify round r (1-based) emits K_r + 1 tokens after it.
    """
    if position == 0:
        return 0, 0
    start = 1
    for index, accepted in enumerate(accept_lengths, start=1):
        if position <= start + accepted:
            return index, start
        start += accepted + 1
    return None


def rounds_cover(num_output: int, draft_lengths: Sequence[int], accept_lengths: Sequence[int]) -> bool:
    """Whether the round data can be the schedule of an output of ``num_output`` tokens: one entry per
    round, 0 <= K <= k, and the rounds emit the output (the last one possibly cut at EOS)."""
    if len(draft_lengths) != len(accept_lengths) or num_output < 1:
        return False
    if any(not 0 <= accepted <= drafted for drafted, accepted in zip(draft_lengths, accept_lengths, strict=True)):
        return False
    if not accept_lengths:
        return num_output == 1
    before_last = 1 + sum(accepted + 1 for accepted in accept_lengths[:-1])
    return before_last < num_output <= before_last + accept_lengths[-1] + 1


def _window(output_ids: Sequence[int], start: int, drafted: int, known_end: int) -> list[int]:
    """The inputs of the round emitting from ``start``: [pending, output[start:known_end]], padded to
    width ``drafted`` + 1 with output[known_end] (the correction/bonus of an earlier round, the spec
    token itself in the replayed round).

    The padded slots stand for drafts the spec run's verifier rejected (values not recorded). Causal
    attention keeps them out of every row up to ``known_end``, and they are truncated away (earlier
    rounds) or never read (the replayed round): only the width, which sets the shape of the k-row
    forward, can change the kept rows' numerics — the filler's values cannot.
    """
    known = list(output_ids[start - 1 : known_end])
    return known + [output_ids[known_end]] * (drafted + 1 - len(known))


@torch.inference_mode()
def replay_round(
    runner: LoneSequence,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    draft_lengths: Sequence[int],
    accept_lengths: Sequence[int],
    position: int,
) -> ReplayResult:
    """Recompute, with the target alone, the spec round that emitted ``output_ids[position]``.

    As the engine does: prefill the prompt (last row
    only), then for each earlier round r forward [pending, K_r accepted, k_r - K_r fillers] (width
    k_r + 1) and truncate the KV to prefix + pending + accepted; in the round of ``position`` take the
    row that predicted it. ``draft_lengths`` / ``accept_lengths``: [rounds] k_r proposed, K_r accepted;
    ``position`` < len(``output_ids``) (past the spec's end there is no spec round to replay). The
    runner is reset before and after.
    """
    located = round_of(position, accept_lengths) if position < len(output_ids) else None
    if located is None or len(draft_lengths) != len(accept_lengths):
        raise ValueError(f"no spec round emitted output position {position} ({len(accept_lengths)} rounds recorded)")
    target_round = located[0]
    runner.reset()
    row = runner.forward(list(prompt_ids), last_only=True)  # [V], predicts output position 0
    window_start, width, start = 0, len(prompt_ids), 1  # start: first output position of the round
    for index in range(target_round):
        drafted, accepted = draft_lengths[index], accept_lengths[index]
        is_target = index == target_round - 1
        window = _window(output_ids, start, drafted, position if is_target else start + accepted)
        window_start, width = len(prompt_ids) + start - 1, len(window)
        logits = runner.forward(window)  # [k_r + 1, V]
        if is_target:
            row = logits[position - start]  # [V]
        else:
            runner.truncate(len(prompt_ids) + start + accepted)  # the engine's kept length
            start += accepted + 1
    runner.reset()
    replayed = int(torch.argmax(row.float()))  # the greedy verifier's rule: fp32, first maximum
    spec_token = int(output_ids[position])
    return ReplayResult(position, replayed, spec_token, target_round, window_start, width, replayed == spec_token)


@torch.inference_mode()
def top2_margin(runner: LoneSequence, prompt_ids: Sequence[int], reference_prefix: Sequence[int]) -> float:
    """Top-1 minus top-2 logit of the target alone after prompt + ``reference_prefix`` (cache reset first)."""
    runner.reset()
    logits = runner.forward(list(prompt_ids) + list(reference_prefix), last_only=True).float()  # [V]
    runner.reset()
    top2 = torch.topk(logits, 2).values
    return float(top2[0] - top2[1])


def divergence(
    runner: LoneSequence,
    prompt_ids: Sequence[int],
    reference: Sequence[int],
    output: Sequence[int],
    threshold: float,
    *,
    arm: str = "spec",
    case_id: str = "",
    repeat_idx: int = 0,
    max_width: int = 1,
    draft_lengths: Sequence[int] | None = None,
    accept_lengths: Sequence[int] | None = None,
) -> Divergence | None:
    """The classified first divergence of ``output`` from ``reference`` (None when identical).

    ``draft_lengths`` / ``accept_lengths``: the spec run's rounds (k_r, K_r). When they cover
    ``output`` the round that emitted the divergence is replayed (:func:`replay_round`); otherwise the
    width scan 2..``max_width`` (= γ + 1; 1: none) is the only way to reproduce it. A length difference
    is judged at the shorter end (:func:`first_divergence`) and is never a near-tie.
    """
    position = first_divergence(list(reference), list(output))
    if position is None:
        return None
    margin = top2_margin(runner, prompt_ids, reference[:position])  # for information only
    token = lambda ids: int(ids[position]) if position < len(ids) else None  # noqa: E731
    reference_token, spec_token = token(reference), token(output)
    replayable = (draft_lengths is not None and accept_lengths is not None
                  and rounds_cover(len(output), draft_lengths, accept_lengths))  # fmt: skip
    replay, flip = None, None
    if spec_token is not None and replayable:
        replay = replay_round(runner, prompt_ids, output, draft_lengths, accept_lengths, position)
    elif spec_token is not None:
        flip = flip_width(runner, list(prompt_ids) + list(reference[:position]), spec_token, max_width)
    reproduced = replay.reproduced if replay else flip is not None
    tie = reproduced and reference_token is not None  # a length difference is never rounding
    classification = NEAR_TIE if tie else UNEXPLAINED
    return Divergence(arm, case_id, repeat_idx, position, reference_token, spec_token, margin, threshold,
                      classification, flip, reproduced=reproduced, **_replay_fields(replay))  # fmt: skip


def _replay_fields(replay: ReplayResult | None) -> dict[str, int]:
    if replay is None:
        return {}
    return {"replayed_token": replay.replayed_token, "replay_round": replay.round,
            "replay_window_start": replay.window_start, "replay_width": replay.width}  # fmt: skip


@torch.inference_mode()
def flip_width(runner: LoneSequence, context: Sequence[int], token: int, max_width: int) -> int | None:
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
    """The exactness section: counts, the verdict, and every divergence with its margin and class.

    exact: no divergence; exact up to near-ties: every divergence reproduced and at most
    ``MAX_TIE_SHARE`` of the pairs diverge; diverges by rounding: every one reproduced, in more pairs
    than that (fails); unexplained divergence: any not reproduced (fails).
    """
    found = list(divergences)
    unexplained = sum(d.classification == UNEXPLAINED for d in found)
    share = len(found) / pairs if pairs else 0.0
    if not found:
        result = EXACT
    elif unexplained:
        result = FAILED
    else:
        result = EXACT_UP_TO_TIES if share <= MAX_TIE_SHARE else DIVERGENT_ROUNDING
    return {
        "verdict": result,
        "passed": result in (EXACT, EXACT_UP_TO_TIES),
        "pairs": pairs,
        "identical": pairs - len(found),
        "divergent_pairs": len(found),
        "divergent_share": share,
        "max_tie_share": MAX_TIE_SHARE,
        "near_ties": len(found) - unexplained,
        "unexplained": unexplained,
        "divergences": [asdict(d) for d in found],
    }
