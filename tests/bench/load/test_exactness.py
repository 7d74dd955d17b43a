"""Divergences under batching: replayed with the target alone, classified by its top-2 margin."""

from __future__ import annotations

import pytest

from spectoolkit.bench.load import exactness
from spectoolkit.bench.load.exactness import classify_divergences
from spectoolkit.eval.exactness import top2_margin
from spectoolkit.metrics.records import RequestRecord
from spectoolkit.metrics.summary import first_divergence
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.runtime.lone import lone_sequence

PROMPT = [5, 9, 13, 17, 21]


def _record(output: list[int]) -> RequestRecord:
    return RequestRecord(case_id="c", task_type="qa", repeat_idx=0, arm="spec", drafter="ngram",
                         target_precision="fp32", draft_precision=None, random_seed=0, temperature=0.0,
                         top_p=1.0, top_k=0, draft_len=4, load_level="8", output_ids=output)  # fmt: skip


def _section(position: int) -> dict:
    item = {"arm": "spec", "level": "8", "case_id": "c", "repeat": 0, "position": position}
    return {"reference": "baseline at concurrency 1", "divergent": [item], "checked": 4}


def _classify(monkeypatch, margin: float, output: list[int], invariant: bool = False) -> dict:
    monkeypatch.setattr(exactness, "top2_margin", lambda runner, prompt, prefix: margin)
    position = first_divergence([1, 2, 3, 4], output)
    return classify_divergences(_section(position), [_record(output)], {"c": PROMPT}, {"c": [1, 2, 3, 4]},
                                tiny_llama(), "fp32", "auto", invariant)  # fmt: skip


def test_a_divergence_within_the_near_tie_margin_is_a_near_tie(monkeypatch) -> None:
    section = _classify(monkeypatch, 1e-5, [1, 2, 7, 8])
    assert section["divergent"][0]["classification"] == "near_tie"
    assert section["verdict"] == "exact up to near-ties" and section["passed"]
    assert (section["divergent"][0]["reference_token"], section["divergent"][0]["token"]) == (3, 7)


def test_a_clear_margin_is_unexplained(monkeypatch) -> None:
    section = _classify(monkeypatch, 2.0, [1, 2, 7, 8])
    assert section["divergent"][0]["classification"] == "unexplained" and not section["passed"]


def test_a_length_difference_is_never_a_near_tie(monkeypatch) -> None:
    section = _classify(monkeypatch, 0.0, [1, 2])
    assert section["divergent"][0]["classification"] == "unexplained"


def test_in_batch_invariant_mode_any_divergence_fails(monkeypatch) -> None:
    section = _classify(monkeypatch, 0.0, [1, 2, 7, 8], invariant=True)
    assert section["verdict"] == "not batch-invariant" and not section["passed"]


def test_the_replay_is_the_target_alone_margin_at_the_reference_prefix() -> None:
    model = tiny_llama()
    section = classify_divergences(_section(2), [_record([1, 2, 7, 8])], {"c": PROMPT}, {"c": [1, 2, 3, 4]},
                                   model, "fp32", "auto", False)  # fmt: skip
    expected = top2_margin(lone_sequence(model), PROMPT, [1, 2])
    assert section["divergent"][0]["margin"] == pytest.approx(expected) and expected > 0
