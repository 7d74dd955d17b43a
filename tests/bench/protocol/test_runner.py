"""The measurement protocol end to end on a tiny random checkpoint (DESIGN §3): records, summary,
errors that cost one record, Ctrl-C, and earlier records kept."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import yaml

from spectoolkit.bench.protocol.runner import RECORDS_FILE, SUMMARY_FILE, run
from spectoolkit.config import BenchConfig, DraftConfig, ModelConfig, RunConfig, WorkloadConfig
from spectoolkit.serving.one import OneRequestEngine

DESIGN_FIELDS = (
    "case_id", "task_type", "repeat_idx", "input_len", "output_len", "temperature", "top_p", "top_k",
    "random_seed", "draft_len", "batch_size", "concurrency", "drafted_tokens", "accepted_tokens",
    "verify_rounds", "rollback_count", "ttft", "total_time", "draft_time", "verify_time", "gpu_mem_peak",
    "arm", "output_ids", "accept_lengths",
)  # fmt: skip
BUILTIN_CASES = 6
BUILTIN_TASK_TYPES = {"chat", "code", "structured", "summarization", "qa"}
MAX_NEW_TOKENS = 8
GAMMA = 4
COST_PER_HOUR = 2.0

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: extra threads only contend


def _config(checkpoint: Path, out: Path, draft: DraftConfig, **overrides) -> RunConfig:
    values = dict(
        draft=draft,
        model=ModelConfig(target_path=str(checkpoint)),
        workload=WorkloadConfig(kind="builtin", max_new_tokens=MAX_NEW_TOKENS),
        bench=BenchConfig(warmup=0, repeat=2, cost_per_hour=COST_PER_HOUR),
        device="cpu",
        output_dir=str(out),
    )
    return RunConfig(**{**values, **overrides})


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _written_summary(out: Path) -> dict:
    return json.loads((out / SUMMARY_FILE).read_text(encoding="utf-8"))


@pytest.fixture(
    scope="module",
    params=[DraftConfig(kind="ngram"), DraftConfig(kind="model", precision="fp32")],
    ids=["ngram", "self-draft-fp32"],
)
def two_arm_run(request, one_thread, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """One run per drafter: builtin workload, 2 repeats, both arms. Returns (config, summary, records)."""
    cfg = _config(tiny_checkpoint, tmp_path_factory.mktemp("run"), request.param)
    summary = run(cfg, progress=False)
    return cfg, summary, _lines(Path(cfg.output_dir) / RECORDS_FILE)


def test_records_cover_arms_cases_repeats(two_arm_run) -> None:
    _, _, records = two_arm_run
    assert len(records) == 2 * BUILTIN_CASES * 2
    keys = {(r["case_id"], r["repeat_idx"], r["arm"]) for r in records}
    assert len(keys) == len(records)
    assert {r["arm"] for r in records} == {"baseline", "spec"}
    assert {r["repeat_idx"] for r in records} == {0, 1}
    assert {r["task_type"] for r in records} == BUILTIN_TASK_TYPES
    for record in records:
        missing = [name for name in DESIGN_FIELDS if name not in record]
        assert not missing, f"record lacks {missing}"
        assert record["error"] is None
        assert record["gpu_mem_peak"] is None  # no accelerator
        assert (record["batch_size"], record["concurrency"]) == (1, 1)
        assert 1 <= record["output_len"] == len(record["output_ids"]) <= MAX_NEW_TOKENS
        assert record["input_len"] > 0
        assert 0 < record["ttft"] <= record["total_time"]
        assert (record["temperature"], record["top_p"], record["top_k"]) == (0.0, 1.0, 0)


def test_arm_counters_are_consistent(two_arm_run) -> None:
    _, _, records = two_arm_run
    for record in records:
        if record["arm"] == "baseline":
            assert (record["draft_len"], record["drafted_tokens"], record["accepted_tokens"]) == (0, 0, 0)
            assert record["drafter"] == "none"
        else:
            assert record["draft_len"] == GAMMA
            assert len(record["accept_lengths"]) == record["verify_rounds"]
            assert sum(record["accept_lengths"]) == record["accepted_tokens"] <= record["drafted_tokens"]
            # Every round emits its accepted drafts + 1 token, the prefill the first token.
            assert record["output_len"] <= 1 + record["verify_rounds"] + record["accepted_tokens"]


def test_seeds_shared_by_arms_and_differ_across_repeats(two_arm_run) -> None:
    _, _, records = two_arm_run
    seeds: dict[tuple[str, int], set[int]] = {}
    for record in records:
        seeds.setdefault((record["case_id"], record["repeat_idx"]), set()).add(record["random_seed"])
    assert all(len(pair) == 1 for pair in seeds.values()), "both arms of a (case, repeat) share one seed"
    for case_id in {case for case, _ in seeds}:
        assert seeds[(case_id, 0)] != seeds[(case_id, 1)]
    assert len({next(iter(s)) for s in seeds.values()}) == len(seeds)


def test_arms_are_interleaved(two_arm_run) -> None:
    _, _, records = two_arm_run
    firsts = [records[i]["arm"] for i in range(0, len(records), 2)]
    assert [records[i]["case_id"] for i in range(0, len(records), 2)] == [
        records[i + 1]["case_id"] for i in range(0, len(records), 2)
    ]  # both arms of a case run back to back
    assert {"baseline", "spec"} == set(firsts)  # and neither arm always goes first


def test_summary(two_arm_run) -> None:
    cfg, summary, _ = two_arm_run
    assert _written_summary(Path(cfg.output_dir)) == json.loads(json.dumps(summary))
    assert summary["complete"] is True
    assert (summary["requests"], summary["errors"]) == (24, 0)
    assert summary["greedy_exact_match"] == 1.0
    assert summary["speedup"] is not None and summary["speedup"] > 0
    base, spec = summary["arms"]["baseline"], summary["arms"]["spec"]
    assert base["requests"] == spec["requests"] == 12
    assert base["tokens_per_verify"] == pytest.approx(1.0)
    assert set(summary["by_task_type"]) == BUILTIN_TASK_TYPES
    for group in summary["by_task_type"].values():
        assert set(group["arms"]) == {"baseline", "spec"} and set(group["speedups"]) == {"spec"}
    cost = summary["token_cost"]  # per 1M output tokens at bench.cost_per_hour, from each arm's net throughput
    assert cost["cost_per_hour"] == COST_PER_HOUR and list(cost["arms"]) == ["baseline", "spec"]
    for name, stats in summary["arms"].items():
        expected = COST_PER_HOUR / (stats["net_throughput"] * 3600) * 1e6
        assert cost["arms"][name]["cost_per_million_output_tokens"] == pytest.approx(expected)
    assert cost["arms"]["spec"]["reference"] == "baseline" and cost["arms"]["spec"]["change"] is not None
    alerts = yaml.safe_load((Path(cfg.output_dir) / "alerts.yml").read_text(encoding="utf-8"))  # beside report.md
    assert alerts["groups"][0]["name"] == "spectoolkit-speculation"
    if cfg.draft.kind == "model":  # a self-draft at the target's precision proposes what the target picks
        assert spec["drafted_tokens"] > 0 and spec["acceptance_rate"] > 0.9
        assert spec["tokens_per_verify"] > 1.5
        assert spec["proposal_coverage"] == 1.0


def test_conditions(two_arm_run) -> None:
    cfg, summary, _ = two_arm_run
    conditions = summary["conditions"]
    assert conditions["hardware"]["device"] == "cpu"
    assert conditions["hardware"]["cpu"] and conditions["hardware"]["torch_threads"] >= 1
    hardware = conditions["hardware"]  # the kernel path that ran, among those this CPU runs, and what chose it
    assert (
        hardware["kernel_path"] in hardware["kernel_paths_available"] and "scalar" in hardware["kernel_paths_available"]
    )
    assert isinstance(hardware["cpu_flags"], list)
    assert hardware["kernel_paths_by_kind"]["int8-activation linear"] == hardware["kernel_path"]
    assert conditions["gamma"] == GAMMA
    assert conditions["target"] == {
        "path": cfg.model.target_path,
        "precision": "fp32",
        "group_size": 64,
        "activations": "float",
        "label": "fp32",
    }
    assert conditions["draft"]["kind"] == cfg.draft.kind
    memory = conditions["memory"]
    assert memory["target_weight_bytes"] > 0
    if cfg.draft.kind == "model":
        assert memory["draft_weight_bytes"] == memory["target_weight_bytes"]  # same checkpoint, same precision
        assert memory["memory_delta_bytes"] >= memory["draft_weight_bytes"] > 0
    else:  # n-gram lookup holds no weights and no KV; the spec arm's candidates take at most one more KV block
        model = json.loads((Path(cfg.model.target_path) / "config.json").read_text())
        head_dim = model["hidden_size"] // model["num_attention_heads"]
        slot = model["num_hidden_layers"] * 2 * model["num_key_value_heads"] * head_dim * 4  # fp32 keys + values
        assert 0 <= memory["memory_delta_bytes"] <= cfg.serve.block_size * slot


def test_draft_none_runs_only_the_baseline(tiny_checkpoint: Path, tmp_path: Path, monkeypatch) -> None:
    frozen = []  # objects out of the collector's reach at each generation: the loaded heap, frozen while measuring
    generate = OneRequestEngine.generate

    def noting_the_heap(self, *args, **kwargs):
        frozen.append(gc.get_freeze_count())
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(OneRequestEngine, "generate", noting_the_heap)
    before = gc.get_freeze_count()
    cfg = _config(tiny_checkpoint, tmp_path, DraftConfig(kind="none"), bench=BenchConfig(warmup=1, repeat=1))
    summary = run(cfg, progress=False)
    assert frozen and min(frozen) > before
    assert gc.get_freeze_count() == before  # and unfrozen after the run
    records = _lines(tmp_path / RECORDS_FILE)
    assert len(records) == BUILTIN_CASES  # warm-up generations are not recorded
    assert {r["arm"] for r in records} == {"baseline"}
    assert summary["speedup"] is None
    assert set(summary["arms"]) == {"baseline"}
    assert summary["greedy_exact_match"] is None
    assert summary["conditions"]["memory"]["memory_delta_bytes"] == 0


def test_bad_requests_become_error_records(tiny_checkpoint_short_context: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    long_prompt = " ".join(["lorem ipsum dolor sit amet"] * 60)  # far beyond a 128-position context
    prompts.write_text(
        "\n".join(
            [
                json.dumps({"id": "ok", "task_type": "qa", "prompt": "What is 2 + 2?"}),
                json.dumps({"id": "long", "task_type": "chat", "prompt": long_prompt}),
                '{"id": "broken", "prompt": ',
            ]
        )
        + "\n",
        encoding="utf-8",
    )
    workload = WorkloadConfig(kind="jsonl", path=str(prompts), max_new_tokens=MAX_NEW_TOKENS)
    cfg = _config(
        tiny_checkpoint_short_context, tmp_path / "out", DraftConfig(kind="ngram"),
        workload=workload, bench=BenchConfig(warmup=1, repeat=1),
    )  # fmt: skip
    summary = run(cfg, progress=False)
    records = {(r["case_id"], r["arm"]): r for r in _lines(tmp_path / "out" / RECORDS_FILE)}
    assert set(records) == {(case, arm) for case in ("ok", "long", "line-3") for arm in ("baseline", "spec")}
    for arm in ("baseline", "spec"):
        assert records[("ok", arm)]["error"] is None and records[("ok", arm)]["output_len"] > 0
        assert "exceeds the model's context of 128" in records[("long", arm)]["error"]
        assert "line 3" in records[("line-3", arm)]["error"]
        assert records[("long", arm)]["output_ids"] == []
    assert (summary["requests"], summary["errors"]) == (6, 4)
    assert summary["arms"]["baseline"]["requests"] == summary["arms"]["spec"]["requests"] == 1
    assert summary["complete"] is True
    assert summary["greedy_exact_match"] == 1.0  # over the one pair that ran


def test_interrupt_keeps_finished_records(tiny_checkpoint: Path, tmp_path: Path, monkeypatch) -> None:
    calls = []
    generate = OneRequestEngine.generate

    def interrupted_on_third_call(self, *args, **kwargs):
        calls.append(self.name)
        if calls.count("spec") == 3:
            raise KeyboardInterrupt
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(OneRequestEngine, "generate", interrupted_on_third_call)
    cfg = _config(tiny_checkpoint, tmp_path, DraftConfig(kind="ngram"), bench=BenchConfig(warmup=0, repeat=1))
    with pytest.raises(KeyboardInterrupt):
        run(cfg, progress=False)
    # Arm order alternates: case 0 baseline, spec; case 1 spec, baseline; case 2 baseline, then spec #3.
    lines = (tmp_path / RECORDS_FILE).read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]  # every line is a complete record
    assert len(records) == 5
    assert all(r["error"] is None and r["output_ids"] for r in records)
    summary = _written_summary(tmp_path)
    assert summary["complete"] is False
    assert summary["requests"] == 5
    assert summary["conditions"]["hardware"]["device"] == "cpu"


def test_rerun_sets_earlier_records_aside(tiny_checkpoint: Path, tmp_path: Path, monkeypatch) -> None:
    # A fixed clock: every run lands in the same second, the worst case for timestamped names.
    monkeypatch.setattr("spectoolkit.bench.protocol.runner.time.strftime", lambda *args: "20250101-000000")
    workload = WorkloadConfig(kind="builtin", max_new_tokens=2, num_prompts=1)
    cfg = _config(
        tiny_checkpoint, tmp_path, DraftConfig(kind="ngram"), workload=workload,
        bench=BenchConfig(warmup=0, repeat=1),
    )  # fmt: skip
    contents = []
    for _ in range(3):
        run(cfg, progress=False)
        contents.append((tmp_path / RECORDS_FILE).read_text(encoding="utf-8"))
    assert all(len(text.splitlines()) == 2 for text in contents)  # each run starts a fresh file
    kept = sorted(tmp_path.glob("records*.jsonl"))
    assert len(kept) == 3, [path.name for path in kept]
    assert sorted(path.read_text(encoding="utf-8") for path in kept) == sorted(contents)
