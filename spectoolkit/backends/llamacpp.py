"""llama.cpp as a managed back-end: ``llama-server`` command lines (issue 46, item 4).

``make llama-cpp`` builds ``llama-server`` (and ``llama-speculative-simple``) from the llama.cpp sources
vendored in the llama-cpp-python sdist, for the CPU it runs on, into ``<backend.llamacpp_dir>/bin``.
:func:`llamacpp_server_args` builds a server's flags: the target GGUF, the served name, every core for the
model's threads, one slot per concurrent request (``-np``), each slot ``ctx_per_slot`` tokens of context,
``--metrics`` (its ``llamacpp:spec_decode_*`` counters are scraped as vLLM's are), and for the speculative
server the drafter:

- a draft model: ``-md DRAFT.gguf --spec-type draft-simple --spec-draft-n-max GAMMA`` (this version needs
  the type: without it the draft loads and drafts nothing);
- an n-gram mode: ``--spec-type ngram-simple`` (our ``+draft=ngram``: lookup ``--spec-ngram-simple-size-n``
  = draft.ngram_max, ``--spec-ngram-simple-size-m`` = GAMMA) or any other of its types named in
  ``backend.llamacpp_spec_type`` (ngram-mod, ngram-map-k, ngram-map-k4v, ngram-cache), with llama.cpp's own
  defaults for that type.

Checked on the llama.cpp of llama-cpp-python 0.3.36 (``common/arg.cpp``, ``tools/server``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from spectoolkit.errors import SpecToolkitError

SERVER_BINARY = "llama-server"
DRAFT_TYPE = "draft-simple"
NGRAM_TYPES = ("ngram-simple", "ngram-mod", "ngram-map-k", "ngram-map-k4v", "ngram-cache")
SPEC_TYPES = (DRAFT_TYPE, *NGRAM_TYPES)


def find_llama_server(directory: str | Path) -> tuple[Path, str]:
    """``<directory>/bin/llama-server`` (relative: to the working directory), checked to run, and what its
    ``--version`` prints (its build number and commit)."""
    root = Path(directory).expanduser().absolute()
    binary = root / "bin" / SERVER_BINARY
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise SpecToolkitError(
            f"no llama-server at {binary}: run `make llama-cpp` (it builds llama-server from the llama.cpp sources "
            "of llama-cpp-python for this CPU), or set backend.llamacpp_dir to where one is"
        )
    try:
        probe = subprocess.run([str(binary), "--version"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SpecToolkitError(f"{binary} does not run ({type(exc).__name__}): run `make llama-cpp` again") from None
    if probe.returncode != 0:
        why = (probe.stderr or probe.stdout).decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise SpecToolkitError(f"{binary} --version failed ({why[0]}): run `make llama-cpp` again on this machine")
    lines = (probe.stdout + probe.stderr).decode(errors="replace").splitlines()
    return binary, next((line.strip() for line in lines if line.startswith("version")), " ".join(lines[-2:]).strip())


def llamacpp_available(directory: str | Path) -> str | None:
    """None when a llama-server is built under ``directory``, else why not (a pytest skip reason)."""
    try:
        find_llama_server(directory)
    except SpecToolkitError as exc:
        return str(exc)
    return None


def llamacpp_server_args(
    *,
    model: str | Path,
    served_model_name: str,
    host: str,
    port: int,
    threads: int,
    slots: int,
    ctx_per_slot: int,
    spec_type: str | None = None,
    gamma: int = 4,
    draft_model: str | Path | None = None,
    ngram_max: int = 3,
    extra_args: tuple[str, ...] = (),
) -> list[str]:
    """The flags of one llama-server (after the binary); ``spec_type`` None: the target alone."""
    if slots < 1 or ctx_per_slot < 1 or threads < 1:
        raise SpecToolkitError(f"llama-server needs slots, ctx_per_slot and threads >= 1 (got {slots}, "
                               f"{ctx_per_slot}, {threads})")  # fmt: skip
    args = ["-m", str(model), "--alias", served_model_name, "--host", host, "--port", str(port)]
    args += ["-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot)]
    args += ["--metrics", "--no-webui"]
    if spec_type is not None:
        args += _spec_args(spec_type, gamma, draft_model, ngram_max, threads)
    return args + [str(arg) for arg in extra_args]


def _spec_args(spec_type: str, gamma: int, draft_model: str | Path | None, ngram_max: int, threads: int) -> list[str]:
    if spec_type not in SPEC_TYPES:
        raise SpecToolkitError(
            f"backend.llamacpp_spec_type={spec_type} is not a llama.cpp speculative type this run can start: use one "
            f"of {', '.join(SPEC_TYPES)}"
        )
    if gamma < 1:
        raise SpecToolkitError(f"speculate.gamma={gamma}: a llama.cpp speculative server needs gamma >= 1")
    args = ["--spec-type", spec_type]
    if spec_type == DRAFT_TYPE:
        if draft_model is None:
            raise SpecToolkitError("llama.cpp's draft-simple needs a draft model: set model.draft_path to a GGUF")
        args += ["-md", str(draft_model), "--spec-draft-n-max", str(gamma), "-td", str(threads), "-tbd", str(threads)]
    elif spec_type == "ngram-simple":
        args += ["--spec-ngram-simple-size-n", str(ngram_max), "--spec-ngram-simple-size-m", str(gamma)]
    return args
