"""Batch 1 on the one engine, each drafter against the target alone, and trees vs chains under load.

    python experiments/one_engine_bench.py --max-new-tokens 64 --repeat 3
    python experiments/one_engine_bench.py --compiled    # the same arms on compiled runners

Arms at concurrency 1, every one on the same loaded models, alternating order per repeat so they
share the time window (output tok/s, median over repeats): ``one-<drafter>`` is
:class:`~spectoolkit.serving.one.OneRequestEngine`, the continuous-batching engine with one request in
flight, for drafter ``base`` (the target alone), ``ngram`` and ``self`` (a ``--self-draft`` quantized
copy of the target); each is printed with its ratio to ``one-base``. Then a chain arm (γ = ``--gamma``)
and a static tree arm (``--branching``, ``--max-nodes``) of the self-draft at concurrency ``--level``,
with the target alone at that level as their baseline. Greedy outputs of every arm are compared with
its baseline's; any mismatch is printed.

Every arm runs on one runner and paged pool per model (the target's, the self-draft's), as a server's
arms do. ``--compiled``: those runners are :class:`~spectoolkit.runtime.compiled.CompiledRunner` (models
loaded without the eager kernel choice), every width the arms call compiled before anything is timed.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from serving_bench import closed_loop, sequential  # experiments/ (this script's directory)

from spectoolkit.config import SpeculateConfig, TreeConfig, WorkloadConfig
from spectoolkit.drafting import ModelDrafter, NgramDrafter
from spectoolkit.kernels.batched_kernels import choose_batched_kernels
from spectoolkit.policy import FixedPolicy, draft_depth
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.compiled import bucket
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import Runner, make_runner
from spectoolkit.sampling import GreedyChooser
from spectoolkit.serving.engine import ContinuousEngine
from spectoolkit.serving.one import OneRequestEngine
from spectoolkit.serving.scheduler import SchedulerLimits
from spectoolkit.verify import GreedyVerifier
from spectoolkit.wiring.loading import load_model, load_tokenizer
from spectoolkit.wiring.setup import eos_ids_of
from spectoolkit.workloads.prompts import encode_prompt, load_workload

SLOTS = 16 * 1024
BLOCK = 16
CONTEXT = 8192  # the embedded model's context


def shared_runner(model: torch.nn.Module, compiled: bool) -> tuple[Runner, BlockAllocator]:
    """``model``'s runner over its pool and the pool's allocator: one per model, shared by every arm on it."""
    return make_runner(model, make_pool(model, "auto", SLOTS), compiled), BlockAllocator(SLOTS // BLOCK, BLOCK)


def continuous(target, eos, gamma=0, drafter=None, tree: TreeConfig | None = None) -> ContinuousEngine:
    """An engine on ``target`` (runner, allocator) drafting ``gamma`` tokens (``tree``: nodes) with ``drafter``."""
    runner, allocator = target
    limits = SchedulerLimits(CONTEXT, 64, None, None)
    drafter = drafter.variant(None, tree) if drafter is not None and tree is not None else drafter
    depth = draft_depth(SpeculateConfig(gamma=4, tree=tree)) if tree is not None else gamma  # trees: γ 4 deep
    return ContinuousEngine("bench", runner, allocator, GreedyVerifier(), limits, eos, CONTEXT, drafter,
                            policy=FixedPolicy(gamma, depth))  # fmt: skip


def batched_self(lm, draft, draft_pool, eos) -> ModelDrafter:
    """A self-draft on the draft model's shared runner and pool (``draft_pool``: runner, allocator)."""
    runner, allocator = draft_pool
    shared = min(lm.vocab_size, draft.vocab_size)
    return ModelDrafter(runner, GreedyChooser(), allocator, lm.vocab_size, shared, eos, "self")


def warm(target: Runner, draft: Runner, args) -> None:
    """Compile every width the arms call before anything is timed: a target decode step and a chain's verify, and
    with ``--level`` a tree's verify and a batched step; a draft step, a catch-up feed, a prompt chunk and a
    tree's widest level."""
    verify = {bucket(args.gamma + 1)}
    if args.level >= 2:  # the chain and tree arms under load
        verify |= {bucket(args.max_nodes + 1), bucket(args.level * (max(args.gamma, args.max_nodes) + 1))}
    target.warm((1, *verify))
    draft.warm((1, 2, 8, bucket(args.max_nodes)))


def timed(arms: dict, repeat: int) -> tuple[dict[str, float], dict[str, list]]:
    """Median tok/s per arm (order alternating per repeat) and each arm's last outputs."""
    rates: dict[str, list[float]] = {name: [] for name in arms}
    outputs = {}
    for index in range(repeat):
        for name in list(arms) if index % 2 == 0 else list(arms)[::-1]:
            rate, outputs[name] = arms[name]()
            rates[name].append(rate)
    return {name: statistics.median(values) for name, values in rates.items()}, outputs


def report(label: str, medians: dict[str, float], outputs: dict[str, list], base: str) -> None:
    """Each arm's tok/s, its ratio to ``base`` and how many of its outputs equal ``base``'s."""
    for name in medians:
        same = sum(a == b for a, b in zip(outputs[name], outputs[base], strict=True))
        print(f"concurrency {label} {name:>9}: {medians[name]:7.2f} tok/s  x{medians[name] / medians[base]:.3f} "
              f"of {base}  outputs equal to {base}: {same}/{len(outputs[base])}", flush=True)  # fmt: skip


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
    parser.add_argument("--compiled", action="store_true", help="every arm on compiled runners (runtime.compile)")
    args = parser.parse_args()
    tokenizer = load_tokenizer(None)
    cpu, kernels = torch.device("cpu"), None if args.compiled else "auto"
    lm = load_model(None, "fp32", cpu, kernels=kernels, widths=(1, max(args.gamma, args.max_nodes) + 1))
    draft = load_model(None, args.self_draft, cpu, kernels=kernels, widths=(1, 2))
    if not args.compiled:
        choose_batched_kernels(lm.model)
    target, draft_pool = shared_runner(lm.model, args.compiled), shared_runner(draft.model, args.compiled)
    if args.compiled:
        warm(target[0], draft_pool[0], args)
    eos = eos_ids_of(tokenizer, lm.model)
    workload = load_workload(WorkloadConfig(kind=args.workload, num_prompts=args.num_prompts))
    prompts = [encode_prompt(tokenizer, request, True) for request in workload]
    new, gamma = args.max_new_tokens, args.gamma
    ngram = NgramDrafter(3, 2, lm.vocab_size, False)
    one = {
        "one-base": OneRequestEngine(continuous(target, eos), "baseline"),
        "one-ngram": OneRequestEngine(continuous(target, eos, gamma, ngram), "spec"),
        "one-self": OneRequestEngine(continuous(target, eos, gamma, batched_self(lm, draft, draft_pool, eos)), "spec"),
    }
    arms = {name: lambda engine=engine: sequential(engine, prompts, new) for name, engine in one.items()}
    for engine in one.values():  # warm-up: first-call costs are not measured
        sequential(engine, prompts[:1], 8)
    print(f"threads={torch.get_num_threads()} max_new_tokens={new} gamma={gamma} prompts={len(prompts)} "
          f"compiled={args.compiled}", flush=True)  # fmt: skip
    report("1", *timed(arms, args.repeat), "one-base")
    if args.level < 2:  # --level 0: concurrency 1 only
        return
    branching = [int(b) for b in args.branching.split(",")]
    tree = TreeConfig(kind="static", branching=branching, max_nodes=args.max_nodes)
    chain_draft, tree_draft = (batched_self(lm, draft, draft_pool, eos) for _ in range(2))
    level = {
        f"chain-g{gamma}": continuous(target, eos, gamma, chain_draft),
        f"tree-n{args.max_nodes}": continuous(target, eos, args.max_nodes, tree_draft, tree),
        "base": continuous(target, eos),
    }
    runs = {name: lambda engine=engine: closed_loop(engine, prompts, args.level, new) for name, engine in level.items()}
    for engine in level.values():
        closed_loop(engine, prompts[:2], 2, 8)
    report(str(args.level), *timed(runs, args.repeat), "base")


if __name__ == "__main__":
    main()
