"""A run directory written before summaries and records carried ``schema_version`` still loads and renders.

``data/pre_schema_run`` is a real run made with the code of commit 2dacd9f (a four_groups run on the
tiny random checkpoint of tests/conftest.py, CPU):

    python -m spectoolkit model.target_path=<tiny ckpt> experiment=four_groups +target=rtn-int8 \
        +draft=rtn-int4 workload.max_new_tokens=8 workload.num_prompts=3 bench.warmup=0 bench.repeat=2 \
        quant_quality.num_texts=2 quant_quality.max_tokens=32 device=cpu

Kept small: summary.json re-serialised without indentation, records.jsonl cut to repeat 0 (12 lines).
``data/pre_schema_run_report.md`` is the report that same commit rendered from these two files; when the
report's wording changes on purpose, re-render it and review the difference.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from spectoolkit.bench.report.load import load_records, load_summary
from spectoolkit.bench.report.render import write_report

DATA = Path(__file__).parent / "data"
RUN = DATA / "pre_schema_run"
EXPECTED_REPORT = DATA / "pre_schema_run_report.md"


@pytest.fixture
def run_copy(tmp_path: Path) -> Path:
    """The fixture run in a directory of the same name (the report's title), so writing never touches data/."""
    return Path(shutil.copytree(RUN, tmp_path / RUN.name))


def _sections(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("## ")]


def test_pre_schema_files_load_as_version_1() -> None:
    summary, records = load_summary(RUN), load_records(RUN)
    assert summary.schema_version == 1 and {r.schema_version for r in records} == {1}
    assert summary.primary_arm == "quant+spec" and list(summary.arms) == ["baseline", "quant", "spec", "quant+spec"]
    assert summary.arms["quant+spec"].reference_arm == "quant" and summary.cost_model["quant+spec"].predicted_by_gamma
    assert summary.exactness.verdict == "exact" and summary.quant_quality.quantized == "rtn-int8"
    assert len(records) == 12 and all(len(r.output_ids) == r.output_len for r in records)


def test_pre_schema_run_renders_the_report_it_rendered_before(run_copy: Path) -> None:
    text = write_report(run_copy).read_text(encoding="utf-8")
    expected = EXPECTED_REPORT.read_text(encoding="utf-8")
    headline = next(line for line in text.splitlines() if line.startswith("**Headline:**"))
    assert headline == next(line for line in expected.splitlines() if line.startswith("**Headline:**"))
    assert headline.startswith("**Headline:** `quant+spec` decodes at **0.70×**")
    assert _sections(text) == _sections(expected)
    assert "## Exactness" in _sections(text) and "## Quantization quality" in _sections(text)
    assert text == expected
