"""Calibration micro-benchmark: every width timed on a fixed context that never grows."""

from __future__ import annotations

import pytest

from spectoolkit.bench.protocol.calibrate import calibration_context, calibration_widths, measure_verify_costs
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.runtime.lone import LoneSequence, lone_sequence

VOCAB = 512


@pytest.fixture(scope="module")
def runner(one_thread) -> LoneSequence:
    return lone_sequence(tiny_llama(vocab_size=VOCAB))


def _recording(runner: LoneSequence, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int, list[int]]]:
    """Wrap ``runner.forward``; each call logs (cache length before, tokens fed, logits rows, ids)."""
    calls = []
    original = runner.forward

    def forward(token_ids: list[int], last_only: bool = False):
        before = runner.num_computed
        logits = original(token_ids, last_only=last_only)
        assert runner.num_computed == before + len(token_ids)  # the forward really appended them all
        calls.append((before, len(token_ids), 1 if last_only else logits.shape[0], list(token_ids)))
        return logits

    monkeypatch.setattr(runner, "forward", forward)
    return calls


def test_measure_verify_costs_times_every_width_on_a_fixed_context(runner, monkeypatch) -> None:
    context = calibration_context([[5, 6, 7, 8, 9, 10], [11, 12, 13]], max_new_tokens=16, max_positions=1024)
    widths = calibration_widths([4])
    calls = _recording(runner, monkeypatch)
    costs = measure_verify_costs(runner, context, widths, repeats=3)

    assert sorted(costs) == widths
    assert all(seconds > 0 for seconds in costs.values())
    assert runner.num_computed == len(context)
    prefill, timed = calls[0], calls[1:]
    assert prefill[:2] == (0, len(context))
    assert all(before == len(context) for before, *_ in timed)  # rolled back after every forward
    assert all(fed == rows for _, fed, rows, _ in timed)  # a verify forward returns logits for every position
    assert sorted(fed for _, fed, _, _ in timed) == sorted(widths * 4)  # warm-up + 3 passes
    assert all(set(ids) <= set(context) for *_, ids in timed)  # real context ids, not random ones
    passes = [[fed for _, fed, _, _ in timed[i : i + len(widths)]] for i in range(0, len(timed), len(widths))]
    assert all(later == earlier[::-1] for earlier, later in zip(passes, passes[1:], strict=False))


def test_measure_verify_costs_rejects_bad_arguments(runner) -> None:
    with pytest.raises(ValueError):
        measure_verify_costs(runner, [], [1, 2])
    with pytest.raises(ValueError):
        measure_verify_costs(runner, [5, 6], [0, 1])


def test_calibration_context_length_and_cap() -> None:
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]  # mean length 4
    assert calibration_context(prompts, max_new_tokens=10, max_positions=1024) == [1, 2, 3, 4, 5, 6, 7, 8, 1]
    capped = calibration_context(prompts, max_new_tokens=100, max_positions=20, max_width=9)
    assert len(capped) == 20 - 9 - 1
    assert capped == [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    with pytest.raises(ValueError):
        calibration_context([], max_new_tokens=10, max_positions=1024)


def test_calibration_widths_cover_every_verify_forward() -> None:
    assert calibration_widths([4]) == list(range(1, 10))
    assert calibration_widths([2, 12]) == list(range(1, 14))
    assert calibration_widths([1], floor=2) == [1, 2, 3]
