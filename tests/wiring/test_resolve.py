"""Resolve once, at the door (spectoolkit/wiring/resolve.py): a run's specs are resolved by one step, then handed down.

A run with a target and a separate draft checkpoint resolves each spec exactly once: loading (the tokenizer, both
models, the RTN backend), the compat check and the arm builders take the resolved checkpoints.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from spectoolkit import checkpoints
from spectoolkit.wiring.resolve import resolve_run
from spectoolkit.wiring.setup import build
from tests.test_config import _run_config


def test_a_run_resolves_each_spec_once(tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    draft_dir = tmp_path / "draft"
    shutil.copytree(tiny_checkpoint, draft_dir)
    cfg = _run_config(f"model.target_path={tiny_checkpoint}", f"model.draft_path={draft_dir}", "+target=rtn-int4",
                      "+draft=fp32", "runtime.kernels=reference")  # fmt: skip
    resolved: list[str | None] = []
    resolve_path = checkpoints.resolve_path

    def counted(spec: str | None) -> str:
        resolved.append(spec)
        return resolve_path(spec)

    monkeypatch.setattr(checkpoints, "resolve_path", counted)  # the one resolver: the compat check has none
    setup = build(cfg)
    assert sorted(resolved) == sorted([str(tiny_checkpoint), str(draft_dir)])
    run = setup.resolved
    assert (run.target.location, run.draft.location) == (str(tiny_checkpoint), str(draft_dir)) and run.separate_draft
    assert setup.models.target.checkpoint == run.target and setup.models.draft.checkpoint == run.draft
    assert setup.facts.compat_checked


def test_a_self_draft_is_the_targets_checkpoint(tiny_checkpoint: Path) -> None:
    run = resolve_run(_run_config(f"model.target_path={tiny_checkpoint}", "+draft=rtn-int4"))
    assert run.draft is run.target and not run.separate_draft and run.model_drafts
    assert run.kernel_mode == "auto" and run.target_widths == (1, 5) and run.verify_sizes == (5,)
    suffix = resolve_run(_run_config(f"model.target_path={tiny_checkpoint}", f"model.draft_path={tiny_checkpoint}x"))
    assert not suffix.model_drafts and suffix.draft is suffix.target  # no draft model: its path is never resolved
