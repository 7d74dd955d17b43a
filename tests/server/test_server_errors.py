"""Every refused request gets OpenAI's status code and error object and never reaches the engine; the server goes on.

OpenAI's shape: ``{"error": {"message": str, "type": "invalid_request_error", "param": str | None,
"code": str | None}}`` (type ``server_error`` for 5xx). Bad parameters, a body that is not JSON and a prompt
past the context are 400; an unknown model or route 404; a route's wrong method 405; a server shutting down
503. After all of them a normal request still gets its 200 and ``/health`` is ok.
"""

from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import MODEL, TIMEOUT_S, Server, completion, counters, post

pytestmark = pytest.mark.integration

CONTEXT = 8192  # SmolLM2-135M's max_position_embeddings
KV_SLOTS = 4096  # serve.max_kv_tokens of the test server
VOCAB = 49152

# (id, path, body, the param the error names, its code): each a 400
BAD = [
    ("max-tokens-string", "/completions", completion("a", "5"), "max_tokens", None),
    ("max-tokens-float", "/completions", completion("a", 5.0), "max_tokens", None),
    ("prompt-float", "/completions", completion(3.5, 2), "prompt", None),
    ("prompt-mixed-list", "/completions", completion([1, "a"], 2), "prompt", None),
    ("max-tokens-zero", "/completions", completion("a", 0), "max_tokens", None),
    ("max-tokens-negative", "/completions", completion("a", -1), "max_tokens", None),
    ("max-tokens-negative-echo", "/completions", completion("a", -1, echo=True), "max_tokens", None),
    ("prompt-too-long", "/completions", completion([17] * (CONTEXT - 4), 8), "max_tokens", "context_length_exceeded"),
    ("max-tokens-past-context", "/completions", completion("a", CONTEXT), "max_tokens", "context_length_exceeded"),
    ("token-id-vocab", "/completions", completion([1, VOCAB], 2), "prompt", None),
    ("token-id-negative", "/completions", completion([-1, 5], 2), "prompt", None),
    ("batch-token-id-vocab", "/completions", completion([[5, 6], [VOCAB + 3]], 2), "prompt.1", None),
    ("empty-prompt", "/completions", completion("", 2), "prompt", None),
    ("empty-id-list", "/completions", completion([], 2), "prompt", None),
    ("n-0", "/completions", completion("a", 2, n=0), "n", None),
    ("best-of-below-n", "/completions", completion("a", 2, n=3, best_of=2), "best_of", None),
    ("best-of-stream", "/completions", completion("a", 2, n=1, best_of=2, stream=True), "best_of", None),
    ("temperature", "/completions", completion("a", 2, temperature=-0.7), "temperature", None),
    ("temperature-string", "/completions", completion("a", 2, temperature="1"), "temperature", None),
    ("min-p", "/completions", completion("a", 2, min_p=1.5), "min_p", None),
    ("presence-penalty", "/completions", completion("a", 2, presence_penalty=2.5), "presence_penalty", None),
    ("frequency-penalty", "/completions", completion("a", 2, frequency_penalty=-9), "frequency_penalty", None),
    ("repetition-penalty", "/completions", completion("a", 2, repetition_penalty=0), "repetition_penalty", None),
    ("draft-cap", "/completions", completion("a", 2, num_speculative_tokens=-1), "num_speculative_tokens", None),
    ("top-p", "/completions", completion("a", 2, top_p=1.5), "top_p", None),
    ("top-k", "/completions", completion("a", 2, top_k=-5), "top_k", None),
    ("logprobs-over-20", "/completions", completion("a", 2, logprobs=21), "logprobs", None),
    ("stream-not-bool", "/completions", completion("a", 2, stream="yes"), "stream", None),
    ("missing-prompt", "/completions", {"model": MODEL, "max_tokens": 2}, "prompt", None),
    ("missing-model", "/completions", {"prompt": "a", "max_tokens": 2}, "model", None),
    ("chat-messages-string", "/chat/completions", {"model": MODEL, "messages": "hi", "max_tokens": 2}, "messages",
     None),
    ("chat-messages-empty", "/chat/completions", {"model": MODEL, "messages": [], "max_tokens": 2}, "messages", None),
    ("chat-role", "/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}],
                                        "max_tokens": 2}, "messages", None),
    ("chat-max-tokens-zero", "/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                   "max_tokens": 0}, "max_tokens", None),
    ("chat-max-completion-tokens-zero", "/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens", None),
    ("chat-n-0", "/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 0}, "n",
     None),
    ("chat-top-logprobs", "/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 2, "top_logprobs": 2}, "top_logprobs", None),
    ("chat-top-logprobs-21", "/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                   "max_tokens": 2, "logprobs": True, "top_logprobs": 21},
     "top_logprobs", None),
    ("chat-temperature", "/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                               "temperature": -1}, "temperature", None),
]  # fmt: skip
UNKNOWN_MODEL = [
    ("/completions", {"model": "gpt-4", "prompt": "a", "max_tokens": 2}),
    ("/completions", {"model": "gpt-4", "prompt": "a", "max_tokens": 2, "stream": True}),
    ("/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "x"}]}),
]


def _error(response: httpx.Response, status: int) -> dict:
    """The error object of ``response``, checked against OpenAI's shape and ``status``."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert isinstance(error["message"], str) and error["message"]
    return error


def _assert_openai_error(response: httpx.Response, param: str, code: str | None = None, status: int = 400) -> dict:
    error = _error(response, status)
    assert error["param"] is not None and error["param"].split(".")[0] == param.split(".")[0], error
    if "." in param:
        assert error["param"] == param, error
    assert error["code"] == code, error
    return error


def _untouched(server: Server, before) -> None:
    after = counters(server)
    assert after.prompt_tokens == before.prompt_tokens and after.failed_requests == before.failed_requests
    assert server.built.runner.in_flight() == 0


@pytest.mark.parametrize(("path", "body", "param", "code"), [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_request_is_400_and_never_reaches_engine(server: Server, path, body, param, code):
    before = counters(server)
    _assert_openai_error(post(server, path, body), param, code)
    _untouched(server, before)


@pytest.mark.parametrize(("path", "body"), UNKNOWN_MODEL, ids=["completions", "completions-stream", "chat"])
def test_unknown_model_is_404_model_not_found(server: Server, path: str, body: dict):
    """As OpenAI and vLLM answer: 404, invalid_request_error, code model_not_found; the message names the model."""
    before = counters(server)
    error = _assert_openai_error(post(server, path, body), "model", "model_not_found", status=404)
    assert body["model"] in error["message"] and MODEL in error["message"]
    _untouched(server, before)


def test_prompt_past_the_context_states_the_limit(server: Server):
    """vLLM's wording, which clients parse: the limit, then the tokens requested."""
    response = post(server, "/completions", completion([17] * (CONTEXT - 4), 8))
    error = _assert_openai_error(response, "max_tokens", "context_length_exceeded")
    assert error["message"].startswith(
        f"This model's maximum context length is {CONTEXT} tokens. However, you "
        f"requested {CONTEXT + 4} tokens ({CONTEXT - 4} in the prompt, 8 in max_tokens)"
    )


@pytest.mark.parametrize("stream", [False, True])
def test_server_shutting_down_is_503(server: Server, monkeypatch: pytest.MonkeyPatch, stream: bool):
    """While the runner drains (Ctrl-C / SIGTERM) a new request is refused before it reaches the engine."""
    monkeypatch.setattr(server.built.runner, "accepting", False)
    before = counters(server)
    error = _error(post(server, "/completions", completion("a", 2, stream=stream)), 503)
    assert error["code"] == "unavailable" and "shutting down" in error["message"]
    _untouched(server, before)


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/nope"), ("POST", "/v1/embeddings"), ("GET", "/nope")])
def test_unknown_route_is_404(server: Server, method: str, path: str):
    error = _error(httpx.request(method, server.root + path, json={}, timeout=TIMEOUT_S), 404)
    assert error["param"] is None and error["code"] is None
    assert f"{method} {path}" in error["message"] and "POST /v1/completions" in error["message"]


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [("GET", "/v1/completions", "POST"), ("POST", "/v1/models", "GET"), ("DELETE", "/health", "GET")],
)
def test_wrong_method_is_405(server: Server, method: str, path: str, allowed: str):
    response = httpx.request(method, server.root + path, timeout=TIMEOUT_S)
    error = _error(response, 405)
    assert response.headers["allow"] == allowed and error["param"] is None
    assert f"{method} {path} is not allowed" in error["message"] and allowed in error["message"]


def test_temperature_message_says_what_to_change(server: Server):
    error = _assert_openai_error(post(server, "/completions", completion("a", 2, temperature=-0.7)), "temperature")
    assert "-0.7" in error["message"] and "greedy" in error["message"]


def test_greedy_sampling_fields_are_accepted(server: Server):
    """Values that mean this server's own sampling (greedy, no top-k / top-p) are not refused."""
    body = completion("a", 1, temperature=0, top_p=1.0, top_k=-1, n=1, unknown_field="ignored")
    response = post(server, "/completions", body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["token_ids"]) == 1


@pytest.mark.parametrize("content", [b"{not json", b'{"model": "smollm2-135m", "prompt": "a",', b"[1, 2]"])
def test_invalid_json_body_is_400(server: Server, content: bytes):
    response = httpx.post(server.url + "/completions", content=content, timeout=TIMEOUT_S,
                          headers={"content-type": "application/json"})  # fmt: skip
    _error(response, 400)


def test_malformed_json_names_no_param(server: Server):
    """pydantic reports json_invalid at loc ("body", <offset>); pydantic_message turns the offset into the
    param. OpenAI sends param null for a body it cannot parse."""
    response = httpx.post(server.url + "/completions", content=b"{not json", timeout=TIMEOUT_S,
                          headers={"content-type": "application/json"})  # fmt: skip
    error = response.json()["error"]
    assert error["param"] is None and "JSON" in error["message"] and not error["message"][0].isdigit()


def test_request_larger_than_kv_pool_is_400(server: Server):
    """8 + 4200 tokens fit the 8192-token context but never the 4096-slot pool: the server knows before it
    submits (spectoolkit/server/model.py check_length), where the engine would fail it with a 500; the message
    states the server's limit."""
    response = post(server, "/completions", completion([17] * 8, KV_SLOTS + 104))
    error = _assert_openai_error(response, "max_tokens", "context_length_exceeded")
    assert f"maximum context length is {KV_SLOTS + 1} tokens" in error["message"]
    assert f"requested {KV_SLOTS + 112} tokens" in error["message"]


def test_server_still_serves_after_bad_requests(server: Server):
    for _, path, body, param, code in BAD[:5]:
        _assert_openai_error(post(server, path, body), param, code)
    response = post(server, "/completions", completion("Hello", 2))
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["token_ids"]) == 2
    health = httpx.get(server.root + "/health", timeout=TIMEOUT_S)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    models = httpx.get(server.url + "/models", timeout=TIMEOUT_S).json()
    assert [card["id"] for card in models["data"]] == [MODEL]
