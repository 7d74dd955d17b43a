"""Our kernels on this machine: decode tok/s against stock transformers, V(k)/T₁, and the stream bandwidth.

    python experiments/kernel_bench.py --precisions fp32 rtn-int4 --rounds 3 --tokens 48
    python experiments/kernel_bench.py --precisions int4 nf4 --group-size 64 --eager-only   # GPTQ, bitsandbytes

Arms (each a lone sequence, :func:`~spectoolkit.runtime.lone.lone_sequence`, over the embedded model):
``stock`` — transformers ``generate`` (greedy, the model as loaded, no packing: MKL/oneDNN); ``eager`` and
``compiled`` — our runners on the packed model. Every round runs every arm once, in rotated order, and the
table gives the median per arm. ``T1`` is one decode step after a 100-token context; ``V(k)`` a forward
of k rows at the same place (rolled back), so ``V(k)/T1`` is what a verify of γ + 1 = k rows costs in
decode steps. ``stream`` is a 512 MB fp32 read (``sum``), the bandwidth a decode step of streamed
weights can reach; ``weights`` the packed bytes a step reads. The stream is measured again in every round,
right after that round's T1 (a shared machine's bandwidth moves between runs), and ``of stream`` is the
median over rounds of reads / that round's stream. Compile time of the compiled runner's
widths is printed once (inductor caches it on disk: a second run takes seconds).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spectoolkit.kernels.kernel_choice import cpu_model
from spectoolkit.kernels.packing import packed_bytes
from spectoolkit.runtime.lone import lone_sequence
from spectoolkit.wiring.loading import load_model

CONTEXT = [(7 + 13 * index) % 49000 + 100 for index in range(100)]
WIDTHS = (1, 2, 4, 8)


def stream_gbps(repeats: int = 7) -> float:
    data = torch.ones(128 * 1024 * 1024)  # 512 MB, touched
    best = min(_timed(data.sum) for _ in range(repeats))
    return data.numel() * 4 / best / 1e9


def _timed(call) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


@torch.inference_mode()
def decode_rate(seq, tokens: int) -> float:
    seq.reset()
    logits = seq.forward(CONTEXT, last_only=True)
    began = time.perf_counter()
    for _ in range(tokens):
        logits = seq.forward([int(logits[-1].argmax())])
    return tokens / (time.perf_counter() - began)


@torch.inference_mode()
def window_times(seq, repeats: int = 5) -> dict[int, float]:
    seq.reset()
    seq.forward(CONTEXT, last_only=True)
    times = {}
    for width in WIDTHS:
        samples = []
        for _ in range(repeats):
            samples.append(_timed(lambda w=width: seq.forward(CONTEXT[:w])))
            seq.truncate(len(CONTEXT))
        times[width] = min(samples)
    return times


@torch.inference_mode()
def stock_rate(model, tokens: int) -> float:
    ids = torch.tensor([CONTEXT])
    began = time.perf_counter()
    model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return tokens / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precisions", nargs="+", default=["fp32", "rtn-int4"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--group-size", type=int, default=32, help="rtn-*/int4 (GPTQ) group size")
    parser.add_argument("--eager-only", action="store_true", help="skip the compiled arm (and its compiling)")
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}, ISA {torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()}")
    print(f"stream: {stream_gbps():.1f} GB/s")
    for precision in args.precisions:
        group = args.group_size
        stock = load_model(None, precision, torch.device("cpu"), group_size=group, kernels="reference").model
        ours = load_model(None, precision, torch.device("cpu"), group_size=group).model
        runners = {"eager": lone_sequence(ours, positions=512)}
        began = time.perf_counter()
        if not args.eager_only:
            runners["compiled"] = lone_sequence(ours, positions=512, compiled=True)
            runners["compiled"].runner.warm(WIDTHS)
        print(f"{precision}: weights {packed_bytes(ours) / 1e6:.0f} MB; compiled widths {WIDTHS} in "
              f"{time.perf_counter() - began:.0f} s")  # fmt: skip
        arms = {"stock": (stock_rate, stock)} | {name: (decode_rate, seq) for name, seq in runners.items()}
        rates: dict[str, list[float]] = {name: [] for name in arms}
        windows: dict[str, list[dict[int, float]]] = {name: [] for name in runners}
        streams: list[float] = []
        for round_index in range(args.rounds):
            names = list(arms)[round_index % len(arms) :] + list(arms)[: round_index % len(arms)]
            for name in names:
                measure, subject = arms[name]
                rates[name].append(measure(subject, args.tokens))
            for name, seq in runners.items():
                windows[name].append(window_times(seq))
            streams.append(stream_gbps(repeats=3))
        stock_median = statistics.median(rates["stock"])
        for name, values in rates.items():
            rate = statistics.median(values)
            line = f"  {name:9s} {rate:6.1f} tok/s  ({rate / stock_median:.2f}x stock)"
            if name in windows:
                t1 = statistics.median(w[1] for w in windows[name])
                ratios = " ".join(
                    f"V({w})/T1={statistics.median(x[w] for x in windows[name]) / t1:.2f}" for w in WIDTHS
                )
                share = statistics.median(
                    packed_bytes(ours) / w[1] / 1e9 / stream for w, stream in zip(windows[name], streams, strict=True)
                )
                line += (
                    f"  T1 {t1 * 1e3:.1f} ms  {ratios}  reads {packed_bytes(ours) / t1 / 1e9:.1f} GB/s "
                    f"({share:.0%} of stream; rounds' stream {min(streams):.1f}-{max(streams):.1f} GB/s)"
                )
            print(line, flush=True)


if __name__ == "__main__":
    main()
