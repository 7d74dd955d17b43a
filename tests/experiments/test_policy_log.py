"""experiments/policy_log.py: the adaptive policy's expectation against the measurement from a step log."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from spectoolkit.serving.api import StepStats

_PATH = Path(__file__).resolve().parents[2] / "experiments" / "policy_log.py"
_SPEC = importlib.util.spec_from_file_location("policy_log", _PATH)
policy_log = importlib.util.module_from_spec(_SPEC)
sys.modules["policy_log"] = policy_log  # its dataclasses look their module up
_SPEC.loader.exec_module(policy_log)
render, summarize = policy_log.render, policy_log.summarize


def _line(arm: str, prefill: int = 0, predicted: bool = True, **kwargs) -> str:
    stats = StepStats(0, 2, 2 + 4, prefill, 4, 40, 0, 0, True, 0.12, 0.02, 0, emitted_tokens=5, drafted=[3, 1],
                      accepted=[3, 0], **kwargs)  # fmt: skip
    if predicted:
        stats = dataclasses.replace(stats, predicted_tokens=4.5, predicted_target_seconds=0.11,
                                    predicted_actual_seconds=0.09, predicted_draft_seconds=0.03,
                                    acceptance_estimates=[[0.9, 0.8, 0.7], [0.5]], prior_strength=3.0)  # fmt: skip
    return json.dumps({"arm": arm, "level": "4", "repeat": 0, **dataclasses.asdict(stats)})


def test_positions_widths_and_totals():
    lines = [_line("spec-adaptive"), _line("spec-adaptive"), _line("spec-adaptive", prefill=30)]
    lines.append(_line("spec-g4", 0, False))
    logs = summarize(lines)
    assert list(logs) == [("spec-adaptive", "4")]  # the prefill step and the fixed arm's steps are left out
    log = logs[("spec-adaptive", "4")]
    assert log.steps == 2
    rounds, predicted, kept = log.position[1]  # both requests proposed a first token: 0.9 and 0.5, one kept
    assert (rounds, predicted / rounds, kept / rounds) == (4, pytest.approx(0.7), 0.5)
    assert log.position[3] == [2, pytest.approx(1.4), 2]  # only the first request proposed a third
    measured, policy = log.widths[(2, 6)]
    assert measured == pytest.approx([0.10, 0.10]) and policy == pytest.approx([0.09, 0.09])
    assert log.totals["predicted_tokens"] == pytest.approx(9.0) and log.totals["emitted_tokens"] == 10
    text = render(logs)
    assert "spec-adaptive at level 4: 2 decode steps" in text and "tokens 0.900" in text
    assert summarize(lines, "spec-g4") == {}
