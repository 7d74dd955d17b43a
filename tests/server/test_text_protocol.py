"""The server's request-side pieces without a model: incremental text with stop strings, sampling checks,
pydantic errors as OpenAI errors, and the request bodies' helpers.

TextStream runs on the embedded SmolLM2 tokenizer (byte-level BPE: a multi-byte character can span
tokens, and a token's text can decode as U+FFFD until the next one arrives).
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from spectoolkit.config import SamplingConfig
from spectoolkit.sampling import SamplingParams
from spectoolkit.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    choice_counts,
    pydantic_message,
    request_sampling,
)
from spectoolkit.server.text import REPLACEMENT, TextStream

EOS = 2  # <|im_end|>
MULTIBYTE = "héllo wörld 日本語 🎉 done"  # 🎉 and 語 each span several tokens


@pytest.fixture(scope="module")
def tokenizer():
    from spectoolkit.wiring.loading import load_tokenizer

    return load_tokenizer(None)


def _stream(tokenizer, ids: list[int], stops: list[str], chunk: int = 1) -> tuple[TextStream, list[str]]:
    """Feed ``ids`` ``chunk`` at a time (a speculative step emits several); the deltas returned."""
    stream = TextStream(tokenizer, stops, frozenset({EOS}))
    deltas = [stream.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return stream, deltas


# ---- TextStream ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 2, 5])
@pytest.mark.parametrize("text", [MULTIBYTE, "def f(x):\n    return x  # ok\n"])
def test_no_stops_text_is_the_full_decode(tokenizer, text, chunk):
    ids = tokenizer(text).input_ids + [EOS]
    stream, deltas = _stream(tokenizer, ids, [], chunk)
    rest = stream.flush()
    assert "".join(deltas) + rest == text == stream.text
    assert not any(REPLACEMENT in delta for delta in deltas), "half a UTF-8 character was sent"
    assert stream.flush() == "", "flush twice gives nothing new"


@pytest.mark.parametrize("chunk", [1, 3, 12])
@pytest.mark.parametrize(
    ("stops", "before"),
    [
        (["END OF"], "The answer is 42. "),  # the stop spans two tokens (" END", " OF")
        ([" OF TEXT and"], "The answer is 42. END"),  # three tokens, starting mid-token boundary
        (["42. E"], "The answer is "),  # ends inside the token " END"
        (["and more", "is 4"], "The answer "),  # the earliest of several stops wins
        (["The"], ""),  # at the very start: nothing is sent
    ],
)
def test_stop_strings_are_never_partially_sent(tokenizer, stops, before, chunk):
    ids = tokenizer("The answer is 42. END OF TEXT and more").input_ids
    stream = TextStream(tokenizer, stops, frozenset({EOS}))
    sent = ""
    for i in range(0, len(ids), chunk):
        sent += stream.add(ids[i : i + chunk])
        assert before.startswith(sent), f"sent {sent!r}: more than the text before the stop {before!r}"
    assert stream.stopped
    assert sent == before == stream.text
    assert not any(stop in sent for stop in stops)
    assert stream.add([EOS]) == "" and stream.flush() == "", "nothing after a stop"


def test_stop_never_found_flush_gives_held_text(tokenizer):
    text = "one two three four"
    ids = tokenizer(text).input_ids
    stream, deltas = _stream(tokenizer, ids, ["three four five"])
    assert not stream.stopped
    held = stream.flush()
    assert held == text[-(len("three four five") - 1) :], "the last len(stop) - 1 characters are held back"
    assert "".join(deltas) + held == text


@pytest.mark.parametrize(("text", "stop"), [("say 🎉 done", "y 🎉"), (MULTIBYTE, "本語 🎉"), (MULTIBYTE, "語 🎉")])
def test_stop_ending_in_a_multibyte_character(tokenizer, text, stop):
    """The emoji is three tokens; while its bytes are incomplete the decode ends in U+FFFD, which
    TextStream.add counts among the len(stop) - 1 characters it holds back, so the start of the stop
    ("y", "本", "語") is sent before the stop is complete."""
    ids = tokenizer(text).input_ids
    stream, deltas = _stream(tokenizer, ids, [stop])
    before = text[: text.index(stop)]
    assert stream.stopped
    assert "".join(deltas) == before, f"sent {''.join(deltas)!r}, the text before the stop is {before!r}"


def test_stop_string_across_newline_tokens(tokenizer):
    ids = tokenizer("first line\n\nsecond paragraph").input_ids
    stream, deltas = _stream(tokenizer, ids, ["\n\n"])
    assert "".join(deltas) == "first line" and stream.stopped


# ---- request_sampling: the request's own fields, the server's for the rest --------------------------------

GREEDY = SamplingConfig()
SAMPLED = SamplingConfig(temperature=0.8, top_k=50, top_p=0.95)


def _body(**fields) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="a", **fields)


@pytest.mark.parametrize(
    ("default", "fields", "expected"),
    [
        (GREEDY, {}, SamplingParams()),
        (GREEDY, {"temperature": 0.7}, SamplingParams(temperature=0.7)),
        (GREEDY, {"temperature": 1, "top_k": -1, "top_p": 0.9}, SamplingParams(temperature=1.0, top_p=0.9)),
        (SAMPLED, {}, SamplingParams(temperature=0.8, top_k=50, top_p=0.95)),
        (SAMPLED, {"temperature": 0}, SamplingParams(temperature=0.0, top_k=50, top_p=0.95)),
        (SAMPLED, {"top_k": -1, "min_p": 0.1}, SamplingParams(temperature=0.8, top_p=0.95, min_p=0.1)),
        (GREEDY, {"presence_penalty": 1, "frequency_penalty": -0.5, "repetition_penalty": 1.2},
         SamplingParams(presence_penalty=1.0, frequency_penalty=-0.5, repetition_penalty=1.2)),
    ],
)  # fmt: skip
def test_request_sampling_takes_the_servers_for_omitted_fields(default, fields, expected):
    assert request_sampling(_body(**fields), default) == expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_request_sampling_names_the_bad_field(fields, param):
    with pytest.raises(APIError) as caught:
        request_sampling(_body(**fields), GREEDY)
    assert caught.value.param == param and caught.value.status == 400 and param in caught.value.message


def test_logprobs_reach_the_rule_and_chat_is_read_the_same_way():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], temperature=0.5)
    assert request_sampling(body, GREEDY, 3) == SamplingParams(temperature=0.5, logprobs=3)


@pytest.mark.parametrize(
    ("n", "best_of", "param"), [(0, None, "n"), (17, None, "n"), (3, 2, "best_of"), (1, 17, "best_of")]
)
def test_choice_counts_refuse_out_of_range(n, best_of, param):
    with pytest.raises(APIError) as caught:
        choice_counts(n, best_of)
    assert caught.value.param == param


def test_choice_counts_default_best_of_to_n():
    assert choice_counts(2) == (2, 2) and choice_counts(1, 3) == (1, 3)


# ---- pydantic errors, APIError, request bodies -------------------------------------------------------


def test_pydantic_message_names_the_parameter():
    errors = [{"loc": ("body", "max_tokens"), "msg": "Input should be a valid integer"}]
    assert pydantic_message(errors) == ("max_tokens: Input should be a valid integer", "max_tokens")
    nested = [{"loc": ("body", "messages", 0, "role"), "msg": "bad role"}, {"loc": ("body", "n"), "msg": "x"}]
    assert pydantic_message(nested) == ("messages.0.role: bad role (and 1 more)", "messages.0.role")
    assert pydantic_message([{"loc": ("body",), "msg": "Field required"}]) == ("request: Field required", None)
    assert pydantic_message([]) == ("request: invalid request", None)


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"max_tokens": "5"}, "max_tokens"), ({"max_tokens": True}, "max_tokens"), ({"stream": 1}, "stream"),
     ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"seed": 1.5}, "seed")],
)  # fmt: skip
def test_strict_types_refused(fields, param):
    with pytest.raises(ValidationError) as caught:
        CompletionRequest(model="m", prompt="a", **fields)
    message, named = pydantic_message(list(caught.value.errors()))
    assert named == param and message.startswith(param + ":")


def test_api_error_body():
    assert APIError("bad", "prompt").body() == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "prompt", "code": None}
    }
    assert APIError("boom", code="internal_error", status=500).body()["error"]["type"] == "server_error"


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [("a", ["a"]), ([1, 2], [[1, 2]]), (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]]), ([], [[]])],
)
def test_completion_prompts_are_a_batch(prompt, prompts):
    assert CompletionRequest(model="m", prompt=prompt).prompts() == prompts


def test_stop_strings_drop_empty_ones():
    assert _body(stop="x").stop_strings() == ["x"]
    assert _body(stop=["", "y", "z"]).stop_strings() == ["y", "z"]
    assert _body().stop_strings() == []


def test_unknown_fields_are_ignored_and_developer_is_system():
    body = ChatCompletionRequest(model="m", messages=[{"role": "developer", "content": [{"type": "text", "text": "a"},
                                 {"type": "text", "text": "b"}]}], frequency_penalty=0.0)  # fmt: skip
    assert body.as_template_input() == [{"role": "system", "content": "ab"}]
