"""One prompt through the engine, as the HTTP side sees it: events in, text and ids out (issue 17).

:func:`generate` submits the prompt to the :class:`~spectoolkit.server.runner.EngineRunner` and yields
a :class:`Delta` per engine step (new ids, new text, their logprobs when the request asked for them) and a final one
with the finish reason. The spec carries the request's own sampling, draft cap and id (the samples of n > 1 name
their leader, whose prompt KV they share). Whatever
ends the iteration early — a stop string, a client that went away (the task is cancelled), a timeout —
aborts the request in the engine, which frees its KV at once.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from spectoolkit.sampling import SamplingParams
from spectoolkit.server.protocol import APIError
from spectoolkit.server.runner import Done, EngineRunner, Listener, Tokens
from spectoolkit.server.text import TextStream
from spectoolkit.serving.api import FinishedRequest, ServeRequest, TokenLogprob

_ids = itertools.count()


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{int(time.time() * 1000):x}-{next(_ids)}"


@dataclass
class Delta:
    """What one engine step added to one prompt's output (``finish_reason`` set on the last)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    finished: FinishedRequest | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of ``token_ids`` when the request asked


@dataclass
class Output:
    """A prompt's whole output once it is done."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    finished: FinishedRequest | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # [len(token_ids)] when the request asked

    @property
    def cumulative_logprob(self) -> float:
        """The sum of its tokens' logprobs (how best_of ranks samples)."""
        return sum(entry.logprob for entry in self.logprobs)


@dataclass(frozen=True)
class GenerationSpec:
    prompt_ids: list[int]
    max_tokens: int
    seed: int
    stops: list[str]
    sampling: SamplingParams | None = None  # None: the engine's (the server's sampling config)
    draft_cap: int | None = None  # drafts per round at most (0: no speculation); None: the policy's
    request_id: str = field(default_factory=lambda: new_request_id("req"))
    after: str | None = None  # another sample's request id: start once its prompt is computed, share its KV
    index: int = 0  # the choice it answers


async def generate(
    runner: EngineRunner, spec: GenerationSpec, tokenizer: Any, eos_ids: frozenset[int], timeout_s: float
) -> AsyncIterator[Delta]:
    """Deltas of ``spec``'s output; raises APIError when the engine fails it or it runs past ``timeout_s``."""
    request_id = spec.request_id
    listener = Listener(asyncio.get_running_loop())
    stream = TextStream(tokenizer, spec.stops, eos_ids)
    request = ServeRequest(request_id, spec.prompt_ids, spec.max_tokens, spec.seed, sampling=spec.sampling,
                           draft_cap=spec.draft_cap, after=spec.after)  # fmt: skip
    runner.submit(request, listener)
    deadline = time.monotonic() + timeout_s
    done = False
    try:
        while True:
            event = await _next(listener, deadline, timeout_s)
            if isinstance(event, Tokens):
                text = stream.add(event.ids)
                if stream.stopped:  # a stop string: the rest is not wanted, free its KV now
                    done = True
                    runner.abort(request_id)
                    yield Delta(event.ids[: stream.kept], text, "stop", None, (event.logprobs or [])[: stream.kept])
                    return
                yield Delta(event.ids, text, logprobs=event.logprobs or [])
                continue
            done = True
            finished = event.finished
            if finished.error:
                raise APIError(f"the request failed: {finished.error}", code="engine_error", status=500)
            last = finished.output_ids[-1] if finished.output_ids else None
            reason = "stop" if last in eos_ids else "length"
            yield Delta([], stream.flush(), reason, finished)
            return
    finally:
        if not done:  # cancelled (client gone), timed out, or the consumer stopped early
            runner.abort(request_id)


async def _next(listener: Listener, deadline: float, timeout_s: float) -> Tokens | Done:
    remaining = deadline - time.monotonic()
    try:
        return await asyncio.wait_for(listener.queue.get(), timeout=max(0.0, remaining))
    except TimeoutError:
        raise APIError(
            f"the request ran past server.request_timeout_s={timeout_s:g} s and was cancelled",
            code="timeout", status=504,
        ) from None  # fmt: skip


async def collect(deltas: AsyncIterator[Delta]) -> Output:
    """The whole output of a :func:`generate` iteration."""
    output = Output()
    async for delta in deltas:
        output.token_ids += delta.token_ids
        output.text += delta.text
        output.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            output.finish_reason, output.finished = delta.finish_reason, delta.finished
    return output
