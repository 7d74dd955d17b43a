"""run_serving end to end on fake serving engines (the tiny checkpoint's tokenizer and setup): records,
summary.json, steps.jsonl, the printed table, Ctrl-C, the KV check, and the CLI route."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from spectoolkit.bench.load import runner
from spectoolkit.bench.load.runner import STEPS_FILE, format_serving_table, run_serving
from spectoolkit.bench.protocol.runner import RECORDS_FILE, SUMMARY_FILE
from spectoolkit.bench.protocol.runner import _report as _protocol_report
from spectoolkit.config import (
    BenchConfig,
    ModelConfig,
    RunConfig,
    RuntimeConfig,
    SamplingConfig,
    ServeConfig,
    WorkloadConfig,
)
from spectoolkit.errors import SpecToolkitError
from spectoolkit.metrics.records import read_records
from spectoolkit.wiring.setup import build
from tests.bench.load.fakes import fake_arms, install_serving_arms

BUILTIN_CASES = 6
MAX_NEW_TOKENS = 8
COST_PER_HOUR = 2.0
LEVEL_KEYS = ["1", "2", "rate=200"]
STAT_KEYS = {
    "output_throughput", "request_throughput", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p50", "itl_p99",
    "latency_p95", "latency_p99", "mean_batch_size", "acceptance_rate", "mean_accept_length", "peak_temp_kv_tokens",
    "speculating_share", "preemptions", "errors", "num_requests", "speedup", "speedup_low", "speedup_high",
    "exact_match", "by_task",
    "policy_predicted_rate", "policy_measured_rate", "policy_tokens_ratio", "policy_target_ratio", "policy_draft_ratio",
}  # fmt: skip


def _cfg(checkpoint: Path, out: Path, **serve) -> RunConfig:
    values = {"enabled": True, "concurrency": (1, 2), "rate": (200.0,), "warmup_requests": 1, "step_log": True}
    return RunConfig(
        model=ModelConfig(target_path=str(checkpoint)),
        workload=WorkloadConfig(kind="builtin", max_new_tokens=MAX_NEW_TOKENS),
        bench=BenchConfig(warmup=0, repeat=2, calibrate=False, baseline_check=False, cost_per_hour=COST_PER_HOUR),
        runtime=RuntimeConfig(kernels="reference"), serve=ServeConfig(**{**values, **serve}),
        device="cpu", output_dir=str(out),
    )  # fmt: skip


@pytest.fixture(scope="module")
def setup(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tiny checkpoint's run setup, built once: every test here swaps in fake serving engines."""
    return build(_cfg(tiny_checkpoint, tmp_path_factory.mktemp("setup")))


@pytest.fixture
def patched(monkeypatch, setup):
    """Returns a function installing fake arms (``spec`` keyword arguments go to the spec engine).

    The report (plots: most of a second) is written only by the end-to-end test."""
    monkeypatch.setattr(runner, "build", lambda cfg, arms=True: setup)
    monkeypatch.setattr(runner, "_report", lambda out_dir: None)

    def install(**spec):
        arms = fake_arms(time.perf_counter, **spec)
        install_serving_arms(monkeypatch, arms)
        return arms

    return install


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_end_to_end(patched, monkeypatch, tiny_checkpoint: Path, tmp_path: Path) -> None:
    patched()
    monkeypatch.setattr(runner, "_report", _protocol_report)
    (tmp_path / RECORDS_FILE).write_text('{"old": true}\n', encoding="utf-8")
    summary = run_serving(_cfg(tiny_checkpoint, tmp_path), progress=False)
    assert json.loads((tmp_path / SUMMARY_FILE).read_text(encoding="utf-8")) == json.loads(json.dumps(summary))
    assert [p.name for p in tmp_path.glob("records.*.jsonl")] != []  # the old records were set aside
    records = read_records(tmp_path / RECORDS_FILE)
    assert len(records) == 2 * 2 * (6 + 6 + 8)  # arms x repeats x level sizes (6 prompts; open loop >= 8)
    assert all(r.error is None and r.output_len == MAX_NEW_TOKENS and r.input_len > 0 for r in records)
    assert all(r.ttft > 0 and r.total_time >= r.ttft and r.arrival_offset >= 0 for r in records)
    assert {r.load_level for r in records} == set(LEVEL_KEYS)
    assert {r.concurrency for r in records if r.load_level == "2"} == {2}
    assert all(r.rate == 200.0 for r in records if r.load_level == "rate=200")
    assert (summary["mode"], summary["complete"], summary["requests"], summary["errors"]) == ("serving", True, 80, 0)
    assert [level["key"] for level in summary["serving_levels"]] == LEVEL_KEYS
    for arm in ("baseline", "spec"):
        assert list(summary["serving"][arm]) == LEVEL_KEYS
        for stats in summary["serving"][arm].values():
            assert STAT_KEYS <= set(stats) and stats["output_throughput"] > 0 and stats["exact_match"] == 1.0
    spec = summary["serving"]["spec"]["2"]
    assert spec["speedup"] > 0 and spec["peak_temp_kv_tokens"] > 0
    # 8 tokens: the prefill's 1, rounds of 2 + 1 and 2 + 1, then 0 + 1 (capped), each round drafting 4
    assert spec["acceptance_rate"] == pytest.approx(4 / 12) and spec["mean_accept_length"] == pytest.approx(1 + 4 / 3)
    assert summary["serving_exactness"]["divergent"] == [] and summary["serving_exactness"]["checked"] == 80
    assert list(summary["serve"]["concurrency"]) == [1, 2] and summary["serve"] == summary["conditions"]["serve"]
    assert summary["conditions"]["concurrency"] is None
    assert [arm["name"] for arm in summary["conditions"]["arms"]] == ["baseline", "spec"]
    steps = _lines(tmp_path / STEPS_FILE)
    assert {line["level"] for line in steps} == set(LEVEL_KEYS)
    cost = summary["token_cost"]  # per arm and level, from each level's output throughput
    assert (cost["cost_per_hour"], cost["arms"], list(cost["by_level"])) == (COST_PER_HOUR, {}, ["baseline", "spec"])
    for arm, by_level in summary["serving"].items():
        for key, stats in by_level.items():
            expected = COST_PER_HOUR / (stats["output_throughput"] * 3600) * 1e6
            assert cost["by_level"][arm][key]["cost_per_million_output_tokens"] == pytest.approx(expected)
    assert cost["by_level"]["spec"]["2"]["reference"] == "baseline"
    assert cost["by_level"]["baseline"]["2"]["change"] is None
    assert (tmp_path / "report.md").exists() and (tmp_path / "alerts.yml").exists()  # the report reads this summary
    table = format_serving_table(summary).splitlines()
    assert "out tok/s" in table[0] and len(table) == 1 + 3 * 2 + 1
    assert table[-1].startswith("greedy exactness: 80/80 outputs equal baseline at concurrency 1")


def test_without_level_1_the_reference_is_a_batch_1_run_after_the_levels(patched, tiny_checkpoint, tmp_path) -> None:
    arms = patched(diverge_at=3)  # spec outputs differ from position 3 whenever it runs batched
    summary = run_serving(_cfg(tiny_checkpoint, tmp_path, concurrency=(2,), rate=()), progress=False)
    references = [rid for rid, *_ in arms[0].engine.submitted if rid.startswith("reference:")]
    assert len(references) == BUILTIN_CASES
    assert [rid for rid, *_ in arms[0].engine.submitted][-BUILTIN_CASES:] == references  # after the timed levels
    assert not any(rid.startswith("reference:") for rid, *_ in arms[1].engine.submitted)
    exactness = summary["serving_exactness"]
    assert exactness["checked"] == 2 * 2 * BUILTIN_CASES
    assert exactness["divergent"] and {d["arm"] for d in exactness["divergent"]} == {"spec"}
    assert {d["position"] for d in exactness["divergent"]} == {3}
    assert summary["serving"]["baseline"]["2"]["exact_match"] == 1.0
    assert summary["serving"]["spec"]["2"]["exact_match"] < 1.0


def test_ctrl_c_keeps_finished_records_and_writes_an_incomplete_summary(patched, tiny_checkpoint, tmp_path) -> None:
    patched(interrupt_at_step=40)  # the spec engine, in the middle of a level
    with pytest.raises(KeyboardInterrupt):
        run_serving(_cfg(tiny_checkpoint, tmp_path), progress=False)
    records = read_records(tmp_path / RECORDS_FILE)
    summary = json.loads((tmp_path / SUMMARY_FILE).read_text(encoding="utf-8"))
    assert summary["complete"] is False and summary["requests"] == len(records) > 0
    assert {r.arm for r in records} == {"baseline", "spec"}  # the spec run's finished requests were kept
    assert summary["serving"]["baseline"]["1"]["num_requests"] > 0


def test_a_prompt_that_cannot_run_is_an_error_record(patched, monkeypatch, tiny_checkpoint, tmp_path) -> None:
    patched()
    encode = runner._encode
    fail_code = lambda models, request, cfg: (  # noqa: E731
        "empty prompt" if request.case_id == "builtin-code" else encode(models, request, cfg)
    )
    monkeypatch.setattr(runner, "_encode", fail_code)
    summary = run_serving(_cfg(tiny_checkpoint, tmp_path, concurrency=(1,), rate=()), progress=False)
    errors = [r for r in read_records(tmp_path / RECORDS_FILE) if r.error]
    assert len(errors) == 2 * 2 and {r.error for r in errors} == {"empty prompt"}  # arms x repeats
    assert summary["serving"]["spec"]["1"]["errors"] == 2 and summary["serving"]["spec"]["1"]["num_requests"] == 12
    assert summary["error_reasons"] == ["empty prompt"]


def test_a_request_that_cannot_fit_the_kv_budget_says_what_to_change(patched, tiny_checkpoint, tmp_path) -> None:
    patched()
    with pytest.raises(SpecToolkitError, match=r"serve.max_kv_tokens=32 cannot hold one request: .* raise serve"):
        run_serving(_cfg(tiny_checkpoint, tmp_path, max_kv_tokens=32), progress=False)
    assert not (tmp_path / SUMMARY_FILE).exists()


def test_sampling_runs_have_no_exactness_and_no_reference_run(patched, tiny_checkpoint, tmp_path) -> None:
    arms = patched()
    cfg = _cfg(tiny_checkpoint, tmp_path, concurrency=(2,), rate=(), step_log=False)
    from dataclasses import replace

    summary = run_serving(replace(cfg, sampling=SamplingConfig(temperature=0.8)), progress=False)
    assert summary["serving_exactness"] is None and summary["serving"]["spec"]["2"]["exact_match"] is None
    assert not any(rid.startswith("reference:") for rid, *_ in arms[0].engine.submitted)
    assert not (tmp_path / STEPS_FILE).exists()
    assert format_serving_table(summary).splitlines()[-1].startswith("greedy exactness: n/a (sampling)")


def test_a_sampling_mix_sends_each_request_its_rule_and_splits_speedup_by_mode(patched, tiny_checkpoint,
                                                                                 tmp_path) -> None:  # fmt: skip
    patched()
    cfg = _cfg(tiny_checkpoint, tmp_path, concurrency=(2,), rate=(), step_log=False, sampling_mix=(0.0, 0.7))
    summary = run_serving(cfg, progress=False)
    records = read_records(tmp_path / RECORDS_FILE)  # the fake engine reports the rule each request brought
    assert [r.temperature for r in records[:4]] == [0.0, 0.7, 0.0, 0.7]
    spec = summary["serving"]["spec"]["2"]
    assert spec["requests_by_mode"] == {"greedy": 6, "T=0.7": 6} and set(spec["speedup_by_mode"]) == {"greedy", "T=0.7"}
    assert summary["serving_exactness"]["checked"] == 2 * 2 * BUILTIN_CASES // 2  # the greedy half only


def test_the_cli_bench_job_runs_serving_when_enabled(monkeypatch, tiny_checkpoint, tmp_path) -> None:
    from spectoolkit.__main__ import _bench_job

    canned = {"serving_levels": [], "serving": {}, "serving_exactness": None, "errors": 0, "complete": True}
    monkeypatch.setattr(runner, "run_serving", lambda cfg: canned)
    assert _bench_job(_cfg(tiny_checkpoint, tmp_path)) == format_serving_table(canned)


def test_the_printed_table_gives_a_speedup_the_range_of_its_repeats() -> None:
    stats = dict.fromkeys(["output_throughput", "ttft_p99", "tpot_p99", "mean_batch_size", "acceptance_rate"], 1.0)
    spread = {**stats, "num_requests": 8, "speedup": 1.4, "speedup_low": 1.31, "speedup_high": 1.52}
    equal = {**spread, "speedup_low": 1.4, "speedup_high": 1.4}
    summary = {"serving_levels": [{"key": "1"}, {"key": "8"}], "serving": {"spec": {"1": spread, "8": equal}},
               "serving_exactness": None, "errors": 0, "complete": True}  # fmt: skip
    rows = format_serving_table(summary).splitlines()[1:3]
    assert "1.40x (1.31-1.52)" in rows[0] and rows[1].split()[4] == "1.40x" and "(" not in rows[1]
