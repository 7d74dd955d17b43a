"""The greedy divergence classifier (issue 5): a numerical near-tie passes, a real bug fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spectoolkit.config import DraftConfig, ModelConfig, RunConfig
from spectoolkit.eval.exactness import (
    DIVERGENT_ROUNDING,
    EXACT,
    EXACT_UP_TO_TIES,
    FAILED,
    MAX_TIE_SHARE,
    NEAR_TIE,
    UNEXPLAINED,
    Divergence,
    divergence,
    first_divergence,
    near_tie_threshold,
    replay_round,
    round_of,
    rounds_cover,
    verdict,
)
from spectoolkit.eval.exactness_section import greedy_exactness
from spectoolkit.metrics.records import RequestRecord
from spectoolkit.wiring.setup import build


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


def test_a_tiny_margin_alone_excuses_nothing_and_a_real_bug_is_unexplained() -> None:
    # issue 14: a near-tie only when the target alone reproduces the spec token, whatever the margin
    tie = _FixedLogits([20.0, 20.0 + 2e-4, 3.0])
    found = divergence(tie, [5, 6], reference=[1, 2, 1], output=[1, 2, 0], threshold=near_tie_threshold("fp32"))
    assert tie.fed[0] == [5, 6, 1, 2]  # the target alone over prompt + the reference prefix
    assert (found.position, found.reference_token, found.spec_token) == (2, 1, 0)
    assert found.margin == pytest.approx(2e-4, abs=1e-5) and found.classification == UNEXPLAINED

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
    tie = _reproduced(0)  # the target alone, replaying the round, emits the spec token
    bug = divergence(_FixedLogits([9.0, 1.0]), [5], [0], [1], 1e-3)
    assert verdict(20, [])["verdict"] == EXACT
    only_ties = verdict(20, [tie])
    assert only_ties["verdict"] == EXACT_UP_TO_TIES and only_ties["passed"] and only_ties["identical"] == 19
    failed = verdict(20, [tie, bug])
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


# ---- issue 14: a divergence is replayed from the spec run's own rounds, never excused by its margin ----


class _Log:
    """Stand-in runner (unit test only) that logs every call shaping its KV; argmax is always token 0."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def reset(self) -> None:
        self.calls.append(("reset",))

    def truncate(self, length: int) -> None:
        self.calls.append(("truncate", length))

    def forward(self, ids: list[int], last_only: bool = False) -> torch.Tensor:
        self.calls.append(("forward", list(ids), last_only))
        return torch.zeros(4) if last_only else torch.zeros(len(ids), 4)  # [V] or [w, V]


class _Recorder(_Log):
    """A real LoneSequence with the same log: the engine's schedule and the replay's side by side."""

    def __init__(self, runner) -> None:
        super().__init__()
        self.runner = runner
        self.device = runner.device

    def reset(self) -> None:
        super().reset()
        self.runner.reset()

    def truncate(self, length: int) -> None:
        super().truncate(length)
        self.runner.truncate(length)

    def forward(self, ids: list[int], last_only: bool = False) -> torch.Tensor:
        self.calls.append(("forward", list(ids), last_only))
        return self.runner.forward(ids, last_only)


# prompt [5, 6, 7]; the prefill emits 10; rounds (k, K): (2, 1) emits 11 12, (3, 3) emits 13..16 (16 the bonus),
# (1, 0) emits 17, (0, 0) emits 18
ROUND_OUTPUT, ROUND_DRAFTS, ROUND_ACCEPTS = [10, 11, 12, 13, 14, 15, 16, 17, 18], [2, 3, 1, 0], [1, 3, 0, 0]


def test_replay_follows_the_engine_schedule_window_by_window() -> None:
    log = _Log()
    found = replay_round(log, [5, 6, 7], ROUND_OUTPUT, ROUND_DRAFTS, ROUND_ACCEPTS, 5)
    assert log.calls == [
        ("reset",),
        ("forward", [5, 6, 7], True),  # the prefill, last row only
        ("forward", [10, 11, 12], False),  # pending 10, accepted 11, the rejected slot filled with the correction
        ("truncate", 5),  # prompt + pending + 1 accepted, as the engine keeps
        ("forward", [12, 13, 14, 15], False),  # round 2 at its width 4; row 2 predicted position 5
        ("reset",),
    ]
    assert (found.round, found.window_start, found.width, found.position) == (2, 5, 4, 5)
    assert found.spec_token == 15 and found.replayed_token == 0 and not found.reproduced
    prefill = replay_round(_Log(), [5, 6, 7], ROUND_OUTPUT, ROUND_DRAFTS, ROUND_ACCEPTS, 0)
    assert (prefill.round, prefill.window_start, prefill.width) == (0, 0, 3)
    last = replay_round(_Log(), [5, 6, 7], ROUND_OUTPUT, ROUND_DRAFTS, ROUND_ACCEPTS, 8)
    assert (last.round, last.window_start, last.width) == (4, 3 + 8 - 1, 1)  # nothing proposed: width 1
    with pytest.raises(ValueError):
        replay_round(_Log(), [5, 6, 7], ROUND_OUTPUT, ROUND_DRAFTS, ROUND_ACCEPTS, 9)  # no spec round emitted it


def test_round_data_must_cover_the_output_to_be_replayed() -> None:
    assert round_of(0, ROUND_ACCEPTS) == (0, 0) and round_of(2, ROUND_ACCEPTS) == (1, 1)
    assert round_of(6, ROUND_ACCEPTS) == (2, 3) and round_of(9, ROUND_ACCEPTS) is None
    assert rounds_cover(9, ROUND_DRAFTS, ROUND_ACCEPTS) and rounds_cover(1, [], [])
    assert rounds_cover(7, [2, 3], [1, 3])  # the last round cut at EOS after 13, 14, 15
    assert not rounds_cover(8, ROUND_DRAFTS, ROUND_ACCEPTS)  # the last round emitted nothing: inconsistent
    assert not rounds_cover(9, [], []) and not rounds_cover(9, [2, 3, 1], ROUND_ACCEPTS)
    assert not rounds_cover(9, [0, 3, 1, 0], ROUND_ACCEPTS)  # K > k


def test_a_margin_alone_no_longer_excuses_a_divergence() -> None:
    tie = _FixedLogits([20.0, 20.0 + 2e-4, 3.0])  # a true tie, but nothing reproduces the spec token 0
    found = divergence(tie, [5, 6], reference=[1, 2, 1], output=[1, 2, 0], threshold=1e9, max_width=3)
    assert found.margin == pytest.approx(2e-4, abs=1e-5) and found.threshold == 1e9
    assert found.classification == UNEXPLAINED and not found.reproduced and found.flip_width is None


@pytest.fixture(scope="module")
def spec_run(one_thread, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """A greedy run of the real engine with a 4-bit self-draft (rounds with full, partial and no acceptance),
    its call log, and the target-alone reference."""
    cfg = RunConfig(draft=DraftConfig(kind="model", precision="rtn-int4"),
                    model=ModelConfig(target_path=str(tiny_checkpoint)), device="cpu",
                    output_dir=str(tmp_path_factory.mktemp("replay")))  # fmt: skip
    setup = build(cfg)
    prompt = setup.models.tokenizer("The quick brown fox jumps over the lazy dog. The quick brown fox")["input_ids"]
    engine = setup.arm_set.spec.engine.engine  # the one engine behind the batch-1 arm
    steps = _StepLog(engine.runner)
    engine.runner = steps
    out = setup.arm_set.spec.engine.generate(prompt, 32, None)
    engine.runner = steps.runner
    reference = setup.arm_set.baseline.engine.generate(prompt, 32, None).output_ids
    return setup, prompt, out, steps.calls, reference


class _StepLog:
    """The engine's runner, logging each target forward as the replay's calls: ("forward", ids, last_only), and
    before every forward after the first the length the previous round kept, as ("truncate", start)."""

    def __init__(self, runner) -> None:
        self.runner, self.device, self.calls = runner, runner.device, []

    def forward(self, batch):
        ids, start = batch.token_ids.tolist(), batch.start_of(0)
        if self.calls:
            self.calls.append(("truncate", start))
        self.calls.append(("forward", ids, len(batch.logit_rows) == 1))
        return self.runner.forward(batch)


def test_replay_reproduces_every_token_the_engine_emitted(spec_run) -> None:
    setup, prompt, out, engine_calls, reference = spec_run
    rounds = list(zip(out.draft_lengths, out.accept_lengths, strict=True))
    assert any(0 < accepted < drafted for drafted, accepted in rounds)  # a partial rejection: fillers used
    assert any(accepted == drafted > 0 for drafted, accepted in rounds) and out.output_ids == reference
    runner = setup.arm_set.spec.engine.target
    for position, token in enumerate(out.output_ids):
        found = replay_round(runner, prompt, out.output_ids, out.draft_lengths, out.accept_lengths, position)
        assert found.replayed_token == token and found.reproduced, position
        if found.round:
            assert found.width == out.draft_lengths[found.round - 1] + 1
    # the replay of the last token recomputes the engine's schedule: same widths, same kept inputs, same truncations
    replay = _Recorder(runner)
    replay_round(replay, prompt, out.output_ids, out.draft_lengths, out.accept_lengths, len(out.output_ids) - 1)
    engine_forwards = [call for call in engine_calls if call[0] == "forward"]
    replay_forwards = [call for call in replay.calls if call[0] == "forward"]
    assert [len(call[1]) for call in replay_forwards] == [len(call[1]) for call in engine_forwards]
    for (_, engine_ids, _), (_, replay_ids, _), accepted in zip(engine_forwards[1:], replay_forwards[1:],
                                                               out.accept_lengths, strict=True):  # fmt: skip
        assert replay_ids[: accepted + 1] == engine_ids[: accepted + 1]  # only rejected slots differ
    engine_truncations = [call for call in engine_calls if call[0] == "truncate"]
    assert [call for call in replay.calls if call[0] == "truncate"] == engine_truncations[1:]


def _spec_record(out, output_ids: list[int], repeat_idx: int) -> dict:
    return {"arm": "spec", "case_id": "c", "repeat_idx": repeat_idx, "output_ids": output_ids,
            "draft_lengths": out.draft_lengths, "accept_lengths": out.accept_lengths}  # fmt: skip


def test_a_corrupted_output_is_unexplained_whatever_the_threshold(spec_run) -> None:
    setup, prompt, out, _, reference = spec_run
    runner = setup.arm_set.spec.engine.target
    for position in (0, 7, len(reference) - 1):  # the prefill, inside a round, the last round
        wrong = list(reference)
        wrong[position] = (wrong[position] + 1) % 100  # what a broken verifier would emit
        found = divergence(runner, prompt, reference, wrong, 1e9, draft_lengths=out.draft_lengths,
                           accept_lengths=out.accept_lengths)  # fmt: skip
        assert found.classification == UNEXPLAINED and not found.reproduced, position
        assert found.replayed_token == reference[position] and found.margin <= 1e9
        assert (found.replay_round == 0) == (position == 0)
    records = [{"arm": "baseline", "case_id": "c", "repeat_idx": r, "output_ids": reference} for r in (0, 1)]
    records += [_spec_record(out, out.output_ids, 0), _spec_record(out, wrong, 1)]
    section = greedy_exactness([RequestRecord.from_dict(r) for r in records], setup.arm_set, {"c": prompt}, "auto")
    [found] = section["divergences"]
    assert found["replay_round"] == len(out.accept_lengths) and found["replayed_token"] == reference[-1]
    assert (section["verdict"], section["divergent_pairs"], section["divergent_share"]) == (FAILED, 1, 0.5)
    assert section["arms"]["spec"]["divergent_pairs"] == 1


def test_a_length_difference_is_never_a_near_tie(spec_run) -> None:
    setup, prompt, out, _, reference = spec_run
    runner = setup.arm_set.spec.engine.target
    longer = divergence(runner, prompt, reference[:-1], out.output_ids, 1e9, draft_lengths=out.draft_lengths,
                        accept_lengths=out.accept_lengths)  # fmt: skip
    assert longer.reproduced and longer.reference_token is None and longer.classification == UNEXPLAINED
    shorter = divergence(runner, prompt, reference, out.output_ids[:-1], 1e9, max_width=5,
                         draft_lengths=out.draft_lengths, accept_lengths=out.accept_lengths)  # fmt: skip
    assert shorter.spec_token is None and shorter.replay_round is None and shorter.classification == UNEXPLAINED


def _reproduced(index: int) -> Divergence:
    return Divergence("spec", f"case/{index}", 0, 3, 7, 8, 0.01, 0.1, NEAR_TIE, replayed_token=8, replay_round=1,
                      replay_window_start=12, replay_width=5, reproduced=True)  # fmt: skip


def test_verdict_counts_divergent_pairs_plainly() -> None:
    most = verdict(10, [_reproduced(i) for i in range(6)])
    assert most["verdict"] == DIVERGENT_ROUNDING and most["verdict"] != EXACT_UP_TO_TIES and not most["passed"]
    assert (most["divergent_pairs"], most["divergent_share"], most["near_ties"]) == (6, 0.6, 6)
    rare = verdict(20, [_reproduced(0)])
    assert rare["verdict"] == EXACT_UP_TO_TIES and rare["passed"] and rare["divergent_share"] == 0.05
    at_limit = verdict(10, [_reproduced(0)])
    assert MAX_TIE_SHARE == 0.1 and at_limit["verdict"] == EXACT_UP_TO_TIES and at_limit["passed"]
    bug = Divergence("spec", "case/9", 0, 3, 7, 8, 0.01, 0.1, UNEXPLAINED, replayed_token=7, reproduced=False)
    assert verdict(20, [_reproduced(0), bug])["verdict"] == FAILED
    assert verdict(20, [])["divergent_pairs"] == 0 and verdict(20, [])["verdict"] == EXACT
