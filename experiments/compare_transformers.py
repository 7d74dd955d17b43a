"""Our decode loops against transformers' own, same model, prompts and greedy settings, interleaved.

    python experiments/compare_transformers.py --workload humaneval --prompts 6 --max-new-tokens 96

Prints tokens/s of (a) our baseline vs ``model.generate`` and (b) our ``draft=ngram`` vs
transformers' prompt-lookup decoding (``prompt_lookup_num_tokens=γ``), as ratios measured in one
run with the arms alternating per prompt. transformers runs the checkpoint as a user would load it
(``AutoModelForCausalLM.from_pretrained``); ours are the one engine's batch-1 arms
(:class:`~spectoolkit.serving.one.OneRequestEngine` on the eager runner over a paged pool), on the model
as ``load_model`` loads it (the linear kernel variants measured on this machine:
kernels/kernel_choice.py). ``ours_plain`` is the same engine on transformers' model (stock
linears), which isolates the decode loop and paged attention from the kernel choice. Outputs are
compared too (a mismatch between different kernels is a near-tie question, not a loop bug).
"""

from __future__ import annotations

import argparse
import time

import torch

from spectoolkit.config import WorkloadConfig
from spectoolkit.drafting import NgramDrafter
from spectoolkit.policy import FixedPolicy
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import Runner, make_runner
from spectoolkit.serving.engine import ContinuousEngine
from spectoolkit.serving.one import OneRequestEngine
from spectoolkit.serving.scheduler import SchedulerLimits
from spectoolkit.verify import GreedyVerifier
from spectoolkit.wiring.loading import load_model, load_tokenizer
from spectoolkit.workloads.prompts import encode_prompt, load_workload

CONTEXT = 8192  # the embedded model's context
BLOCK = 16


def _runner(model: torch.nn.Module) -> tuple[Runner, BlockAllocator]:
    """``model``'s eager runner over a pool for a request and a lone sequence, and its allocator (shared by
    the arms on ``model``)."""
    slots = 2 * (CONTEXT + BLOCK)
    return make_runner(model, make_pool(model, "auto", slots)), BlockAllocator(slots // BLOCK, BLOCK)


def _one(target: tuple[Runner, BlockAllocator], eos_ids: frozenset[int], gamma: int = 0, drafter=None):
    """A batch-1 arm on ``target`` (runner, allocator): the target alone, or drafting ``gamma`` with ``drafter``."""
    runner, allocator = target
    limits = SchedulerLimits(CONTEXT + gamma + 1, 1, None, None)  # a whole prompt in one step
    policy = FixedPolicy(gamma) if drafter is not None else None
    engine = ContinuousEngine("bench", runner, allocator, GreedyVerifier(), limits, eos_ids, CONTEXT, drafter,
                              policy=policy)  # fmt: skip
    return OneRequestEngine(engine, "spec" if drafter is not None else "baseline")


def _hf_generate(model, ids: list[int], max_new: int, eos: int, **kwargs) -> tuple[list[int], float]:
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos, **kwargs
        )
    return out[0, len(ids) :].tolist(), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="humaneval")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from spectoolkit.checkpoints import resolve_path

    tokenizer = load_tokenizer(None)
    target = load_model(None, "fp32", torch.device("cpu"))
    plain = AutoModelForCausalLM.from_pretrained(resolve_path(None)).eval()
    eos = tokenizer.eos_token_id
    requests = load_workload(WorkloadConfig(kind=args.workload, num_prompts=args.prompts))
    prompts = [encode_prompt(tokenizer, r, True) for r in requests]
    runner, eos_ids = _runner(target.model), frozenset({eos})
    ours = _one(runner, eos_ids)
    ours_plain = _one(_runner(plain), eos_ids)
    ngram = _one(runner, eos_ids, args.gamma, NgramDrafter(3, 1, target.vocab_size, False))
    _hf_generate(plain, prompts[0], 8, eos)  # warm-up
    ours.generate(prompts[0], 8, None)
    totals = {name: [0, 0.0] for name in ("ours", "ours_plain", "hf", "ngram", "hf_pld")}
    mismatches = dict.fromkeys(("ours_plain vs generate", "ngram vs ours", "ours vs generate"), 0)
    for _ in range(args.rounds):
        for index, ids in enumerate(prompts):
            runs = {
                "ours": lambda ids=ids: _ours(ours, ids, args.max_new_tokens),
                "ours_plain": lambda ids=ids: _ours(ours_plain, ids, args.max_new_tokens),
                "hf": lambda ids=ids: _hf_generate(plain, ids, args.max_new_tokens, eos),
                "ngram": lambda ids=ids: _ours(ngram, ids, args.max_new_tokens),
                "hf_pld": lambda ids=ids: _hf_generate(
                    plain, ids, args.max_new_tokens, eos, prompt_lookup_num_tokens=args.gamma
                ),
            }
            order = list(runs) if index % 2 == 0 else list(runs)[::-1]
            outputs = {}
            for name in order:
                outputs[name], seconds = runs[name]()
                totals[name][0] += len(outputs[name])
                totals[name][1] += seconds
            mismatches["ours_plain vs generate"] += outputs["ours_plain"] != outputs["hf"]
            mismatches["ngram vs ours"] += outputs["ngram"] != outputs["ours"]
            mismatches["ours vs generate"] += outputs["ours"] != outputs["hf"]
    rate = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
    for name, value in rate.items():
        print(f"{name:>7}: {value:6.2f} tok/s")
    print(f"baseline vs generate: {rate['ours'] / rate['hf']:.2f}x (loop only: {rate['ours_plain'] / rate['hf']:.2f}x)")
    print(f"ngram vs transformers prompt lookup (gamma={args.gamma}): {rate['ngram'] / rate['hf_pld']:.2f}x")
    print(f"ngram speedup over our baseline: {rate['ngram'] / rate['ours']:.2f}x")
    print(f"output mismatches per prompt: {mismatches}")


def _ours(engine, ids: list[int], max_new: int) -> tuple[list[int], float]:
    out = engine.generate(ids, max_new, None)
    return out.output_ids, out.total_time


if __name__ == "__main__":
    main()
