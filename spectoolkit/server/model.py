"""What the HTTP side knows about the served model: its name, tokenizer, limits, default sampling (issue 17).

Everything a request is checked against before it reaches the engine lives here, so a bad request gets
its 400 (an unknown model its 404) without touching the running batch: the model name, prompt ids inside
the vocabulary, prompt + ``max_tokens`` within the context, chat messages the template can render.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spectoolkit.config import SamplingConfig
from spectoolkit.sampling import SamplingError, SamplingParams
from spectoolkit.server.protocol import APIError
from spectoolkit.server.scoring import TokenScores


@dataclass
class ServedModel:
    name: str
    tokenizer: Any
    vocab_size: int
    max_positions: int  # the context: prompt + output tokens
    eos_ids: frozenset[int]
    sampling: SamplingConfig
    scorer: Callable[[list[int], int], TokenScores]  # (ids, top) -> scores, run on the engine thread
    info: dict[str, Any] = field(default_factory=dict)  # what the server reports about itself (/info)
    default_max_tokens: int = 16  # completions without max_tokens (OpenAI's default)
    kv_slots: int | None = None  # the engine's KV pool: one request's prompt + output - 1 must fit
    unsupported: Callable[[SamplingParams], SamplingError | None] = lambda _: None  # what its drafter cannot apply

    @property
    def context(self) -> int:
        """The most prompt + output tokens one request may have: the model's context, or the KV pool's."""
        return self.max_positions if self.kv_slots is None else min(self.max_positions, self.kv_slots + 1)

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise APIError(f"the model '{name}' does not exist: this server serves '{self.name}' (see /v1/models)",
                           "model", "model_not_found", status=404)  # fmt: skip

    def encode(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """Token ids of a text prompt (no special tokens added twice: the tokenizer's own rule), or the ids."""
        if isinstance(prompt, str):
            ids = [int(i) for i in self.tokenizer(prompt).input_ids]
        else:
            ids = list(prompt)
            bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
            if bad is not None:
                raise APIError(f"{param} has token id {bad} outside the vocabulary [0, {self.vocab_size})", param)
        if not ids:
            raise APIError(f"{param} is empty: send at least one token", param)
        return ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(f"the model '{self.name}' has no chat template: use /v1/completions", "messages")
        try:
            encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # noqa: BLE001  a template that refuses the messages is the caller's input
            raise APIError(f"the chat template cannot render these messages: {exc}", "messages") from None
        ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
        return self.encode([int(i) for i in ids], "messages")

    def check_length(self, prompt_len: int, max_tokens: int, param: str = "max_tokens") -> None:
        """Prompt + ``max_tokens`` within the context; the message opens as vLLM's does (clients parse it)."""
        total = prompt_len + max_tokens
        asked = f"However, you requested {total} tokens ({prompt_len} in the prompt, {max_tokens} in {param})"
        if total > self.max_positions:
            raise APIError(
                f"This model's maximum context length is {self.max_positions} tokens. {asked}: shorten the prompt "
                f"or lower {param}",
                param, "context_length_exceeded",
            )  # fmt: skip
        if total > self.context:
            raise APIError(
                f"This server's maximum context length is {self.context} tokens (its KV pool of {self.kv_slots} "
                f"tokens; the model's context is {self.max_positions}). {asked}: shorten the prompt, lower {param}, "
                "or restart the server with a larger serve.max_kv_tokens",
                param, "context_length_exceeded",
            )  # fmt: skip

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
