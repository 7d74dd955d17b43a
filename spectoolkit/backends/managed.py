"""``backend=vllm`` and ``backend=llamacpp``: start the baseline and speculative servers from the run's config
(issues 17 and 46).

The target checkpoint (``model.target_path``; the embedded SmolLM2 directory by default) is served at
``target.precision`` (a float precision: vLLM's ``--dtype``) on ``backend.port`` (baseline) and
``backend.port + 1`` (speculative: ``draft=ngram``, ``draft=<precision>`` with a draft model, or an
EAGLE head when ``backend.eagle_path`` is given), both from the venv ``make vllm`` builds.

``backend=llamacpp``: llama-server (``make llama-cpp``) on the target's GGUF file at its own quantization
(so the run says ``+target=gguf``), on the same two ports; the speculative server drafts with the draft
model's GGUF (``+draft=gguf``), or with an n-gram mode (``+draft=ngram``, or ``backend.llamacpp_spec_type``).

Logs go to ``<output_dir>/<backend>-<arm>.log``. Servers are registered on the caller's ``ExitStack``, so
they stop on every exit path; a server that dies or is not healthy within ``backend.startup_timeout_s`` is
one clear error with its log's last lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any

from spectoolkit.backends.arms import Declared
from spectoolkit.backends.llamacpp import DRAFT_TYPE, find_llama_server, llamacpp_server_args
from spectoolkit.backends.process import ManagedServer
from spectoolkit.backends.vllm import find_vllm_python, vllm_command, vllm_env, vllm_server_args
from spectoolkit.config import BackendConfig, RunConfig
from spectoolkit.errors import SpecToolkitError
from spectoolkit.wiring.resolve import ResolvedRun

FLOAT_DTYPES = ("fp32", "bf16", "fp16")
VLLM_DRAFTERS = {"ngram": "ngram", "model": "model", "none": None}  # our draft.kind -> what vLLM runs


def _eagle_dir(cfg: RunConfig) -> str | None:
    """The EAGLE head vLLM drafts with: ``backend.eagle_path``, or ``+draft=eagle``'s ``draft.eagle_path``."""
    return cfg.backend.eagle_path or (cfg.draft.eagle_path if cfg.draft.kind == "eagle" else None)


def _drafter(cfg: RunConfig) -> str | None:
    if _eagle_dir(cfg):
        return "eagle"
    if cfg.draft.kind == "skip":
        raise SpecToolkitError(
            "backend=vllm has no layer-skip drafter: use +draft=ngram, a draft model (+draft=<precision>), or an "
            "EAGLE head (backend.eagle_path=DIR); +draft=skip runs on backend=local or our server"
        )
    if cfg.draft.kind == "suffix":
        raise SpecToolkitError(
            "backend=vllm: our +draft=suffix runs on backend=local or our server; vLLM's own suffix method needs "
            "the arctic-inference package, which its CPU build lacks: use +draft=ngram there"
        )
    if cfg.draft.kind == "eagle":
        raise SpecToolkitError("backend=vllm +draft=eagle needs the head's directory: set draft.eagle_path=DIR "
                               "(python -m spectoolkit.train_draft prints it) or backend.eagle_path=DIR")  # fmt: skip
    if cfg.draft.kind == "hybrid":
        raise SpecToolkitError(
            "backend=vllm: our +draft=hybrid (suffix decoding with a head) runs on backend=local or our server; "
            "vLLM drafts with the head alone: +draft=eagle draft.eagle_path=DIR (or backend.eagle_path=DIR)"
        )
    return VLLM_DRAFTERS[cfg.draft.kind]


def _threads_bind(setting: str | None) -> str | None:
    """None: every core of this machine (our engine uses them all too); "auto": vLLM's own choice."""
    if setting == "auto":
        return None
    return setting or f"0-{max(0, (os.cpu_count() or 1) - 1)}"


def start_vllm_servers(
    cfg: RunConfig, stack: contextlib.ExitStack, run: ResolvedRun
) -> tuple[RunConfig, dict[str, Any], dict]:
    """Start the servers of ``cfg`` (its checkpoints resolved once as ``run``); returns ``cfg`` with their URLs as
    the endpoint back-end's, how each was started, and what each arm runs (vLLM's servers do not report their
    speculation settings)."""
    backend = cfg.backend
    if cfg.target.precision not in FLOAT_DTYPES:
        raise SpecToolkitError(
            f"backend=vllm serves the target checkpoint at a float precision ({', '.join(FLOAT_DTYPES)}), not "
            f"target={cfg.target.precision}: use +target=bf16 (or point model.target_path at a checkpoint vLLM loads)"
        )
    python = find_vllm_python(backend.vllm_env)
    model_dir = run.target.location
    draft_dir = run.draft.location if run.separate_draft else None  # None: a self-draft
    drafter = _drafter(cfg)
    env = vllm_env(backend.vllm_kv_cache_gib, _threads_bind(backend.vllm_threads_bind))
    commands = {}
    for role in _roles(drafter is not None):
        args = vllm_server_args(
            role, model_dir=model_dir, served_model_name=cfg.model.name, host=backend.host, port=_port(backend, role),
            dtype=cfg.target.precision, gamma=cfg.speculate.gamma, drafter=drafter or "ngram",
            ngram_max=cfg.draft.ngram_max, ngram_min=cfg.draft.ngram_min, draft_model_dir=draft_dir,
            draft_precision=cfg.draft.precision if drafter == "model" else None, eagle_dir=_eagle_dir(cfg),
            extra_args=backend.vllm_args,
        )  # fmt: skip
        commands[role] = vllm_command(python, args)
    cfg, managed = _start(cfg, stack, "vllm", commands, env)
    return cfg, managed, _declared(cfg, drafter)


def _roles(speculative: bool) -> tuple[str, ...]:
    return ("baseline", "spec") if speculative else ("baseline",)


def _port(backend: BackendConfig, role: str) -> int:
    """The baseline server listens on backend.port, the speculative one on the next port."""
    return backend.port + (role == "spec")


def _start(cfg: RunConfig, stack: contextlib.ExitStack, kind: str, commands: dict[str, list[str]],
           env: dict[str, str]) -> tuple[RunConfig, dict[str, Any]]:  # fmt: skip
    """Start one server per role (baseline on backend.port, spec on port + 1), wait until all are healthy;
    returns ``cfg`` with their URLs as the endpoint back-end's, and how each was started."""
    backend = cfg.backend
    servers, managed = {}, {}
    for role, command in commands.items():
        log = Path(cfg.output_dir) / f"{kind}-{role}.log"
        server = ManagedServer(command, host=backend.host, port=_port(backend, role), log_path=log, env=env,
                               name=f"{kind} {role}", allow_remote=backend.allow_remote)  # fmt: skip
        stack.enter_context(server)
        servers[role] = server
        managed[role] = {"command": server.command, "log": str(log), "url": server.base_url}
    for server in servers.values():
        server.wait_healthy(backend.startup_timeout_s)
    spec = servers.get("spec")
    urls = {"baseline_url": servers["baseline"].base_url, "spec_url": spec.base_url if spec else None}
    return dataclasses.replace(cfg, backend=dataclasses.replace(backend, **urls)), managed


def _declared(cfg: RunConfig, drafter: str | None) -> dict[str, Declared]:
    precision = cfg.target.precision
    declared = {"baseline": Declared("none", 0, "none", precision)}
    if drafter:
        draft_precision = cfg.draft.precision if drafter == "model" else None
        declared["spec"] = Declared(f"vllm-{drafter}", cfg.speculate.gamma, "fixed", precision, draft_precision)
    return declared


LLAMACPP_PRECISION = "gguf"  # llama.cpp runs a GGUF at the file's own quantization: our +target=gguf


def _llamacpp_spec_type(cfg: RunConfig) -> str | None:
    """llama.cpp's speculative type for the run's drafter (None: the target alone)."""
    if cfg.backend.llamacpp_spec_type is not None:
        return cfg.backend.llamacpp_spec_type
    kind = cfg.draft.kind
    if kind == "model":
        if cfg.draft.precision != LLAMACPP_PRECISION:
            raise SpecToolkitError(
                f"backend=llamacpp drafts with the draft model's GGUF file at its own quantization, not "
                f"draft={cfg.draft.precision}: use +draft=gguf"
            )
        return DRAFT_TYPE
    if kind == "ngram":
        return "ngram-simple"
    if kind == "none":
        return None
    raise SpecToolkitError(
        f"backend=llamacpp has no drafter like our +draft={kind}: use a draft model (+draft=gguf), +draft=ngram, "
        "or one of llama.cpp's n-gram modes (backend.llamacpp_spec_type=ngram-mod, ngram-map-k, ngram-cache)"
    )


def start_llamacpp_servers(
    cfg: RunConfig, stack: contextlib.ExitStack, run: ResolvedRun
) -> tuple[RunConfig, dict[str, Any], dict]:
    """Start llama-server for the target alone and, with a drafter, speculative (the GGUF files behind ``run``'s
    checkpoints); returns as :func:`start_vllm_servers` does."""
    backend = cfg.backend
    if cfg.target.precision != LLAMACPP_PRECISION:
        raise SpecToolkitError(
            f"backend=llamacpp runs the target's GGUF file at its own quantization, not target={cfg.target.precision}:"
            " add +target=gguf (our arms at that precision run the same weights)"
        )
    binary, version = find_llama_server(backend.llamacpp_dir)
    spec_type = _llamacpp_spec_type(cfg)
    target = run.target.gguf_file()
    draft = run.draft.gguf_file("model.draft_path") if spec_type == DRAFT_TYPE else None
    slots = backend.llamacpp_slots or max([*cfg.serve.concurrency, 1])
    threads = os.cpu_count() or 1
    commands = {}
    for role in _roles(spec_type is not None):
        args = llamacpp_server_args(
            model=target, served_model_name=cfg.model.name, host=backend.host, port=_port(backend, role),
            threads=threads, slots=slots, ctx_per_slot=backend.llamacpp_ctx_per_slot,
            spec_type=spec_type if role == "spec" else None, gamma=cfg.speculate.gamma, draft_model=draft,
            ngram_max=cfg.draft.ngram_max, extra_args=backend.llamacpp_args,
        )  # fmt: skip
        commands[role] = [str(binary), *args]
    cfg, managed = _start(cfg, stack, "llamacpp", commands, {})
    for started in managed.values():
        started["version"] = version
    precision = f"{LLAMACPP_PRECISION} (llama.cpp)"
    declared = {"baseline": Declared("none", 0, "none", precision)}
    if spec_type:
        draft_precision = f"{LLAMACPP_PRECISION} (llama.cpp)" if draft else None
        declared["spec"] = Declared(f"llamacpp-{spec_type}", cfg.speculate.gamma, "fixed", precision, draft_precision)
    return cfg, managed, declared
