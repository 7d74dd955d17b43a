"""Arm sets of the protocol on a tiny checkpoint: four_groups, gamma_sweep, and what every record of
a run carries (time split, streaming TTFT, memory, rotation of the arm order)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spectoolkit.bench.protocol.runner import RECORDS_FILE, run
from spectoolkit.config import BenchConfig, DraftConfig, ModelConfig, RunConfig, TargetConfig, WorkloadConfig
from spectoolkit.errors import SpecToolkitError

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NEW_TOKENS = 8
NUM_PROMPTS = 3


def _config(checkpoint: Path, out: Path, **overrides) -> RunConfig:
    values = dict(
        draft=DraftConfig(kind="model", precision="fp32"),
        model=ModelConfig(target_path=str(checkpoint)),
        workload=WorkloadConfig(kind="builtin", max_new_tokens=MAX_NEW_TOKENS, num_prompts=NUM_PROMPTS),
        bench=BenchConfig(warmup=0, repeat=2),
        device="cpu",
        output_dir=str(out),
    )
    return RunConfig(**{**values, **overrides})


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / RECORDS_FILE).read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def four_groups(one_thread, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("four")
    bench = BenchConfig(warmup=0, repeat=2, arms="four_groups", reference_precision="fp32")
    cfg = _config(tiny_checkpoint, out, bench=bench, target=TargetConfig(precision="rtn-int8"))
    return run(cfg, progress=False), _records(out), out


def test_four_groups_arms_and_references(four_groups) -> None:
    summary, records, _ = four_groups
    assert list(summary["arms"]) == ["baseline", "quant", "spec", "quant+spec"]
    assert summary["primary_arm"] == "quant+spec"
    assert set(summary["speedups"]) == {"quant", "spec", "quant+spec"}
    assert summary["speedup"] == summary["speedups"]["quant+spec"]
    precisions = {r["arm"]: r["target_precision"] for r in records}
    assert precisions == {"baseline": "fp32", "quant": "rtn-int8", "spec": "fp32", "quant+spec": "rtn-int8"}
    refs = {name: stats["reference_arm"] for name, stats in summary["arms"].items()}
    assert refs == {"baseline": None, "quant": None, "spec": "baseline", "quant+spec": "quant"}
    # Exactness is against the target at its own precision: each drafting arm vs its reference arm.
    assert summary["exact_match"] == {"spec": 1.0, "quant+spec": 1.0}
    assert summary["exactness"]["verdict"] == "exact" and set(summary["exactness"]["arms"]) == {"spec", "quant+spec"}
    assert summary["exactness"]["arms"]["quant+spec"]["threshold"] == 0.1  # int8 target: activation rounding
    assert summary["conditions"]["memory"]["arms"]["quant"]["delta_bytes"] < 0  # int8 weights are smaller
    assert set(summary["cost_model"]) == {"spec", "quant+spec"}


def test_four_groups_rotates_arm_order(four_groups) -> None:
    _, records, _ = four_groups
    firsts = {records[i]["arm"] for i in range(0, len(records), 4)}
    assert firsts == {"baseline", "quant", "spec", "quant+spec"}  # 6 (case, repeat) slots, 4 arms rotate
    for i in range(0, len(records), 4):
        block = records[i : i + 4]
        assert len({(r["case_id"], r["repeat_idx"], r["random_seed"]) for r in block}) == 1


def test_records_carry_time_split_and_streaming_ttft(four_groups) -> None:
    _, records, _ = four_groups
    for record in records:
        parts = record["prefill_time"] + record["draft_time"] + record["verify_time"] + record["overhead_time"]
        assert parts == pytest.approx(record["total_time"], rel=1e-6)
        assert min(record["prefill_time"], record["verify_time"], record["overhead_time"]) >= 0
        assert 0 < record["ttft"] <= record["ttft_nonstreaming"]
        assert record["ttft_nonstreaming"] >= record["total_time"]
        assert record["host_rss"] > 0 and record["start_offset"] >= 0
        assert len(record["draft_lengths"]) == len(record["accept_lengths"]) == record["verify_rounds"] or (
            record["draft_len"] == 0 and record["draft_lengths"] == []
        )
    offsets = [r["start_offset"] for r in records]
    assert offsets == sorted(offsets)


def test_run_writes_report(four_groups) -> None:
    _, _, out = four_groups
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "quant+spec" in report


def test_four_groups_needs_a_quantized_target(tiny_checkpoint: Path, tmp_path: Path) -> None:
    cfg = _config(tiny_checkpoint, tmp_path, bench=BenchConfig(arms="four_groups"))
    with pytest.raises(SpecToolkitError, match=r"set \+target="):
        run(cfg, progress=False)


def test_arm_sets_need_a_drafter(tiny_checkpoint: Path, tmp_path: Path) -> None:
    cfg = _config(tiny_checkpoint, tmp_path, draft=DraftConfig(kind="none"), bench=BenchConfig(arms="gamma_sweep"))
    with pytest.raises(SpecToolkitError, match=r"\+draft="):
        run(cfg, progress=False)


def test_gamma_sweep(tiny_checkpoint: Path, tmp_path: Path) -> None:
    bench = BenchConfig(warmup=0, repeat=1, arms="gamma_sweep", gammas=(1, 3))
    summary = run(_config(tiny_checkpoint, tmp_path, bench=bench), progress=False)
    assert list(summary["arms"]) == ["baseline", "spec-g1", "spec-g3", "spec-adaptive"]
    assert summary["primary_arm"] is None  # speculate.gamma=4 is not in the sweep: no single headline
    assert summary["speedup"] is None and set(summary["speedups"]) == {"spec-g1", "spec-g3", "spec-adaptive"}
    adaptive = [r for r in _records(tmp_path) if r["arm"] == "spec-adaptive"]
    assert adaptive and all(r["draft_len"] == 3 for r in adaptive)  # at most max(bench.gammas)
    assert all(len(r["chosen_lengths"]) == len(r["draft_lengths"]) for r in adaptive)
    assert all(0 <= k <= 3 for r in adaptive for k in r["chosen_lengths"])
    for gamma in (1, 3):
        stats = summary["arms"][f"spec-g{gamma}"]
        assert stats["gamma"] == gamma
        assert len(stats["acceptance_histogram"]) == gamma + 1
        assert len(stats["prob_accept_at_least"]) == gamma
        assert max(len(r["accept_lengths"]) and max(r["draft_lengths"]) for r in _records(tmp_path)
                   if r["arm"] == f"spec-g{gamma}") <= gamma  # fmt: skip
    assert summary["exact_match"] == {"spec-g1": 1.0, "spec-g3": 1.0, "spec-adaptive": 1.0}


def test_every_kind_of_bad_line_is_an_error_record(tiny_checkpoint_short_context: Path, tmp_path: Path) -> None:
    lines = [
        json.dumps({"id": "ok", "task_type": "qa", "prompt": "What is 2 + 2?"}),
        '{"id": "broken", "prompt": ',  # malformed JSON
        json.dumps({"id": "empty", "prompt": "   "}),  # empty prompt
        json.dumps({"id": "long", "prompt": " ".join(["lorem ipsum dolor sit amet"] * 60)}),  # > 128 positions
        json.dumps({"id": "noprompt"}),
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n", encoding="utf-8")
    workload = WorkloadConfig(kind="jsonl", path=str(prompts), max_new_tokens=MAX_NEW_TOKENS)
    cfg = _config(tiny_checkpoint_short_context, tmp_path / "out", draft=DraftConfig(kind="ngram"),
                  workload=workload, bench=BenchConfig(warmup=0, repeat=1))  # fmt: skip
    summary = run(cfg, progress=False)
    errors = {r["case_id"]: r["error"] for r in _records(tmp_path / "out") if r["arm"] == "baseline"}
    assert errors["ok"] is None
    assert "malformed JSON" in errors["line-2"]
    assert '"prompt" is empty' in errors["empty"]
    assert "exceeds the model's context of 128" in errors["long"]
    assert 'missing "prompt"' in errors["noprompt"]
    assert (summary["errors"], summary["complete"]) == (8, True)
    assert summary["arms"]["spec"]["requests"] == 1


def test_drafters_pits_the_lookup_drafters_and_the_draft_model_against_each_other(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    bench = BenchConfig(warmup=0, repeat=1, arms="drafters")
    summary = run(_config(tiny_checkpoint, tmp_path, bench=bench), progress=False)
    assert list(summary["arms"]) == ["baseline", "spec-ngram", "spec-suffix", "spec"]
    assert summary["primary_arm"] == "spec"  # the run's own +draft (a model)
    drafters = {r["arm"]: (r["drafter"], r["draft_precision"]) for r in _records(tmp_path)}
    assert drafters == {"baseline": ("none", None), "spec-ngram": ("ngram", None), "spec-suffix": ("suffix", None),
                        "spec": ("model-fp32", "fp32")}  # fmt: skip
    assert summary["exact_match"] == {"spec-ngram": 1.0, "spec-suffix": 1.0, "spec": 1.0}
    lookups = _config(tiny_checkpoint, tmp_path / "lookups", draft=DraftConfig(kind="suffix"),
                      bench=BenchConfig(warmup=0, repeat=1, arms="drafters", drafters=("suffix", "ngram")))  # fmt: skip
    summary = run(lookups, progress=False)
    assert list(summary["arms"]) == ["baseline", "spec-suffix", "spec-ngram"]
    assert summary["primary_arm"] == "spec-suffix"
