"""How a completion request and its stream look on the wire, per server dialect (issues 17 and 46).

:class:`EndpointEngine <spectoolkit.backends.endpoint.EndpointEngine>` sends every request through a
:class:`Wire`: the URL it posts to, the JSON body, and how one streamed chunk reads as :class:`Piece` s.

- :data:`OPENAI`: ``POST {base}/completions`` (OpenAI), token ids through ``return_token_ids`` (vLLM's
  extension; our server has it too). A server that sends text only gets it re-tokenized by the engine.
- :data:`LLAMACPP`: llama-server's own ``POST /completion``, whose stream carries the token ids
  (``return_tokens``) that its OpenAI route leaves out. llama.cpp's sampler chain has more stages than
  OpenAI's fields (min-p 0.05, a repeat penalty, DRY, XTC, ...), so every stage the run does not use is
  switched off explicitly: the server samples from the same distribution as our arms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from spectoolkit.config import SamplingConfig
from spectoolkit.sampling import SamplingParams
from spectoolkit.serving.api import ServeRequest


@dataclass(frozen=True)
class Piece:
    """What one stream chunk says about one completion: new text, new token ids (None: the server sent none),
    its finish reason once it finished, and how many tokens it has generated so far when the server says (a
    count above the ids received means the stream left some out: llama-server sends no chunk for a token that
    ends inside a UTF-8 character, and its text comes with the next one)."""

    text: str
    ids: list[int] | None
    finish_reason: str | None
    generated: int | None = None


class Wire(Protocol):
    def url(self, base_url: str) -> str:
        """Where a completion is posted, for the OpenAI base URL ``base_url`` (``http://host:port/v1``)."""
        ...

    def payload(self, request: ServeRequest, model: str, sampling: SamplingConfig) -> dict[str, Any]: ...

    def pieces(self, chunk: dict[str, Any]) -> list[Piece]:
        """The completion updates in one decoded ``data:`` chunk of the stream."""
        ...


def server_root(base_url: str) -> str:
    """``http://host:port/v1`` -> ``http://host:port``: where a server's routes outside OpenAI's API live."""
    return base_url.rstrip("/").removesuffix("/v1")


def request_sampling(request: ServeRequest, sampling: SamplingConfig) -> SamplingConfig | SamplingParams:
    """What ``request`` samples with: its own settings (a sampling mix's), else the run's."""
    return request.sampling if request.sampling is not None else sampling


def sampling_payload(sampling: SamplingConfig | SamplingParams) -> dict[str, Any]:
    """The OpenAI request fields that make a server sample as the run does (greedy: temperature 0)."""
    payload: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p}
    if sampling.top_k > 0:
        payload["top_k"] = sampling.top_k
    return payload


class OpenAIWire:
    def url(self, base_url: str) -> str:
        return f"{base_url.rstrip('/')}/completions"

    def payload(self, request: ServeRequest, model: str, sampling: SamplingConfig) -> dict[str, Any]:
        return {
            "model": model, "prompt": list(request.prompt_ids), "max_tokens": request.max_new_tokens,
            "seed": request.seed, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, **sampling_payload(request_sampling(request, sampling)),
        }  # fmt: skip

    def pieces(self, chunk: dict[str, Any]) -> list[Piece]:
        return [
            Piece(choice.get("text") or "", _ids(choice.get("token_ids")), choice.get("finish_reason"))
            for choice in chunk.get("choices") or []
        ]


# llama.cpp sampler stages and the setting that makes each a no-op (common/common.h, tools/server/server-schema.cpp).
LLAMACPP_NEUTRAL = {
    "min_p": 0.0, "typical_p": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0, "repeat_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0, "mirostat": 0, "dynatemp_range": 0.0,
}  # fmt: skip


class LlamaCppWire:
    def url(self, base_url: str) -> str:
        return f"{server_root(base_url)}/completion"

    def payload(self, request: ServeRequest, model: str, sampling: SamplingConfig) -> dict[str, Any]:
        return {
            "model": model, "prompt": list(request.prompt_ids), "n_predict": request.max_new_tokens,
            "seed": request.seed, "stream": True, "return_tokens": True,
            "cache_prompt": False,  # a prompt repeated across warm-up and timed passes must not skip its prefill
            **LLAMACPP_NEUTRAL, **_llamacpp_sampling(request_sampling(request, sampling)),
        }  # fmt: skip

    def pieces(self, chunk: dict[str, Any]) -> list[Piece]:
        finish = None
        if chunk.get("stop"):
            finish = "length" if chunk.get("stop_type") == "limit" else "stop"
        generated = chunk.get("tokens_predicted")
        count = int(generated) if isinstance(generated, int) else None
        return [Piece(chunk.get("content") or "", _ids(chunk.get("tokens")), finish, count)]


def _llamacpp_sampling(sampling: SamplingConfig | SamplingParams) -> dict[str, Any]:
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": max(sampling.top_k, 0)}


def _ids(ids: Any) -> list[int] | None:
    return None if ids is None else [int(i) for i in ids]


OPENAI = OpenAIWire()
LLAMACPP = LlamaCppWire()
