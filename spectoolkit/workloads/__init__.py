"""Prompt data: built-in prompts, user JSONL, HumanEval and ShareGPT (below everything that uses them)."""

from spectoolkit.workloads.prompts import TASK_TYPES, Request, encode_prompt, load_workload

__all__ = ["TASK_TYPES", "Request", "encode_prompt", "load_workload"]
