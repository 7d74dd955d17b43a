"""Tokenizer compatibility: the embedded SmolLM2 tokenizer against modified copies of itself."""

from __future__ import annotations

import copy
import json
import shutil
import time
from pathlib import Path

import pytest

from spectoolkit.checkpoints import resolve_checkpoint
from spectoolkit.compat import CompatReport, check_compat, check_pair, main
from spectoolkit.embedded import embedded_dir

pytestmark = pytest.mark.integration

# Everything a tokenizer + AutoConfig need, without the 500 MB safetensors.
LIGHT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB_SIZE = 49152  # SmolLM2: tokenizer length == embedding rows


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = embedded_dir()
    out = tmp_path_factory.mktemp("base")
    for name in LIGHT_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out


@pytest.fixture(scope="module")
def base_tokenizer(base_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_dir)


def _variant(base_dir: Path, out: Path) -> Path:
    shutil.copytree(base_dir, out)
    return out


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def _load(directory: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def test_identical_pair_is_compatible(base_tokenizer):
    start = time.perf_counter()
    report = check_compat(base_tokenizer, base_tokenizer, VOCAB_SIZE, VOCAB_SIZE)
    elapsed = time.perf_counter() - start
    assert report.compatible
    assert report.mismatches == [] and report.warnings == []
    assert report.shared_vocab_size == VOCAB_SIZE
    assert report.message().startswith("compatible")
    assert elapsed < 1.0, f"check_compat took {elapsed:.2f} s on a 49k vocabulary"


def test_swapped_token_text_is_reported(base_dir, base_tokenizer, tmp_path):
    id_a, id_b = 1000, 1001
    text_a, text_b = base_tokenizer.convert_ids_to_tokens([id_a, id_b])

    def swap(data):  # swap two ids in the BPE vocab; merges refer to texts, so they stay valid
        vocab = data["model"]["vocab"]
        vocab[text_a], vocab[text_b] = id_b, id_a

    draft_dir = _variant(base_dir, tmp_path / "draft")
    _edit_json(draft_dir / "tokenizer.json", swap)
    report = check_compat(base_tokenizer, _load(draft_dir), VOCAB_SIZE, VOCAB_SIZE)

    assert not report.compatible
    message = report.message()
    assert f"id {id_a}: {text_a!r} vs {text_b!r}" in message
    assert f"id {id_b}: {text_b!r} vs {text_a!r}" in message
    assert "token text differs for 2 of 49152" in message


def test_changed_eos_is_reported(base_dir, base_tokenizer, tmp_path):
    draft_dir = _variant(base_dir, tmp_path / "draft")
    _edit_json(draft_dir / "tokenizer_config.json", lambda data: data.update(eos_token="<|endoftext|>"))
    draft = _load(draft_dir)
    assert draft.eos_token_id == 0 != base_tokenizer.eos_token_id

    report = check_compat(base_tokenizer, draft, VOCAB_SIZE, VOCAB_SIZE)
    assert not report.compatible
    eos_lines = [line for line in report.mismatches if line.startswith("eos token")]
    assert len(eos_lines) == 1
    assert "'<|im_end|>'" in eos_lines[0] and "'<|endoftext|>'" in eos_lines[0]
    assert "eos" in report.message()


def test_larger_vocabulary_lists_extra_ids(base_tokenizer, tmp_path):
    draft = copy.deepcopy(base_tokenizer)
    draft.add_tokens(["<extra_tool>", "spectoolkitword"])
    draft.save_pretrained(tmp_path)
    draft = _load(tmp_path)
    assert len(draft) == VOCAB_SIZE + 2

    report = check_compat(base_tokenizer, draft, VOCAB_SIZE, VOCAB_SIZE + 64)
    assert not report.compatible
    size_lines = [line for line in report.mismatches if line.startswith("vocabulary size")]
    assert len(size_lines) == 1
    assert "2 extra draft ids: 49152 '<extra_tool>', 49153 'spectoolkitword'" in size_lines[0]
    # All mismatches are collected: the added-token table differs too.
    assert any(line.startswith("added/special tokens") for line in report.mismatches)


def test_model_with_fewer_rows_than_its_tokenizer_is_a_mismatch(base_tokenizer):
    report = check_compat(base_tokenizer, base_tokenizer, VOCAB_SIZE, VOCAB_SIZE - 100)
    assert not report.compatible
    assert any("draft model has 49052 embedding rows" in line for line in report.mismatches)


def test_padded_model_vocab_is_compatible_with_warning(base_dir, tmp_path):
    target_dir = _variant(base_dir, tmp_path / "target")
    _edit_json(target_dir / "config.json", lambda data: data.update(vocab_size=VOCAB_SIZE + 64))

    report = check_pair(resolve_checkpoint(str(target_dir)), resolve_checkpoint(str(base_dir)))
    assert report.compatible, report.message()
    assert report.shared_vocab_size == VOCAB_SIZE
    assert len(report.warnings) == 1
    assert "padded" in report.warnings[0] and f"ids >= {VOCAB_SIZE}" in report.warnings[0]
    assert "warnings:" in report.message()

    # Symmetric: a padded draft gives the same shared size.
    assert (
        check_pair(resolve_checkpoint(str(base_dir)), resolve_checkpoint(str(target_dir))).shared_vocab_size
        == VOCAB_SIZE
    )


def test_chat_template_on_one_side_only_is_a_mismatch(base_tokenizer):
    draft = copy.deepcopy(base_tokenizer)
    draft.chat_template = None
    report = check_compat(base_tokenizer, draft, VOCAB_SIZE, VOCAB_SIZE)
    assert report.mismatches == ["chat template: only the target tokenizer has one"]

    both_without = check_compat(draft, draft, VOCAB_SIZE, VOCAB_SIZE)
    assert both_without.compatible and both_without.warnings == []


def test_changed_chat_template_is_a_mismatch(base_tokenizer):
    draft = copy.deepcopy(base_tokenizer)
    draft.chat_template = base_tokenizer.chat_template.replace("named SmolLM", "named Draft")
    report = check_compat(base_tokenizer, draft, VOCAB_SIZE, VOCAB_SIZE)
    assert len(report.mismatches) == 1
    assert report.mismatches[0].startswith("chat template renders differently")


def test_message_lists_every_mismatch():
    report = CompatReport(mismatches=["first", "second"], warnings=["careful"], shared_vocab_size=10)
    assert not report.compatible
    assert report.message().splitlines() == [
        "incompatible: 2 mismatches between target and draft:",
        "  - first",
        "  - second",
        "warnings:",
        "  - careful",
    ]


def test_cli_compatible_pair_exits_zero(base_dir, capsys):
    assert main([str(base_dir), str(base_dir)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("compatible")
    assert captured.err == ""


def test_cli_incompatible_pair_exits_one(base_dir, tmp_path, capsys):
    draft_dir = _variant(base_dir, tmp_path / "draft")
    _edit_json(draft_dir / "tokenizer_config.json", lambda data: data.update(eos_token="<|endoftext|>"))
    assert main([str(base_dir), str(draft_dir)]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("incompatible")
    assert "eos token" in captured.err


def test_cli_missing_path_is_an_error_without_traceback(base_dir, tmp_path, capsys):
    assert main([str(base_dir), str(tmp_path / "missing")]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("error:") and "does not exist" in captured.err
    assert "Traceback" not in captured.err + captured.out


def test_cli_unloadable_directory_is_an_error(base_dir, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(base_dir), str(empty)]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("error: model directory") and "has no config.json" in captured.err
    (empty / "config.json").write_text("not json")
    assert main([str(base_dir), str(empty)]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("error: could not load the draft config")
    assert "Traceback" not in captured.err


def test_special_flag_of_added_token_is_compared(base_dir, base_tokenizer, tmp_path):
    # Matters: decode(..., skip_special_tokens=True) drops the token on one side only.
    draft_dir = _variant(base_dir, tmp_path / "draft")
    _edit_json(draft_dir / "tokenizer.json", lambda data: data["added_tokens"][5].update(special=False))
    report = check_compat(base_tokenizer, _load(draft_dir), VOCAB_SIZE, VOCAB_SIZE)
    assert report.mismatches == [
        "added/special tokens differ at 1 id (target vs draft): "
        "id 5: '<file_sep>' (special) vs '<file_sep>' (not special)"
    ]


def test_cli_takes_gguf_files_and_refuses_other_files(tmp_path, capsys):
    from spectoolkit.embedded import gguf_path

    copy = tmp_path / "copy.gguf"
    shutil.copyfile(gguf_path(), copy)
    assert main([str(gguf_path()), str(copy)]) == 0  # both converted (once, by content hash) from the GGUF
    assert capsys.readouterr().out.startswith("compatible")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0")
    assert main([str(copy), str(other)]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: model path ") and "is a file: give a model directory, a .gguf file" in error
