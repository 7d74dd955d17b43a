"""GGUF files as checkpoints (spectoolkit.embedded): content hashes memoized per (path, size, mtime), a converted
directory that finds its GGUF file again (the gguf precision reads it), and a GGUF whose architecture transformers
does not convert is one clear error."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from spectoolkit.embedded import GGUF_DIR, SHA256_DIR, gguf_dir, gguf_source, sha256_of
from spectoolkit.errors import SpecToolkitError


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECTOOLKIT_CACHE", str(root))
    return root


def test_a_content_hash_is_read_once_per_path_size_and_mtime(tmp_path: Path, cache: Path) -> None:
    file = tmp_path / "weights.gguf"
    file.write_bytes(b"first content")
    first = hashlib.sha256(b"first content").hexdigest()
    assert sha256_of(file) == first and len(list((cache / SHA256_DIR).iterdir())) == 1
    stat = file.stat()
    file.write_bytes(b"other content")  # same size; with the old mtime the memo answers without reading
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert sha256_of(file) == first
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # rewritten: read again
    assert sha256_of(file) == hashlib.sha256(b"other content").hexdigest()
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(b"first content")
    assert sha256_of(copy) == first  # another path is hashed on its own, to the same digest


def test_an_architecture_transformers_does_not_convert_is_one_error(tmp_path: Path, cache: Path) -> None:
    import gguf

    file = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(file), "nonesuch")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SpecToolkitError) as caught:
        gguf_dir(file)
    message = str(caught.value)
    assert "\n" not in message and str(file) in message and "architecture nonesuch" in message
    assert [path.name for path in (cache / GGUF_DIR).iterdir() if not path.name.endswith(".lock")] == []


def test_a_converted_directory_knows_its_gguf_file_while_it_keeps_its_content(tmp_path: Path, cache: Path) -> None:
    file = tmp_path / "model.gguf"
    file.write_bytes(b"gguf bytes")
    converted = cache / GGUF_DIR / sha256_of(file)
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")  # converted already: gguf_dir only records the file
    assert gguf_dir(file) == converted and gguf_source(converted) == file.resolve()
    file.write_bytes(b"other bytes")  # no longer the content the directory was converted from
    assert gguf_source(converted) is None
    assert gguf_source(tmp_path) is None  # not a converted directory
