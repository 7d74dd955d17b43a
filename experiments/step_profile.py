"""Where a decode step's time goes: weights, attention, other kernels, and Python/dispatch overhead.

    python experiments/step_profile.py --precisions fp32 rtn-int4 --steps 20

For each precision, a lone sequence (:func:`~spectoolkit.runtime.lone.lone_sequence`: one sequence over a
paged pool, the forward a batch-1 arm runs) decodes ``--steps`` one-token steps after a prompt on each
runner: ``eager`` (``runtime.compile=false``: :class:`~spectoolkit.runtime.eager.EagerRunner`, the model
loaded with the measured kernel choice) and ``compiled`` (:class:`~spectoolkit.runtime.compiled.CompiledRunner`,
its width-1 graph compiled first, the model loaded without the eager kernel choice). ``torch.profiler``
attributes the self time of every operator to a class:

- ``linear``: the weight matmuls (``aten::mm``/``addmm``/``linear``, MKL, torch's int4/int8 kernels,
  ``spectoolkit::row_linear``) — the part bounded by how fast the weights stream from memory;
- ``attention``: SDPA, ``bmm``, ``spectoolkit::paged_attention``;
- ``kernels``: everything else that computes (norms, rotary, activations, copies, the pool's KV writes;
  in the compiled step, inductor's generated C++ is counted here);
- ``overhead``: the rest of the step's wall time — Python, dispatch, guards, allocation — which is
  what compiling removes.

A profiled step is slower than an unprofiled one; the step time printed first is measured without
the profiler, and the shares are the profiler's. ``bound`` is the weights' bytes over this
machine's measured streaming rate (a one-row pass over every linear weight, timed here).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from spectoolkit.runtime.lone import LoneSequence, lone_sequence
from spectoolkit.wiring.loading import load_model

LINEAR = (
    "aten::mm",
    "aten::addmm",
    "aten::linear",
    "mkl::",
    "_weight_int4pack",
    "_weight_int8pack",
    "row_linear",
    "spectoolkit::linear",
)
ATTENTION = ("attention", "aten::bmm")  # SDPA, spectoolkit::paged_attention
PROMPT = list(range(100, 180))


def _classify(name: str) -> str:
    if any(part in name for part in LINEAR):
        return "linear"
    if any(part in name for part in ATTENTION):
        return "attention"
    return "kernels"


def _steps(runner: LoneSequence, count: int) -> None:
    for _ in range(count):
        runner.forward([5])
    runner.truncate(len(PROMPT))


def _split(runner: LoneSequence, steps: int, top: int = 0) -> dict[str, float]:
    """ms per step: measured wall time, then the profiler's classes."""
    runner.reset()
    runner.forward(PROMPT, last_only=True)
    _steps(runner, 3)
    start = time.perf_counter()
    _steps(runner, steps)
    wall = (time.perf_counter() - start) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        began = time.perf_counter()
        _steps(runner, steps)
        profiled = (time.perf_counter() - began) / steps * 1e3
    shares = dict.fromkeys(("linear", "attention", "kernels"), 0.0)
    for event in prof.key_averages():
        if event.key.startswith(("## Call CompiledFxGraph", "Torch-Compiled Region", "TorchDynamo")):
            if event.key.startswith("## Call CompiledFxGraph"):
                shares["kernels"] += event.self_cpu_time_total / 1e3 / steps  # inductor's generated code
            continue
        shares[_classify(event.key)] += event.self_cpu_time_total / 1e3 / steps
    shares["overhead"] = max(profiled - sum(shares.values()), 0.0)
    if top:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    return {"step": wall, **shares}


def _bound(model: torch.nn.Module) -> tuple[float, float]:
    """(weight MB, ms of one pass over every float linear weight with one row): the streaming floor here."""
    weights = [m.weight for m in model.modules() if type(m) is torch.nn.Linear]
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights}
    for _ in range(2):
        start = time.perf_counter()
        for w in weights:
            F.linear(inputs[w.shape[1]], w)
        seconds = time.perf_counter() - start
    return sum(w.numel() * w.element_size() for w in weights) / 1e6, seconds * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "rtn-int4"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=0, help="also print the N operators with the most self time")
    args = parser.parse_args()
    cpu = torch.device("cpu")
    print(f"{'model':<22} {'step ms':>8} {'linear':>7} {'attn':>6} {'kernels':>8} {'overhead':>9}")
    for precision in args.precisions:
        loaded = load_model(None, precision, cpu, group_size=32, kernels=None)  # for the compiled runner
        if precision == "fp32":
            megabytes, ms = _bound(loaded.model)
            print(f"fp32 weights {megabytes:.0f} MB stream in {ms:.1f} ms here ({megabytes / ms:.1f} GB/s, MKL gemv)")
        positions = len(PROMPT) + max(args.steps, 3)
        compiled = lone_sequence(loaded.model, positions=positions, compiled=True)
        compiled.runner.warm((1,))  # the decode step's graph; the prompt runs through it too
        eager = lone_sequence(load_model(None, precision, cpu, group_size=32).model, positions=positions)
        for name, runner in (("eager", eager), ("compiled", compiled)):
            split = _split(runner, args.steps, args.top)
            label = f"{precision} {name}"
            print(f"{label:<22} {split['step']:>8.1f} {split['linear']:>7.1f} {split['attention']:>6.1f} "
                  f"{split['kernels']:>8.1f} {split['overhead']:>9.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
