"""The stock-baseline check (bench.protocol.baseline_check) on a tiny checkpoint: a deliberately slowed
baseline fails the checklist item; a real run writes ``summary.json["baseline_check"]`` unless
``bench.baseline_check=false``.

Timings of the tiny model are noise: only the slowed case, where the sleep dominates, is asserted on
its ratio; elsewhere only presence and positivity.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from spectoolkit.bench.protocol.baseline_check import _Deadline, stock_baseline_check
from spectoolkit.bench.protocol.runner import SUMMARY_FILE, run
from spectoolkit.bench.report.checklist import FAIL, NA, STOCK_RATIO_LIMIT, check_baseline_vs_stock
from spectoolkit.checkpoints import resolve_checkpoint
from spectoolkit.config import BenchConfig, DraftConfig, ModelConfig, RunConfig, TargetConfig, WorkloadConfig
from spectoolkit.metrics.summary_schema import Summary
from spectoolkit.wiring.setup import build
from spectoolkit.workloads.prompts import encode_prompt, load_workload

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NEW_TOKENS = 6
SLOWDOWN_S = 0.25  # per call of our baseline: far above a tiny-model generation of 6 tokens
RATES = ("stock_tokens_per_s", "baseline_tokens_per_s", "ratio")


def _config(checkpoint: Path, out: Path, **overrides) -> RunConfig:
    values = dict(
        draft=DraftConfig(kind="none"),
        model=ModelConfig(target_path=str(checkpoint)),
        workload=WorkloadConfig(kind="builtin", max_new_tokens=MAX_NEW_TOKENS, num_prompts=2),
        bench=BenchConfig(warmup=0, repeat=1),
        device="cpu",
        output_dir=str(out),
    )
    return RunConfig(**{**values, **overrides})


def _prompts(cfg: RunConfig, setup) -> list[list[int] | str]:
    requests = load_workload(cfg.workload)
    return [encode_prompt(setup.models.tokenizer, r, cfg.workload.chat_template) for r in requests] + ["too long"]


def test_a_slowed_baseline_fails_the_checklist_item(tiny_checkpoint: Path, tmp_path: Path, monkeypatch) -> None:
    cfg = _config(tiny_checkpoint, tmp_path)
    setup = build(cfg)
    engine = setup.arm_set.baseline.engine
    generate = engine.generate

    def slowed(*args, **kwargs):
        time.sleep(SLOWDOWN_S)
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", slowed)
    check = stock_baseline_check(cfg, setup, _prompts(cfg, setup))
    assert check["prompts"] == 2 and check["max_new_tokens"] == MAX_NEW_TOKENS  # the error string is left out
    assert check["stock"].startswith("transformers ") and check["stock"].endswith("fp32")
    assert check["ratio"] == pytest.approx(check["baseline_tokens_per_s"] / check["stock_tokens_per_s"])
    assert check["baseline_tokens_per_s"] < MAX_NEW_TOKENS / SLOWDOWN_S
    assert check["ratio"] < STOCK_RATIO_LIMIT
    item = check_baseline_vs_stock(Summary.from_dict({"baseline_check": check}))
    assert item.status == FAIL and "limit 0.95" in item.evidence, item


@pytest.mark.parametrize(("precision", "kind"), [("rtn-int8", "int8"), ("rtn-int4", "int4")])
def test_rtn_targets_are_timed_against_torchao_at_the_same_bits(
    tiny_checkpoint: Path, tmp_path: Path, precision: str, kind: str
) -> None:
    """torchao at our bits and g; on a tiny model either side may win its warm-up, so both outcomes are checked:
    timed (rates, an item that is not N/A) or skipped as too slow a comparator (its rate stated)."""
    pytest.importorskip("torchao")
    cfg = _config(tiny_checkpoint, tmp_path, target=TargetConfig(precision=precision, group_size=32))
    setup = build(cfg)
    check = stock_baseline_check(cfg, setup, _prompts(cfg, setup))
    assert "error" not in check, check
    assert f"{kind} weight-only g32" in check["stock"] and "torchao" in check["stock"], check["stock"]
    item = check_baseline_vs_stock(Summary.from_dict({"baseline_check": check}))
    if "skipped" in check:
        assert "slower than ours" in check["skipped"] and item.status == NA, check
    else:
        assert all(check[key] > 0 for key in RATES) and item.status != NA, check


def _slowed_stock(monkeypatch, seconds_per_call: float) -> None:
    """Every stock ``generate`` call takes ``seconds_per_call`` more (the stock model is loaded fresh per check)."""
    from spectoolkit.bench.protocol import baseline_check

    load = baseline_check.load_stock

    def slowed_load(*args, **kwargs):
        model, how = load(*args, **kwargs)
        generate = model.generate

        def slowed(*gen_args, **gen_kwargs):
            time.sleep(seconds_per_call)
            return generate(*gen_args, **gen_kwargs)

        model.generate = slowed
        return model, how

    monkeypatch.setattr(baseline_check, "load_stock", slowed_load)


def test_a_far_slower_rtn_comparator_is_a_skip_with_its_rate(tiny_checkpoint: Path, tmp_path: Path, monkeypatch):
    pytest.importorskip("torchao")
    cfg = _config(tiny_checkpoint, tmp_path, target=TargetConfig(precision="rtn-int8", group_size=32))
    setup = build(cfg)
    _slowed_stock(monkeypatch, SLOWDOWN_S)
    check = stock_baseline_check(cfg, setup, _prompts(cfg, setup))
    assert "slower than ours on its warm-up" in check["skipped"] and "rtn-int8" in check["skipped"], check
    assert "torchao" in check["stock"] and check["seconds"] < 10 * SLOWDOWN_S, check  # stopped after one warm-up
    fp32 = _config(tiny_checkpoint, tmp_path / "fp32")  # a float stock path is timed however slow (it is the user's)
    check = stock_baseline_check(fp32, build(fp32), _prompts(fp32, build(fp32)))
    assert check["ratio"] > 0, check


def test_a_stock_side_past_the_bound_is_stopped_and_skipped(tiny_checkpoint: Path, tmp_path: Path, monkeypatch):
    """A bound shorter than the stock warm-up: the deadline stops stock ``generate`` itself, and the record says so."""
    from spectoolkit.bench.protocol import baseline_check

    cfg = _config(tiny_checkpoint, tmp_path)
    setup = build(cfg)
    monkeypatch.setattr(baseline_check, "MIN_BOUND_S", 0.05)

    class Slow(baseline_check.StoppingCriteria):  # 20 ms per stock token: the 6 tokens cannot fit in 50 ms
        def __call__(self, input_ids, scores, **kwargs):
            time.sleep(0.02)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    real = baseline_check.StoppingCriteriaList
    monkeypatch.setattr(baseline_check, "StoppingCriteriaList", lambda criteria: real([Slow(), *criteria]))
    check = stock_baseline_check(cfg, setup, _prompts(cfg, setup))
    assert "past the check's bound" in check["skipped"] and "tok/s" in check["skipped"], check
    assert check["seconds"] < 1.0, check


def test_the_bound_is_a_share_of_the_runs_estimated_time(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from spectoolkit.bench.protocol.baseline_check import run_estimate_s

    cfg = _config(tiny_checkpoint, tmp_path, bench=BenchConfig(warmup=0, repeat=3))
    setup = build(cfg)  # draft=none: one arm
    assert run_estimate_s(cfg, setup, 4, 0.01) == pytest.approx(4 * 1 * 3 * MAX_NEW_TOKENS * 0.01)


def test_a_missing_stock_library_is_skipped_with_the_reason_and_a_stock_failure_is_recorded(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch
) -> None:
    cfg = _config(tiny_checkpoint, tmp_path, target=TargetConfig(precision="rtn-int8"))
    setup = build(cfg)
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    check = stock_baseline_check(cfg, setup, _prompts(cfg, setup))
    assert set(check) == {"skipped"} and "rtn-int8" in check["skipped"] and "torchao" in check["skipped"]
    item = check_baseline_vs_stock(Summary.from_dict({"baseline_check": check}))
    assert item.status == NA and "torchao" in item.evidence

    def broken(*args, **kwargs):
        raise OSError("no such checkpoint\nsecond line")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", broken)
    setup.arm_set.baseline.target.precision = "fp32"  # the stock side follows the loaded target's precision
    assert stock_baseline_check(cfg, setup, _prompts(cfg, setup)) == {"error": "OSError: no such checkpoint"}
    assert stock_baseline_check(cfg, setup, ["too long"]) is None


def test_a_run_writes_the_check_unless_switched_off(tiny_checkpoint: Path, tmp_path: Path) -> None:
    summary = run(_config(tiny_checkpoint, tmp_path / "on"), progress=False)
    written = json.loads((tmp_path / "on" / SUMMARY_FILE).read_text(encoding="utf-8"))
    assert written["baseline_check"] == summary["baseline_check"]
    assert all(written["baseline_check"][key] > 0 for key in RATES), written["baseline_check"]
    off = _config(tiny_checkpoint, tmp_path / "off", bench=BenchConfig(warmup=0, repeat=1, baseline_check=False))
    run(off, progress=False)
    written = json.loads((tmp_path / "off" / SUMMARY_FILE).read_text(encoding="utf-8"))
    assert written.get("baseline_check") is None
    assert check_baseline_vs_stock(Summary.from_dict(written)).status == NA


def _record_generate_calls(monkeypatch, calls: list[dict], starve_assisted: bool = False) -> None:
    """Every stock ``generate`` call's keyword arguments go to ``calls``; ``starve_assisted``: an assisted call
    returns no new token (as one stopped by the deadline)."""
    from spectoolkit.bench.protocol import baseline_check

    load = baseline_check.load_stock

    def recording_load(*args, **kwargs):
        model, how = load(*args, **kwargs)
        generate = model.generate

        def recorded(input_ids, **gen_kwargs):
            calls.append(gen_kwargs)
            if starve_assisted and "assistant_model" in gen_kwargs:
                return input_ids
            return generate(input_ids, **gen_kwargs)

        model.generate = recorded
        return model, how

    monkeypatch.setattr(baseline_check, "load_stock", recording_load)


def test_a_draft_model_adds_stock_assisted_generation_beside_our_spec_arm(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch
) -> None:
    cfg = _config(tiny_checkpoint, tmp_path, draft=DraftConfig(kind="model", precision="fp32"))
    setup = build(cfg)
    calls: list[dict] = []
    _record_generate_calls(monkeypatch, calls)
    check = stock_baseline_check(cfg, setup, _prompts(cfg, setup))
    assert check["spec_arm"] == setup.arm_set.primary and check["assisted"].endswith("fp32"), check
    assert check["spec_tokens_per_s"] > 0 and check["assisted_tokens_per_s"] > 0 and check["ratio"] > 0, check
    ours = [call for call in calls if any(isinstance(c, _Deadline) for c in call.get("stopping_criteria", []))]
    assisted = [call for call in ours if "assistant_model" in call]  # (the draft's own calls inside are not ours)
    assert len(assisted) == 2 * (1 + 2) and len(ours) == 2 * len(assisted)  # 2 prompts: warm-up + 2 passes each
    assert all(call["max_new_tokens"] == call["min_new_tokens"] and not call["do_sample"] for call in assisted)
    item = check_baseline_vs_stock(Summary.from_dict({"baseline_check": check}))
    assert "stock assisted generation" in item.evidence, item


def test_assisted_generation_past_the_bound_is_dropped_and_the_plain_check_stands(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch
) -> None:
    cfg = _config(tiny_checkpoint, tmp_path, draft=DraftConfig(kind="model", precision="fp32"))
    setup = build(cfg)
    _record_generate_calls(monkeypatch, [], starve_assisted=True)
    check = stock_baseline_check(cfg, setup, _prompts(cfg, setup))
    assert check["ratio"] > 0 and "assisted_tokens_per_s" not in check, check
    assert check["assisted_skipped"].startswith("assisted generation not timed: its warm-up ran past"), check
    item = check_baseline_vs_stock(Summary.from_dict({"baseline_check": check}))
    assert "assisted generation not timed" in item.evidence, item


def test_a_gguf_target_is_timed_against_its_dequantized_float_checkpoint() -> None:
    from spectoolkit.bench.protocol.stock_models import load_stock
    from spectoolkit.embedded import embedded_dir

    model, how = load_stock(resolve_checkpoint(str(embedded_dir())), "gguf", 64, torch.device("cpu"))
    assert "GGUF dequantized to fp32" in how and next(model.parameters()).dtype == torch.float32
