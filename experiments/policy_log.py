"""The adaptive policy's expectation against the measurement, per load level, from a run's step log (issue 57).

    python experiments/policy_log.py OUTPUT_DIR/steps.jsonl                 # every arm that predicted
    python experiments/policy_log.py OUTPUT_DIR/steps.jsonl --arm spec-adaptive

The log comes from a serving run with ``serve.step_log=true``. Per (arm, level), over the decode steps the policy
planned (no prefill chunk in them):

- acceptance by draft position j: the mean S_j the policy used for the rounds whose drafter proposed at least j
  tokens, against the share of those rounds that kept at least j (a lookup may propose fewer than planned: those
  positions say nothing of acceptance, and show in the tokens line instead);
- step cost by (batch, width run): the median measured target seconds (step_time - draft_time) against the median
  of the policy's T_B at that width (``predicted_actual_seconds``): its curve against the engine's V(w);
- totals: emitted tokens, target and draft seconds, each predicted / measured, and tokens per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class LevelLog:
    """One (arm, level): sums and samples over its predicted decode steps."""

    steps: int = 0
    position: dict[int, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0.0, 0.0, 0.0]))
    widths: dict[tuple[int, int], tuple[list[float], list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: ([], []))
    )  # (batch, width) -> (measured, predicted) seconds
    totals: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, step: dict) -> None:
        self.steps += 1
        # per decoding request in step order (a request preempted after the policy chose is missing from the rounds)
        rounds = zip(step["acceptance_estimates"], step["drafted"], step["accepted"], strict=False)
        for estimate, drafted, accepted in rounds:
            for j in range(1, min(len(estimate), drafted) + 1):
                sums = self.position[j]  # [rounds, predicted S_j, kept >= j]
                sums[0] += 1
                sums[1] += estimate[j - 1]
                sums[2] += accepted >= j
        measured_target = step["step_time"] - step["draft_time"]
        width = step["batch_size"] + sum(step["drafted"])
        measured, predicted = self.widths[(step["batch_size"], width)]
        measured.append(measured_target)
        if step.get("predicted_actual_seconds") is not None:
            predicted.append(step["predicted_actual_seconds"])
        for key, value in (
            ("predicted_tokens", step["predicted_tokens"]), ("emitted_tokens", step["emitted_tokens"]),
            ("predicted_target", step["predicted_target_seconds"] or 0.0), ("measured_target", measured_target),
            ("predicted_draft", step["predicted_draft_seconds"] or 0.0), ("measured_draft", step["draft_time"]),
        ):  # fmt: skip
            self.totals[key] += value


def summarize(lines: Iterable[str], arm: str | None = None) -> dict[tuple[str, str], LevelLog]:
    """(arm, level) -> its :class:`LevelLog`, over the steps of ``arm`` (every arm when None) that the policy
    predicted and that carried no prefill chunk."""
    out: dict[tuple[str, str], LevelLog] = {}
    for line in lines:
        step = json.loads(line)
        if step.get("acceptance_estimates") is None or step["prefill_tokens"] or (arm and step["arm"] != arm):
            continue
        out.setdefault((step["arm"], step["level"]), LevelLog()).add(step)
    return out


def _ratio(num: float, den: float) -> str:
    return f"{num / den:.3f}" if den else "n/a"


def render(logs: dict[tuple[str, str], LevelLog]) -> str:
    lines = []
    for (arm, level), log in logs.items():
        t = log.totals
        lines.append(f"## {arm} at level {level}: {log.steps} decode steps")
        rate_pred = _ratio(t["predicted_tokens"], t["predicted_target"] + t["predicted_draft"])
        rate_meas = _ratio(t["emitted_tokens"], t["measured_target"] + t["measured_draft"])
        lines.append(f"tokens/s predicted {rate_pred}, measured {rate_meas}; predicted/measured: tokens "
                     f"{_ratio(t['predicted_tokens'], t['emitted_tokens'])}, draft seconds "
                     f"{_ratio(t['predicted_draft'], t['measured_draft'])}")  # fmt: skip
        lines.append("position j | rounds | mean S_j used | share kept >= j")
        for j in sorted(log.position):
            rounds, predicted, kept = log.position[j]
            lines.append(f"{j} | {rounds:.0f} | {predicted / rounds:.3f} | {kept / rounds:.3f}")
        lines.append("batch | width | steps | measured T ms (median) | policy's T_B ms (median)")
        for (batch, width), (measured, predicted) in sorted(log.widths.items()):
            policy = f"{statistics.median(predicted) * 1e3:.1f}" if predicted else "n/a"
            lines.append(f"{batch} | {width} | {len(measured)} | {statistics.median(measured) * 1e3:.1f} | {policy}")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("steps", type=Path, help="steps.jsonl of a run with serve.step_log=true")
    parser.add_argument("--arm", default=None, help="only this arm (default: every arm that predicted)")
    args = parser.parse_args()
    with args.steps.open(encoding="utf-8") as lines:
        print(render(summarize(lines, args.arm)))


if __name__ == "__main__":
    main()
