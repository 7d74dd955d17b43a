"""The ``exactness`` section of a greedy run: every drafting arm's records against its reference arm's.

Each (case, repeat) output of a drafting arm is compared with the target-alone arm that has the same
target (``Arm.reference``); at a divergence the reference arm's target replays the spec record's own
round (its ``draft_lengths`` / ``accept_lengths``) and the divergence is a near-tie only when that
replay emits the spec token (:mod:`spectoolkit.eval.exactness`). At most ``MAX_MARGINS`` divergences
are examined (a margin and a replay, a few target forwards each); further ones count as unexplained
until examined.
"""

from __future__ import annotations

from typing import Any

from spectoolkit.eval.exactness import UNEXPLAINED, Divergence, divergence, near_tie_threshold, verdict
from spectoolkit.metrics.records import RequestRecord
from spectoolkit.metrics.summary import output_pairs
from spectoolkit.wiring.setup import ArmSet

MAX_MARGINS = 64
ARM_KEYS = ("verdict", "pairs", "identical", "divergent_pairs", "divergent_share", "near_ties", "unexplained")


def greedy_exactness(
    records: list[RequestRecord], arm_set: ArmSet, prompts: dict[str, list[int]], kv: str
) -> dict[str, Any]:
    """Verdict over all drafting arms, plus per-arm counts; ``prompts`` maps case_id -> prompt ids."""
    per_arm: dict[str, Any] = {}
    found: list[Divergence] = []
    pairs = 0
    for arm in (arm for arm in arm_set.arms if arm.gamma and arm.reference):
        runner = arm_set.arm(arm.reference).engine.target
        threshold = near_tie_threshold(arm.target_precision, kv)
        arm_found: list[Divergence] = []
        pairs_of_arm = output_pairs(records, arm.name, arm.reference)
        spec_records = {(r.case_id, r.repeat_idx): r for r in records if r.arm == arm.name and not r.error}
        for case_id, repeat_idx, reference, output in pairs_of_arm:
            if reference == output:
                continue
            if len(found) + len(arm_found) < MAX_MARGINS:
                spec = spec_records[(case_id, repeat_idx)]
                item = divergence(runner, prompts[case_id], reference, output, threshold, arm=arm.name,
                                  case_id=case_id, repeat_idx=repeat_idx, max_width=arm.gamma + 1,
                                  draft_lengths=spec.draft_lengths, accept_lengths=spec.accept_lengths)  # fmt: skip
            else:
                item = Divergence(arm.name, case_id, repeat_idx, -1, None, None, None, threshold, UNEXPLAINED)
            arm_found.append(item)
        section = verdict(len(pairs_of_arm), arm_found)
        per_arm[arm.name] = {key: section[key] for key in ARM_KEYS}
        per_arm[arm.name]["threshold"] = threshold
        found += arm_found
        pairs += len(pairs_of_arm)
    return {**verdict(pairs, found), "arms": per_arm}
