"""``/v1/completions`` and ``/v1/chat/completions``: checked requests to engine requests, outputs to OpenAI JSON.

Non-streaming requests wait for every prompt of the batch (one engine request each, run concurrently
in the running batch); streaming ones send Server-Sent Events, one chunk per engine step, then
``data: [DONE]``. ``echo``/``logprobs`` score prompt and output with one target forward afterwards
(:mod:`spectoolkit.server.scoring`). ``return_token_ids`` (vLLM's extension) adds ``token_ids`` and
``prompt_token_ids`` to each choice.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from spectoolkit.server.generation import Delta, GenerationSpec, Output, collect, generate, new_request_id
from spectoolkit.server.model import ServedModel
from spectoolkit.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, check_sampling
from spectoolkit.server.runner import EngineRunner
from spectoolkit.server.scoring import TokenScores


@dataclass
class Context:
    runner: EngineRunner
    served: ServedModel
    timeout_s: float

    def check_running(self) -> None:
        if not self.runner.alive or not self.runner.accepting:
            raise APIError("the server is shutting down or its engine stopped", code="unavailable", status=503)


# ---- /v1/completions ------------------------------------------------------------------------------


def completion_specs(body: CompletionRequest, ctx: Context) -> list[GenerationSpec]:
    """Every prompt of ``body`` checked and encoded (raises APIError on the first bad one)."""
    served = ctx.served
    served.check_model(body.model)
    check_sampling(body, served.sampling)
    max_tokens = served.default_max_tokens if body.max_tokens is None else body.max_tokens
    if max_tokens < 1 and not (body.echo and max_tokens == 0):
        raise APIError(f"max_tokens={max_tokens} must be >= 1 (0 only with echo=true)", "max_tokens")
    if body.stream and body.logprobs is not None:
        raise APIError("logprobs with stream=true is not supported: send stream=false", "logprobs")
    specs = []
    for index, prompt in enumerate(body.prompts()):
        ids = served.encode(prompt, "prompt" if index == 0 else f"prompt.{index}")
        served.check_length(len(ids), max_tokens)
        specs.append(GenerationSpec(ids, max_tokens, _seed(body, served, index), body.stop_strings()))
    return specs


def _seed(body, served: ServedModel, index: int) -> int:
    return (body.seed if body.seed is not None else served.sampling.seed) + index


async def _run(ctx: Context, spec: GenerationSpec) -> Output:
    if spec.max_tokens == 0:
        return Output(finish_reason="length")
    return await collect(generate(ctx.runner, spec, ctx.served.tokenizer, ctx.served.eos_ids, ctx.timeout_s))


async def complete(body: CompletionRequest, ctx: Context) -> dict[str, Any]:
    specs = completion_specs(body, ctx)
    ctx.check_running()
    outputs = await asyncio.gather(*(_run(ctx, spec) for spec in specs))
    choices = []
    for index, (spec, output) in enumerate(zip(specs, outputs, strict=True)):
        text = (ctx.served.tokenizer.decode(spec.prompt_ids) if body.echo else "") + output.text
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": output.finish_reason}
        if body.logprobs is not None:
            choice["logprobs"] = await _logprobs(ctx, spec.prompt_ids, output.token_ids, body.logprobs, body.echo)
        if body.return_token_ids:
            choice |= {"token_ids": output.token_ids, "prompt_token_ids": spec.prompt_ids}
        choices.append(choice)
    return {**_head("cmpl", "text_completion", ctx), "choices": choices, "usage": _usage(specs, outputs)}


async def _logprobs(ctx: Context, prompt_ids: list[int], output_ids: list[int], top: int, echo: bool) -> dict:
    """OpenAI's completions ``logprobs`` object over the echoed prompt (when ``echo``) and the output."""
    ids = prompt_ids + output_ids
    scores: TokenScores = await asyncio.wrap_future(ctx.runner.call(lambda: ctx.served.scorer(ids, top)))
    first = 0 if echo else len(prompt_ids)
    text = ctx.served.token_text
    tokens = [text(i) for i in ids[first:]]
    tops = [None if alt is None else {text(i): lp for i, lp in alt} for alt in scores.top[first:]]
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {"tokens": tokens, "token_logprobs": scores.token_logprobs[first:], "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


async def stream_completion(body: CompletionRequest, ctx: Context, specs: list[GenerationSpec]) -> AsyncIterator[str]:
    """SSE events of a streamed completion (``specs`` from :func:`completion_specs`, checked before the
    response started)."""
    head = _head("cmpl", "text_completion", ctx)
    outputs = [Output() for _ in specs]

    def chunk(index: int, delta: Delta) -> dict:
        choice = {"index": index, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}
        if body.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return {**head, "choices": [choice]}

    if body.echo:
        for index, spec in enumerate(specs):
            text = ctx.served.tokenizer.decode(spec.prompt_ids)
            yield _event({**head, "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": None}]})
    async for index, delta in _merged(ctx, specs):
        outputs[index].token_ids += delta.token_ids
        yield _event(chunk(index, delta))
    if body.stream_options and body.stream_options.include_usage:
        yield _event({**head, "choices": [], "usage": _usage(specs, outputs)})
    yield "data: [DONE]\n\n"


async def _merged(ctx: Context, specs: list[GenerationSpec]) -> AsyncIterator[tuple[int, Delta]]:
    """The deltas of every prompt as they come (one task per prompt; all cancelled if the client leaves)."""
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


def chat_spec(body: ChatCompletionRequest, ctx: Context) -> GenerationSpec:
    served = ctx.served
    served.check_model(body.model)
    check_sampling(body, served.sampling)
    if body.logprobs:
        raise APIError("logprobs on chat completions is not supported: use /v1/completions", "logprobs")
    ids = served.encode_chat(body.as_template_input())
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = max(1, served.context - len(ids))
    if max_tokens < 1:
        raise APIError(f"{param}={max_tokens} must be >= 1", param)
    served.check_length(len(ids), max_tokens, param)
    return GenerationSpec(ids, max_tokens, _seed(body, served, 0), body.stop_strings())


async def chat(body: ChatCompletionRequest, ctx: Context) -> dict[str, Any]:
    spec = chat_spec(body, ctx)
    ctx.check_running()
    output = await _run(ctx, spec)
    choice = {"index": 0, "message": {"role": "assistant", "content": output.text}, "logprobs": None,
              "finish_reason": output.finish_reason}  # fmt: skip
    if body.return_token_ids:
        choice |= {"token_ids": output.token_ids, "prompt_token_ids": spec.prompt_ids}
    return {**_head("chatcmpl", "chat.completion", ctx), "choices": [choice], "usage": _usage([spec], [output])}


async def stream_chat(body: ChatCompletionRequest, ctx: Context, spec: GenerationSpec) -> AsyncIterator[str]:
    head = _head("chatcmpl", "chat.completion.chunk", ctx)
    output = Output()
    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    yield _event({**head, "choices": [first]})
    async for _, delta in _merged(ctx, [spec]):
        output.token_ids += delta.token_ids
        choice = {"index": 0, "delta": {"content": delta.text} if delta.text else {}, "logprobs": None,
                  "finish_reason": delta.finish_reason}  # fmt: skip
        if body.return_token_ids:
            choice["token_ids"] = delta.token_ids
        yield _event({**head, "choices": [choice]})
    if body.stream_options and body.stream_options.include_usage:
        yield _event({**head, "choices": [], "usage": _usage([spec], [output])})
    yield "data: [DONE]\n\n"


# ---- shared -----------------------------------------------------------------------------------------


def _head(prefix: str, kind: str, ctx: Context) -> dict[str, Any]:
    return {"id": new_request_id(prefix), "object": kind, "created": int(time.time()), "model": ctx.served.name}


def _usage(specs: list[GenerationSpec], outputs: list[Output]) -> dict[str, int]:
    prompt = sum(len(spec.prompt_ids) for spec in specs)
    completion = sum(len(output.token_ids) for output in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def error_event(exc: APIError) -> str:
    return _event(exc.body())
