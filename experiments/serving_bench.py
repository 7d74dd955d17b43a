"""Output throughput vs concurrency: the one engine batched, the same engine one request at a time, transformers'.

    python experiments/serving_bench.py --levels 1,2,4,8,16 --max-new-tokens 64 --repeat 2

At each load level N (closed loop: N requests in flight, the next one sent when one finishes, over
``--requests-per-level`` max(prompts, 2N) requests) every arm serves the same requests, the arms
alternating per repeat so they share the time window:

- ``new``: :class:`spectoolkit.serving.engine.ContinuousEngine`, target alone (the serving baseline);
  ``new-invariant`` the same with ``serve.batch_invariant`` (every row as a decode step computes it);
- ``old``: the one engine's batch-1 arm, target alone (:class:`~spectoolkit.serving.one.OneRequestEngine`:
  a whole prompt in one step, ``chosen`` row mode), one request at a time — what serving without
  batching gives;
- ``hf``: transformers ``generate_batch`` (continuous batching, ``paged|sdpa``) with at most N
  requests per batch (``ContinuousBatchingConfig.max_requests_per_batch``);
- ``ngram`` / ``self-<precision>``: the new engine with speculation (``--gamma``), with
  ``--spec-max-batch`` as load control when given.

Prints tok/s per arm and level and each arm's ratio to ``new`` at the same level; outputs of ``new``
are compared with ``old`` (greedy; batched ``plain`` rows vs batch-1 ``chosen`` rows: a mismatch is a
batching-rounding question, see the issue).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spectoolkit.config import WorkloadConfig
from spectoolkit.drafting import ModelDrafter, NgramDrafter
from spectoolkit.kernels.batched_kernels import choose_batched_kernels
from spectoolkit.policy import FixedPolicy
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import make_runner
from spectoolkit.sampling import GreedyChooser
from spectoolkit.serving.api import ServeRequest
from spectoolkit.serving.engine import ContinuousEngine
from spectoolkit.serving.one import OneRequestEngine
from spectoolkit.serving.scheduler import SchedulerLimits
from spectoolkit.verify import GreedyVerifier
from spectoolkit.wiring.loading import load_model, load_tokenizer
from spectoolkit.wiring.setup import eos_ids_of
from spectoolkit.workloads.prompts import encode_prompt, load_workload

SLOTS = 32 * 1024
CONTEXT = 8192  # the embedded model's context


def closed_loop(engine, prompts: list[list[int]], concurrency: int, max_new: int) -> tuple[float, list[list[int]]]:
    """tok/s of ``engine`` serving ``prompts`` with ``concurrency`` in flight; outputs in prompt order."""
    engine.reset()
    outputs: dict[int, list[int]] = {}
    sent, start = 0, time.perf_counter()
    while sent < min(concurrency, len(prompts)):
        engine.submit(ServeRequest(str(sent), prompts[sent], max_new))
        sent += 1
    while engine.has_work():
        for done in engine.step():
            outputs[int(done.request_id)] = done.output_ids
            if sent < len(prompts):
                engine.submit(ServeRequest(str(sent), prompts[sent], max_new))
                sent += 1
    elapsed = time.perf_counter() - start
    return sum(map(len, outputs.values())) / elapsed, [outputs[i] for i in range(len(prompts))]


def sequential(engine: OneRequestEngine, prompts: list[list[int]], max_new: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = [engine.generate(ids, max_new, None).output_ids for ids in prompts]
    return sum(map(len, outputs)) / (time.perf_counter() - start), outputs


def hf_batch(model, prompts: list[list[int]], concurrency: int, max_new: int, eos: int) -> tuple[float, list]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    batching = ContinuousBatchingConfig(max_requests_per_batch=concurrency, page_size=16)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=batching)
    elapsed = time.perf_counter() - start
    tokens = sum(len(result.generated_tokens) for result in out.values())
    return tokens / elapsed, []


def engine_for(lm, eos, gamma: int = 0, drafter=None, spec_max_batch=None, invariant=False) -> ContinuousEngine:
    limits = SchedulerLimits(256, 64, spec_max_batch, None)
    runner = make_runner(lm.model, make_pool(lm.model, "auto", SLOTS))
    return ContinuousEngine("bench", runner, BlockAllocator(SLOTS // 16, 16), GreedyVerifier(), limits, eos, CONTEXT,
                            drafter, invariant=invariant, policy=FixedPolicy(gamma) if drafter else None)  # fmt: skip


def one_request(lm, eos) -> OneRequestEngine:
    """The one engine's batch-1 arm, target alone: one request in flight, its whole prompt in one step."""
    limits = SchedulerLimits(CONTEXT + 1, 1, None, None)
    runner = make_runner(lm.model, make_pool(lm.model, "auto", SLOTS))
    engine = ContinuousEngine("old", runner, BlockAllocator(SLOTS // 16, 16), GreedyVerifier(), limits, eos, CONTEXT)
    return OneRequestEngine(engine, "baseline")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="builtin")
    parser.add_argument("--levels", default="1,2,4,8,16")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--arms", default="new,old,hf,ngram")
    parser.add_argument("--self-draft", default="", help="draft precision for a self-draft arm, e.g. bf16 or rtn-int4")
    parser.add_argument("--spec-max-batch", type=int, default=None)
    parser.add_argument("--no-batched-kernels", action="store_true", help="F.linear for every row count")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    levels = [int(x) for x in args.levels.split(",")]
    arms = args.arms.split(",") + ([f"self-{args.self_draft}"] if args.self_draft else [])

    tokenizer = load_tokenizer(None)
    lm = load_model(None, "fp32", torch.device("cpu"))
    if not args.no_batched_kernels:
        print("batched kernels (W @ Xᵀ from this many rows):", choose_batched_kernels(lm.model))
    eos = eos_ids_of(tokenizer, lm.model)
    prompts_all = [encode_prompt(tokenizer, r, True) for r in load_workload(WorkloadConfig(kind=args.workload))]
    engines = {"new": engine_for(lm, eos), "new-invariant": engine_for(lm, eos, invariant=True)}
    old = one_request(lm, eos)
    if "ngram" in arms:
        engines["ngram"] = engine_for(lm, eos, args.gamma, NgramDrafter(3, 2, lm.vocab_size, False),
                                      args.spec_max_batch)  # fmt: skip
    if args.self_draft:
        draft = load_model(None, args.self_draft, torch.device("cpu"), kernels="auto", widths=(1, 2))
        pool = make_pool(draft.model, "auto", SLOTS)
        drafter = ModelDrafter(make_runner(draft.model, pool), GreedyChooser(), BlockAllocator(SLOTS // 16, 16),
                                    lm.vocab_size, min(lm.vocab_size, draft.vocab_size), eos)  # fmt: skip
        engines[f"self-{args.self_draft}"] = engine_for(lm, eos, args.gamma, drafter, args.spec_max_batch)
    hf_model = None
    if "hf" in arms:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(lm.path, dtype=torch.float32, attn_implementation="paged|sdpa")
        hf_model.eval()

    def run_arm(arm: str, prompts: list[list[int]], level: int) -> tuple[float, list]:
        if arm == "old":
            return sequential(old, prompts, args.max_new_tokens)
        if arm == "hf":
            return hf_batch(hf_model, prompts, level, args.max_new_tokens, min(eos))
        return closed_loop(engines[arm], prompts, level, args.max_new_tokens)

    for arm in arms:  # warm-up: first-call costs are not measured
        run_arm(arm, prompts_all[:2], 2)
    print(f"threads={torch.get_num_threads()} max_new_tokens={args.max_new_tokens} gamma={args.gamma} "
          f"spec_max_batch={args.spec_max_batch}")  # fmt: skip
    print("level " + " ".join(f"{arm:>12}" for arm in arms) + "   ratios to new")
    for level in levels:
        prompts = (prompts_all * (2 * level // len(prompts_all) + 1))[: max(len(prompts_all), 2 * level)]
        rates: dict[str, list[float]] = {arm: [] for arm in arms}
        mismatches = 0
        for repeat in range(args.repeat):
            order = arms if repeat % 2 == 0 else arms[::-1]
            outputs = {}
            for arm in order:
                rate, outs = run_arm(arm, prompts, level)
                rates[arm].append(rate)
                outputs[arm] = outs
            if "old" in outputs:
                mismatches += sum(a != b for a, b in zip(outputs["new"], outputs["old"], strict=True))
        medians = {arm: statistics.median(values) for arm, values in rates.items()}
        ratios = " ".join(f"{arm}={medians[arm] / medians['new']:.2f}" for arm in arms if arm != "new")
        cells = " ".join(f"{medians[arm]:12.1f}" for arm in arms)
        print(f"{level:5d} {cells}   {ratios}  (new≠old outputs: {mismatches})", flush=True)


if __name__ == "__main__":
    main()
