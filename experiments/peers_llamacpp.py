"""llama.cpp and our engine side by side: same model, same prompt tokens, greedy, arms interleaved.

    make llama-cpp          # llama-cpp-python 0.3.36, built from source (~10 min on 2 cores)
    python experiments/peers_llamacpp.py --prompts 4 --max-new-tokens 64 --rounds 2

llama.cpp runs the very Q4_1 GGUF the embedded model ships as (``spectoolkit.embedded.gguf_path``),
plain and with its prompt-lookup drafter (``LlamaPromptLookupDecoding``, γ draft tokens). Ours run
the HF checkpoint converted from that GGUF (dequantized to fp32), each arm the one engine's batch-1 arm
(:class:`~spectoolkit.serving.one.OneRequestEngine`) on ``runtime.compile`` runners
(:class:`~spectoolkit.runtime.compiled.CompiledRunner`: compiled row-invariant steps over a paged pool,
every width compiled before timing) unless ``--eager`` (the eager runner, the measured kernel choice);
the arms on one target share its runner and pool:

- ``fp32``: our fp32 baseline; ``rtn-int4``: ``+target=rtn-int4 target.group_size=32`` (the GGUF's
  4-bit, re-quantized by our RTN: same bits per weight, not the same codes);
- ``rtn-int4+qhead``: the same with its output head quantized too (``quantize_head``), as the GGUF's is;
- ``fp32+ngram`` / ``rtn-int4+ngram``: the same targets with n-gram lookup (γ draft tokens);
- ``fp32+rtn-int4``: the fp32 target with its rtn-int4 self-draft.

Every arm gets the same prompt token ids (the GGUF's vocabulary is the checkpoint's) and decodes up
to ``--max-new-tokens`` tokens or EOS; tokens/s is generated tokens over wall time, prompt included,
summed over prompts and rounds, with the arm order reversed on every other prompt. Ratios are
against llama.cpp plain.
"""

from __future__ import annotations

import argparse
import time

import torch

from spectoolkit.config import WorkloadConfig
from spectoolkit.drafting import ModelDrafter, NgramDrafter
from spectoolkit.embedded import gguf_path
from spectoolkit.policy import FixedPolicy
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
from spectoolkit.workloads.prompts import encode_prompt, load_workload

CONTEXT = 8192  # the embedded model's context
BLOCK = 16


def _llama_cpp(threads: int, gamma: int | None):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=gamma) if gamma else None
    return Llama(str(gguf_path()), n_ctx=2048, n_threads=threads, n_batch=512, verbose=False, draft_model=draft)


def _run_llama(llm, ids: list[int], max_new: int) -> tuple[int, float]:
    llm.reset()
    start = time.perf_counter()
    out = llm.create_completion(ids, max_tokens=max_new, temperature=0.0, top_k=1)
    return out["usage"]["completion_tokens"], time.perf_counter() - start


def _run_ours(engine, ids: list[int], max_new: int) -> tuple[int, float]:
    start = time.perf_counter()
    out = engine.generate(ids, max_new, None)
    return len(out.output_ids), time.perf_counter() - start


def _pool(model: torch.nn.Module, compiled: bool) -> tuple[Runner, BlockAllocator]:
    """``model``'s runner over a pool for a request and a lone sequence, and its allocator."""
    slots = 2 * (CONTEXT + BLOCK)
    return make_runner(model, make_pool(model, "auto", slots), compiled), BlockAllocator(slots // BLOCK, BLOCK)


def _one(target: tuple[Runner, BlockAllocator], eos_ids: frozenset[int], gamma: int = 0, drafter=None):
    """A batch-1 arm on ``target`` (runner, allocator): the target alone, or drafting ``gamma`` with ``drafter``."""
    runner, allocator = target
    limits = SchedulerLimits(CONTEXT + gamma + 1, 1, None, None)  # a whole prompt in one step
    policy = FixedPolicy(gamma) if drafter is not None else None
    engine = ContinuousEngine("bench", runner, allocator, GreedyVerifier(), limits, eos_ids, CONTEXT, drafter,
                              policy=policy)  # fmt: skip
    return OneRequestEngine(engine, "spec" if drafter is not None else "baseline")


def _our_arms(args, eos_ids: frozenset[int]) -> dict:
    compiled = not args.eager
    kernels = None if compiled else "auto"
    cpu = torch.device("cpu")
    fp32 = load_model(None, "fp32", cpu, kernels=kernels, widths=(1, args.gamma + 1))
    int4 = load_model(None, "rtn-int4", cpu, group_size=32, kernels=kernels, widths=(1, args.gamma + 1))
    # The GGUF's output head is quantized too; ours keeps lm_head in fp32 unless asked (113 MB of a 193 MB step).
    int4_head = load_model(None, "rtn-int4", cpu, group_size=32, kernels=kernels, widths=(1, args.gamma + 1),
                           quantize_head=True)  # fmt: skip
    loaded = (("fp32", fp32), ("rtn-int4", int4), ("rtn-int4+qhead", int4_head))
    targets = {name: _pool(m.model, compiled) for name, m in loaded}
    # The self-draft: its own runner (own KV) over the rtn-int4 weights the rtn-int4 arms use too.
    draft_runner, draft_allocator = _pool(int4.model, compiled)
    draft = ModelDrafter(draft_runner, GreedyChooser(), draft_allocator, fp32.vocab_size, fp32.vocab_size,
                              eos_ids, "rtn-int4")  # fmt: skip
    if compiled:  # a decode step and the verify windows of both gammas; the draft's step, catch-up feed, prompt chunk
        verify = {bucket(args.gamma + 1), bucket(args.draft_gamma + 1)}
        for runner, _ in targets.values():
            runner.warm((1, *verify))
        draft_runner.warm((1, 2, 8))

    def ngram() -> NgramDrafter:
        return NgramDrafter(3, 1, fp32.vocab_size, False)

    return {
        "fp32": _one(targets["fp32"], eos_ids),
        "rtn-int4": _one(targets["rtn-int4"], eos_ids),
        "rtn-int4+qhead": _one(targets["rtn-int4+qhead"], eos_ids),
        "fp32+ngram": _one(targets["fp32"], eos_ids, args.gamma, ngram()),
        "rtn-int4+ngram": _one(targets["rtn-int4"], eos_ids, args.gamma, ngram()),
        "fp32+rtn-int4": _one(targets["fp32"], eos_ids, args.draft_gamma, draft),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="humaneval")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens of the n-gram / prompt-lookup arms")
    parser.add_argument("--draft-gamma", type=int, default=3, help="draft tokens of the rtn-int4 self-draft arm")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--eager", action="store_true", help="our arms on the eager runner (runtime.compile=false)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(None)
    eos_ids = frozenset({tokenizer.eos_token_id})
    requests = load_workload(WorkloadConfig(kind=args.workload, num_prompts=args.prompts))
    prompts = [encode_prompt(tokenizer, request, True) for request in requests]
    began = time.perf_counter()
    ours = _our_arms(args, eos_ids)
    print(f"our arms ready in {time.perf_counter() - began:.0f} s (compiling included)")
    peers = {"llama.cpp": _llama_cpp(args.threads, None), "llama.cpp+lookup": _llama_cpp(args.threads, args.gamma)}
    runs = {name: (lambda ids, llm=llm: _run_llama(llm, ids, args.max_new_tokens)) for name, llm in peers.items()}
    runs.update({name: (lambda ids, e=engine: _run_ours(e, ids, args.max_new_tokens)) for name, engine in ours.items()})
    for run in runs.values():  # warm-up
        run(prompts[0][:32])
    totals = {name: [0, 0.0] for name in runs}
    for round_index in range(args.rounds):
        for index, ids in enumerate(prompts):
            order = list(runs) if (index + round_index) % 2 == 0 else list(runs)[::-1]
            for name in order:
                tokens, seconds = runs[name](ids)
                totals[name][0] += tokens
                totals[name][1] += seconds
    base = totals["llama.cpp"][0] / totals["llama.cpp"][1]
    print(f"{'arm':<18} {'tok/s':>7} {'vs llama.cpp':>13}   ({len(prompts)} prompts x {args.rounds} rounds)")
    for name, (tokens, seconds) in totals.items():
        rate = tokens / seconds
        print(f"{name:<18} {rate:>7.1f} {rate / base:>12.2f}x")


if __name__ == "__main__":
    main()
