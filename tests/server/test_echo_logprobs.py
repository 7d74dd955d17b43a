"""``echo`` + ``logprobs`` on /v1/completions: the prompt scored by the target (lm-eval's loglikelihood path).

Position 0 has no context (None); position i > 0 carries log_softmax(target logits at i - 1)[ids[i]],
recomputed here with a plain forward of the served target; the top alternative at each position is the
greedy token there, and with ``max_tokens: 1`` the one generated token is that greedy token.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.server.helpers import Server, completion, post

pytestmark = pytest.mark.integration

PROMPT = "def fib(n):\n    return fib(n - 1) +"  # short: scoring runs the target row by row
TOLERANCE = 1e-4


def _log_softmax(server: Server, ids: list[int]) -> torch.Tensor:
    """[L, V] log-probabilities of the next token after each prefix of ``ids``: a plain forward of the served
    target, run on the engine thread (between steps)."""
    model = server.engine.model

    def forward() -> torch.Tensor:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return server.built.runner.call(forward).result(timeout=300)


@pytest.fixture(scope="module")
def scored(server: Server) -> dict:
    response = post(server, "/completions", completion(PROMPT, 0, echo=True, logprobs=1))
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def reference(scored, server: Server) -> torch.Tensor:
    """[L, V]: row i scores the token after the first i + 1 prompt tokens (the last row: the next token)."""
    return _log_softmax(server, scored["choices"][0]["prompt_token_ids"])


def test_echo_returns_the_prompt(scored):
    (choice,) = scored["choices"]
    assert choice["text"] == PROMPT
    assert choice["token_ids"] == [] and choice["finish_reason"] == "length"
    assert scored["usage"]["completion_tokens"] == 0
    assert scored["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"])


def test_token_logprobs_are_the_targets(scored, reference, server: Server):
    (choice,) = scored["choices"]
    ids, logprobs = choice["prompt_token_ids"], choice["logprobs"]
    tokenizer = server.built.served.tokenizer
    assert logprobs["tokens"] == [tokenizer.decode([i]) for i in ids]
    assert "".join(logprobs["tokens"]) == PROMPT
    assert logprobs["text_offset"] == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(ids))]
    token_logprobs = logprobs["token_logprobs"]
    assert len(token_logprobs) == len(ids) and token_logprobs[0] is None
    expected = reference[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(token_logprobs[1:]), expected, atol=TOLERANCE, rtol=0)
    assert all(lp <= 0 for lp in token_logprobs[1:])


def test_top_logprobs_name_the_greedy_token(scored, reference, server: Server):
    (choice,) = scored["choices"]
    ids, tops = choice["prompt_token_ids"], choice["logprobs"]["top_logprobs"]
    tokenizer = server.built.served.tokenizer
    best = reference[:-1].max(dim=-1)
    assert tops[0] is None and len(tops) == len(ids)
    for i, top in enumerate(tops[1:]):
        ((token, logprob),) = top.items()  # logprobs=1: one alternative
        assert token == tokenizer.decode([int(best.indices[i])])
        assert math.isclose(logprob, float(best.values[i]), abs_tol=TOLERANCE)
        assert logprob >= choice["logprobs"]["token_logprobs"][i + 1] - TOLERANCE


def test_echo_with_one_token_appends_the_greedy_token(scored, reference, server: Server):
    response = post(server, "/completions", completion(PROMPT, 1, echo=True, logprobs=2))
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    ids, (token_id,) = choice["prompt_token_ids"], choice["token_ids"]
    assert ids == scored["choices"][0]["prompt_token_ids"]
    tokenizer = server.built.served.tokenizer
    assert choice["text"] == PROMPT + tokenizer.decode([token_id])
    assert token_id == int(reference[-1].argmax()), "the generated token is not the target's greedy choice"
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1
    assert logprobs["tokens"][-1] == tokenizer.decode([token_id])
    assert math.isclose(logprobs["token_logprobs"][-1], float(reference[-1, token_id]), abs_tol=TOLERANCE)
    last_top = logprobs["top_logprobs"][-1]
    prompt_logprobs = scored["choices"][0]["logprobs"]["token_logprobs"]
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:-1] == pytest.approx(prompt_logprobs[1:], abs=TOLERANCE)
    assert len(last_top) == 2 and max(last_top.values()) == pytest.approx(logprobs["token_logprobs"][-1], abs=1e-6)


def test_logprobs_without_echo_cover_the_output_only(server: Server):
    response = post(server, "/completions", completion(PROMPT, 2, logprobs=0))
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(choice["token_ids"]) == 2
    assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs["token_logprobs"])
    assert logprobs["top_logprobs"] == [{}, {}]
    assert choice["text"] == "".join(logprobs["tokens"])
