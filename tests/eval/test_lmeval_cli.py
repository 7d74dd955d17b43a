"""``spectoolkit-lm-eval``: the device lm-eval fills in is no user choice, and user errors are one line.

Each test runs :func:`spectoolkit.eval.lmeval_cli.main` in-process, as the console script does. lm-eval
indexes only the shipped task directory (its own task tree takes ~11 s and is not under test), and
the device tests stop at loading the model: only argument handling is tested there.
"""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

lm_eval_tasks = pytest.importorskip("lm_eval.tasks")

import spectoolkit.eval.lmeval  # noqa: E402
from spectoolkit.config import RunConfig  # noqa: E402
from spectoolkit.errors import SpecToolkitError  # noqa: E402
from spectoolkit.eval.lmeval_cli import main, prefer_auto_device  # noqa: E402

RUN = ["--model", "spectoolkit", "--tasks", "spectoolkit_shortqa", "--limit", "1"]
NOT_LOADED = "model not loaded (test)"


class _ShippedTasksOnly(lm_eval_tasks.TaskManager):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{**kwargs, "include_defaults": False})


@pytest.fixture(autouse=True)
def _quick_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lm_eval_tasks, "TaskManager", _ShippedTasksOnly)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() sets sys.argv for lm-eval's parser
    monkeypatch.setenv("LMEVAL_LOG_LEVEL", "ERROR")  # lm-eval's log handler outlives a test's captured stderr


@pytest.fixture
def built_devices(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ``device`` of each RunConfig the model is built from; building stops with a user error."""
    devices: list[str] = []

    def record(config: RunConfig) -> None:
        devices.append(config.device)
        raise SpecToolkitError(NOT_LOADED)

    monkeypatch.setattr(spectoolkit.eval.lmeval, "build", record)
    return devices


@pytest.mark.parametrize(
    ("extra", "device"),
    [([], "auto"), (["--device", "cpu"], "cpu"), (["--device=cuda:0"], "cuda"),
     (["--device", "cuda", "--model_args", "draft=ngram,device=cpu"], "cpu")],
)  # fmt: skip
def test_device_is_auto_unless_the_user_sets_one(
    built_devices: list[str], capsys: pytest.CaptureFixture[str], extra: list[str], device: str
) -> None:
    assert main([*RUN, *extra]) == 1
    assert built_devices == [device]
    assert capsys.readouterr().err == f"error: {NOT_LOADED}\n"


@pytest.mark.parametrize(("yaml_device", "device"), [("", "auto"), ("device: cpu\n", "cpu")])
def test_device_in_the_config_yaml_is_the_users(
    built_devices: list[str], tmp_path: Path, yaml_device: str, device: str
) -> None:
    config = tmp_path / "eval.yaml"
    config.write_text(f"model: spectoolkit\n{yaml_device}", encoding="utf-8")
    assert main(["--config", str(config), "--tasks", "spectoolkit_shortqa", "--limit", "1"]) == 1
    assert built_devices == [device]


def test_other_models_and_subcommands_keep_lm_evals_default() -> None:
    hf = Namespace(device=None, config=None, model="hf")
    prefer_auto_device(hf, "spectoolkit")
    assert hf.device is None  # lm-eval then fills in its cuda:0
    listing = Namespace(config=None, model=None)  # `ls` has no --device
    prefer_auto_device(listing, "spectoolkit")
    assert not hasattr(listing, "device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_explicit_cuda_without_a_gpu_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*RUN, "--model_args", "draft=ngram", "--device", "cuda"]) == 1
    captured = capsys.readouterr()
    assert captured.err == "error: device=cuda but no CUDA device is available: use device=cpu or device=auto\n"
    assert "Traceback" not in captured.out


def test_bad_model_args_are_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*RUN, "--model_args", "drfat=bf16"]) == 1
    assert capsys.readouterr().err.startswith("error: unknown spectoolkit model_args: drfat; use target,")


def test_a_model_arg_with_no_effect_is_one_error_line(built_devices: list[str], capsys: pytest.CaptureFixture[str]):
    """``gamma`` without a drafter is refused as ``python -m spectoolkit +draft=none speculate.gamma=4`` is (the
    message: tests/eval/test_lmeval_args.py), before any model loads."""
    assert main([*RUN, "--model_args", "draft=none,gamma=4"]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("error: model_args gamma=4: speculate.gamma has no effect with +draft=none")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.out + captured.err
    assert built_devices == []
