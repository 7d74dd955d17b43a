"""Which kernel a linear runs when a batched serving step hands it many rows, chosen by measurement.

In a serving step (row mode ``"plain"``, :data:`~spectoolkit.runtime.step.ROW_MODES`) every linear gets the
step's T rows in one call. For a plain fp32 ``nn.Linear`` on the CPU two kernels compute it: the
layer's own ``F.linear`` (the reference) and ``W @ Xᵀ`` (``torch.mm`` in the other orientation), and
which is faster depends on T and on the machine — measured on one 2-core Xeon: ``F.linear`` is faster
up to 8 rows, ``W @ Xᵀ`` 1.5–2.5× faster at 16–32. So per layer shape both are timed at :data:`ROWS`
over all the layers of that shape (the weights stream as in a step), interleaved per repeat;
``gemm_from`` is the smallest row count from which ``W @ Xᵀ`` wins by more than ``TIE_MARGIN`` at it
and at every larger count measured (None: never). Choices are cached per machine fingerprint beside
the row-invariant choices (``<cache>/kernels/<fingerprint>.batched.json``); a choice made on one
machine is never reused on another.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from spectoolkit.kernels.kernel_choice import (
    TIE_MARGIN,
    ChunkedLinear,
    _gemm,
    fingerprint,
    library_layer,
    linear_layers,
)

ROWS = (2, 4, 8, 16, 32, 64)
REPEATS = 5


def applies(layer: nn.Module) -> bool:
    """A plain fp32 CPU ``nn.Linear`` running a chosen variant (``W @ Xᵀ`` is only defined there)."""
    if not isinstance(layer, ChunkedLinear):
        return False
    inner = layer.layer
    return type(inner) is nn.Linear and inner.weight.dtype == torch.float32 and inner.weight.device.type == "cpu"


def batched_key(layer: nn.Linear) -> str:
    return f"batched:{layer.in_features}x{layer.out_features}:bias={layer.bias is not None}:rows={ROWS}"


@torch.inference_mode()
def measure_gemm_from(layers: list[nn.Linear], rows: tuple[int, ...] = ROWS, repeats: int = REPEATS) -> int | None:
    """The smallest row count from which ``W @ Xᵀ`` beats ``F.linear`` on ``layers`` (one shape) for good."""
    samples: dict[tuple[str, int], list[float]] = {}
    layers = [library_layer(layer) for layer in layers]  # the library's nn.Linear, timed without the wrapper
    inputs = {m: torch.randn(m, layers[0].in_features, generator=torch.Generator().manual_seed(m)) for m in rows}
    kernels = {"linear": lambda layer, x: layer.forward(x), "gemm": _gemm}
    for repeat in range(repeats + 1):  # pass 0 warms up
        for name in kernels if repeat % 2 else list(kernels)[::-1]:
            for m in rows:
                start = time.perf_counter()
                for layer in layers:
                    kernels[name](layer, inputs[m])
                if repeat:
                    samples.setdefault((name, m), []).append(time.perf_counter() - start)
    wins = [statistics.median(samples["gemm", m]) < (1 - TIE_MARGIN) * statistics.median(samples["linear", m])
            for m in rows]  # fmt: skip
    for index, m in enumerate(rows):
        if all(wins[index:]):
            return m
    return None


def choose_batched_kernels(model: nn.Module, cache_path: Path | None | str = "default") -> dict[str, int | None]:
    """Measure (or read) ``gemm_from`` per linear shape of ``model`` and install it on its layers."""
    groups: dict[str, list[nn.Linear]] = {}
    for _, layer in linear_layers(model):
        if applies(layer):
            groups.setdefault(batched_key(layer), []).append(layer)
    if not groups:
        return {}
    if cache_path == "default":
        from spectoolkit.embedded import cache_root

        cache_path = cache_root() / "kernels" / f"{fingerprint(torch.device('cpu'))}.batched.json"
    cached = _read(cache_path)
    chosen = {}
    for key, layers in groups.items():
        if key not in cached:
            cached[key] = measure_gemm_from(layers)
            _write(cache_path, cached)
        chosen[key] = cached[key]
        for layer in layers:
            layer.gemm_from = chosen[key]
    return chosen


def _read(path: Path | None) -> dict[str, int | None]:
    if path is None or not Path(path).is_file():
        return {}
    try:
        loaded = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # an unreadable cache is measured again, never trusted
    if not isinstance(loaded, dict):
        return {}
    return {k: v for k, v in loaded.items() if v is None or (isinstance(v, int) and not isinstance(v, bool))}


def _write(path: Path | None, choices: dict[str, int | None]) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(choices, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)
