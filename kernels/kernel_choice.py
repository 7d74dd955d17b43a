"""Linear kernels chosen by measurement on the machine at hand, among row-invariant variants.

Two things decide how a linear layer should run, and neither can be known in advance:

- **Speed.** The same weights run through different BLAS kernels depending on the row count
  (gemv for one row, small-gemm paths for a few) and on the orientation (``F.linear`` or
  ``W @ Xᵀ``); which is fastest differs between machines of the same kind (measured: the
  ``W @ Xᵀ`` path that was 2× faster where it was tuned is 3–4× slower than ``F.linear`` elsewhere).
- **Exactness (DESIGN §1, §6).** A k-token verify forward must compute each row as the one-token
  decode step does, or a speculative output can differ from the target alone's. A kernel whose
  per-row result depends on how many rows it is given breaks that by a last bit, which a quantized
  KV cache or a bf16 head turns into a different token.

A *variant* runs the layer's own forward on fixed-size chunks of ``chunk`` rows (the last chunk
padded by repeating its last row), so a decode step and every verify row go through the very same
kernel call shape; ``chunk = 1`` (the layer's forward one row at a time) is the reference: a decode
step of the reference is exactly the stock one-row call. At load time, per layer shape, each
variant is (1) probed for row invariance on the real weights — rows of a multi-row call must equal
the same rows alone, bit for bit — and (2) timed at a decode step and a verify width; the fastest
invariant variant wins, the reference on ties (within :data:`TIE_MARGIN`). Calls with more than
:data:`MAX_CHUNKED_ROWS` rows are prefills, which the baseline and speculative arms make alike, and
keep the layer's plain forward. Choices are cached per machine fingerprint (CPU model, cores, torch
version, threads, device) in ``<cache>/kernels/<fingerprint>.json``: a choice made on one machine
is never reused on another. ``runtime.kernels=reference`` skips the measurement.

A chosen layer is held by a :class:`ChunkedLinear` (:mod:`spectoolkit.kernels.layer_wrapper`): the library's
module is never patched, its parameters and ``state_dict`` keys stay what they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from spectoolkit.kernels.cpu_linear import PackedLinear
from spectoolkit.kernels.layer_wrapper import LayerWrapper, leaf_linears, replace_module

# Calls with at most this many rows (verify windows up to γ = 32) run row-invariantly, in linears and (in
# chosen mode) attention alike; longer calls are prefills, which every arm makes identically, so they keep
# the fast path.
MAX_CHUNKED_ROWS = 33
TIE_MARGIN = 0.03  # a variant must beat the reference by more than this share to be chosen
PROBE_ROWS = (2, 5, 9)  # multi-row calls whose rows must equal the same rows alone
Timer = Callable[["Variant", int, Callable[[], object]], float]  # (variant, rows, call) -> seconds of one call


@dataclass(frozen=True)
class Variant:
    """How a linear layer runs rows: ``chunk`` rows per call, through ``F.linear`` or ``W @ Xᵀ``."""

    name: str
    chunk: int
    gemm: bool = False  # W @ Xᵀ (plain fp32 nn.Linear only)


REFERENCE = Variant("rows1", 1)
VARIANTS = (REFERENCE, Variant("rows2", 2), Variant("rows4", 4), Variant("rows8", 8),
            Variant("gemm2", 2, gemm=True), Variant("gemm8", 8, gemm=True))  # fmt: skip
BY_NAME = {variant.name: variant for variant in VARIANTS}


def _gemm(layer: nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    """rows [c, K] -> [c, N] as W @ Xᵀ (MKL's gemm in that orientation)."""
    out = torch.mm(layer.weight, rows.t()).t()
    return out + layer.bias if layer.bias is not None else out


def run_variant(
    layer: nn.Module, variant: Variant, inputs: torch.Tensor, mode: str = "chosen", gemm_from: int | None = None
) -> torch.Tensor:
    """inputs [..., K] -> [..., N] through the library ``layer``, rows run as the step's row ``mode`` says
    (:data:`~spectoolkit.runtime.step.ROW_MODES`): ``"chosen"`` as in the module docstring; ``"plain"`` the
    layer's own forward for any row count (a batched step: one call for all rows; ``W @ Xᵀ`` from ``gemm_from``
    rows, :mod:`spectoolkit.kernels.batched_kernels`); ``"invariant"`` the chosen chunks for every row count,
    prefills included (no row's result depends on the others)."""
    if mode == "plain":
        rows = inputs.reshape(-1, inputs.shape[-1])  # [M, K]
        if gemm_from is not None and rows.shape[0] >= gemm_from:
            out = _gemm(layer, rows).contiguous()  # [M, N]
            return out.reshape(*inputs.shape[:-1], out.shape[-1])
        return layer.forward(inputs)
    rows = inputs.reshape(-1, inputs.shape[-1])  # [M, K]
    count, chunk = rows.shape[0], variant.chunk
    if count == 0 or (count > MAX_CHUNKED_ROWS and mode != "invariant") or (count == chunk and not variant.gemm):
        return layer.forward(inputs)
    if count == 1:  # a decode step: the row repeated to a whole chunk (contiguous, not a stride-0 view)
        part = rows.repeat(chunk, 1)  # [chunk, K]
        out = (_gemm(layer, part) if variant.gemm else layer.forward(part))[:1]  # [1, N]
        return out.reshape(*inputs.shape[:-1], out.shape[-1])
    pieces = []
    for start in range(0, count, chunk):
        part = rows[start : start + chunk]  # [m, K], m <= chunk
        kept = part.shape[0]
        if kept < chunk:  # contiguous copies: a stride-0 expand may take another kernel path
            part = torch.cat([part, part[-1:].repeat(chunk - kept, 1)])
        out = _gemm(layer, part) if variant.gemm else layer.forward(part)
        pieces.append(out[:kept])
    out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]  # [M, N]
    return out.reshape(*inputs.shape[:-1], out.shape[-1])


class ChunkedLinear(LayerWrapper):
    """A library linear (child ``layer``, untouched) run as ``variant``; see the module docstring."""

    def __init__(self, layer: nn.Module, variant: Variant) -> None:
        super().__init__(layer)
        self.variant = variant
        self.gemm_from: int | None = None  # plain mode: W @ Xᵀ from this many rows (kernels.batched_kernels)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """inputs [..., K] -> [..., N] in ``"chosen"`` mode (the layer called as a module)."""
        return run_variant(self.layer, self.variant, inputs, "chosen", self.gemm_from)

    def run(self, inputs: torch.Tensor, mode: str) -> torch.Tensor:
        """inputs [..., K] -> [..., N] in row ``mode`` (:func:`run_variant`)."""
        return run_variant(self.layer, self.variant, inputs, mode, self.gemm_from)


def library_layer(layer: nn.Module) -> nn.Module:
    """The library's layer: the one a :class:`ChunkedLinear` holds, else ``layer`` itself."""
    return layer.layer if isinstance(layer, ChunkedLinear) else layer


def install(layer: nn.Module, variant: Variant) -> ChunkedLinear:
    """``layer`` run as ``variant`` from now on: a wrapper's variant set, or a new :class:`ChunkedLinear` holding a
    plain layer (which the caller puts in the model: :func:`wrap_linears`). The layer itself is never changed."""
    if isinstance(layer, ChunkedLinear):
        layer.variant = variant
        return layer
    return ChunkedLinear(layer, variant)


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers to choose kernels for: plain ``nn.Linear`` and quantized linears (any module with
    ``in_features``/``out_features`` and no child modules), or the :class:`ChunkedLinear` holding one; our packed
    kernel and other wrappers (bitsandbytes int8 runs its own row-wise forward, :mod:`spectoolkit.quant.bnb`)
    are left alone."""
    layers = []
    for name, module in leaf_linears(model):
        if isinstance(module, PackedLinear):  # our kernel: row-invariant by construction
            continue
        if isinstance(module, LayerWrapper) and not isinstance(module, ChunkedLinear):
            continue
        if isinstance(module, nn.Linear) or hasattr(module, "out_features"):
            layers.append((name, module))
    return layers


def wrap_linears(model: nn.Module, variant: Variant | None = None) -> list[tuple[str, ChunkedLinear]]:
    """Every layer of :func:`linear_layers` held by a :class:`ChunkedLinear` in ``model`` (plain layers wrapped as
    ``variant``, the reference by default; wrappers kept as they are); returns them by name."""
    wrapped = []
    for name, layer in linear_layers(model):
        if not isinstance(layer, ChunkedLinear):
            layer = ChunkedLinear(layer, variant or REFERENCE)
            replace_module(model, name, layer)
        wrapped.append((name, layer))
    return wrapped


def _activation_dtype(model: nn.Module) -> torch.dtype:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return embeddings.weight.dtype if embeddings is not None else torch.float32


def shape_key(layer: nn.Module, dtype: torch.dtype, widths: tuple[int, ...]) -> str:
    """What identifies a choice: layer class, shape, activation dtype, bias, the widths it was timed at."""
    layer = library_layer(layer)
    bias = getattr(layer, "bias", None) is not None
    return f"{type(layer).__name__}:{layer.in_features}x{layer.out_features}:{dtype}:bias={bias}:w={widths}"


def candidates(layer: nn.Module, dtype: torch.dtype) -> list[Variant]:
    """Variants that apply: W @ Xᵀ only for a plain fp32 ``nn.Linear`` on the CPU."""
    layer = library_layer(layer)
    plain_fp32 = type(layer) is nn.Linear and layer.weight.dtype == torch.float32 and layer.weight.device.type == "cpu"
    return [variant for variant in VARIANTS if not variant.gemm or plain_fp32]


def _device(layer: nn.Module) -> torch.device:
    """Where the layer's tensors live (quantized layers may hold only buffers)."""
    tensor = next(iter(layer.parameters()), None)
    tensor = tensor if tensor is not None else next(iter(layer.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _run(layer: nn.Module, variant: Variant, rows: torch.Tensor) -> torch.Tensor:
    return run_variant(library_layer(layer), variant, rows)


@torch.inference_mode()
def row_invariant(
    layer: nn.Module, variant: Variant, dtype: torch.dtype, probe_rows: Iterable[int] = PROBE_ROWS
) -> bool:
    """Whether every row of a multi-row call of ``variant`` equals that row alone, bit for bit."""
    device = _device(layer)
    generator = torch.Generator().manual_seed(0)
    for count in probe_rows:
        rows = torch.randn(count, layer.in_features, generator=generator).to(device=device, dtype=dtype)  # [M, K]
        together = _run(layer, variant, rows)  # [M, N]
        for index in range(count):
            if not torch.equal(together[index], _run(layer, variant, rows[index : index + 1])[0]):
                return False
    return True


def _set_variant(layers: list[nn.Module], variant: Variant) -> None:
    """Run the model's wrapped ``layers`` as ``variant`` (a whole-step timing needs them in the model)."""
    for layer in layers:
        if not isinstance(layer, ChunkedLinear):
            raise TypeError(f"timing whole steps needs the model's ChunkedLinear wrappers, not {type(layer).__name__}")
        layer.variant = variant


def one_call(variant: Variant, rows: int, function: Callable[[], object]) -> float:
    """Seconds of one call of ``function`` (``variant`` on ``rows`` rows): the default :data:`Timer`."""
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def _sample_rows(layer: nn.Module, dtype: torch.dtype, width: int) -> torch.Tensor:
    rows = torch.randn(width, layer.in_features, generator=torch.Generator().manual_seed(width))
    return rows.to(_device(layer), dtype)  # [width, K]


@torch.inference_mode()
def measure(
    layers: list[nn.Module],
    variants: list[Variant],
    dtype: torch.dtype,
    widths: tuple[int, ...],
    timer: Timer,
    step: Callable[[int], object] | None = None,
    repeats: int = 5,
) -> dict[Variant, tuple[float, ...]]:
    """Median seconds per width of each variant on ``layers`` (one shape), the variants interleaved per
    repeat so drift is shared. With ``step`` (a whole model forward of a given width) the variant is
    installed on the layers and the model step is timed — the weights then stream as in a real decode
    step; without it, one pass over the layers is timed (weights partly cache-resident: optimistic)."""
    samples: dict[Variant, list[list[float]]] = {variant: [[] for _ in widths] for variant in variants}
    calls = {}
    for variant in variants:
        for index, width in enumerate(widths):
            if step is None:
                rows = _sample_rows(layers[0], dtype, width)
                calls[variant, index] = lambda v=variant, r=rows: [_run(layer, v, r) for layer in layers]
            else:
                calls[variant, index] = lambda w=width: step(w)
    for repeat in range(repeats + 1):  # pass 0 warms every shape up
        for variant in variants if repeat % 2 else variants[::-1]:
            if step is not None:
                _set_variant(layers, variant)
            for index, width in enumerate(widths):
                elapsed = timer(variant, width, calls[variant, index])
                if repeat:
                    samples[variant][index].append(elapsed)
    return {variant: tuple(statistics.median(s) for s in per_width) for variant, per_width in samples.items()}


def choose_variant(
    layers: list[nn.Module],
    dtype: torch.dtype,
    widths: tuple[int, ...],
    timer: Timer = one_call,
    step: Callable[[int], object] | None = None,
) -> Variant:
    """The variant ``layers`` (one shape) run: the reference unless an invariant variant decodes no slower
    (``widths[0]``, within TIE_MARGIN: the baseline must not pay for the verify) and verifies
    (``widths[-1]``) faster by more than TIE_MARGIN. Invariance is probed on the first layer's weights;
    with ``step``, the two most promising candidates of a cheap layer-pass timing are timed as whole steps."""
    invariant = [v for v in candidates(layers[0], dtype) if v != REFERENCE and row_invariant(layers[0], v, dtype)]
    if not invariant:
        return REFERENCE
    widths = (widths[0], widths[-1])
    times = measure(layers, [REFERENCE, *invariant], dtype, widths, timer, repeats=5)
    if step is not None:
        promising = [v for v in invariant if times[v][0] <= 1.5 * times[REFERENCE][0]]
        promising = sorted(promising, key=lambda v: times[v][1])[:2]
        times = measure(layers, [REFERENCE, *promising], dtype, widths, timer, step, repeats=5)
        _set_variant(layers, REFERENCE)
        invariant = promising
    decode_limit, verify_limit = (1 + TIE_MARGIN) * times[REFERENCE][0], (1 - TIE_MARGIN) * times[REFERENCE][1]
    fit = [v for v in invariant if times[v][0] <= decode_limit and times[v][1] < verify_limit]
    return min(fit, key=lambda v: times[v][1], default=REFERENCE)


def fingerprint(device: torch.device) -> str:
    """The machine a choice was measured on: CPU model, cores, torch version and threads, accelerator."""
    facts = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def _cpuinfo(field: str) -> str | None:
    """The value of ``field`` on /proc/cpuinfo's first line for it (Linux), None where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo, else what platform reports)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


# The /proc/cpuinfo flags that choose a kernel path (csrc/ops.cpp detect) or tell a reader what the CPU could do.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx_vnni", "avx512_bf16",
                "amx_int8", "amx_bf16")  # fmt: skip


def cpu_flags() -> list[str]:
    """Which of :data:`KERNEL_FLAGS` this CPU lists (Linux /proc/cpuinfo; empty elsewhere). A guest may list AMX
    flags it cannot run; the path taken (``kernel_path``) is what the CPU was found to run."""
    listed = set((_cpuinfo("flags") or "").split())
    return [flag for flag in KERNEL_FLAGS if flag in listed]


class ChoiceCache:
    """Kernel choices of one machine fingerprint, a JSON file of shape key -> variant name."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.choices: dict[str, str] = {}
        if path is not None and path.is_file():
            try:
                loaded = json.loads(path.read_text(encoding="utf-8"))
                self.choices = {k: v for k, v in loaded.items() if isinstance(v, str) and v in BY_NAME}
            except (OSError, ValueError, AttributeError):
                self.choices = {}  # an unreadable cache is measured again, never trusted

    def get(self, key: str) -> Variant | None:
        name = self.choices.get(key)
        return BY_NAME[name] if name else None

    def put(self, key: str, variant: Variant) -> None:
        self.choices[key] = variant.name
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.choices, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(self.path)


def default_cache(device: torch.device) -> ChoiceCache:
    from spectoolkit.embedded import cache_root

    return ChoiceCache(cache_root() / "kernels" / f"{fingerprint(device)}.json")


def choose_kernels(
    model: nn.Module,
    mode: str = "auto",
    widths: tuple[int, ...] = (1, 5),
    cache: ChoiceCache | None = None,
    timer: Timer = one_call,
    step: Callable[[int], object] | None = None,
) -> dict[str, str]:
    """Run every linear layer of ``model`` as a kernel variant (each held by a :class:`ChunkedLinear`,
    :func:`wrap_linears`); returns shape key -> variant name.

    ``mode="reference"`` installs the reference everywhere; ``"auto"`` reads each shape's choice from
    ``cache`` (by default the machine's cache file) or measures it (:func:`choose_variant`; ``step(w)``
    runs one model forward of width w, e.g. :func:`~spectoolkit.runtime.lone.model_step`). Shapes are measured
    largest first, the others on their current variant.
    """
    layers = wrap_linears(model)
    if not layers:
        return {}
    dtype = _activation_dtype(model)
    if mode == "auto" and cache is None:
        cache = default_cache(_device(layers[0][1]))
    groups: dict[str, list[ChunkedLinear]] = {}
    for _, layer in layers:
        groups.setdefault(shape_key(layer, dtype, widths), []).append(layer)
    chosen = {key: REFERENCE if mode == "reference" else cache.get(key) for key in groups}
    for key, group in groups.items():
        _set_variant(group, chosen[key] or REFERENCE)
    by_size = sorted(
        groups, key=lambda key: -len(groups[key]) * groups[key][0].in_features * groups[key][0].out_features
    )
    for key in by_size:
        if chosen[key] is None:
            chosen[key] = choose_variant(groups[key], dtype, widths, timer, step)
            cache.put(key, chosen[key])
            _set_variant(groups[key], chosen[key])
    return {key: variant.name for key, variant in chosen.items()}
