"""Held text for quality measurements: real responses from the workloads, tokenized as chat turns."""

from __future__ import annotations

import dataclasses

from spectoolkit.config import WorkloadConfig
from spectoolkit.eval.quant_quality import HeldText
from spectoolkit.workloads.prompts import encode_prompt, load_workload


def held_texts(tokenizer, workload: WorkloadConfig, num_texts: int, max_tokens: int) -> list[HeldText]:
    """Up to ``num_texts`` (prompt, response) pairs of ``workload``; ShareGPT when it has no responses.

    The prompt goes through the chat template like the run's prompts; at most ``max_tokens``
    response tokens are scored per text.
    """
    texts = _from(tokenizer, workload, num_texts, max_tokens)
    if not texts:  # built-in and JSONL prompts carry no reference responses
        sharegpt = WorkloadConfig(kind="sharegpt", num_prompts=num_texts, chat_template=workload.chat_template)
        texts = _from(tokenizer, sharegpt, num_texts, max_tokens)
    return texts


def _from(tokenizer, workload: WorkloadConfig, num_texts: int, max_tokens: int) -> list[HeldText]:
    requests = load_workload(dataclasses.replace(workload, num_prompts=None if workload.kind == "jsonl" else num_texts))
    texts = []
    for request in requests:
        if request.error or not request.reference or len(texts) == num_texts:
            continue
        prompt_ids = encode_prompt(tokenizer, request, workload.chat_template)
        response_ids = tokenizer(request.reference, add_special_tokens=False).input_ids[:max_tokens]
        if len(response_ids) >= 2:
            texts.append(HeldText(prompt_ids + response_ids, len(prompt_ids)))
    return texts
