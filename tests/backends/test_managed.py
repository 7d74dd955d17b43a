"""Which drafter managed vLLM runs for each of our draft kinds (spectoolkit.backends.managed._drafter).

Every ``draft.kind`` is either mapped to a vLLM method or refused with one error that says where it runs: a
kind added later without a decision here fails this test instead of a ``KeyError`` in a user's run.
"""

from __future__ import annotations

import pytest

from spectoolkit.backends.managed import _drafter
from spectoolkit.config import DRAFT_KINDS, BackendConfig, DraftConfig, RunConfig
from spectoolkit.errors import SpecToolkitError

MAPPED = {"ngram": "ngram", "model": "model", "none": None}
REFUSED = {"skip": "no layer-skip drafter", "suffix": "runs on backend=local", "hybrid": "vLLM drafts with the head",
           "eagle": "needs the head's directory"}  # fmt: skip


def _cfg(kind: str, eagle_path: str | None = None) -> RunConfig:
    return RunConfig(draft=DraftConfig(kind=kind, eagle_path=eagle_path), backend=BackendConfig(kind="vllm"))


def test_every_draft_kind_is_mapped_or_refused() -> None:
    assert set(MAPPED) | set(REFUSED) == set(DRAFT_KINDS)


@pytest.mark.parametrize("kind", sorted(MAPPED))
def test_mapped_kinds(kind: str) -> None:
    assert _drafter(_cfg(kind)) == MAPPED[kind]


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_refused_kinds_say_where_they_run(kind: str) -> None:
    with pytest.raises(SpecToolkitError, match=REFUSED[kind]):
        _drafter(_cfg(kind))


def test_a_head_directory_makes_vllm_draft_with_eagle() -> None:
    assert _drafter(_cfg("eagle", "/heads/h")) == "eagle"
    assert _drafter(RunConfig(backend=BackendConfig(kind="vllm", eagle_path="/heads/h"))) == "eagle"
