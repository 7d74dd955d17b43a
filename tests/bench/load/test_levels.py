"""The load-level protocol on fake engines: same sequence for every arm, alternating arm order, warm-up
per level, resets between runs, prompts that cannot run recorded without stopping the level."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import pytest

from spectoolkit.bench.load.levels import LoadSweep, StepLog, arm_order, reference_outputs, run_levels
from spectoolkit.bench.load.plan import Case, level_requests, level_size, load_levels
from spectoolkit.bench.protocol.runner import request_seed
from spectoolkit.config import BenchConfig, RunConfig, SamplingConfig, ServeConfig, WorkloadConfig
from spectoolkit.metrics.records import RecordWriter, read_records
from tests.bench.load.fakes import FakeClock, fake_arms, fake_token

CASES = [
    Case("a", "code", [1, 2, 3]),
    Case("long", "chat", None, "prompt of 999 tokens + max_new_tokens 20 exceeds the model's context"),
    Case("b", "chat", [4, 5]),
    Case("c", "qa", [6, 7, 8, 9]),
]
MAX_NEW_TOKENS = 20


def _cfg(**serve) -> RunConfig:
    return RunConfig(
        serve=ServeConfig(**{"concurrency": (1, 4), "rate": (50.0,), "warmup_requests": 2, **serve}),
        bench=BenchConfig(repeat=3), workload=WorkloadConfig(max_new_tokens=MAX_NEW_TOKENS),
        sampling=SamplingConfig(seed=11),
    )  # fmt: skip


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory):
    """One sweep over levels 1, 4 and rate=50 with 3 repeats: (sweep, records, events, steps.jsonl lines)."""
    out = tmp_path_factory.mktemp("levels")
    clock, events = FakeClock(), []
    cfg = _cfg()
    sweep = LoadSweep(cfg, fake_arms(clock, clock.sleep, events), load_levels(cfg.serve), CASES, clock, clock.sleep)
    log = StepLog(out / "steps.jsonl")
    with RecordWriter(out / "records.jsonl") as writer:
        run_levels(sweep, writer, log)
    log.close()
    lines = [json.loads(line) for line in (out / "steps.jsonl").read_text(encoding="utf-8").splitlines()]
    return sweep, read_records(out / "records.jsonl"), events, lines


def test_levels_in_run_order_and_sizes() -> None:
    levels = load_levels(ServeConfig(concurrency=(8, 2), rate=(2.0, 0.5)))
    assert [(lv.key, lv.kind, lv.value) for lv in levels] == [
        ("2", "concurrency", 2), ("8", "concurrency", 8), ("rate=0.5", "rate", 0.5), ("rate=2", "rate", 2.0),
    ]  # fmt: skip
    two, eight, slow = levels[0], levels[1], levels[2]
    assert (level_size(two, 3, None), level_size(eight, 3, None), level_size(slow, 3, None)) == (4, 16, 8)
    assert (level_size(two, 20, None), level_size(slow, 20, None), level_size(eight, 20, 5)) == (20, 20, 5)
    assert level_size(eight, 0, 5) == 0  # nothing runnable: nothing to send


def test_level_sequence_cycles_runnable_prompts_with_unique_ids_and_seeds() -> None:
    cfg = _cfg()
    sampling = SamplingConfig(seed=11)
    sent = level_requests(CASES, load_levels(cfg.serve)[1], cfg.serve, MAX_NEW_TOKENS, sampling, repeat_idx=2)
    assert [s.case.case_id for s in sent] == ["a", "b", "c", "a", "b", "c", "a", "b"]  # max(3, 2 x 4)
    assert len({s.request.request_id for s in sent}) == 8
    assert all(s.request.seed == request_seed(11, s.case.case_id, 2) for s in sent)
    assert all(s.request.max_new_tokens == MAX_NEW_TOKENS for s in sent)
    assert all(s.request.sampling is None for s in sent)  # no mix: the engine's own sampling


def test_sampling_mix_gives_the_requests_its_temperatures_in_turn() -> None:
    cfg = _cfg()
    serve = dataclasses.replace(cfg.serve, sampling_mix=(0, 0.7))
    sampling = SamplingConfig(top_p=0.9, seed=11)
    sent = level_requests(CASES, load_levels(cfg.serve)[1], serve, MAX_NEW_TOKENS, sampling, repeat_idx=0)
    assert [s.request.sampling.temperature for s in sent] == [0.0, 0.7] * 4
    assert all(s.request.sampling.top_p == 0.9 for s in sent)  # the rest of the run's sampling kept


def test_arms_alternate_across_repeats(swept) -> None:
    _, records, _, _ = swept
    order: dict[tuple[str, int], list[str]] = defaultdict(list)
    for record in records:
        arms = order[(record.load_level, record.repeat_idx)]
        if record.arm not in arms:
            arms.append(record.arm)
    for level in ("1", "4", "rate=50"):
        assert [order[(level, r)] for r in range(3)] == [["baseline", "spec"], ["spec", "baseline"],
                                                         ["spec", "baseline"]]  # fmt: skip
    assert [arm.name for arm in arm_order(swept[0].arms, 1)] == ["spec", "baseline"]


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_arm_order_cancels_a_linear_drift_in_every_pair_and_balances_the_first_place(count):
    arms = [f"arm{i}" for i in range(count)]
    orders = [arm_order(arms, repeat) for repeat in range(2 * count)]
    assert all(sorted(order) == arms for order in orders)
    for pair in range(count):  # each pair of repeats: the same mean position for every arm (a linear drift cancels)
        first, second = orders[2 * pair], orders[2 * pair + 1]
        assert all(first.index(arm) + second.index(arm) == count - 1 for arm in arms)
    assert sorted(order[0] for order in orders) == sorted(arms * 2)  # over 2n repeats: every arm first twice


def _timed_runs(events) -> list[tuple[str, list]]:
    """(arm, requests submitted) per timed run: the submits after each reset, warm-ups left out."""
    runs: list[tuple[str, list]] = []
    for name, kind, request in events:
        if kind == "reset":
            runs.append((name, []))
        elif not request.request_id.startswith(("warmup-", "reference:")):
            runs[-1][1].append(request)
    return [run for run in runs if run[1]]


def test_every_arm_gets_the_same_sequence_after_a_reset(swept) -> None:
    _, _, events, _ = swept
    runs = _timed_runs(events)
    assert len(runs) == 3 * 3 * 2  # levels x repeats x arms, each preceded by a reset
    for pair in zip(runs[::2], runs[1::2], strict=True):
        (arm1, sent1), (arm2, sent2) = pair
        assert {arm1, arm2} == {"baseline", "spec"}
        assert [(r.request_id, r.prompt_ids, r.seed) for r in sent1] == [(r.request_id, r.prompt_ids, r.seed)
                                                                          for r in sent2]  # fmt: skip


def test_open_loop_arms_share_the_arrival_schedule(swept) -> None:
    _, records, _, _ = swept
    offsets: dict[tuple[str, int], list[float]] = defaultdict(list)
    for record in records:
        if record.load_level == "rate=50" and not record.error:
            offsets[(record.arm, record.repeat_idx)].append(record.arrival_offset)
    for repeat in range(3):
        assert sorted(offsets[("baseline", repeat)]) == pytest.approx(sorted(offsets[("spec", repeat)]))
    assert sorted(offsets[("baseline", 0)]) != pytest.approx(sorted(offsets[("baseline", 1)]))


def test_warm_up_per_level_and_arm_before_its_timed_runs(swept) -> None:
    _, _, events, _ = swept
    warm = [(name, request) for name, kind, request in events if kind == "submit"
            and request.request_id.startswith("warmup-")]  # fmt: skip
    assert len(warm) == 3 * 2 * 2  # levels x arms x serve.warmup_requests
    assert all(request.max_new_tokens == 16 for _, request in warm)  # capped
    submits = [request.request_id for _, kind, request in events if kind == "submit"]
    first_timed = next(i for i, rid in enumerate(submits) if not rid.startswith("warmup-"))
    assert submits[:first_timed] == [r.request_id for _, r in warm[:4]]  # both arms warm before level 1 runs


def test_prompts_that_cannot_run_are_error_records_and_the_level_goes_on(swept) -> None:
    _, records, _, _ = swept
    errors = [r for r in records if r.error]
    assert len(errors) == 3 * 3 * 2 and all(r.case_id == "long" for r in errors)  # one per run
    ok = [r for r in records if not r.error]
    assert len(ok) == 2 * 3 * (3 + 8 + 8)  # arms x repeats x (level sizes 1, 4, rate=50)
    assert all(r.output_len == MAX_NEW_TOKENS for r in ok)
    assert all(r.output_ids == [fake_token(p, i) for i in range(MAX_NEW_TOKENS)]
               for r in ok for p in [next(c.prompt_ids for c in CASES if c.case_id == r.case_id)])  # fmt: skip


def test_step_totals_and_step_log(swept) -> None:
    sweep, _, _, lines = swept
    assert set(sweep.steps) == {(arm, level, r) for arm in ("baseline", "spec") for level in ("1", "4", "rate=50")
                                for r in range(3)}  # fmt: skip
    assert sum(t.steps for t in sweep.steps.values()) == len(lines)  # warm-ups are not logged
    first = lines[0]
    assert {"arm", "level", "repeat", "batch_size", "reserved_kv_tokens", "step_time"} <= set(first)
    spec_steps = [line for line in lines if line["arm"] == "spec"]
    assert spec_steps and all(line["speculating"] for line in spec_steps)


def test_reference_outputs_are_batch_1_over_distinct_prompts(swept) -> None:
    sweep = swept[0]
    references = reference_outputs(sweep, sweep.arms[0])
    assert references == {c.case_id: [fake_token(c.prompt_ids, i) for i in range(MAX_NEW_TOKENS)]
                          for c in CASES if c.prompt_ids}  # fmt: skip
    assert max(sweep.arms[0].engine.in_flight_log[-3 * MAX_NEW_TOKENS :]) == 1


def test_step_log_lines(tmp_path: Path) -> None:
    from spectoolkit.serving.api import StepStats

    log = StepLog(tmp_path / "steps.jsonl")
    log.write("spec", "rate=2", 1, StepStats(3, 2, 7, 0, 5, 5, 40, 1, True, 0.02, 0.005, 1))
    log.close()
    line = json.loads((tmp_path / "steps.jsonl").read_text(encoding="utf-8"))
    assert (line["arm"], line["level"], line["repeat"]) == ("spec", "rate=2", 1)
    assert (line["draft_tokens"], line["queued"], line["speculating"]) == (5, 1, True)
