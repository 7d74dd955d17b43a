"""Whole-model step times per width (a decode step and verify windows) of GGUF models at float or int8 activations.

    python experiments/step_widths.py --activations int8            # the real pair (make pair), 1.5B and 0.5B
    python experiments/step_widths.py --activations float --models embedded

Each model runs :func:`~spectoolkit.runtime.lone.model_step` (one forward of w tokens on a 64-token context on the
eager runner, rolled back after: what a decode step, w = 1, or a verify window costs). Models and widths are
interleaved per repeat, the first repeat is warm-up, and the median is printed in ms and in units of the first
model's decode step (T₁). Run it alone: two 2-thread processes wreck each other's numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spectoolkit.pair import PAIR
from spectoolkit.runtime.lone import model_step
from spectoolkit.wiring.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--activations", choices=("float", "int8"), default="int8")
    parser.add_argument("--models", nargs="+", default=[model.name for model in PAIR], help="pair names or embedded")
    parser.add_argument("--widths", nargs="+", type=int, default=[1, 2, 4, 5, 8, 9])
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    cpu = torch.device("cpu")
    steps = {}
    for name in args.models:
        path = None if name == "embedded" else name
        steps[name] = model_step(load_model(path, "gguf", cpu, activations=args.activations).model)
    times: dict[tuple[str, int], list[float]] = {(name, w): [] for name in steps for w in args.widths}
    for repeat in range(args.repeats + 1):  # repeat 0 warms up
        for name, step in steps.items():
            for width in args.widths:
                began = time.perf_counter()
                step(width)
                if repeat:
                    times[name, width].append(time.perf_counter() - began)
    t1 = statistics.median(times[args.models[0], args.widths[0]])
    for name in steps:
        medians = {w: statistics.median(times[name, w]) for w in args.widths}
        cells = [f"V({w})={seconds * 1e3:.1f}ms/{seconds / t1:.2f}T1" for w, seconds in medians.items()]
        print(name, args.activations, " ".join(cells))


if __name__ == "__main__":
    main()
