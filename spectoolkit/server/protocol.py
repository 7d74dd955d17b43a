"""OpenAI request bodies the server accepts, and the OpenAI-style error every bad request gets (issue 17).

Pydantic checks types (strictly: ``"5"`` is not an int); :func:`request_sampling` and the app check what
depends on values or the running server (ranges, model name, context length, what its drafter can apply). Every
failure is an :class:`APIError`, rendered as ``{"error": {"message", "type", "param", "code"}}`` with status 400
(404 for an unknown model, as OpenAI and vLLM answer), ``param`` naming the field.
Sampling is per request (issue 56): the server's ``sampling=`` config fills the fields a request omits. Speculation
is per request too, through vLLM-style extra body fields: ``speculate: false`` turns it off for the request,
``num_speculative_tokens: k`` caps its drafts per round. Fields we do not know are ignored, as OpenAI-compatible
servers do; fields we know but cannot honour are refused, never silently dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from spectoolkit.config import SamplingConfig
from spectoolkit.sampling import MAX_LOGPROBS, SamplingError, SamplingParams

MAX_CHOICES = 16  # n and best_of at most (each is one engine request)
StrictNumber = StrictFloat | StrictInt


class APIError(Exception):
    """A request the server refuses: OpenAI's error object, HTTP ``status``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class CommonRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: StrictNumber | None = None
    top_p: StrictNumber | None = None
    top_k: StrictInt | None = None  # vLLM's extension
    min_p: StrictNumber | None = None  # vLLM's extension
    presence_penalty: StrictNumber | None = None
    frequency_penalty: StrictNumber | None = None
    repetition_penalty: StrictNumber | None = None  # vLLM's extension
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    return_token_ids: StrictBool = False  # vLLM's extension: output (and prompt) token ids in the response
    speculate: StrictBool = True  # ours (extra_body): false = no speculation for this request
    num_speculative_tokens: StrictInt | None = None  # ours (extra_body): at most this many drafts per round

    def draft_cap(self) -> int | None:
        """The request's drafts per round at most (0: speculation off; None: as the server's policy says)."""
        if not self.speculate:
            return 0
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise APIError(f"num_speculative_tokens={self.num_speculative_tokens} must be >= 0 (0: no speculation)",
                           "num_speculative_tokens")  # fmt: skip
        return self.num_speculative_tokens

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class CompletionRequest(CommonRequest):
    """``POST /v1/completions``: one prompt (text or token ids) or a batch of them."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: StrictInt | None = None  # vLLM's definition: this many samples, the n of highest cumulative logprob

    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt (a single text or id list is a batch of one)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt) if prompt else [[]]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(CommonRequest):
    """``POST /v1/chat/completions``: the messages go through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None

    def as_template_input(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


def request_sampling(body: CommonRequest, default: SamplingConfig, logprobs: int | None = None) -> SamplingParams:
    """The request's token rule: its own fields, the server's ``default`` for those it omits (raises APIError naming
    the bad field). ``logprobs``: how many alternatives per token the engine reports (None: none)."""
    asked = {
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
    }  # fmt: skip
    fields = {name: value for name, value in asked.items() if value is not None}
    try:
        return SamplingParams(**(dataclasses.asdict(SamplingParams.of(default)) | fields | {"logprobs": logprobs}))
    except SamplingError as exc:
        raise APIError(str(exc), exc.field) from None


def choice_counts(n: int, best_of: int | None = None) -> tuple[int, int]:
    """(n, best_of): choices returned per prompt and samples drawn for them (vLLM: best_of >= n, default n)."""
    if not 1 <= n <= MAX_CHOICES:
        raise APIError(f"n={n} must be in [1, {MAX_CHOICES}]", "n")
    if best_of is not None and not n <= best_of <= MAX_CHOICES:
        raise APIError(f"best_of={best_of} must be in [n={n}, {MAX_CHOICES}]", "best_of")
    return n, best_of or n


def pydantic_message(errors: list[dict]) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, and the parameter it names."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'cannot parse it')}", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{param or 'request'}: {first.get('msg', 'invalid')}{more}", param
