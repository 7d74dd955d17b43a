"""alerts.yml (bench.report.alerts): Prometheus rules with thresholds from the run — acceptance below the
break-even α, rollback above its per-request P95, TPOT P99 above the SLO — rules left out with a comment when
they cannot be derived, the file always valid YAML, and the checklist items that point to it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from spectoolkit.bench.report import alerts
from spectoolkit.bench.report import checklist as cl
from spectoolkit.bench.report.render import write_report
from spectoolkit.bench.report.serving_checklist import evaluate_serving_checklist
from spectoolkit.metrics.records import RequestRecord
from tests.bench.report.test_report import make_run, typed, write_run
from tests.bench.report.test_serving_report import PRE_SCHEMA_RUN, serving_summary, write_serving_run
from tests.bench.report.test_serving_report import typed as typed_serving

ALPHA_EXPR = (
    "sum(rate(vllm:spec_decode_num_accepted_tokens_total[5m])) / sum(rate(vllm:spec_decode_num_draft_tokens_total[5m]))"
)
TPOT_EXPR = "histogram_quantile(0.99, sum by (le) (rate(vllm:request_time_per_output_token_seconds_bucket[5m])))"
REJECTED = [i / 100 for i in range(21)]  # per-request rejected share of the spec arm: P95 = 0.19 exactly


def _record(arm: str, case: int, drafted: int, accepted: int, error: str | None = None, **extra: Any) -> RequestRecord:
    return RequestRecord(
        case_id=f"case/{case}", task_type="code", repeat_idx=0, arm=arm, drafter="ngram" if drafted else "none",
        target_precision="fp32", draft_precision=None, random_seed=case, temperature=0.0, top_p=1.0, top_k=0,
        draft_len=4 if arm != "baseline" else 0, output_len=50, drafted_tokens=drafted, accepted_tokens=accepted,
        total_time=1.0, error=error, **extra,
    )  # fmt: skip


def known_records(arm: str = "spec", **extra: Any) -> list[RequestRecord]:
    """21 requests of ``arm`` whose rejected share is 0.00, 0.01, …, 0.20, and records the P95 must skip."""
    records = [_record(arm, i, 100, round(100 * (1 - share)), **extra) for i, share in enumerate(REJECTED)]
    records.append(_record(arm, 90, 100, 0, error="prompt too long", **extra))  # failed: not counted
    records.append(_record(arm, 91, 0, 0, **extra))  # drafted nothing (no n-gram match): no share
    records += [_record("baseline", i, 0, 0, **extra) for i in range(3)]  # the target alone drafts nothing
    return records


def _write(run_dir: Path, summary: dict, records: list[RequestRecord]) -> Path:
    write_run(run_dir, summary, [json.loads(r.to_json()) for r in records], torn=False)
    write_report(run_dir)
    return run_dir / alerts.ALERTS_NAME


def _rules(path: Path) -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert list(doc) == ["groups"] and len(doc["groups"]) == 1
    group = doc["groups"][0]
    assert group["name"] == "spectoolkit-speculation" and isinstance(group["rules"], list)
    return {rule["alert"]: rule for rule in group["rules"]}


def _comments(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("#")]


def test_batch_run_gets_acceptance_and_rollback_rules_with_its_thresholds(tmp_path: Path) -> None:
    summary, _ = make_run()  # spec: break-even α 0.55
    assert float(np.percentile(REJECTED, 95)) == 0.19
    path = _write(tmp_path / "run", summary, known_records())
    assert path == tmp_path / "run" / "alerts.yml" and not list((tmp_path / "run").glob(".*tmp"))
    rules = _rules(path)
    assert list(rules) == [alerts.ACCEPTANCE, alerts.ROLLBACK]
    acceptance, rollback = rules[alerts.ACCEPTANCE], rules[alerts.ROLLBACK]
    assert acceptance["expr"] == f"{ALPHA_EXPR} < 0.5500"
    assert rollback["expr"] == f"1 - ({ALPHA_EXPR}) > 0.1900"
    for rule in (acceptance, rollback):
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}
        assert rule["for"] == "10m" and rule["labels"]["severity"] in ("warning", "info")
        assert set(rule["annotations"]) == {"summary", "description"}
        assert str((tmp_path / "run").resolve()) in rule["annotations"]["description"]
        assert "arm spec" in rule["annotations"]["description"]
    # measured α = (2100 - 210) / 2100 drafted over the successful drafting requests
    assert "Measured α 0.9000, break-even α 0.5500" in acceptance["annotations"]["description"]
    assert "measured speedup 1.25×" in acceptance["annotations"]["description"]
    assert "above 0.1900, the P95 of that share over 21 requests of arm spec" in rollback["annotations"]["description"]
    assert "median 0.1000, measured α 0.9000, break-even α 0.5500" in rollback["annotations"]["description"]
    assert any(line.startswith("# Left out: TimePerOutputTokenP99AboveSLO: serve.slo_tpot_ms is not set")
               for line in _comments(path))  # fmt: skip


def test_tpot_rule_only_with_an_slo(tmp_path: Path) -> None:
    summary, _ = make_run()
    summary["conditions"]["serve"] = {"slo_tpot_ms": 50}
    rules = _rules(_write(tmp_path / "run", summary, known_records()))
    tpot = rules[alerts.TPOT]
    assert tpot["expr"] == f"{TPOT_EXPR} > 0.05" and tpot["labels"]["severity"] == "critical"
    assert "serve.slo_tpot_ms = 50 ms (0.05 s)" in tpot["annotations"]["description"]
    assert not any(alerts.TPOT in line for line in _comments(tmp_path / "run" / "alerts.yml"))


def test_rules_that_cannot_be_derived_are_left_out_with_a_comment(tmp_path: Path) -> None:
    summary, _ = make_run()
    summary["cost_model"]["spec"]["break_even_alpha"] = None  # even α = 1 does not pay
    path = _write(tmp_path / "no-even", summary, known_records())
    assert list(_rules(path)) == [alerts.ROLLBACK]
    assert any(line.startswith(f"# Left out: {alerts.ACCEPTANCE}: no break-even α for spec: even α = 1")
               for line in _comments(path))  # fmt: skip
    summary, _ = make_run()
    summary["conditions"]["arms"][1]["policy"] = "adaptive"
    plan = alerts.derive_alerts(typed(summary), known_records())
    assert plan.rule(alerts.ACCEPTANCE) is None and "adaptive policy" in (plan.why(alerts.ACCEPTANCE) or "")
    plan = alerts.derive_alerts(typed(summary), [])
    assert plan.rule(alerts.ROLLBACK) is None and "no records.jsonl" in (plan.why(alerts.ROLLBACK) or "")
    undrafted = [r for r in known_records() if r.drafted_tokens == 0]  # spec's case/91 and the baseline
    assert alerts.derive_alerts(typed(summary), undrafted).why(alerts.ROLLBACK) == (
        "no successful request of spec drafted a token: no rollback share to take a P95 of"
    )


def test_a_run_without_a_drafter_writes_a_valid_file_without_rules(tmp_path: Path) -> None:
    summary, _ = make_run("none")
    path = _write(tmp_path / "none", summary, [r for r in known_records() if r.arm == "baseline"])
    assert _rules(path) == {}
    left = [line for line in _comments(path) if line.startswith("# Left out:")]
    assert len(left) == 3 and all("no speculative arm" in line for line in left[:2])
    items = {i.name: i for i in cl.evaluate_checklist(typed(summary), [])}
    assert items["alerts on acceptance and rollback"].status == cl.NA


def test_a_newline_or_yaml_syntax_in_the_run_dir_cannot_break_the_file(tmp_path: Path) -> None:
    summary, _ = make_run()
    run_dir = tmp_path / "odd\nname: #- [x"
    rules = _rules(_write(run_dir, summary, known_records()))
    assert str(run_dir.resolve()) in rules[alerts.ROLLBACK]["annotations"]["description"]
    assert all(line.startswith(("#", "groups:", " ", "-")) for line in (run_dir / "alerts.yml").read_text().split("\n")
               if line)  # fmt: skip


def test_serving_run_has_no_break_even_but_a_rollback_and_a_tpot_rule(tmp_path: Path) -> None:
    summary = serving_summary(serve={"slo_tpot_ms": 40})
    run_dir = write_serving_run(tmp_path / "serve", summary)
    records = known_records(load_level="1")
    (run_dir / "records.jsonl").write_text("".join(r.to_json() + "\n" for r in records), encoding="utf-8")
    write_report(run_dir)
    path = run_dir / "alerts.yml"
    rules = _rules(path)
    assert list(rules) == [alerts.ROLLBACK, alerts.TPOT]
    assert rules[alerts.ROLLBACK]["expr"].endswith("> 0.1900")
    assert rules[alerts.TPOT]["expr"] == f"{TPOT_EXPR} > 0.04"
    assert "measured TPOT P99 of spec: concurrency 1 30.0 ms" in rules[alerts.TPOT]["annotations"]["description"]
    assert any("a serving run has no cost model" in line for line in _comments(path))
    item = next(i for i in evaluate_serving_checklist(*typed_serving(summary), records)
                if i.name == "alerts on acceptance and rollback")  # fmt: skip
    # no finding: the number is missing, and the item says which run derives it
    assert item.status == cl.INSUFFICIENT and "a serving run has no cost model" in item.evidence
    assert "rejected draft share > 0.1900" in item.evidence
    assert item.fix.startswith(f"{alerts.ACCEPTANCE}: run this configuration batch-1 (serve.enabled=false)")


def test_checklist_points_to_alerts_yml_with_its_thresholds() -> None:
    summary, _ = make_run()
    items = {i.name: i for i in cl.evaluate_checklist(typed(summary), known_records())}
    item = items["alerts on acceptance and rollback"]
    assert item.status == cl.PASS
    assert item.evidence == ("alerts.yml: acceptance < 0.5500 (break-even α of spec), rejected draft share > 0.1900 "
                             "(P95 over spec's requests)")  # fmt: skip
    canary = items["canary share"]
    assert canary.status == cl.NA and canary.evidence == (
        "a deployment choice: route a canary share of traffic to the speculative arm and watch alerts.yml before "
        "full rollout"
    )
    summary["cost_model"] = {}
    item = next(i for i in cl.evaluate_checklist(typed(summary), known_records()) if i.name == item.name)
    assert item.status == cl.INSUFFICIENT and "no cost model for spec" in item.evidence and item.fix


def test_alerts_item_fails_only_on_a_finding_and_says_what_derives_each_missing_rule() -> None:
    """Speculation that never pays is a finding (FAIL, keep draft=none); a variable-k policy or missing records
    only leave the number out (INSUFFICIENT DATA, with the run that derives it)."""
    summary, _ = make_run()
    summary["cost_model"]["spec"]["break_even_alpha"] = None  # even α = 1 does not pay
    item = cl.check_alerts(alerts.derive_alerts(typed(summary), known_records()))
    assert item.status == cl.FAIL and "even α = 1 does not pay" in item.evidence
    assert item.fix.startswith(f"{alerts.ACCEPTANCE}: keep draft=none on this machine")
    summary, _ = make_run()
    summary["conditions"]["arms"][1]["policy"] = "adaptive"
    item = cl.check_alerts(alerts.derive_alerts(typed(summary), []))
    assert item.status == cl.INSUFFICIENT
    assert item.fix == (f"{alerts.ACCEPTANCE}: a fixed-γ run of this drafter (speculate.policy=fixed) measures the "
                        f"break-even α to alert on; {alerts.ROLLBACK}: {cl.NO_RECORDS}")  # fmt: skip


def test_a_summary_older_than_the_alerts_still_gets_a_valid_file(tmp_path: Path) -> None:
    run_dir = Path(shutil.copytree(PRE_SCHEMA_RUN, tmp_path / PRE_SCHEMA_RUN.name))
    write_report(run_dir)
    rules = _rules(run_dir / "alerts.yml")
    assert alerts.ROLLBACK in rules and alerts.ACCEPTANCE not in rules  # its break-even α is null: never pays
    empty = write_run(tmp_path / "empty", {}, [], torn=False)
    write_report(empty)
    assert _rules(empty / "alerts.yml") == {}
    plan = alerts.derive_alerts(typed({}), [])
    assert plan.rules == () and plan.drafts is False and plan.arm is None
