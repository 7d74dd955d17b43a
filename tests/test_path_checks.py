"""Every path a user can give is checked before work starts (spectoolkit.path_checks): one error naming the key.

Which keys are path-valued is derived from the typed configs, not listed by hand: a field of
:class:`~spectoolkit.config.RunConfig` (its sections, recursively) or of the ``train/`` group's
:class:`~spectoolkit.training.job.TrainConfig` whose name is ``path``, ``dir``, ``env``, ``file`` or ``out``, or
ends in ``_path``, ``_dir``, ``_env`` or ``_file``, or whose type mentions ``Path``. The Hydra yamls cannot add
keys these dataclasses lack (unknown keys are refused), so the dataclasses are the whole list. A new such key
without an entry in :data:`~spectoolkit.path_checks.PATH_KEYS` (and a way below to make it take effect) fails here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from spectoolkit import report
from spectoolkit.config import RunConfig, run_config_from_dict
from spectoolkit.errors import SpecToolkitError
from spectoolkit.models.eagle3_head import CONFIG_FILE, WEIGHTS_FILE, Eagle3Head, HeadShape
from spectoolkit.path_checks import (
    HEAD_FILES,
    PATH_KEYS,
    PathKind,
    check_path,
    check_run_paths,
    is_hub_id,
    path_problem,
    run_paths,
)
from spectoolkit.train_draft import check_train_paths
from spectoolkit.training.job import TrainConfig

PATH_NAME = re.compile(r"^(path|dir|env|file|out)$|_(path|dir|env|file)$")  # not *_out: train.held_out counts


def _path_fields(cls: type, prefix: str) -> set[str]:
    """Dotted keys of the path-valued fields of dataclass ``cls`` and of its dataclass-typed sections."""
    keys = set()
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            keys |= _path_fields(f.default_factory, f"{prefix}{f.name}.")
        elif PATH_NAME.search(f.name) or "Path" in str(f.type):
            keys.add(prefix + f.name)
    return keys


def test_every_path_valued_key_of_the_configs_has_a_check() -> None:
    found = _path_fields(RunConfig, "") | _path_fields(TrainConfig, "train.")
    assert found == set(PATH_KEYS)
    assert set(SETUPS) == set(PATH_KEYS)  # and a way below to make each one take effect


def test_the_rule_finds_a_new_path_key() -> None:
    @dataclasses.dataclass(frozen=True)
    class Section:
        cache_dir: str = ""
        checkpoint: Path | None = None
        output: str = ""  # not paths by name
        held_out: int = 0

    @dataclasses.dataclass(frozen=True)
    class Top:
        section: Section = dataclasses.field(default_factory=Section)
        out: str = ""

    assert _path_fields(Top, "") == {"section.cache_dir", "section.checkpoint", "out"}


# ---- each key, in a config where it takes effect -------------------------------------------------------------


def _venv(root: Path, program: str = "python") -> Path:
    """A directory with an executable ``bin/<program>`` (a virtual environment's python, llama.cpp's server)."""
    executable = root / "bin" / program
    executable.parent.mkdir(parents=True)
    executable.write_text("#!/bin/sh\n", encoding="utf-8")
    executable.chmod(0o755)
    return root


def _run(values: dict[str, Any]) -> Callable[[str], None]:
    """Check the paths of the run config ``values`` with the key's value filled in at ``"VALUE"``."""

    def check(value: str) -> None:
        filled = json.loads(json.dumps(values).replace('"VALUE"', json.dumps(value)))
        check_run_paths(run_config_from_dict(filled), "run")

    return check


def _train(**kwargs: Any) -> Callable[[str], None]:
    def check(value: str) -> None:
        filled = {key: value if given == "VALUE" else given for key, given in kwargs.items()}
        check_train_paths(RunConfig(), TrainConfig(**filled))

    return check


VENV = "VENV"  # replaced by a working fake venv (the vLLM keys are checked together)
SETUPS: dict[str, Callable[[Path], Callable[[str], None]]] = {
    "model.target_path": lambda tmp: _run({"model": {"target_path": "VALUE"}}),
    "model.draft_path": lambda tmp: _run({"draft": {"kind": "model"}, "model": {"draft_path": "VALUE"}}),
    "draft.eagle_path": lambda tmp: _run({"draft": {"kind": "eagle", "eagle_path": "VALUE"}}),
    "workload.path": lambda tmp: _run({"workload": {"kind": "jsonl", "path": "VALUE"}}),
    "backend.eagle_path": lambda tmp: _run(
        {"backend": {"kind": "vllm", "eagle_path": "VALUE", "vllm_env": str(_venv(tmp / "venv"))}}
    ),
    "backend.vllm_env": lambda tmp: _run({"backend": {"kind": "vllm", "vllm_env": "VALUE"}}),
    "backend.llamacpp_dir": lambda tmp: _run({"backend": {"kind": "llamacpp", "llamacpp_dir": "VALUE"}}),
    "output_dir": lambda tmp: _run({"output_dir": "VALUE"}),
    "train.jsonl_path": lambda tmp: _train(sources=("jsonl",), jsonl_path="VALUE"),
    "train.out": lambda tmp: _train(out="VALUE"),
}


def _bad_values(kind: PathKind, tmp: Path) -> dict[str, str]:
    """Values ``kind`` must refuse, by what is wrong with them."""
    empty_file = tmp / "empty.txt"
    empty_file.write_bytes(b"")
    (tmp / "blank.txt").write_text("\n  \n", encoding="utf-8")
    (tmp / "empty_dir").mkdir()
    (tmp / "unrelated").mkdir()
    (tmp / "unrelated" / "notes.txt").write_text("not what the key needs", encoding="utf-8")
    bad = {"empty value": "", "file for a directory": str(empty_file), "below a file": str(empty_file / "x")}
    if kind.expects == "new_dir":
        return bad
    bad = {"empty value": "", "missing": str(tmp / "missing"), "missing relative": "./missing"}
    if kind.expects == "file":
        return bad | {"empty file": str(empty_file), "blank file": str(tmp / "blank.txt"),
                      "directory for a file": str(tmp / "empty_dir")}  # fmt: skip
    return bad | {"file for a directory": str(empty_file), "empty directory": str(tmp / "empty_dir"),
                  "directory without its files": str(tmp / "unrelated")}  # fmt: skip


@pytest.mark.parametrize("key", sorted(PATH_KEYS))
def test_each_bad_value_is_one_error_naming_the_key(key: str, tmp_path: Path) -> None:
    check = SETUPS[key](tmp_path)
    cases = _bad_values(PATH_KEYS[key], tmp_path)
    assert len(cases) >= 3
    for case, value in cases.items():
        with pytest.raises(SpecToolkitError) as caught:
            check(value)
        message = str(caught.value)
        assert key in message and "\n" not in message, (case, message)
        if value:  # an empty value may be refused by the config itself ("workload=jsonl needs workload.path=FILE")
            assert message.startswith(f"{key}={value!r} ") and message.endswith(PATH_KEYS[key].fix), (case, message)


def _hf_dir(root: Path, weights: str = "model.safetensors") -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text("{}", encoding="utf-8")
    (root / weights).write_bytes(b"\0")
    return root


def _gguf(file: Path, head: bytes = b"GGUF") -> Path:
    file.write_bytes(head + b"\3\0\0\0")
    return file


def _our_head(root: Path) -> Path:
    shape = HeadShape(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=4, vocab_size=32, draft_vocab_size=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=64, aux_layers=(0, 1, 2))  # fmt: skip
    return Eagle3Head(shape, torch.arange(16)).save(root)


def _good_values(key: str, tmp: Path) -> list[str]:
    """Values ``key`` takes (its kind's), made under ``tmp``."""
    jsonl = tmp / "prompts.jsonl"
    jsonl.write_text('\n{"id": "a", "task_type": "qa", "prompt": "Hi"}\n', encoding="utf-8")
    created = [str(tmp / "new" / "deeper"), str(tmp)]
    good = {
        "model.target_path": [str(_hf_dir(tmp / "hf")), str(_hf_dir(tmp / "hf-bin", "pytorch_model.bin")), "embedded",
                              "org/name", str(_gguf(tmp / "model.gguf"))],
        "draft.eagle_path": [str(_our_head(tmp / "head"))],
        "workload.path": [str(jsonl)],
        "backend.eagle_path": [str(_hf_dir(tmp / "vllm-head")), "org/EAGLE3-head"],
        "backend.vllm_env": [str(_venv(tmp / "venv2"))],
        "backend.llamacpp_dir": [str(_venv(tmp / "llama", "llama-server"))],
        "output_dir": created,
        "train.jsonl_path": [str(jsonl)],
        "train.out": created,
    }  # fmt: skip
    good["model.draft_path"] = good["model.target_path"]
    return good[key]


@pytest.mark.parametrize("key", sorted(PATH_KEYS))
def test_good_values_and_unset_keys_pass(key: str, tmp_path: Path) -> None:
    check = SETUPS[key](tmp_path)
    for value in _good_values(key, tmp_path):
        check(value)
    check_path(key, None, PATH_KEYS[key])


def test_what_a_directory_lacks_is_named(tmp_path: Path) -> None:
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}", encoding="utf-8")
    assert path_problem(str(no_weights), PATH_KEYS["model.target_path"]) == "has no weights (*.safetensors or *.bin)"
    vllm_layout = _hf_dir(tmp_path / "foreign-head")  # a head vLLM loads, not one Eagle3Head.load reads
    (vllm_layout / "model.safetensors").rename(vllm_layout / "pytorch_model.bin")
    assert path_problem(str(vllm_layout), PATH_KEYS["draft.eagle_path"]) == "has no model.safetensors"
    (vllm_layout / "model.safetensors").write_bytes(b"\0")
    assert "did not write (no spectoolkit.shape)" in path_problem(str(vllm_layout), PATH_KEYS["draft.eagle_path"])
    assert path_problem(str(vllm_layout), PATH_KEYS["backend.eagle_path"]) is None
    venv = _venv(tmp_path / "venv")
    (venv / "bin" / "python").chmod(0o644)
    if os.geteuid() != 0:  # root may execute anything
        assert path_problem(str(venv), PATH_KEYS["backend.vllm_env"]) == "has a bin/python that is not executable"


def test_a_gguf_file_is_a_model_and_other_files_are_not(tmp_path: Path) -> None:
    model = PATH_KEYS["model.target_path"]
    assert path_problem(str(_gguf(tmp_path / "model.gguf")), model) is None
    assert (
        path_problem(str(_gguf(tmp_path / "fake.gguf", b"PK\3\4")), model)
        == "is not a GGUF file (it does not start with GGUF)"
    )
    assert path_problem(str(_gguf(tmp_path / "model.bin")), model) == "is a file, not a directory"
    with pytest.raises(SpecToolkitError, match=r"^model.draft_path='.*fake.gguf' is not a GGUF file .*a \.gguf file"):
        check_path("model.draft_path", tmp_path / "fake.gguf", model)


def test_the_head_files_are_those_the_head_writes() -> None:
    assert HEAD_FILES == (CONFIG_FILE, WEIGHTS_FILE)


def test_vllm_drafting_takes_any_head_checkpoint_as_draft_eagle_path(tmp_path: Path) -> None:
    foreign = _hf_dir(tmp_path / "EAGLE3-foreign")
    vllm = {"draft": {"kind": "eagle", "eagle_path": str(foreign)},
            "backend": {"kind": "vllm", "vllm_env": str(_venv(tmp_path / "venv"))}}  # fmt: skip
    check_run_paths(run_config_from_dict(vllm), "run")
    with pytest.raises(SpecToolkitError, match="^draft.eagle_path="):
        check_run_paths(run_config_from_dict({"draft": vllm["draft"]}), "run")


def test_a_key_without_effect_is_not_looked_at() -> None:
    assert set(run_paths(RunConfig())) == {"model.target_path", "output_dir"}  # not backend.vllm_env=.venv-vllm
    served = run_config_from_dict({"workload": {"kind": "jsonl", "path": "/nonexistent.jsonl"}})
    assert "workload.path" not in run_paths(served, "serve")
    check_run_paths(served, "serve")  # the server reads no workload
    check_train_paths(RunConfig(), TrainConfig(jsonl_path="/nonexistent.jsonl"))  # not a source: not read


def test_hub_ids_are_told_from_local_paths() -> None:
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    for local in ("./org/name", "/org/name", "~/name", "name", "a/b/c"):
        assert not is_hub_id(local)


def test_model_args_keys_are_named_as_lm_eval_spells_them(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    from spectoolkit.eval.lmeval import SpecToolkitLM

    with pytest.raises(SpecToolkitError, match=r"^model_args eagle_path='.*' is an empty directory"):
        SpecToolkitLM(draft="eagle", eagle_path=str(tmp_path), device="cpu")


def test_report_dir_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "summary.json"
    file.write_text("{}", encoding="utf-8")
    (tmp_path / "empty").mkdir()
    for bad, problem in ((tmp_path / "missing", "does not exist"), (file, "is a file, not a directory"),
                         (tmp_path / "empty", "is an empty directory")):  # fmt: skip
        assert report.main([str(bad)]) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines == [f"error: DIR={str(bad)!r} {problem}: {report.HINT}"]


def test_cli_refuses_an_empty_eagle_path_before_any_work(tmp_path: Path) -> None:
    empty, run_dir = tmp_path / "head", tmp_path / "run"
    empty.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "HYDRA_FULL_ERROR"}
    result = subprocess.run(
        [sys.executable, "-m", "spectoolkit", "+draft=eagle", f"draft.eagle_path={empty}", "device=cpu",
         f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: draft.eagle_path="), result.stderr
    assert "is an empty directory" in errors[0] and "config.json" in errors[0]
    assert not (run_dir / "job.json").exists()  # refused before the job started: nothing trained or measured
