"""Per-request records: written then read back as the same dataclass, older lines, tolerant reading."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from spectoolkit.metrics.records import (
    RECORD_SCHEMA_VERSION,
    SERVING_FIELDS,
    RecordWriter,
    RequestRecord,
    read_records,
    rounds_of,
)

# One line of records.jsonl as written before schema_version existed (tests/bench/report/data/pre_schema_run).
PRE_SCHEMA_LINE = (
    '{"case_id":"builtin-chat","task_type":"chat","repeat_idx":0,"arm":"spec","drafter":"model-rtn-int4",'
    '"target_precision":"bf16","draft_precision":"rtn-int4","random_seed":1302020537,"temperature":0.0,'
    '"top_p":1.0,"top_k":0,"draft_len":4,"kv_target":"auto","kv_draft":"auto","batch_size":1,"concurrency":1,'
    '"input_len":39,"output_len":8,"drafted_tokens":5,"accepted_tokens":5,"verify_rounds":2,"rollback_count":0,'
    '"proposed_rounds":2,"ttft":0.0038431599999739774,"ttft_nonstreaming":0.022961723999969763,'
    '"total_time":0.02294300400001248,"prefill_time":0.0038251519999903394,"draft_time":0.012243283000088923,'
    '"verify_time":0.005824201999985235,"overhead_time":0.0010503669999479825,"gpu_mem_peak":null,'
    '"host_rss":744435712,"start_offset":0.06347737800001596,"accept_lengths":[4,1],"draft_lengths":[4,1],'
    '"output_ids":[3736,33163,1005,48732,30358,1867,24068,43147],"error":null}'
)


def _record(**fields) -> RequestRecord:
    values = dict(
        case_id="case/1", task_type="code", repeat_idx=2, arm="quant+spec", drafter="ngram",
        target_precision="rtn-int4", draft_precision=None, random_seed=123, temperature=0.7, top_p=0.9, top_k=50,
        draft_len=4,
    )  # fmt: skip
    return RequestRecord(**{**values, **fields})


def test_a_written_record_reads_back_as_the_same_dataclass(tmp_path: Path) -> None:
    written = [
        _record(output_len=3, ttft=0.01, total_time=0.5, gpu_mem_peak=2**30, accept_lengths=[2, 0],
                draft_lengths=[4, 4], output_ids=[5, 6, 7], start_offset=1.25),
        _record(case_id="case/2", error="prompt too long"),
    ]  # fmt: skip
    with RecordWriter(tmp_path / "records.jsonl") as writer:
        for record in written:
            writer.write(record)
    lines = (tmp_path / "records.jsonl").read_text(encoding="utf-8").splitlines()
    assert all(json.loads(line)["schema_version"] == RECORD_SCHEMA_VERSION for line in lines)
    assert read_records(tmp_path / "records.jsonl") == written
    assert RequestRecord.from_dict(json.loads(written[0].to_json())) == written[0]


def test_a_line_without_schema_version_is_version_1_with_every_field() -> None:
    raw = json.loads(PRE_SCHEMA_LINE)
    record = RequestRecord.from_dict(raw)
    assert record.schema_version == 1 and RECORD_SCHEMA_VERSION > 1
    added = ("schema_version", "chosen_lengths", "tree", "tree_depths", *SERVING_FIELDS)  # versions 3-5 add these
    assert {k: v for k, v in dataclasses.asdict(record).items() if k not in added} == raw
    assert record.chosen_lengths == [] and record.tree is None and record.tree_depths == []
    assert all(getattr(record, name) is None for name in SERVING_FIELDS if name != "token_offsets")
    assert record.output_ids == [3736, 33163, 1005, 48732, 30358, 1867, 24068, 43147]
    assert record.rounds() == [(4, 4), (1, 1)] and rounds_of([record, record]) == record.rounds() * 2
    assert record.gpu_mem_peak is None and record.temperature == 0.0


def test_wrong_typed_fields_take_their_default_and_unknown_keys_are_ignored() -> None:
    raw = json.loads(PRE_SCHEMA_LINE)
    raw.update(output_len="eight", ttft="fast", output_ids="abc", accept_lengths=[1, None, "2", 3], case_id=7,
               top_k=True, temperature=float("nan"), kv_target=None, added_by_a_later_version={"x": 1})  # fmt: skip
    record = RequestRecord.from_dict(raw)
    assert (record.output_len, record.ttft, record.output_ids) == (0, None, [])
    assert record.accept_lengths == [1, 3]  # wrong-typed items dropped, the list kept
    assert (record.case_id, record.top_k, record.temperature, record.kv_target) == (None, None, None, "auto")
    assert not hasattr(record, "added_by_a_later_version")
    empty = RequestRecord.from_dict({})
    assert (empty.arm, empty.output_ids, empty.batch_size, empty.schema_version) == (None, [], 1, 1)
    assert RequestRecord.from_dict("not an object").arm is None


def test_torn_and_non_object_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join([PRE_SCHEMA_LINE, "[1, 2]", "", _record().to_json(), '{"case_id": "to']) + "\n")
    records = read_records(path)
    assert [r.schema_version for r in records] == [1, RECORD_SCHEMA_VERSION]
    assert records[1] == _record()
