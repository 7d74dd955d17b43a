"""The report's draft-length parts (issue 16): the distribution of k per round (batch-1 and serving), the cost
model checked against a gamma sweep, recommended γ only within the measured range (anything beyond it
labelled "predicted, not measured"), variable-k arms without a fixed-γ what-if, and summaries without
any of it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from spectoolkit.bench.protocol.table import format_summary
from spectoolkit.bench.report import checklist as cl
from spectoolkit.bench.report.render import write_report
from spectoolkit.metrics.gamma_validation import gamma_validation
from spectoolkit.metrics.summary import cost_models, summarize
from tests.bench.report.test_report import make_run, typed, typed_records, write_run
from tests.bench.report.test_serving_report import serving_summary, write_serving_run
from tests.metrics.sweep_records import ARMS, sweep_records, verify_costs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LABEL = "predicted, not measured"


def _computed_sweep() -> tuple[dict, list]:
    """summary.json of the hand-made gamma sweep as the runner writes it: statistics, cost model, validation."""
    records = sweep_records()
    summary = summarize(records, greedy=True, arms=ARMS, primary="spec-g4")
    summary["cost_model"] = cost_models(records, ARMS, verify_costs())
    summary["gamma_validation"] = gamma_validation(summary["cost_model"], ARMS)
    arms = [{"name": name, "gamma": info["gamma"], "policy": info["policy"], "reference": info["reference"],
             "drafter": "none" if name == "baseline" else "ngram"} for name, info in ARMS.items()]  # fmt: skip
    summary["conditions"] = {"arms": arms, "policy": "fixed", "gamma": 4, "sampling": {"temperature": 0.0}}
    return json.loads(json.dumps(summary)), [json.loads(r.to_json()) for r in records]


def _table(text: str, header_start: str) -> list[list[str]]:
    """The cells of each row of the Markdown table whose header starts with ``header_start``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def test_gamma_sweep_report_shows_k_per_round_and_the_cost_model_against_the_sweep(tmp_path: Path) -> None:
    run = write_run(tmp_path / "sweep", *_computed_sweep(), torn=False)
    text = write_report(run).read_text(encoding="utf-8")
    k_rows = {(row[0], row[4]): row for row in _table(text, "| arm | policy | γ (most per round)")}
    assert k_rows[("spec-adaptive", "all")] == ["spec-adaptive", "adaptive", "4", "chosen_lengths", "all", "44",
                                                "2.36", "36.4%", "2.18", "16 / 0 / 0 / 8 / 20"]  # fmt: skip
    assert k_rows[("spec-adaptive", "code")][5] == "22" and k_rows[("spec-g2", "all")][-1] == "0 / 0 / 56"
    assert ("baseline", "all") not in k_rows
    checks = _table(text, "| predicted from |")
    assert len(checks) == 9  # 3 fixed sources × 3 measured γ'
    by_pair = {(row[0], row[2]): row for row in checks}
    assert by_pair[("spec-g4", "2")][4:] == ["1.67×", "spec-g2", "+0.0%", "exact truncation (γ' ≤ its γ)"]
    assert by_pair[("spec-g1", "4")][6:] == ["+38.4%", "extrapolation (γ' > its γ)"]
    assert "Mean |error|: exact truncations 0.0% over 6; extrapolations 24.5% over 3." in text
    cost = {row[0]: row for row in _table(text, "| arm | T₁ ms |")}
    assert cost["spec-g2"][-2] == "4: 1.83× (of 1–4, spec-g4's rounds)"  # another measured arm's γ
    assert cost["spec-g1"][-1] == f"16: 3.56× ({LABEL})"
    assert cost["spec-adaptive"][-3:] == ["n/a (adaptive policy: k varies per round)"] * 3
    assert "**applies** — cost model beyond the measured γ: worst extrapolation +38.4% (spec-g1 at γ'=4" in text
    for name in ("k_distribution", "gamma_validation", "speedup_vs_gamma"):
        assert f"(plots/{name}.png)" in text
        assert (run / "plots" / f"{name}.png").read_bytes().startswith(PNG_SIGNATURE)


def test_no_gamma_beyond_the_measured_range_is_printed_without_its_label(tmp_path: Path) -> None:
    summary, records = _computed_sweep()
    text = write_report(write_run(tmp_path / "sweep", summary, records, torn=False)).read_text(encoding="utf-8")
    for row in _table(text, "| arm | T₁ ms |"):
        recommended = re.match(r"(\d+): ", row[-2])
        assert recommended is None or int(recommended.group(1)) <= 4  # the sweep measured 1..4
        assert row[-1].startswith("n/a") or row[-1].endswith(f"({LABEL})")
    for gamma, speedup, basis in _table(text, "| γ | predicted speedup | basis |"):
        assert (int(gamma) <= 4) == basis.startswith("exact") and (int(gamma) > 4) == (LABEL in basis)
        assert "(recommended)" not in speedup or int(gamma) <= 4
    lines = format_summary({**summary, "conditions": {}}).splitlines()  # the table printed at the end of a run
    cost_line = next(line for line in lines if line.startswith("cost model (spec-g4)"))
    assert "recommended gamma 4 (of 1-4)" in cost_line
    assert "beyond: gamma 15 2.12x (extrapolation: predicted, not measured)" in cost_line


def test_an_old_summary_recommending_beyond_its_gamma_is_relabelled(tmp_path: Path) -> None:
    summary, records = make_run()  # no schema_version: written before version 3
    summary["cost_model"]["spec"].update(recommended_gamma=8, predicted_by_gamma={"1": 1.1, "2": 1.2, "4": 1.3,
                                                                                  "8": 1.4})  # fmt: skip
    text = write_report(write_run(tmp_path / "old", summary, records)).read_text(encoding="utf-8")
    cost = {row[0]: row for row in _table(text, "| arm | T₁ ms |")}
    assert cost["spec"][-2:] == ["4: 1.30× (of 1–4)", f"8: 1.40× ({LABEL})"]
    curve = {row[0]: row for row in _table(text, "| γ | predicted speedup | basis |")}
    assert curve["4"][1] == "1.30× (recommended)"
    assert curve["8"][1:] == [f"1.40× (best beyond the measured range: {LABEL})", f"extrapolation: {LABEL}"]
    assert "## Draft length per round" not in text and "Cost model vs the gamma sweep" not in text
    assert not (tmp_path / "old" / "plots" / "k_distribution.png").exists()
    assert not (tmp_path / "old" / "plots" / "gamma_validation.png").exists()


def _adaptive_standard_run() -> tuple[dict, list]:
    summary, records = make_run()
    summary["schema_version"] = 3
    summary["conditions"]["policy"] = "adaptive"
    next(arm for arm in summary["conditions"]["arms"] if arm["name"] == "spec")["policy"] = "adaptive"
    summary["cost_model"]["spec"].update(policy="adaptive", predicted_by_gamma=None, recommended_gamma=None,
                                         break_even_alpha=None, measured_gamma_max=None)  # fmt: skip
    summary["k_distribution"] = {"spec": {"gamma": 4, "source": "chosen_lengths", "overall": {
        "rounds": 10, "counts": [3, 0, 2, 0, 5], "mean_k": 2.4, "zero_share": 0.3, "mean_proposed": 2.4},
        "by_task_type": {"chat": {"rounds": 4, "counts": [3, 0, 1, 0, 0], "mean_k": 0.5, "zero_share": 0.75,
                                  "mean_proposed": 0.5}}}}  # fmt: skip
    return summary, records


def test_a_variable_k_primary_arm_has_no_fixed_gamma_what_if(tmp_path: Path) -> None:
    summary, records = _adaptive_standard_run()
    run = write_run(tmp_path / "adaptive", summary, records)
    text = write_report(run).read_text(encoding="utf-8")
    headline = next(line for line in text.splitlines() if line.startswith("**Headline:**"))
    assert "γ=4 (adaptive policy: k ≤ γ chosen per round)" in headline
    note = "n/a (adaptive policy: k varies per round)"
    assert _table(text, "| arm | T₁ ms |")[0][-3:] == [note] * 3
    assert f"Predicted speedup per γ (spec): {note}; a fixed-γ what-if does not describe it" in text
    assert "| γ | predicted speedup | basis |" not in text and "(recommended)" not in text
    k_rows = _table(text, "| arm | policy | γ (most per round)")
    assert [row[4] for row in k_rows] == ["all", "chat"] and k_rows[1][7] == "75.0%"
    assert (run / "plots" / "k_distribution.png").read_bytes().startswith(PNG_SIGNATURE)
    assert (run / "plots" / "speedup_vs_gamma.png").read_bytes().startswith(PNG_SIGNATURE)  # its line, no curve
    items = {item.name: item for item in cl.evaluate_checklist(typed(summary), typed_records(records))}
    fallback = items["fallback switch (draft=none)"]
    assert fallback.status == cl.PASS and "break-even α n/a for spec (adaptive policy: k varies per round)" in (
        fallback.evidence
    )
    assert "recommended gamma n/a (adaptive policy: k varies per round)" in format_summary(summary)


def test_serving_report_shows_k_per_load_level(tmp_path: Path) -> None:
    summary = serving_summary(concurrency=(1, 8))
    level = {"rounds": 10, "counts": [0, 0, 0, 0, 10], "mean_k": 4.0, "zero_share": 0.0, "mean_proposed": 3.0}
    busy = {"rounds": 20, "counts": [12, 4, 4, 0, 0], "mean_k": 0.6, "zero_share": 0.6, "mean_proposed": 0.6}
    summary["conditions"]["arms"] = [{"name": "spec", "policy": "adaptive", "gamma": 4, "reference": "baseline"}]
    summary["k_distribution"] = {"spec": {"gamma": 4, "source": "chosen_lengths", "overall": busy,
                                          "by_load_level": {"1": level, "8": busy}}}  # fmt: skip
    run = write_serving_run(tmp_path / "serve", summary)
    text = write_report(run).read_text(encoding="utf-8")
    rows = _table(text, "| arm | policy | γ (most per round)")
    assert [row[4] for row in rows] == ["all", "concurrency 1", "concurrency 8"]
    assert rows[2][1] == "adaptive" and rows[2][6:] == ["0.60", "60.0%", "0.60", "12 / 4 / 4 / 0 / 0"]
    assert (run / "plots" / "k_distribution.png").read_bytes().startswith(PNG_SIGNATURE)
    del summary["k_distribution"]
    plain = write_report(write_serving_run(tmp_path / "plain", summary)).read_text(encoding="utf-8")
    assert "## Draft length per round" not in plain
    assert not (tmp_path / "plain" / "plots" / "k_distribution.png").exists()
