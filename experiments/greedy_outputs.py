"""Greedy outputs of GGUF models run alone, saved or compared: the same bits across packings and kernel paths.

    python experiments/greedy_outputs.py --save before.json                 # the real pair (make pair), 6 x 64
    SPECTOOLKIT_ISA=scalar python experiments/greedy_outputs.py --compare before.json
    python experiments/greedy_outputs.py --models embedded --compare before.json
    python experiments/greedy_outputs.py --models embedded --precision rtn-int4 --layout wide --save wide.json

Each model (``gguf`` precision, int8 activations unless ``--activations float``) decodes ``--tokens`` greedy tokens
after each of ``--prompts`` HumanEval prompts taken from the end of the set (the ones the tests and the pair's
benchmarks do not use), one token per forward on a lone sequence: the target alone. ``--compare`` exits 1 when any
output differs from the saved one, naming the first differing position. ``--precision`` (``rtn-int4``, ``rtn-int8``,
GPTQ ``int4``, ``--group-size``) loads another precision; ``--layout wide`` widens every format at its own size back
to the wide layout of before issue 55.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from spectoolkit.kernels import cpu_ops
from spectoolkit.kernels.packing import widen_formats
from spectoolkit.pair import PAIR
from spectoolkit.runtime.lone import lone_sequence
from spectoolkit.wiring.loading import load_model
from spectoolkit.workloads.prompts import _humaneval_requests


def greedy(model: torch.nn.Module, prompt_ids: list[int], tokens: int) -> list[int]:
    """``tokens`` greedy ids after ``prompt_ids`` (the prompt in one forward, then one token per forward)."""
    sequence = lone_sequence(model)
    logits = sequence.forward(prompt_ids, last_only=True)
    out = []
    for _ in range(tokens):
        out.append(int(torch.argmax(logits)))
        logits = sequence.forward(out[-1:], last_only=True)
    sequence.reset()
    return out


def outputs(name: str, args: argparse.Namespace) -> dict[str, list[int]]:
    path, cpu = None if name == "embedded" else name, torch.device("cpu")
    loaded = load_model(path, args.precision, cpu, args.group_size, activations=args.activations)
    if args.layout == "wide":
        widen_formats(loaded.model)
    prompts, tokens = args.prompts, args.tokens
    tokenizer = AutoTokenizer.from_pretrained(loaded.path)
    requests = list(_humaneval_requests())[-prompts:]
    with torch.inference_mode():
        return {r.case_id: greedy(loaded.model, tokenizer(r.prompt)["input_ids"], tokens) for r in requests}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[model.name for model in PAIR], help="pair names or embedded")
    parser.add_argument("--activations", choices=("float", "int8"), default="int8")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--precision", choices=("gguf", "rtn-int4", "rtn-int8", "int4"), default="gguf")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--layout", choices=("compact", "wide"), default="compact")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--save", type=Path)
    group.add_argument("--compare", type=Path)
    args = parser.parse_args()
    got = {name: outputs(name, args) for name in args.models}
    print(f"kernel path {cpu_ops.isa_name()}; available {', '.join(cpu_ops.available_isas())}")
    if args.save:
        args.save.write_text(json.dumps(got), encoding="utf-8")
        print(f"saved {sum(len(v) for v in got.values())} outputs to {args.save}")
        return 0
    saved = json.loads(args.compare.read_text(encoding="utf-8"))
    differing = 0
    for name, cases in got.items():
        for case, ids in cases.items():
            before = saved[name][case]
            if ids != before:
                differing += 1
                first = next((i for i, (a, b) in enumerate(zip(ids, before)) if a != b), min(len(ids), len(before)))
                print(f"{name} {case}: differs from position {first}")
        print(f"{name}: {sum(ids == saved[name][c] for c, ids in cases.items())}/{len(cases)} identical")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
