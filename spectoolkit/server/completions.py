"""``/v1/completions`` and ``/v1/chat/completions``: checked requests to engine requests, outputs to OpenAI JSON.

Each choice is one engine request with the request's own sampling (the server's ``sampling=`` config fills what it
omits), seed and draft cap; the samples of one prompt (``n``, ``best_of``) name the first as their leader and share
its prompt's KV. ``best_of > n`` keeps the ``n`` samples of highest cumulative logprob (vLLM's definition).
Non-streaming requests wait for every choice (run concurrently in the running batch); streaming ones send
Server-Sent Events, one chunk per engine step and choice, then ``data: [DONE]``. Log-probabilities of output tokens
are the engine's (the target's raw logits at each emitted token, as vLLM reports them); ``echo`` scores the prompt
with one target forward (:mod:`spectoolkit.server.scoring`). ``return_token_ids`` (vLLM's extension) adds
``token_ids`` and ``prompt_token_ids`` to each choice.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from spectoolkit.sampling import MAX_LOGPROBS, SamplingParams
from spectoolkit.server.generation import Delta, GenerationSpec, Output, collect, generate, new_request_id
from spectoolkit.server.model import ServedModel
from spectoolkit.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CommonRequest,
    CompletionRequest,
    choice_counts,
    request_sampling,
)
from spectoolkit.server.runner import EngineRunner
from spectoolkit.server.scoring import TokenScores
from spectoolkit.serving.api import TokenLogprob


@dataclass
class Context:
    runner: EngineRunner
    served: ServedModel
    timeout_s: float

    def check_running(self) -> None:
        if not self.runner.alive or not self.runner.accepting:
            raise APIError("the server is shutting down or its engine stopped", code="unavailable", status=503)


def _sampling(body: CommonRequest, served: ServedModel, logprobs: int | None) -> SamplingParams:
    """The request's rule, checked against what this server's drafter can apply (APIError naming the field)."""
    sampling = request_sampling(body, served.sampling, logprobs)
    refused = served.unsupported(sampling)
    if refused is not None:
        raise APIError(str(refused), refused.field)
    return sampling


def _samples(body: CommonRequest, served: ServedModel, prompts: list[list[int]], max_tokens: int, best_of: int,
             sampling: SamplingParams) -> list[GenerationSpec]:  # fmt: skip
    """``best_of`` engine requests per prompt, prompt-major; a prompt's later samples follow its first (shared KV).
    Choice ``c`` is seeded ``seed + c`` (the request's seed, else the server's)."""
    base = body.seed if body.seed is not None else served.sampling.seed
    draft_cap, specs = body.draft_cap(), []
    for index, ids in enumerate(prompts):
        leader = None
        for sample in range(best_of):
            choice = index * best_of + sample
            spec = GenerationSpec(ids, max_tokens, base + choice, body.stop_strings(), sampling, draft_cap,
                                  after=leader, index=choice)  # fmt: skip
            leader = leader or spec.request_id
            specs.append(spec)
    return specs


def _best(outputs: list[Output], n: int, best_of: int) -> list[int]:
    """Indices of the outputs returned: per prompt, all ``n`` samples, or the ``n`` best of ``best_of``."""
    kept = []
    for first in range(0, len(outputs), best_of):
        group = list(range(first, first + best_of))
        if best_of > n:
            group = sorted(group, key=lambda i: -outputs[i].cumulative_logprob)[:n]
        kept += group
    return kept


# ---- /v1/completions ------------------------------------------------------------------------------


def completion_specs(body: CompletionRequest, ctx: Context) -> list[GenerationSpec]:
    """Every sample of every prompt of ``body`` checked and encoded (raises APIError on the first bad one)."""
    served = ctx.served
    served.check_model(body.model)
    n, best_of = choice_counts(body.n, body.best_of)
    if body.stream and best_of > n:
        raise APIError(f"best_of={best_of} > n={n} with stream=true is not supported: send stream=false", "best_of")
    max_tokens = served.default_max_tokens if body.max_tokens is None else body.max_tokens
    if max_tokens < 1 and not (body.echo and max_tokens == 0):
        raise APIError(f"max_tokens={max_tokens} must be >= 1 (0 only with echo=true)", "max_tokens")
    ranked = 0 if best_of > n else None  # best_of ranks samples by their tokens' logprobs
    sampling = _sampling(body, served, body.logprobs if body.logprobs is not None else ranked)
    prompts = []
    for index, prompt in enumerate(body.prompts()):
        ids = served.encode(prompt, "prompt" if index == 0 else f"prompt.{index}")
        served.check_length(len(ids), max_tokens)
        prompts.append(ids)
    return _samples(body, served, prompts, max_tokens, best_of, sampling)


async def _run(ctx: Context, spec: GenerationSpec) -> Output:
    if spec.max_tokens == 0:
        return Output(finish_reason="length")
    return await collect(generate(ctx.runner, spec, ctx.served.tokenizer, ctx.served.eos_ids, ctx.timeout_s))


async def complete(body: CompletionRequest, ctx: Context) -> dict[str, Any]:
    specs = completion_specs(body, ctx)
    ctx.check_running()
    outputs = await asyncio.gather(*(_run(ctx, spec) for spec in specs))
    n, best_of = choice_counts(body.n, body.best_of)
    choices = []
    for index, kept in enumerate(_best(outputs, n, best_of)):
        spec, output = specs[kept], outputs[kept]
        text = (ctx.served.tokenizer.decode(spec.prompt_ids) if body.echo else "") + output.text
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": output.finish_reason}
        if body.logprobs is not None:
            choice["logprobs"] = await _logprobs(ctx, spec.prompt_ids, output, body.logprobs, body.echo)
        if body.return_token_ids:
            choice |= {"token_ids": output.token_ids, "prompt_token_ids": spec.prompt_ids}
        choices.append(choice)
    return {**_head("cmpl", "text_completion", ctx), "choices": choices, "usage": _usage(specs, outputs)}


async def _logprobs(ctx: Context, prompt_ids: list[int], output: Output, top: int, echo: bool) -> dict:
    """OpenAI's completions ``logprobs`` object over the echoed prompt (when ``echo``, scored by one target forward)
    and the output (the engine's logprobs)."""
    ids, token_logprobs, tops = [], [], []
    if echo:
        scores: TokenScores = await asyncio.wrap_future(ctx.runner.call(lambda: ctx.served.scorer(prompt_ids, top)))
        ids, token_logprobs, tops = list(prompt_ids), list(scores.token_logprobs), list(scores.top)
    ids += output.token_ids
    token_logprobs += [entry.logprob for entry in output.logprobs]
    tops += [entry.top for entry in output.logprobs]
    return _completion_logprobs(ctx, ids, token_logprobs, tops, 0)


def _completion_logprobs(ctx: Context, ids: list[int], token_logprobs: list, tops: list, offset: int) -> dict:
    text = ctx.served.token_text
    tokens = [text(i) for i in ids]
    offsets, position = [], offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs,
            "top_logprobs": [None if alt is None else {text(i): lp for i, lp in alt} for alt in tops],
            "text_offset": offsets}  # fmt: skip


async def stream_completion(body: CompletionRequest, ctx: Context, specs: list[GenerationSpec]) -> AsyncIterator[str]:
    """SSE events of a streamed completion (``specs`` from :func:`completion_specs`, checked before the
    response started)."""
    head = _head("cmpl", "text_completion", ctx)
    outputs = [Output() for _ in specs]

    def chunk(index: int, delta: Delta) -> dict:
        choice = {"index": index, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}
        if body.logprobs is not None:
            offset = len(outputs[index].text)
            choice["logprobs"] = _completion_logprobs(ctx, delta.token_ids, [e.logprob for e in delta.logprobs],
                                                      [e.top for e in delta.logprobs], offset)  # fmt: skip
        if body.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return {**head, "choices": [choice]}

    if body.echo:
        for index, spec in enumerate(specs):
            text = ctx.served.tokenizer.decode(spec.prompt_ids)
            yield _event({**head, "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": None}]})
    async for index, delta in _merged(ctx, specs):
        event = chunk(index, delta)
        outputs[index].token_ids += delta.token_ids
        outputs[index].text += delta.text
        yield _event(event)
    if body.stream_options and body.stream_options.include_usage:
        yield _event({**head, "choices": [], "usage": _usage(specs, outputs)})
    yield "data: [DONE]\n\n"


async def _merged(ctx: Context, specs: list[GenerationSpec]) -> AsyncIterator[tuple[int, Delta]]:
    """The deltas of every choice as they come (one task per choice; all cancelled if the client leaves)."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, spec: GenerationSpec) -> None:
        try:
            if spec.max_tokens == 0:
                await merged.put((index, Delta([], "", "length")))
                return
            async for delta in generate(ctx.runner, spec, ctx.served.tokenizer, ctx.served.eos_ids, ctx.timeout_s):
                await merged.put((index, delta))
        except APIError as exc:
            await merged.put((index, exc))
        finally:
            await merged.put((index, None))

    tasks = [asyncio.create_task(pump(i, spec)) for i, spec in enumerate(specs)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- /v1/chat/completions -------------------------------------------------------------------------


def chat_specs(body: ChatCompletionRequest, ctx: Context) -> list[GenerationSpec]:
    """The ``n`` samples of ``body``'s conversation, checked and encoded."""
    served = ctx.served
    served.check_model(body.model)
    n, _ = choice_counts(body.n)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs needs logprobs=true", "top_logprobs")
    top = body.top_logprobs or 0
    if not 0 <= top <= MAX_LOGPROBS:
        raise APIError(f"top_logprobs={top} must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
    sampling = _sampling(body, served, top if body.logprobs else None)
    ids = served.encode_chat(body.as_template_input())
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = max(1, served.context - len(ids))
    if max_tokens < 1:
        raise APIError(f"{param}={max_tokens} must be >= 1", param)
    served.check_length(len(ids), max_tokens, param)
    return _samples(body, served, [ids], max_tokens, n, sampling)


def _chat_logprobs(ctx: Context, ids: list[int], logprobs: list[TokenLogprob]) -> dict:
    """OpenAI's chat ``logprobs`` object: per token its text, logprob, UTF-8 bytes and the top alternatives."""
    text = ctx.served.token_text

    def entry(token_id: int, logprob: float) -> dict:
        token = text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [entry(i, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for i, lp in zip(ids, logprobs, strict=True)]}  # fmt: skip


async def chat(body: ChatCompletionRequest, ctx: Context) -> dict[str, Any]:
    specs = chat_specs(body, ctx)
    ctx.check_running()
    outputs = await asyncio.gather(*(_run(ctx, spec) for spec in specs))
    choices = []
    for index, (spec, output) in enumerate(zip(specs, outputs, strict=True)):
        choice = {"index": index, "message": {"role": "assistant", "content": output.text}, "logprobs": None,
                  "finish_reason": output.finish_reason}  # fmt: skip
        if body.logprobs:
            choice["logprobs"] = _chat_logprobs(ctx, output.token_ids, output.logprobs)
        if body.return_token_ids:
            choice |= {"token_ids": output.token_ids, "prompt_token_ids": spec.prompt_ids}
        choices.append(choice)
    return {**_head("chatcmpl", "chat.completion", ctx), "choices": choices, "usage": _usage(specs, outputs)}


async def stream_chat(body: ChatCompletionRequest, ctx: Context, specs: list[GenerationSpec]) -> AsyncIterator[str]:
    head = _head("chatcmpl", "chat.completion.chunk", ctx)
    outputs = [Output() for _ in specs]
    for index in range(len(specs)):
        first = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        yield _event({**head, "choices": [first]})
    async for index, delta in _merged(ctx, specs):
        outputs[index].token_ids += delta.token_ids
        choice = {"index": index, "delta": {"content": delta.text} if delta.text else {}, "logprobs": None,
                  "finish_reason": delta.finish_reason}  # fmt: skip
        if body.logprobs:
            choice["logprobs"] = _chat_logprobs(ctx, delta.token_ids, delta.logprobs)
        if body.return_token_ids:
            choice["token_ids"] = delta.token_ids
        yield _event({**head, "choices": [choice]})
    if body.stream_options and body.stream_options.include_usage:
        yield _event({**head, "choices": [], "usage": _usage(specs, outputs)})
    yield "data: [DONE]\n\n"


# ---- shared -----------------------------------------------------------------------------------------


def _head(prefix: str, kind: str, ctx: Context) -> dict[str, Any]:
    return {"id": new_request_id(prefix), "object": kind, "created": int(time.time()), "model": ctx.served.name}


def _usage(specs: list[GenerationSpec], outputs: list[Output]) -> dict[str, int]:
    """Each prompt counted once (its samples share it), every sample's output tokens."""
    prompt = sum(len(spec.prompt_ids) for spec in specs if spec.after is None)
    completion = sum(len(output.token_ids) for output in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def error_event(exc: APIError) -> str:
    return _event(exc.body())
