"""A GGUF file is a checkpoint (spectoolkit.models.paths): ``model.target_path=FILE.gguf`` loads the weights the
embedded directory holds, from a directory named by the file's content hash, so a copy elsewhere reuses it.

Uses the real cache, as the embedded model does: the first run converts the embedded GGUF once (about 20 s).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from spectoolkit.checkpoints import resolve_path
from spectoolkit.embedded import GGUF_DIR, cache_root, embedded_dir, gguf_path, sha256_of
from spectoolkit.wiring.loading import load_model, load_tokenizer


@pytest.fixture(scope="module")
def gguf_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    copy = tmp_path_factory.mktemp("elsewhere") / "copy.gguf"
    shutil.copyfile(gguf_path(), copy)
    return copy


def test_a_gguf_path_loads_the_embedded_weights(gguf_copy: Path) -> None:
    cpu = torch.device("cpu")
    from_gguf = load_model(str(gguf_path()), "fp32", cpu, kernels=None).model.state_dict()
    embedded = load_model(None, "fp32", cpu, kernels=None).model.state_dict()
    assert from_gguf.keys() == embedded.keys()
    for name, tensor in embedded.items():
        assert torch.equal(from_gguf[name], tensor), name
    text = "def mean(values):\n    return sum(values) / len(values)\n"
    assert load_tokenizer(str(gguf_copy))(text).input_ids == load_tokenizer(None)(text).input_ids


def test_the_cache_key_is_the_content_hash(gguf_copy: Path) -> None:
    converted = Path(resolve_path(str(gguf_path())))
    assert converted == cache_root() / GGUF_DIR / sha256_of(gguf_path()) and converted != embedded_dir()
    assert Path(resolve_path(str(gguf_copy))) == converted  # the copy at another path reuses the directory
