"""A :class:`~spectoolkit.serving.api.ServingEngine` over HTTP: any OpenAI-compatible server (issue 17).

Each submitted request is one streamed completion with the prompt as token ids (every server sees the
same input) and the run's sampling, in the server's dialect (:mod:`spectoolkit.backends.wire`: OpenAI's
``/completions`` with ``return_token_ids``, or llama-server's ``/completion`` with ``return_tokens``).
Token times are the arrival times of the stream's chunks: a chunk that carries k tokens (a speculative
step) is one delivery of k tokens, as in the in-process engine. A server that gives no ids, or fewer
than it says it generated, gets its text re-tokenized (``ids_from_text`` is set on the engine).

The requests run on one asyncio loop in a background thread; :meth:`EndpointEngine.step` returns the
requests that finished since the last call, waiting at most :data:`POLL_S` for one. Faults never
raise: a refused connection, an HTTP error, a stream cut mid-way or a timeout (connect, between
chunks, whole request — all from ``backend.*_timeout_s``) each fail that request with the reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import httpx

from spectoolkit.backends.wire import OPENAI, Wire
from spectoolkit.config import SamplingConfig
from spectoolkit.serving.api import FinishedRequest, ServeRequest

POLL_S = 0.005  # longest wait of one step() for a finished request (open-loop arrivals stay on time)
# An idle pooled connection is dropped before the server's own keep-alive timeout (5 s in llama-server's
# cpp-httplib and in uvicorn): reusing one the server is closing fails the request before it was sent.
KEEPALIVE_S = 2.0
logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per request in the run's log


@dataclass(frozen=True)
class Timeouts:
    connect_s: float
    read_s: float  # between two stream chunks
    request_s: float  # the whole request

    def httpx(self) -> httpx.Timeout:
        return httpx.Timeout(connect=self.connect_s, read=self.read_s, write=self.read_s, pool=self.request_s)


class LoopThread:
    """One asyncio event loop on a daemon thread; :meth:`run` schedules a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="spectoolkit-http", daemon=True)
        self._thread.start()

    def run(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class EndpointEngine:
    """Serves requests by sending them to ``base_url`` (an OpenAI base URL, e.g. http://127.0.0.1:8000/v1)."""

    def __init__(
        self,
        name: str,
        base_url: str,
        model: str,
        sampling: SamplingConfig,
        timeouts: Timeouts,
        loop: LoopThread,
        tokenizer: Any = None,
        api_key: str | None = None,
        wire: Wire = OPENAI,
    ) -> None:
        self.name, self.base_url, self.model, self.sampling = name, base_url.rstrip("/"), model, sampling
        self.wire = wire
        self.timeouts, self.loop, self.tokenizer = timeouts, loop, tokenizer
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S)
        self._client = loop.run(_make_client(headers, timeouts, limits)).result()
        self._done: queue.SimpleQueue[tuple[int, FinishedRequest]] = queue.SimpleQueue()
        self._generation = 0  # bumped by reset(): a result of an earlier generation is dropped
        self._in_flight: dict[str, Future] = {}
        self.ids_from_text = False  # set when a server answered with text only
        self.on_step = None  # the load generator's hook; an HTTP server reports no steps

    # ---- the ServingEngine protocol ------------------------------------------------------------

    def submit(self, request: ServeRequest) -> None:
        if request.arrival is None:
            request.arrival = time.perf_counter()
        future = self.loop.run(self._send(request, self._generation))
        self._in_flight[request.request_id] = future
        future.add_done_callback(lambda _: self._in_flight.pop(request.request_id, None))

    def step(self) -> list[FinishedRequest]:
        results = []
        try:
            results.append(self._done.get(timeout=POLL_S))
        except queue.Empty:
            return []
        while True:
            try:
                results.append(self._done.get_nowait())
            except queue.Empty:
                return [done for generation, done in results if generation == self._generation]

    def has_work(self) -> bool:
        return bool(self._in_flight) or not self._done.empty()

    def reset(self) -> None:
        """Cancel every request in flight and forget what finished but was not collected."""
        self._generation += 1
        for future in list(self._in_flight.values()):
            future.cancel()
        deadline = time.monotonic() + 10
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        while not self._done.empty():
            self._done.get_nowait()

    def close(self) -> None:
        self.reset()
        self.loop.run(self._client.aclose()).result(timeout=10)

    # ---- one request ---------------------------------------------------------------------------

    async def _send(self, request: ServeRequest, generation: int) -> None:
        result = FinishedRequest(request.request_id, arrival=request.arrival, prompt_len=len(request.prompt_ids),
                                 sampling=request.sampling)  # fmt: skip
        try:
            await asyncio.wait_for(self._stream(request, result), timeout=self.timeouts.request_s)
        except asyncio.CancelledError:
            raise  # reset(): nobody waits for this one
        except (TimeoutError, asyncio.TimeoutError):  # distinct classes before Python 3.11
            result.error = f"timed out after backend.request_timeout_s={self.timeouts.request_s:g} s"
        except httpx.ConnectTimeout:
            limit = self.timeouts.connect_s
            result.error = f"no connection to {self.base_url} within backend.connect_timeout_s={limit:g} s"
        except httpx.ReadTimeout:
            result.error = (f"{self.base_url} sent nothing for backend.read_timeout_s={self.timeouts.read_s:g} s "
                            "(between stream chunks)")  # fmt: skip
        except httpx.TimeoutException as exc:
            result.error = f"{type(exc).__name__} from {self.base_url} (backend.*_timeout_s)"
        except httpx.ConnectError as exc:
            result.error = _connect_error(self.base_url, exc)
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__} from {self.base_url}: {exc}"
        except Exception as exc:  # noqa: BLE001  a request fails alone, whatever the server sent
            result.error = f"{type(exc).__name__}: {exc}"
        result.finish = time.perf_counter()
        self._done.put((generation, result))

    async def _stream(self, request: ServeRequest, result: FinishedRequest) -> None:
        text, finish_reason, generated = "", None, None
        payload = self.wire.payload(request, self.model, self.sampling)
        reply = await self._send_once_more_if_dropped(payload)
        try:
            if reply.status_code != 200:
                body = (await reply.aread()).decode(errors="replace")
                result.error = f"HTTP {reply.status_code} from {self.base_url}: {_error_message(body)}"
                return
            async for line in reply.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"the server failed the request mid-stream: {_error_message(data)}"
                    return
                now = time.perf_counter()
                for piece in self.wire.pieces(chunk):
                    text += piece.text
                    self._extend(result, self._new_ids(piece.ids, text, result.output_ids), now)
                    finish_reason = piece.finish_reason or finish_reason
                    generated = piece.generated if piece.generated is not None else generated
        finally:
            await reply.aclose()
        if finish_reason is None:
            result.error = (f"the stream from {self.base_url} ended before the request finished "
                            f"(after {len(result.output_ids)} tokens)")  # fmt: skip
        elif generated is not None and generated > len(result.output_ids):  # ids the stream left out
            self._extend(result, self._new_ids(None, text, result.output_ids), time.perf_counter())

    async def _send_once_more_if_dropped(self, payload: dict[str, Any]) -> httpx.Response:
        """The streamed reply to ``payload``. A connection that closes before any response (a pooled one the
        server was closing as it was reused) gets the request once more: the server never answered it."""
        request = self._client.build_request("POST", self.wire.url(self.base_url), json=payload)
        try:
            return await self._client.send(request, stream=True)
        except httpx.RemoteProtocolError:
            return await self._client.send(request, stream=True)

    @staticmethod
    def _extend(result: FinishedRequest, new_ids: list[int], now: float) -> None:
        del result.token_times[len(result.output_ids) :]
        result.output_ids.extend(new_ids)
        result.token_times.extend([now] * len(new_ids))

    def _new_ids(self, ids: list[int] | None, text: str, seen: list[int]) -> list[int]:
        if ids is not None:
            return ids
        if self.tokenizer is None:
            raise ValueError("the server returned no token_ids and no tokenizer was loaded to count tokens")
        self.ids_from_text = True
        ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        common = next((i for i, (a, b) in enumerate(zip(seen, ids, strict=False)) if a != b), min(len(seen), len(ids)))
        del seen[common:]  # a word split across chunks re-tokenizes: the tail is re-spelled (and re-timed)
        return ids[common:]


async def _make_client(headers: dict[str, str], timeouts: Timeouts, limits: httpx.Limits) -> httpx.AsyncClient:
    return httpx.AsyncClient(headers=headers, timeout=timeouts.httpx(), limits=limits)


def _connect_error(base_url: str, exc: httpx.ConnectError) -> str:
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, ConnectionRefusedError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        return f"connection refused by {base_url}: is the server up?"
    return f"cannot connect to {base_url}: {exc}"


def _error_message(body: str) -> str:
    try:
        payload = json.loads(body)
    except ValueError:
        return body[:300]
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    message = error.get("message") if isinstance(error, dict) else None
    return str(message or error)[:300]
