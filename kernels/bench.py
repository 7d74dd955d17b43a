"""``python -m spectoolkit.kernels.bench``: each Triton kernel against its torch path, on the roofline.

For every kernel and shape (each kernel module's ``bench_cases``) it prints the median time of the
kernel and of the torch path (CUDA events, after warm-up, both interleaved call by call), the
kernel's achieved bandwidth ``bytes_moved / time`` and that as a fraction of the device's peak HBM
bandwidth (a table of known GPUs, or ``--peak-gbps``). Decode is memory-bound, so the fraction of
peak is the number to read. ``--decode-step`` also times one decode step of a Llama-3.2-1B-shaped
model (random weights, bf16, 512 cached tokens) so the verification kernel's cost can be read as a
share of a step. Needs a CUDA GPU; the CPU interpreter is for correctness tests only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch

from spectoolkit.kernels.runtime import BenchCase, kernels_usable

# Peak HBM bandwidth in GB/s (vendor data sheets), matched against torch.cuda.get_device_name().
PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350, "GH200": 4000,
             "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "L40": 864, "A10G": 600,
             "A10": 600, "L4": 300, "RTX 4090": 1008, "RTX 3090": 936, "V100": 900, "T4": 320}  # fmt: skip
KERNELS = ("verify", "quant_matmul", "kv_attention")


def peak_gbps(name: str) -> float | None:
    """The peak of the first table entry contained in the device name (longest names first)."""
    for key in sorted(PEAK_GBPS, key=len, reverse=True):
        if key in name:
            return float(PEAK_GBPS[key])
    return None


def time_pair(first: Callable[[], object], second: Callable[[], object], repeat: int, warmup: int):
    """Median milliseconds of two callables, measured alternately with CUDA events."""
    for _ in range(warmup):
        first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for fn, out in ((first, times[0]), (second, times[1])):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
    return statistics.median(times[0]), statistics.median(times[1])


def cases(device: torch.device, names: tuple[str, ...]) -> list[BenchCase]:
    import importlib

    found = []
    for name in names:
        found += importlib.import_module(f"spectoolkit.kernels.{name}").bench_cases(device)
    return found


def decode_step_ms(device: torch.device, context: int = 512, repeat: int = 20) -> float:
    """Median ms of one bf16 decode step of a Llama-3.2-1B-shaped model (random weights) at ``context``."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=4096)  # fmt: skip
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()
    prompt = torch.randint(0, config.vocab_size, (1, context), device=device)
    token = prompt[:, -1:]
    times = []
    with torch.inference_mode():
        for index in range(repeat + 3):
            cache = DynamicCache()
            model(prompt[:, :-1], past_key_values=cache, use_cache=True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(token, past_key_values=cache, use_cache=True)
            end.record()
            end.synchronize()
            if index >= 3:
                times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spectoolkit.kernels.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--peak-gbps", type=float, default=None, help="the device's peak HBM bandwidth")
    parser.add_argument("--decode-step", action="store_true", help="also time a Llama-3.2-1B-shaped decode step")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    if not kernels_usable(device):
        print("error: the kernel benchmark needs a CUDA GPU with Triton; without one, the kernels are checked "
              "for correctness under TRITON_INTERPRET=1 by `make test` (tests/kernels)", file=sys.stderr)  # fmt: skip
        return 1
    name = torch.cuda.get_device_name(device)
    peak = args.peak_gbps or peak_gbps(name)
    print(f"# {name}; peak HBM bandwidth {f'{peak:.0f} GB/s' if peak else 'unknown (pass --peak-gbps)'}")
    print("| kernel | shape | triton µs | torch µs | torch / triton | GB/s | % of peak |")
    print("|---|---|---|---|---|---|---|")
    for case in cases(device, tuple(args.kernels)):
        kernel_ms, torch_ms = time_pair(case.run_triton, case.run_torch, args.repeat, args.warmup)
        gbps = case.bytes_moved / (kernel_ms * 1e-3) / 1e9
        share = f"{100 * gbps / peak:.1f}%" if peak else "n/a"
        print(f"| {case.kernel} | {case.shape} | {kernel_ms * 1e3:.1f} | {torch_ms * 1e3:.1f} | "
              f"{torch_ms / kernel_ms:.2f}× | {gbps:.0f} | {share} |", flush=True)  # fmt: skip
    if args.decode_step:
        print(f"\nLlama-3.2-1B-shaped bf16 decode step (512 cached tokens): {decode_step_ms(device):.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
