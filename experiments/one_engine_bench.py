"""Batch 1 through the one engine vs the batch-1 engine it replaces, and trees vs chains under load.

    python experiments/one_engine_bench.py --max-new-tokens 64 --repeat 3

Arms at concurrency 1, every one on the same loaded models, alternating order per repeat so they
share the time window (output tok/s, median over repeats):

- ``b1-<drafter>``: the batch-1 engines (:class:`~spectoolkit.engine.BaselineEngine`,
  :class:`~spectoolkit.engine.SpeculativeEngine` over :class:`~spectoolkit.models.cached.CachedModel`);
- ``one-<drafter>``: :class:`~spectoolkit.serving.one.OneRequestEngine`, the continuous-batching
  engine with one request in flight (runner + paged pool);

for drafter ``base`` (the target alone), ``ngram`` and ``self`` (a ``--self-draft`` quantized copy of the
target). Then a chain arm (γ = ``--gamma``) and a static tree arm (``--branching``, ``--max-nodes``) of
the self-draft at concurrency ``--level`` on the one engine. Greedy outputs of every arm are compared
with ``b1-base``'s; any mismatch is printed.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from serving_bench import closed_loop, sequential  # experiments/ (this script's directory)

from spectoolkit.config import TreeConfig, WorkloadConfig
from spectoolkit.drafting import ModelDrafter, NgramDrafter
from spectoolkit.engine import BaselineEngine, SpeculativeEngine
from spectoolkit.models.batched_kernels import choose_batched_kernels
from spectoolkit.models.cached import CachedModel
from spectoolkit.policy import FixedPolicy
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.runner import make_runner
from spectoolkit.sampling import GreedyChooser
from spectoolkit.serving.drafters import BatchModelDrafter, BatchNgramDrafter
from spectoolkit.serving.engine import ContinuousEngine
from spectoolkit.serving.factory import make_pool
from spectoolkit.serving.one import OneRequestEngine
from spectoolkit.serving.scheduler import SchedulerLimits
from spectoolkit.verify import GreedyVerifier
from spectoolkit.wiring.loading import load_model, load_tokenizer
from spectoolkit.wiring.setup import eos_ids_of
from spectoolkit.workloads.prompts import encode_prompt, load_workload

SLOTS = 16 * 1024
BLOCK = 16


def continuous(lm, eos, gamma=0, drafter=None, tree: TreeConfig | None = None, depth: int = 0) -> ContinuousEngine:
    policy = FixedPolicy(gamma)
    limits = SchedulerLimits(8192, 64, gamma, None, None)
    pool, allocator = make_pool(lm.model, "auto", SLOTS), BlockAllocator(SLOTS // BLOCK, BLOCK)
    return ContinuousEngine("bench", make_runner(lm.model, pool), allocator, GreedyVerifier(), limits, eos, 8192,
                            drafter, policy=policy, tree=tree, tree_depth=depth)  # fmt: skip


def batched_self(lm, draft, eos) -> BatchModelDrafter:
    pool = make_pool(draft.model, "auto", SLOTS)
    return BatchModelDrafter(make_runner(draft.model, pool), GreedyChooser(), BlockAllocator(SLOTS // BLOCK, BLOCK),
                             lm.vocab_size, min(lm.vocab_size, draft.vocab_size), eos, "self")  # fmt: skip


def timed(arms: dict, repeat: int) -> tuple[dict[str, float], dict[str, list]]:
    """Median tok/s per arm (order alternating per repeat) and each arm's last outputs."""
    rates: dict[str, list[float]] = {name: [] for name in arms}
    outputs = {}
    for index in range(repeat):
        for name in list(arms) if index % 2 == 0 else list(arms)[::-1]:
            rate, outputs[name] = arms[name]()
            rates[name].append(rate)
    return {name: statistics.median(values) for name, values in rates.items()}, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="builtin")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--self-draft", default="rtn-int4")
    parser.add_argument("--branching", default="3,2,1,1")
    parser.add_argument("--max-nodes", type=int, default=8)
    parser.add_argument("--level", type=int, default=4)
    args = parser.parse_args()
    tokenizer = load_tokenizer(None)
    lm = load_model(None, "fp32", torch.device("cpu"), widths=(1, max(args.gamma, args.max_nodes) + 1))
    choose_batched_kernels(lm.model)
    draft = load_model(None, args.self_draft, torch.device("cpu"), widths=(1, 2))
    eos = eos_ids_of(tokenizer, lm.model)
    workload = load_workload(WorkloadConfig(kind=args.workload, num_prompts=args.num_prompts))
    prompts = [encode_prompt(tokenizer, request, True) for request in workload]
    new, gamma = args.max_new_tokens, args.gamma
    target, verifier = CachedModel(lm.model), GreedyVerifier()
    shared = min(lm.vocab_size, draft.vocab_size)
    self_draft = ModelDrafter(draft.model, GreedyChooser(), lm.vocab_size, shared, eos)
    b1 = {
        "base": BaselineEngine(target, verifier, eos),
        "ngram": SpeculativeEngine(target, NgramDrafter(3, 2, lm.vocab_size, False), verifier, gamma, eos),
        "self": SpeculativeEngine(target, self_draft, verifier, gamma, eos),
    }
    one = {
        "base": OneRequestEngine(continuous(lm, eos), "baseline"),
        "ngram": OneRequestEngine(continuous(lm, eos, gamma, BatchNgramDrafter(3, 2, lm.vocab_size, False)), "spec"),
        "self": OneRequestEngine(continuous(lm, eos, gamma, batched_self(lm, draft, eos)), "spec"),
    }
    arms = {}
    for name in b1:
        arms[f"b1-{name}"] = lambda engine=b1[name]: sequential(engine, prompts, new)
        arms[f"one-{name}"] = lambda engine=one[name]: sequential(engine, prompts, new)
    for engine in [*b1.values(), *one.values()]:  # warm-up: first-call costs are not measured
        sequential(engine, prompts[:1], 8)
    print(f"threads={torch.get_num_threads()} max_new_tokens={new} gamma={gamma} prompts={len(prompts)}", flush=True)
    medians, outputs = timed(arms, args.repeat)
    for name in b1:
        ratio = medians[f"one-{name}"] / medians[f"b1-{name}"]
        same = sum(a == b for a, b in zip(outputs[f"one-{name}"], outputs["b1-base"], strict=True))
        print(f"concurrency 1 {name:>6}: b1 {medians[f'b1-{name}']:7.2f} tok/s  one {medians[f'one-{name}']:7.2f} tok/s"
              f"  one/b1 {ratio:.3f}  outputs equal to b1-base: {same}/{len(prompts)}", flush=True)  # fmt: skip
    if args.level < 2:  # --level 0: concurrency 1 only
        return
    branching = [int(b) for b in args.branching.split(",")]
    tree = TreeConfig(kind="static", branching=branching, max_nodes=args.max_nodes)
    depth = len(branching)
    level = {
        f"chain-g{gamma}": continuous(lm, eos, gamma, batched_self(lm, draft, eos)),
        f"tree-n{args.max_nodes}": continuous(lm, eos, args.max_nodes, batched_self(lm, draft, eos), tree, depth),
        "base": continuous(lm, eos),
    }
    runs = {name: lambda engine=engine: closed_loop(engine, prompts, args.level, new) for name, engine in level.items()}
    for engine in level.values():
        closed_loop(engine, prompts[:2], 2, 8)
    medians, outputs = timed(runs, args.repeat)
    for name in level:
        same = sum(a == b for a, b in zip(outputs[name], outputs["base"], strict=True))
        print(f"concurrency {args.level} {name:>8}: {medians[name]:7.2f} tok/s  x{medians[name] / medians['base']:.3f} "
              f"of base  outputs equal to base: {same}/{len(prompts)}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
