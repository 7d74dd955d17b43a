"""Calibration micro-benchmark: target forward time per verify width, the cost model's V(w) (DESIGN §1).

A verify round runs one target forward over k + 1 tokens on top of a context; V grows with the
width (attention, KV writes, logits rows), so it is measured, not assumed equal to T₁. The context
is prefilled once; every timed forward appends w tokens and is rolled back with ``truncate``, so all
widths see the same context length. Widths are visited ascending and descending in alternate passes
so slow drift (clocks, thermals) is shared, and the median per width is kept.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence

from spectoolkit.runtime.lone import LoneSequence
from spectoolkit.runtime.runner import synchronize

DEFAULT_MAX_WIDTH = 17  # verify width of γ = 16, the largest γ the cost model predicts for


def calibration_widths(gammas: Iterable[int], floor: int = 8) -> list[int]:
    """Widths 1..max(max(gammas), floor)+1: every verify forward of the arms, and enough to fit a slope."""
    return list(range(1, max(max(gammas, default=0), floor) + 2))


def calibration_context(
    prompts: list[list[int]], max_new_tokens: int, max_positions: int, max_width: int = DEFAULT_MAX_WIDTH
) -> list[int]:
    """A realistic context: mean prompt length + ``max_new_tokens`` // 2 tokens of prompt ids, cycled.

    Capped at ``max_positions`` - ``max_width`` - 1 so the widest timed forward still fits.
    """
    prompts = [ids for ids in prompts if ids]
    if not prompts:
        raise ValueError("calibration_context needs at least one non-empty prompt")
    mean_prompt = round(sum(len(ids) for ids in prompts) / len(prompts))
    length = max(1, min(mean_prompt + max_new_tokens // 2, max_positions - max_width - 1))
    context: list[int] = []
    index = 0
    while len(context) < length:
        context += prompts[index % len(prompts)]
        index += 1
    return context[:length]


def _cycled(context_ids: list[int], start: int, width: int) -> list[int]:
    """``width`` token ids of the context from ``start``, wrapping around (real ids, not random)."""
    return [context_ids[(start + offset) % len(context_ids)] for offset in range(width)]


def _time_forward(runner: LoneSequence, token_ids: list[int], context_len: int) -> float:
    """Seconds for one forward of ``token_ids`` on top of the context; the cache is rolled back after."""
    synchronize(runner.device)  # nothing queued earlier is charged to this forward
    start = time.perf_counter()
    runner.forward(token_ids)  # [w, V] logits: a verify forward scores every position
    synchronize(runner.device)
    elapsed = time.perf_counter() - start
    runner.truncate(context_len)
    return elapsed


def measure_verify_costs(
    runner: LoneSequence, context_ids: list[int], widths: Sequence[int], repeats: int = 5
) -> dict[int, float]:
    """Median seconds of one target forward of each width in ``widths`` after ``context_ids``.

    One untimed pass first (allocation and kernel selection for each new shape), then ``repeats``
    timed passes in alternating width order. Leaves ``runner`` holding exactly the context.
    """
    if not context_ids or not widths or min(widths) < 1 or repeats < 1:
        raise ValueError(f"need a context, widths >= 1 and repeats >= 1 (widths={list(widths)}, repeats={repeats})")
    runner.reset()
    runner.forward(context_ids, last_only=True)
    context_len = len(context_ids)
    order = sorted(set(widths))
    times: dict[int, list[float]] = {width: [] for width in order}
    for index in range(repeats + 1):
        for width in order if index % 2 else order[::-1]:
            elapsed = _time_forward(runner, _cycled(context_ids, index * width, width), context_len)
            if index:  # pass 0 is the warm-up
                times[width].append(elapsed)
    return {width: statistics.median(values) for width, values in times.items()}
