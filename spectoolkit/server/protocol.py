"""OpenAI request bodies the server accepts, and the OpenAI-style error every bad request gets (issue 17).

Pydantic checks types (strictly: ``"5"`` is not an int); :func:`check_sampling` and the app check what
depends on the running server (model name, context length, its sampling mode). Every failure is an
:class:`APIError`, rendered as ``{"error": {"message", "type", "param", "code"}}`` with status 400 (404
for an unknown model, as OpenAI and vLLM answer).
Fields we do not know are ignored, as OpenAI-compatible servers do; fields we know but cannot honour
(``n > 1``, a temperature other than the server's) are refused, never silently dropped.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from spectoolkit.config import SamplingConfig

MAX_LOGPROBS = 20  # top alternatives per position (OpenAI's completions limit)
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


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: StrictNumber | None = None
    top_p: StrictNumber | None = None
    top_k: StrictInt | None = None  # vLLM's extension
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    return_token_ids: StrictBool = False  # vLLM's extension: output (and prompt) token ids in the response

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class CompletionRequest(_Common):
    """``POST /v1/completions``: one prompt (text or token ids) or a batch of them."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

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


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``: the messages go through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False

    def as_template_input(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


def check_sampling(body: _Common, sampling: SamplingConfig) -> None:
    """The request's sampling must be the server's (one verifier per server): omitted fields take it."""
    if body.n != 1:
        raise APIError(f"n={body.n} is not supported: this server returns one choice per prompt (n=1)", "n")
    mode = "greedy (sampling=greedy)" if sampling.greedy else f"temperature {sampling.temperature}"
    wanted = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}
    off = {"top_p": (1.0, 1.0), "top_k": (0, -1)}  # (ours, OpenAI / vLLM's) value that means "not used"
    for name, expected in wanted.items():
        value = getattr(body, name)
        ours, theirs = off.get(name, (None, None))
        if value is None or value == expected or (expected == ours and value == theirs):
            continue
        raise APIError(
            f"{name}={value} differs from this server's sampling ({mode}, {name}={expected}): omit {name} or send "
            f"{expected}, or start the server with the sampling you want (sampling=... / sampling.{name}=...)",
            name,
        )


def pydantic_message(errors: list[dict]) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, and the parameter it names."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'cannot parse it')}", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{param or 'request'}: {first.get('msg', 'invalid')}{more}", param
