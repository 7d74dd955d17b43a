"""RTN int8/int4 against fp32 and bf16 on the embedded SmolLM2-135M: step times and greedy agreement.

    python experiments/rtn_speed.py --repeats 20 --group-size 64

Times, per arm, (a) a decode step — ``LoneSequence.forward([tok], last_only=True)``
(:func:`~spectoolkit.runtime.lone.lone_sequence`: one sequence on the eager runner over a paged pool,
``chosen`` row mode, the forward a batch-1 arm runs) after a 200-token prefill — and (b) a 5-token
verify forward (all logits), rolling the sequence back to the prefill after each; arms interleave
within every repeat (the order alternates) and medians are reported with their ratio to fp32. Then
greedy top-1 agreement with fp32, teacher-forced, over (i) held reference responses of real prompts
(HumanEval solutions, ShareGPT replies) and (ii) fp32's own greedy continuations of those prompts —
the tokens a self-draft must predict in greedy speculative decoding. ``+head`` arms also quantize
``lm_head`` (``quantize_lm_head=True``); ``@G`` sets an arm's group size (``rtn-int8@-1``: per channel).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spectoolkit.checkpoints import resolve_checkpoint
from spectoolkit.config import WorkloadConfig
from spectoolkit.quant.rtn import load_quantized
from spectoolkit.runtime.lone import LoneSequence, lone_sequence
from spectoolkit.wiring.loading import load_model, load_tokenizer
from spectoolkit.workloads.prompts import encode_prompt, load_workload

CPU = torch.device("cpu")
PREFILL = 200
VERIFY_LEN = 5


def build_arm(name: str, group_size: int) -> torch.nn.Module:
    """fp32 / bf16 / rtn-int8 / rtn-int4, optionally ``@G`` (group size G, -1 per channel) and ``+head``."""
    if name in ("fp32", "bf16"):
        return load_model(None, name, CPU).model
    precision, _, head = name.partition("+")
    precision, _, group = precision.partition("@")
    group_size = int(group) if group else group_size
    return load_quantized(resolve_checkpoint(None), precision, CPU, group_size, quantize_lm_head=bool(head))


def time_steps(runners: dict[str, LoneSequence], repeats: int) -> dict[str, dict[str, float]]:
    """Median ms of a decode step and a verify forward per arm, arms interleaved."""
    prompt = list(range(1000, 1000 + PREFILL))
    for runner in runners.values():
        runner.reset()
        runner.forward(prompt, last_only=True)
    samples = {name: {"decode": [], "verify": []} for name in runners}
    names = list(runners)
    for repeat in range(repeats + 2):  # the first two are warm-up
        for name in names if repeat % 2 == 0 else names[::-1]:
            runner = runners[name]
            for kind, tokens, last_only in (("decode", [5], True), ("verify", list(range(5, 5 + VERIFY_LEN)), False)):
                start = time.perf_counter()
                runner.forward(tokens, last_only=last_only)
                elapsed = time.perf_counter() - start
                runner.truncate(PREFILL)
                if repeat >= 2:
                    samples[name][kind].append(elapsed * 1e3)
    return {name: {kind: statistics.median(times) for kind, times in row.items()} for name, row in samples.items()}


@torch.inference_mode()
def argmax_ids(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Teacher-forced greedy predictions [len(ids)] of one full-sequence forward."""
    return model(input_ids=torch.tensor([ids])).logits[0].float().argmax(-1)


@torch.inference_mode()
def greedy_continuation(model: torch.nn.Module, ids: list[int], num_tokens: int) -> list[int]:
    runner = lone_sequence(model, positions=len(ids) + num_tokens)
    logits = runner.forward(ids, last_only=True)
    out = []
    for _ in range(num_tokens):
        out.append(int(logits.argmax()))
        logits = runner.forward([out[-1]], last_only=True)
    return out


def agreement(models: dict[str, torch.nn.Module], sequences: list[tuple[list[int], int]]) -> dict[str, float]:
    """Fraction of scored positions where each arm's argmax equals fp32's; (ids, first scored index)."""
    hits = dict.fromkeys(models, 0)
    total = 0
    for ids, start in sequences:
        reference = argmax_ids(models["fp32"], ids)[start - 1 : -1]
        total += reference.numel()
        for name, model in models.items():
            hits[name] += int((argmax_ids(model, ids)[start - 1 : -1] == reference).sum())
    return {name: count / total for name, count in hits.items()} | {"positions": total}


def text_sequences(tokenizer, fp32_model, per_source: int, max_response: int, continuation: int):
    """(reference-response sequences, fp32-continuation sequences) over HumanEval + ShareGPT prompts."""
    requests = []
    for kind in ("humaneval", "sharegpt"):
        requests += load_workload(WorkloadConfig(kind=kind, num_prompts=per_source))
    held, own = [], []
    for request in requests:
        prompt = encode_prompt(tokenizer, request, True)
        response = tokenizer(request.reference or "", add_special_tokens=False).input_ids[:max_response]
        held.append((prompt + response, len(prompt)))
        own.append((prompt + greedy_continuation(fp32_model, prompt, continuation), len(prompt)))
    return held, own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="fp32,bf16,rtn-int8,rtn-int4,rtn-int8+head,rtn-int4+head")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--prompts-per-source", type=int, default=2)
    parser.add_argument("--max-response", type=int, default=60, help="reference tokens scored per prompt")
    parser.add_argument("--continuation", type=int, default=50, help="fp32 greedy tokens scored per prompt")
    parser.add_argument("--skip-agreement", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    names = args.arms.split(",")
    if "fp32" not in names:
        names.insert(0, "fp32")
    models = {name: build_arm(name, args.group_size) for name in names}
    sequences = {name: lone_sequence(model, positions=PREFILL + VERIFY_LEN) for name, model in models.items()}
    steps = time_steps(sequences, args.repeats)
    base = steps["fp32"]
    print(f"threads={torch.get_num_threads()} group_size={args.group_size} repeats={args.repeats} (medians)")
    print(f"{'arm':<20}{'decode ms':>10}{'x fp32':>8}{'verify5 ms':>12}{'x fp32':>8}")
    for name, row in steps.items():
        print(
            f"{name:<20}{row['decode']:>10.1f}{row['decode'] / base['decode']:>8.2f}"
            f"{row['verify']:>12.1f}{row['verify'] / base['verify']:>8.2f}"
        )
    if args.skip_agreement:
        return
    tokenizer = load_tokenizer(None)
    held, own = text_sequences(tokenizer, models["fp32"], args.prompts_per_source, args.max_response, args.continuation)
    for label, sequences in (("reference text", held), ("fp32 greedy continuation", own)):
        scores = agreement(models, sequences)
        positions = scores.pop("positions")
        print(f"top-1 agreement with fp32, {label} ({positions} positions):")
        print("  " + "  ".join(f"{name}={value:.1%}" for name, value in scores.items() if name != "fp32"))


if __name__ == "__main__":
    main()
