"""Workload loading (builtin, jsonl, humaneval, sharegpt) and prompt encoding."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from spectoolkit.config import WorkloadConfig
from spectoolkit.errors import SpecToolkitError
from spectoolkit.workloads.datasets import iter_sharegpt_entries
from spectoolkit.workloads.prompts import TASK_TYPES, Request, encode_prompt, load_workload


def _write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


# --- builtin --------------------------------------------------------------------------------------


def test_builtin_covers_task_types() -> None:
    requests = load_workload(WorkloadConfig(kind="builtin"))
    assert len(requests) == 6
    assert {r.task_type for r in requests} == {"chat", "code", "structured", "summarization", "qa"}
    assert len({r.case_id for r in requests}) == len(requests)
    assert all(r.prompt and r.error is None for r in requests)


def test_builtin_num_prompts_caps() -> None:
    requests = load_workload(WorkloadConfig(kind="builtin", num_prompts=2))
    assert [r.case_id for r in requests] == [r.case_id for r in load_workload(WorkloadConfig())][:2]


# --- jsonl ----------------------------------------------------------------------------------------


def test_jsonl_good_file(tmp_path: Path) -> None:
    path = _write_lines(
        tmp_path / "w.jsonl",
        [
            json.dumps({"id": 7, "task_type": "code", "prompt": "Write a loop."}),
            "",
            json.dumps({"id": "b", "prompt": "Say hi.", "reference": "Hi!"}),
            "   ",
        ],
    )
    requests = load_workload(WorkloadConfig(kind="jsonl", path=path))
    assert requests == [
        Request(case_id="7", task_type="code", prompt="Write a loop."),
        Request(case_id="b", task_type="unknown", prompt="Say hi.", reference="Hi!"),
    ]


@pytest.mark.parametrize(
    ("bad_line", "case_id", "reason"),
    [
        ('{"id": 1, "prompt": "unterminated', "line-2", "malformed JSON"),
        ('["a list"]', "line-2", "expected a JSON object"),
        ('"just a string"', "line-2", "expected a JSON object"),
        ('{"id": "x", "task_type": "qa"}', "x", 'missing "prompt"'),
        ('{"id": "x", "prompt": ""}', "x", '"prompt" is empty'),
        ('{"id": "x", "prompt": "   "}', "x", '"prompt" is empty'),
        ('{"id": "x", "prompt": 3}', "x", '"prompt" must be a string'),
        ('{"id": "x", "prompt": null}', "x", 'missing "prompt"'),
        ('{"id": [1], "prompt": "p"}', "line-2", "id must be"),
        ('{"id": "x", "prompt": "p", "reference": 3}', "x", '"reference" (a reply to the prompt) must be a string'),
        ('{"id": "good", "prompt": "again"}', "good", "duplicate id 'good' (first on line 1)"),
    ],
)
def test_jsonl_bad_line_becomes_error_request(tmp_path: Path, bad_line: str, case_id: str, reason: str) -> None:
    path = _write_lines(
        tmp_path / "w.jsonl",
        [
            json.dumps({"id": "good", "prompt": "First."}),
            bad_line,
            json.dumps({"id": "after", "prompt": "Last."}),
        ],
    )
    first, bad, last = load_workload(WorkloadConfig(kind="jsonl", path=path))
    assert (first.case_id, first.error) == ("good", None)
    assert (last.case_id, last.prompt, last.error) == ("after", "Last.", None)
    assert bad.case_id == case_id
    assert bad.prompt == ""
    assert bad.error is not None and bad.error.startswith("line 2: ")
    assert reason in bad.error


def test_jsonl_invalid_utf8_line_is_an_error_request(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff\xfe"}\n')
    requests = load_workload(WorkloadConfig(kind="jsonl", path=str(path)))
    assert [r.error for r in requests] == [None, "line 2: not valid UTF-8"]


def test_jsonl_num_prompts_counts_bad_lines(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "w.jsonl", ["not json", '{"prompt": "a"}', '{"prompt": "b"}'])
    requests = load_workload(WorkloadConfig(kind="jsonl", path=path, num_prompts=2))
    assert [r.case_id for r in requests] == ["line-1", "line-2"]
    assert requests[0].error is not None and requests[1].error is None


def test_jsonl_missing_file_raises_with_fix(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(SpecToolkitError, match="not found") as info:
        load_workload(WorkloadConfig(kind="jsonl", path=str(missing)))
    assert str(missing) in str(info.value)
    assert "workload.path=FILE" in str(info.value)


def test_jsonl_directory_raises(tmp_path: Path) -> None:
    with pytest.raises(SpecToolkitError, match="cannot be read"):
        load_workload(WorkloadConfig(kind="jsonl", path=str(tmp_path)))


@pytest.mark.parametrize("content", ["", "\n  \n\t\n"])
def test_jsonl_empty_file_raises_with_fix(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(SpecToolkitError, match="has no prompts") as info:
        load_workload(WorkloadConfig(kind="jsonl", path=str(path)))
    assert '"prompt"' in str(info.value)


# --- humaneval ------------------------------------------------------------------------------------


def test_humaneval_loads_default_eight() -> None:
    requests = load_workload(WorkloadConfig(kind="humaneval"))
    assert [r.case_id for r in requests] == [f"HumanEval/{i}" for i in range(8)]
    assert all(r.task_type == "code" and r.error is None for r in requests)
    assert all(r.reference and r.reference.strip() for r in requests)
    assert requests[0].prompt.startswith("Complete the following Python function.")
    assert "def has_close_elements(" in requests[0].prompt
    assert requests[0].prompt.rstrip().endswith("```")


def test_humaneval_num_prompts() -> None:
    assert len(load_workload(WorkloadConfig(kind="humaneval", num_prompts=3))) == 3


# --- sharegpt -------------------------------------------------------------------------------------


def test_sharegpt_loads_n_quickly() -> None:
    start = time.perf_counter()
    requests = load_workload(WorkloadConfig(kind="sharegpt", num_prompts=20))
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0
    assert len(requests) == 20
    assert len({r.case_id for r in requests}) == 20
    assert all(r.task_type == "chat" and r.prompt.strip() and len(r.prompt) <= 4000 for r in requests)
    assert requests[0].case_id == "QWJhYvA_0"
    assert requests[0].prompt.startswith("Summarize the main ideas of Jeff Walker")
    assert requests[0].reference is not None and requests[0].reference.startswith("Here are the main ideas")


def test_sharegpt_default_is_eight() -> None:
    assert len(load_workload(WorkloadConfig(kind="sharegpt"))) == 8


def _entry(i: int) -> dict:
    return {
        "id": f"e{i}",
        "conversations": [
            {"from": "human", "value": f'question {i} with a ] bracket, a comma and "quotes" {{}}'},
            {"from": "gpt", "value": f"answer {i}"},
        ],
    }


@pytest.mark.parametrize("cut", [1, 10, 40, -1])
def test_iter_sharegpt_entries_stops_at_truncated_tail(tmp_path: Path, cut: int) -> None:
    entries = [_entry(i) for i in range(5)]
    text = json.dumps(entries, indent=2)
    tail_start = text.index('"e4"')  # inside the last entry
    path = tmp_path / "cut.json"
    path.write_text(text[: tail_start + cut] if cut >= 0 else text[:-3], encoding="utf-8")
    assert list(iter_sharegpt_entries(path)) == entries[:4]


def test_iter_sharegpt_entries_complete_and_compact(tmp_path: Path) -> None:
    entries = [_entry(i) for i in range(3)]
    path = tmp_path / "full.json"
    path.write_text(json.dumps(entries, separators=(",", ":")), encoding="utf-8")
    assert list(iter_sharegpt_entries(path)) == entries


def test_iter_sharegpt_entries_across_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("spectoolkit.workloads.datasets._CHUNK_CHARS", 7)  # every entry spans chunks
    entries = [_entry(i) for i in range(6)] + [{"id": "é", "conversations": []}]
    path = tmp_path / "small.json"
    path.write_text(json.dumps(entries, indent=1)[:-40], encoding="utf-8")
    assert list(iter_sharegpt_entries(path)) == entries[:6]


@pytest.mark.parametrize(("content", "expected"), [("", []), ("  \n", []), ("[", []), ("[ ]", [])])
def test_iter_sharegpt_entries_empty(tmp_path: Path, content: str, expected: list) -> None:
    path = tmp_path / "e.json"
    path.write_text(content)
    assert list(iter_sharegpt_entries(path)) == expected


def test_iter_sharegpt_entries_rejects_non_array(tmp_path: Path) -> None:
    path = tmp_path / "obj.json"
    path.write_text('{"id": 1}')
    with pytest.raises(SpecToolkitError, match="JSON array"):
        list(iter_sharegpt_entries(path))


# --- encode_prompt --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    from spectoolkit.embedded import embedded_dir

    return transformers.AutoTokenizer.from_pretrained(embedded_dir())


@pytest.mark.integration
def test_encode_prompt_chat_template(tokenizer) -> None:
    request = Request("c", "qa", "What is the capital of France?")
    chat_ids = encode_prompt(tokenizer, request, chat_template=True)
    plain_ids = encode_prompt(tokenizer, request, chat_template=False)
    assert isinstance(chat_ids, list) and all(type(t) is int for t in chat_ids)
    assert isinstance(plain_ids, list) and all(type(t) is int for t in plain_ids)
    assert chat_ids != plain_ids
    text = tokenizer.decode(chat_ids)
    assert text.startswith("<|im_start|>")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")  # add_generation_prompt
    assert tokenizer.decode(plain_ids) == request.prompt


@pytest.mark.integration
def test_encode_prompt_without_template_falls_back(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    request = Request("c", "chat", "Hello there")
    plain_ids = encode_prompt(tokenizer, request, chat_template=False)
    monkeypatch.setattr(tokenizer, "chat_template", None)
    assert encode_prompt(tokenizer, request, chat_template=True) == plain_ids


def test_builtin_task_types_are_known() -> None:
    assert all(r.task_type in TASK_TYPES for r in load_workload(WorkloadConfig()))
