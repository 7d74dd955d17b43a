"""The ``exactness`` section of a greedy run: every drafting arm's records against its reference arm's.

Each (case, repeat) output of a drafting arm is compared with the target-alone arm that has the same
target (``Arm.reference``); a divergence is classified by the reference target's top-2 margin there
(:mod:`spectoolkit.eval.exactness`). At most ``MAX_MARGINS`` margins are computed (one target
forward each); further divergences count as unexplained until examined.
"""

from __future__ import annotations

from typing import Any

from spectoolkit.bench.protocol.setup import ArmSet
from spectoolkit.eval.exactness import UNEXPLAINED, Divergence, divergence, near_tie_threshold, verdict
from spectoolkit.metrics.records import RequestRecord
from spectoolkit.metrics.summary import output_pairs

MAX_MARGINS = 64


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
        for case_id, repeat_idx, reference, output in pairs_of_arm:
            if reference == output:
                continue
            if len(found) + len(arm_found) < MAX_MARGINS:
                item = divergence(runner, prompts[case_id], reference, output, threshold, arm=arm.name,
                                  case_id=case_id, repeat_idx=repeat_idx, max_width=arm.gamma + 1)  # fmt: skip
            else:
                item = Divergence(arm.name, case_id, repeat_idx, -1, None, None, None, threshold, UNEXPLAINED)
            arm_found.append(item)
        section = verdict(len(pairs_of_arm), arm_found)
        per_arm[arm.name] = {key: section[key] for key in ("verdict", "pairs", "identical", "near_ties", "unexplained")}
        per_arm[arm.name]["threshold"] = threshold
        found += arm_found
        pairs += len(pairs_of_arm)
    return {**verdict(pairs, found), "arms": per_arm}
