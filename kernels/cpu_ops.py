"""Build and load our CPU kernels (``kernels/csrc``): ``torch.ops.spectoolkit.linear`` / ``paged_attention``.

One build runs on every x86-64 CPU (DESIGN §7): the kernels are compiled for AVX-512 (with and without VNNI),
AVX2+FMA (with and without AVX-VNNI) and plain scalar code in one library (no ``-march=native``), and each
call takes the best path this CPU has (:func:`best_isa`) unless told otherwise — the tests run every path the
CPU can and compare bits. ``SPECTOOLKIT_ISA=scalar|avx2|avx512|avx512-vnni|avx-vnni`` pins a run to one path
(to reproduce another machine's path; every path gives the same bits). The library is built once per source
version with torch's C++ extension loader (gcc, ~30 s) and cached under torch's extensions directory;
``-ffp-contract=off`` keeps the compiler from fusing or reordering any multiply-add the kernels do not spell out.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

from spectoolkit.errors import SpecToolkitError, first_line

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("ops.cpp", "isa_body.inc", "int_body.inc", "layer.inc")
# The paths, by index (the ops' ``isa`` argument). Not an order: an AVX-512 CPU may lack AVX-VNNI and the other
# way round. The VNNI paths differ from their base paths only in the integer-activation linear's dot product.
ISAS = ("scalar", "avx2", "avx512", "avx512-vnni", "avx-vnni")
HEAD_DIMS = tuple(range(16, 257, 16))  # head dims the attention, rotary and norm kernels take (csrc MAX_HEAD_DIM)


@functools.cache
def load() -> None:
    """Build (first time for this source, ~1 min) and load the kernels; registers the ops and their fakes."""
    from torch.utils.cpp_extension import load as load_extension

    digest = hashlib.sha256(b"".join((SOURCE_DIR / name).read_bytes() for name in SOURCES)).hexdigest()[:10]
    try:
        load_extension(
            name=f"spectoolkit_cpu_{digest}",
            sources=[str(SOURCE_DIR / "ops.cpp")],
            extra_cflags=["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=os.environ.get("SPECTOOLKIT_VERBOSE_BUILD") == "1",
        )
    except (RuntimeError, OSError) as exc:  # no compiler, or a failed build
        raise SpecToolkitError(
            f"cannot build spectoolkit's CPU kernels ({first_line(exc)}): install gcc, or run with "
            "runtime.kernels=reference"
        ) from None
    torch.library.register_fake("spectoolkit::linear")(_fake_linear)
    for name in ("paged_attention", "rms_norm", "silu_mul", "rotary", "layer_tail"):  # the first argument's shape
        torch.library.register_fake(f"spectoolkit::{name}")(_fake_like_first)
    torch.library.register_fake("spectoolkit::attn_in")(_fake_attn_in)
    torch.library.register_fake("spectoolkit::decoder_layers")(_fake_decoder_layers)
    torch.library.register_fake("spectoolkit::kv_encode")(_fake_kv_encode)
    torch.library.register_fake("spectoolkit::quantize_activations")(_fake_quantize_activations)


def best_isa() -> int:
    """The path calls take: the best this CPU runs (index into :data:`ISAS`), or ``SPECTOOLKIT_ISA``'s."""
    load()
    pinned = os.environ.get("SPECTOOLKIT_ISA")
    if not pinned:
        return torch.ops.spectoolkit.cpu_isa()
    runs = available_isas()
    if pinned not in runs:
        raise SpecToolkitError(
            f"SPECTOOLKIT_ISA={pinned}: this CPU runs {', '.join(runs)}; unset it or pick one of those"
        )
    return ISAS.index(pinned)


def available_isas() -> tuple[str, ...]:
    """Every path this CPU can run (the scalar one always)."""
    load()
    return tuple(name for index, name in enumerate(ISAS) if torch.ops.spectoolkit.isa_available(index))


def isa_name() -> str:
    """The name of the path calls take (:func:`best_isa`)."""
    return ISAS[best_isa()]


VNNI_BASE = {"avx512-vnni": "avx512", "avx-vnni": "avx2"}  # the VNNI paths run their base path's float kernels


def kernel_paths() -> dict[str, str]:
    """Which path each family of kernels takes here: the integer-activation linear the chosen path itself, the
    float-activation linear, attention and the elementwise kernels its base (a VNNI path differs only in the
    integer dot product)."""
    name = isa_name()
    return {"int8-activation linear": name, "float linear, attention, norms": VNNI_BASE.get(name, name)}


def _fake_linear(x, w, scales, zeros, bias, n, group, isa=-1, fmt=0) -> torch.Tensor:
    """x [M, K] -> [M, n] fp32, for tracing."""
    return x.new_empty((x.shape[0], n), dtype=torch.float32)


def _fake_attn_in(hidden, norm_w, eps, qkv, meta, cos, sin, heads, kv_heads, head_dim, *args):
    """hidden [W, E] -> q [W, Hq, D], k and v [W, Hkv, D] fp32, for tracing."""
    rows = hidden.shape[0]
    shapes = ((rows, heads, head_dim), (rows, kv_heads, head_dim), (rows, kv_heads, head_dim))
    return tuple(hidden.new_empty(shape, dtype=torch.float32) for shape in shapes)


def _fake_decoder_layers(hidden, cos, sin, weights, meta, eps, stores, write, key_slots, starts, *rest):
    """hidden [W, E] -> (hidden [W, E], the captured states [W, len(capture) * E]), for tracing."""
    capture = rest[4]  # after heads, kv_heads, head_dim, scale
    return torch.empty_like(hidden), hidden.new_empty((hidden.shape[0], len(capture) * hidden.shape[1]))


def _fake_kv_encode(rows, store, scaled):
    """rows [W, H, D] -> (codes in the store's dtype, scales [W, H, 1] or empty), for tracing."""
    scale_shape = (rows.shape[0], rows.shape[1], 1) if scaled else (0,)
    return rows.new_empty(rows.shape, dtype=store.dtype), rows.new_empty(scale_shape, dtype=torch.float32)


def _fake_quantize_activations(x, isa=0):
    """x [M, K] -> codes int8 [M, K], scales fp32 [M, K / 32], for tracing."""
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0], x.shape[1] // 32), dtype=torch.float32)


def _fake_like_first(x, *args) -> torch.Tensor:
    """The output's shape for tracing: the first argument's (paged_attention's q [W, Hq, D], a norm's x, ...)."""
    return torch.empty_like(x)
