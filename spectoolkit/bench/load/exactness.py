"""Classify divergences under batching by replaying the position with the target alone (issue 15 §8).

A request's output at some load level differs from its batch-1 target-alone output at ``position``.
The target alone (batch 1, a :class:`~spectoolkit.runtime.lone.LoneSequence` on the same model and KV
precision) recomputes that position over prompt + the reference prefix, and its top-2 logit margin
there says whether a last-bit difference could have flipped the token:

- ``near_tie``: both outputs continue past ``position`` and the margin is within the precision's
  near-tie threshold (:func:`spectoolkit.eval.exactness.near_tie_threshold`) — the padded attention
  or a batch-shaped GEMM rounding differently in a batch (the default mode's documented limit);
- ``unexplained``: anything else, including every length difference — a bug until shown otherwise.

In ``serve.batch_invariant`` mode no row may depend on its batch, so every divergence is a failure
whatever its margin. A batched step cannot be re-run alone bit for bit (its companions are the
cause), hence the margin: the invariant mode is where batching is *proved* not to change outputs.
"""

from __future__ import annotations

from typing import Any

from spectoolkit.eval.exactness import near_tie_threshold, top2_margin
from spectoolkit.metrics.records import RequestRecord
from spectoolkit.runtime.lone import lone_sequence

MAX_REPLAYS = 64  # further divergences stay unexplained until examined


def classify_divergences(
    section: dict[str, Any],
    records: list[RequestRecord],
    prompts: dict[str, list[int]],
    references: dict[str, list[int]],
    model,
    precision: str,
    kv: str,
    invariant: bool,
) -> dict[str, Any]:
    """``section`` (``serving_exactness``) with each divergence classified and a verdict added."""
    threshold = near_tie_threshold(precision, kv)
    outputs = {(r.arm, r.load_level, r.case_id, r.repeat_idx): r.output_ids for r in records if not r.error}
    runner = lone_sequence(model, kv) if section["divergent"] else None
    for index, item in enumerate(section["divergent"]):
        reference = references.get(item["case_id"], [])
        output = outputs.get((item["arm"], item["level"], item["case_id"], item["repeat"]), [])
        position = item["position"]
        both_continue = position < len(reference) and position < len(output)
        margin = None
        if index < MAX_REPLAYS and both_continue and item["case_id"] in prompts:
            margin = top2_margin(runner, prompts[item["case_id"]], reference[:position])
        tie = margin is not None and margin <= threshold and not invariant
        item.update(margin=margin, threshold=threshold, classification="near_tie" if tie else "unexplained",
                    reference_token=reference[position] if position < len(reference) else None,
                    token=output[position] if position < len(output) else None)  # fmt: skip
    return {**section, **_verdict(section, invariant)}


def _verdict(section: dict[str, Any], invariant: bool) -> dict[str, Any]:
    found = section["divergent"]
    unexplained = sum(item["classification"] == "unexplained" for item in found)
    if not found:
        verdict = "exact"
    elif invariant:
        verdict = "not batch-invariant"
    elif unexplained:
        verdict = "unexplained divergence"
    else:
        verdict = "exact up to near-ties"
    return {"verdict": verdict, "near_ties": len(found) - unexplained, "unexplained": unexplained,
            "passed": verdict in ("exact", "exact up to near-ties"), "batch_invariant": invariant}  # fmt: skip
