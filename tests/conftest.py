"""Shared pytest fixtures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

# ---- tests/kvcache, tests/engine, tests/drafting: tiny-model decode loops ---------------------


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add overhead to thousands of 1-token forwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ---- tests/bench/protocol/test_runner.py, tests/test_cli.py: tiny checkpoints loadable by path ----------
# A random 2-layer Llama with the embedded SmolLM2 tokenizer (vocab 49152): the real loading,
# chat-template and engine paths in well under a second per generation. `scale` sharpens the
# next-token distributions so greedy decoding is not dominated by near-ties.

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
TINY_VOCAB_SIZE = 49152  # SmolLM2's tokenizer length == embedding rows
SHORT_CONTEXT = 128  # max_position_embeddings of the short-context variant


def _copy_tokenizer_files(source: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint + the embedded tokenizer: loadable with model.target_path=DIR."""
    from spectoolkit.embedded import embedded_dir
    from spectoolkit.models.tiny import save_tiny_llama

    out = save_tiny_llama(tmp_path_factory.mktemp("tiny") / "ckpt", vocab_size=TINY_VOCAB_SIZE, scale=4.0)
    _copy_tokenizer_files(embedded_dir(), out)
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint_short_context(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with a context of SHORT_CONTEXT positions (for overlong-prompt errors)."""
    out = tmp_path_factory.mktemp("tiny_short") / "ckpt"
    shutil.copytree(tiny_checkpoint, out)
    _edit_json(out / "config.json", lambda config: config.update(max_position_embeddings=SHORT_CONTEXT))
    return out
