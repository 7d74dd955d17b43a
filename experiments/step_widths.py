"""Whole-model step times per width (a decode step and verify windows) of GGUF models at float or int8 activations.

    python experiments/step_widths.py --activations int8            # the real pair (make pair), 1.5B and 0.5B
    python experiments/step_widths.py --activations float --models embedded
    python experiments/step_widths.py --precision rtn-int4 --models embedded --layouts compact wide

Each model runs :func:`~spectoolkit.runtime.lone.model_step` (one forward of w tokens on a 64-token context on the
eager runner, rolled back after: what a decode step, w = 1, or a verify window costs). Models and widths are
interleaved per repeat, the first repeat is warm-up, and the median is printed in ms and in units of the first
model's decode step (T₁). Run it alone: two 2-thread processes wreck each other's numbers.

Per model it also prints the bytes a decode step streams (linears and head), for ``gguf`` against the GGUF file's
bytes of the same tensors, and T₁ against streamed bytes / the read bandwidth measured between repeats in this process
(the floor). ``--layouts compact wide`` loads each model twice, the second with every format at its own size (GGUF,
rtn, GPTQ) widened back to the wide int8-activation layout of before issue 55, interleaved in the same repeats.
``--precision`` loads another precision (``rtn-int4``, ``rtn-int8``, GPTQ ``int4``; ``--group-size``,
``--quantize-head`` as ``draft.group_size`` / ``draft.quantize_head``). ``--prefetch 0 auto`` times each model with
each weight-stream prefetch distance in bytes (``auto``: the one measured at load, :mod:`spectoolkit.kernels.prefetch`;
0: none), interleaved in the same repeats; the default runs the measured one alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from spectoolkit.bench.protocol.conditions import read_bandwidth_gbs
from spectoolkit.embedded import gguf_source
from spectoolkit.kernels import prefetch
from spectoolkit.kernels.packing import widen_formats
from spectoolkit.pair import PAIR
from spectoolkit.quant.gguf_native import TensorReader
from spectoolkit.runtime.lone import model_step
from spectoolkit.wiring.loading import load_model


def file_bytes(path: str) -> int:
    """Bytes of the GGUF tensors a decode step reads: every 2-D one but the input embedding (the head when tied)."""
    reader = TensorReader(gguf_source(Path(path)))
    names = {tensor.name for tensor in reader.tensors}
    tied = "output.weight" not in names
    return sum(
        int(tensor.n_bytes)
        for tensor in reader.tensors
        if len(tensor.shape) == 2 and (tensor.name != "token_embd.weight" or tied)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--activations", choices=("float", "int8"), default="int8")
    parser.add_argument("--models", nargs="+", default=[model.name for model in PAIR], help="pair names or embedded")
    parser.add_argument("--widths", nargs="+", type=int, default=[1, 2, 4, 5, 8, 9])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--layouts", nargs="+", choices=("compact", "wide"), default=["compact"])
    parser.add_argument("--precision", choices=("gguf", "rtn-int4", "rtn-int8", "int4"), default="gguf")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--quantize-head", action="store_true")
    parser.add_argument("--prefetch", nargs="+", default=["auto"], help="bytes ahead, or auto (the measured one)")
    args = parser.parse_args()
    cpu = torch.device("cpu")
    steps, streamed = {}, {}
    for name in args.models:
        path = None if name == "embedded" else name
        for layout in args.layouts:
            loaded = load_model(path, args.precision, cpu, args.group_size, quantize_head=args.quantize_head,
                                activations=args.activations)  # fmt: skip
            if layout == "wide":
                widen_formats(loaded.model)
            key = f"{name}[{layout}]" if len(args.layouts) > 1 else name
            step, nbytes = model_step(loaded.model), loaded.streamed_bytes()
            for ahead in args.prefetch:
                arm = f"{key}[prefetch {ahead}]" if len(args.prefetch) > 1 else key
                steps[arm], streamed[arm] = _prefetched(step, ahead), nbytes
            if args.precision != "gguf":
                print(f"{key} {args.precision}: streams {nbytes / 1e6:.1f} MB a step ({loaded.kernels})")
                continue
            in_file = file_bytes(loaded.path)
            print(
                f"{key}: streams {nbytes / 1e6:.1f} MB a step; the GGUF file's tensors "
                f"{in_file / 1e6:.1f} MB ({nbytes / in_file:.3f}x)"
            )
    print(f"weight prefetch measured at load: {prefetch.current()}")
    names = list(steps)
    times: dict[tuple[str, int], list[float]] = {(name, w): [] for name in steps for w in args.widths}
    bandwidth: list[float] = []
    for repeat in range(args.repeats + 1):  # repeat 0 warms up
        if repeat:
            bandwidth.append(read_bandwidth_gbs(repeats=1))
        for name, step in steps.items():
            for width in args.widths:
                began = time.perf_counter()
                step(width)
                if repeat:
                    times[name, width].append(time.perf_counter() - began)
    t1 = statistics.median(times[names[0], args.widths[0]])
    gbs = statistics.median(bandwidth)
    print(f"read bandwidth (median of {len(bandwidth)}, between repeats): {gbs:.1f} GB/s")
    for name in steps:
        medians = {w: statistics.median(times[name, w]) for w in args.widths}
        cells = [f"V({w})={seconds * 1e3:.1f}ms/{seconds / t1:.2f}T1" for w, seconds in medians.items()]
        floor = streamed[name] / (gbs * 1e9)
        print(
            name,
            args.activations,
            " ".join(cells),
            f"| floor {floor * 1e3:.1f}ms, V(1)/floor {medians[args.widths[0]] / floor:.2f}",
        )


def _prefetched(step, ahead: str):
    """``step`` run with the linears prefetching ``ahead`` bytes (``auto``: what :mod:`prefetch` chose at load)."""

    def run(width: int) -> object:
        torch.ops.spectoolkit.set_stream_prefetch(prefetch.current().distance if ahead == "auto" else int(ahead))
        return step(width)

    return run


if __name__ == "__main__":
    main()
