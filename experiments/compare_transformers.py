"""Our decode loops against transformers' own, same model, prompts and greedy settings, interleaved.

    python experiments/compare_transformers.py --workload humaneval --prompts 6 --max-new-tokens 96

Prints tokens/s of (a) our baseline vs ``model.generate`` and (b) our ``draft=ngram`` vs
transformers' prompt-lookup decoding (``prompt_lookup_num_tokens=γ``), as ratios measured in one
run with the arms alternating per prompt. transformers runs the checkpoint as a user would load it
(``AutoModelForCausalLM.from_pretrained``); ours runs it as ``load_model`` does (row-wise
attention, the linear kernel variants measured on this machine: spectoolkit/models/kernel_choice.py).
``ours_plain`` is our loop on transformers' model, which isolates the decode-loop overhead from the
kernel choice. Outputs are compared too (a mismatch between different kernels is a near-tie question, not a loop bug).
"""

from __future__ import annotations

import argparse
import time

import torch

from spectoolkit.config import WorkloadConfig
from spectoolkit.drafting import NgramDrafter
from spectoolkit.engine import BaselineEngine, SpeculativeEngine
from spectoolkit.models.cached import CachedModel
from spectoolkit.verify import GreedyVerifier
from spectoolkit.wiring.loading import load_model, load_tokenizer
from spectoolkit.workloads.prompts import encode_prompt, load_workload


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

    from spectoolkit.models import resolve_path

    tokenizer = load_tokenizer(None)
    target = load_model(None, "fp32", torch.device("cpu"))
    plain = AutoModelForCausalLM.from_pretrained(resolve_path(None)).eval()
    eos = tokenizer.eos_token_id
    requests = load_workload(WorkloadConfig(kind=args.workload, num_prompts=args.prompts))
    prompts = [encode_prompt(tokenizer, r, True) for r in requests]
    runner = CachedModel(target.model)
    ours = BaselineEngine(runner, GreedyVerifier(), frozenset({eos}))
    ours_plain = BaselineEngine(CachedModel(plain), GreedyVerifier(), frozenset({eos}))
    ngram = SpeculativeEngine(
        runner, NgramDrafter(3, 1, target.vocab_size, False), GreedyVerifier(), args.gamma, frozenset({eos})
    )
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
