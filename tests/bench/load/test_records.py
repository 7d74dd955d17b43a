"""Serving records from known token times: TTFT, TPOT, queue time, ITL over deliveries, batch, counters."""

from __future__ import annotations

import pytest

from spectoolkit.bench.load.generator import Completion
from spectoolkit.bench.load.plan import Case, Level
from spectoolkit.bench.load.records import RunContext, error_record, serving_record
from spectoolkit.config import RunConfig, SamplingConfig
from spectoolkit.metrics.records import RequestRecord
from spectoolkit.metrics.timing import delivery_gaps, time_per_output_token
from spectoolkit.serving.api import FinishedRequest
from tests.bench.load.fakes import FakeArm, FakeClock, FakeServingEngine

CASE = Case("c1", "code", [5, 6, 7])
# 6 tokens in 4 deliveries: the prefill's, a speculative round of 3 (one time), then two single steps.
TOKEN_TIMES = [11.0, 11.2, 11.2, 11.2, 11.5, 12.0]


def _finished(**overrides) -> FinishedRequest:
    values = dict(
        request_id="0:c1", output_ids=[1, 2, 3, 4, 5, 6], arrival=10.0, scheduled=10.5, token_times=TOKEN_TIMES,
        finish=12.25, batch_sizes=[2, 4, 4, 3], verify_rounds=3, drafted_tokens=12, accepted_tokens=3,
        accept_lengths=[2, 0, 1], draft_lengths=[4, 4, 4], preemptions=1, prompt_len=3,
    )  # fmt: skip
    return FinishedRequest(**{**values, **overrides})


def _ctx(level: Level, arm: FakeArm | None = None) -> RunContext:
    cfg = RunConfig(sampling=SamplingConfig(temperature=0.7, top_k=20, seed=3))
    arm = arm or FakeArm("spec", FakeServingEngine(FakeClock()), gamma=4, drafter="ngram", reference="baseline")
    return RunContext(cfg, arm, level, repeat_idx=1, measure_start=8.0)


def _record(level: Level, in_flight: float = 4.0, **overrides) -> RequestRecord:
    completion = Completion(_finished(**overrides), level_start=9.0, in_flight=in_flight)
    return serving_record(_ctx(level), CASE, 99, completion)


def test_token_time_metrics() -> None:
    assert delivery_gaps(TOKEN_TIMES) == pytest.approx([0.2, 0.3, 0.5])
    assert delivery_gaps([1.0]) == [] and delivery_gaps([]) == []
    assert time_per_output_token(TOKEN_TIMES) == pytest.approx(0.2)  # (12 - 11) / 5
    assert time_per_output_token([3.0]) is None


def test_closed_loop_record_fields() -> None:
    record = _record(Level("4", "concurrency", 4), in_flight=3.4)
    assert (record.load_level, record.rate, record.concurrency) == ("4", None, 4)  # closed loop: the level's N
    assert record.ttft == pytest.approx(1.0)
    assert record.total_time == pytest.approx(2.25) and record.ttft_nonstreaming == pytest.approx(2.25)
    assert record.queue_time == pytest.approx(0.5)
    assert record.tpot == pytest.approx(0.2)
    assert record.itl_p50 == pytest.approx(0.3)
    assert record.itl_p99 == pytest.approx(0.3 + 0.98 * 0.2)  # numpy linear between 0.3 and 0.5
    assert record.arrival_offset == pytest.approx(1.0) and record.start_offset == pytest.approx(2.0)
    assert record.token_offsets == pytest.approx([t - 10.0 for t in TOKEN_TIMES])
    assert record.mean_batch_size == pytest.approx(3.25) and record.batch_size == 3
    assert (record.input_len, record.output_len, record.output_ids) == (3, 6, [1, 2, 3, 4, 5, 6])
    assert (record.drafted_tokens, record.accepted_tokens, record.verify_rounds) == (12, 3, 3)
    assert (record.rollback_count, record.proposed_rounds, record.preemptions) == (3, 3, 1)
    assert (record.arm, record.drafter, record.draft_len, record.random_seed, record.repeat_idx) == (
        "spec", "ngram", 4, 99, 1,
    )  # fmt: skip
    assert (record.temperature, record.top_k, record.top_p) == (0.7, 20, 1.0)
    assert record.error is None


def test_open_loop_record_takes_the_measured_load() -> None:
    record = _record(Level("rate=2", "rate", 2.0), in_flight=3.6)
    assert (record.load_level, record.rate, record.concurrency) == ("rate=2", 2.0, 4)


def test_short_and_failed_requests() -> None:
    one = _record(Level("1", "concurrency", 1), token_times=[11.0], output_ids=[1], scheduled=None)
    assert (one.tpot, one.itl_p50, one.itl_p99, one.queue_time) == (None, None, None, None)
    assert one.ttft == pytest.approx(1.0)
    failed = _record(Level("1", "concurrency", 1), token_times=[], output_ids=[], error="nan logits")
    assert failed.error == "nan logits" and failed.ttft is None and failed.output_len == 0


def test_error_record_of_a_prompt_that_cannot_run() -> None:
    case = Case("long", "chat", None, "prompt of 999 tokens exceeds the context")
    record = error_record(_ctx(Level("2", "concurrency", 2)), case, 5)
    assert record.error == case.error and record.load_level == "2" and record.concurrency == 2
    assert record.ttft is None and record.output_len == 0 and record.random_seed == 5
