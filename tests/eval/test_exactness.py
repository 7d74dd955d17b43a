"""The greedy divergence classifier (issue 5): a numerical near-tie passes, a real bug fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spectoolkit.bench.protocol.exactness import greedy_exactness
from spectoolkit.bench.protocol.setup import build
from spectoolkit.config import DraftConfig, ModelConfig, RunConfig
from spectoolkit.eval.exactness import (
    EXACT,
    EXACT_UP_TO_TIES,
    FAILED,
    NEAR_TIE,
    UNEXPLAINED,
    divergence,
    first_divergence,
    near_tie_threshold,
    verdict,
)
from spectoolkit.metrics.records import RequestRecord


class _FixedLogits:
    """Stand-in target runner (unit test only): the same logits at every position, or ``wide`` ones
    for forwards of several tokens (a width-dependent rounding difference)."""

    def __init__(self, logits: list[float], wide: list[float] | None = None) -> None:
        self.logits = torch.tensor(logits)
        self.wide = torch.tensor(wide) if wide is not None else self.logits
        self.fed: list[list[int]] = []

    def reset(self) -> None:
        pass

    def forward(self, ids: list[int], last_only: bool = False) -> torch.Tensor:
        self.fed.append(list(ids))
        if last_only:
            return self.logits  # [V]
        return (self.wide if len(ids) > 1 else self.logits).expand(len(ids), -1)  # [w, V]


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # stopped earlier (EOS): judged at the shorter end
    assert first_divergence([], [7]) == 0


def test_thresholds_are_dtype_aware() -> None:
    assert near_tie_threshold("fp32") == pytest.approx(1e-3)
    assert near_tie_threshold("bf16") == pytest.approx(0.5)
    assert near_tie_threshold("rtn-int4") == pytest.approx(0.1)
    assert near_tie_threshold("fp32", "int4") == pytest.approx(0.5)  # K/V rounded to 4 bits dominates


def test_true_tie_is_a_near_tie_and_a_real_bug_is_unexplained() -> None:
    tie = _FixedLogits([20.0, 20.0 + 2e-4, 3.0])
    found = divergence(tie, [5, 6], reference=[1, 2, 1], output=[1, 2, 0], threshold=near_tie_threshold("fp32"))
    assert tie.fed == [[5, 6, 1, 2]]  # the target alone over prompt + the reference prefix
    assert (found.position, found.reference_token, found.spec_token) == (2, 1, 0)
    assert found.margin == pytest.approx(2e-4, abs=1e-5) and found.classification == NEAR_TIE

    bug = _FixedLogits([25.0, 18.0, 3.0])
    found = divergence(bug, [5, 6], reference=[0, 0], output=[1, 0], threshold=near_tie_threshold("fp32"))
    assert found.margin == pytest.approx(7.0) and found.classification == UNEXPLAINED
    assert divergence(bug, [5], [0, 0], [0, 0], 1e-3) is None


def test_a_large_margin_is_a_near_tie_only_when_a_verify_width_flips_it() -> None:
    # one-token scoring prefers token 0 by 0.3; a 3-token forward (as a γ=2 round) prefers token 1
    flips = _FixedLogits([20.3, 20.0, 3.0], wide=[20.0, 20.2, 3.0])
    found = divergence(flips, [5, 6], [0, 0, 0], [0, 1, 0], 0.1, max_width=3)
    assert found.margin == pytest.approx(0.3, abs=1e-5)
    assert found.flip_width == 2 and found.classification == NEAR_TIE
    assert divergence(flips, [5, 6], [0, 0, 0], [0, 1, 0], 0.1, max_width=1).classification == UNEXPLAINED
    steady = _FixedLogits([20.3, 20.0, 3.0])  # every width agrees: the spec token was never the target's
    found = divergence(steady, [5, 6], [0, 0, 0], [0, 1, 0], 0.1, max_width=5)
    assert found.flip_width is None and found.classification == UNEXPLAINED


def test_verdict() -> None:
    tie = divergence(_FixedLogits([1.0, 1.0]), [5], [0], [1], 1e-3)
    bug = divergence(_FixedLogits([9.0, 1.0]), [5], [0], [1], 1e-3)
    assert verdict(4, [])["verdict"] == EXACT
    only_ties = verdict(4, [tie])
    assert only_ties["verdict"] == EXACT_UP_TO_TIES and only_ties["passed"] and only_ties["identical"] == 3
    failed = verdict(4, [tie, bug])
    assert failed["verdict"] == FAILED and not failed["passed"]
    assert (failed["near_ties"], failed["unexplained"]) == (1, 1)
    assert failed["divergences"][1]["classification"] == UNEXPLAINED


def test_run_exactness_flags_a_corrupted_output(one_thread, tiny_checkpoint: Path, tmp_path: Path) -> None:
    cfg = RunConfig(draft=DraftConfig(kind="ngram"), model=ModelConfig(target_path=str(tiny_checkpoint)),
                    device="cpu", output_dir=str(tmp_path))  # fmt: skip
    setup = build(cfg)
    prompt = setup.models.tokenizer("The quick brown fox jumps over")["input_ids"]
    reference = setup.arm_set.baseline.engine.generate(prompt, 8, None).output_ids
    spec = setup.arm_set.spec.engine.generate(prompt, 8, None).output_ids
    assert spec == reference
    wrong = list(reference)
    wrong[3] = (wrong[3] + 1) % 100  # what a broken verifier would emit
    records = [{"arm": "baseline", "case_id": "c", "repeat_idx": r, "output_ids": reference} for r in (0, 1)]
    records += [{"arm": "spec", "case_id": "c", "repeat_idx": 0, "output_ids": spec},
                {"arm": "spec", "case_id": "c", "repeat_idx": 1, "output_ids": wrong}]  # fmt: skip
    records = [RequestRecord.from_dict(record) for record in records]
    section = greedy_exactness(records, setup.arm_set, {"c": prompt}, "auto")
    assert (section["pairs"], section["identical"]) == (2, 1)
    [found] = section["divergences"]
    assert (found["repeat_idx"], found["position"], found["spec_token"]) == (1, 3, wrong[3])
    assert found["margin"] > near_tie_threshold("fp32")
    assert section["verdict"] == FAILED and section["arms"]["spec"]["unexplained"] == 1
