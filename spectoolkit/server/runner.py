"""The continuous-batching engine on a thread of its own, fed by the server's asyncio side (issue 17).

The engine (:class:`~spectoolkit.serving.engine.ContinuousEngine`) is single-threaded: every call into
it — submit, abort, step, a scoring forward — runs on the runner's thread, between steps. The asyncio
side hands it commands (:meth:`EngineRunner.submit`, :meth:`abort`, :meth:`call`) and listens to one
:class:`Listener` per request, which receives, in order, ``Tokens`` events (the output ids each step
emitted) and one final ``Done`` (the finished request, or its error).

A step that raises fails every request in flight with the reason (the engine is reset) and the runner
goes on: one bad step never takes the server down. :meth:`EngineRunner.stop` stops accepting, lets
in-flight requests finish for ``drain_s`` seconds, then cancels the rest (each listener is told why).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spectoolkit.serving.api import FinishedRequest, ServeRequest, TokenLogprob
from spectoolkit.serving.engine import ContinuousEngine

IDLE_WAIT_S = 0.05  # how long an idle runner sleeps before looking for commands again
SHUTDOWN_REASON = "the server is shutting down"


@dataclass(frozen=True)
class Tokens:
    ids: list[int]  # output ids emitted by one step
    logprobs: list[TokenLogprob] | None = None  # theirs, when the request asked for logprobs


@dataclass(frozen=True)
class Done:
    finished: FinishedRequest  # ``error`` set when it failed or was cancelled


class Listener:
    """The asyncio side of one request: events arrive on ``queue`` from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Tokens | Done] = asyncio.Queue()

    def put(self, event: Tokens | Done) -> None:
        """Thread-safe: called on the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


FinishHook = Callable[[FinishedRequest], None]


class EngineRunner:
    """Owns ``engine`` and the thread that steps it."""

    def __init__(self, engine: ContinuousEngine, on_finish: FinishHook | None = None) -> None:
        self.engine = engine
        self.on_finish = on_finish  # every finished request (metrics), on the engine thread
        self.accepting = True
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._listeners: dict[str, Listener] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spectoolkit-engine", daemon=True)
        engine.on_emit = self._emitted

    # ---- asyncio side ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def submit(self, request: ServeRequest, listener: Listener) -> None:
        """Queue ``request``; its events go to ``listener``."""
        request.arrival = time.perf_counter()

        def command() -> None:
            self._listeners[request.request_id] = listener
            self.engine.submit(request)

        self._send(command)

    def abort(self, request_id: str) -> None:
        """Cancel ``request_id`` if it is still in the engine (a client went away): its KV is freed."""

        def command() -> None:
            if self._listeners.pop(request_id, None) is not None:
                self.engine.abort(request_id)

        self._send(command)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread between steps (e.g. a scoring forward); its result's future."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # noqa: BLE001  handed to the caller, who reports it
                    future.set_exception(exc)

        self._send(command)
        return future

    def in_flight(self) -> int:
        return len(self._listeners)

    def stop(self, drain_s: float) -> None:
        """Stop accepting; give in-flight requests ``drain_s`` seconds, cancel the rest, end the thread."""
        self.accepting = False
        deadline = time.monotonic() + drain_s
        while self._listeners and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=max(5.0, drain_s))

    def _send(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._drain_commands()
            if self.engine.has_work():
                self._step()
            else:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
        self._drain_commands()
        self._cancel_all(SHUTDOWN_REASON)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as exc:  # noqa: BLE001  the server goes on; every request in flight is told why
            self._cancel_all(f"engine step failed: {type(exc).__name__}: {exc}")
            return
        for done in finished:
            self._finished(done)

    def _emitted(self, request_id: str, ids: list[int], logprobs: list[TokenLogprob] | None) -> None:
        listener = self._listeners.get(request_id)
        if listener is not None:
            listener.put(Tokens(list(ids), None if logprobs is None else list(logprobs)))

    def _finished(self, done: FinishedRequest) -> None:
        listener = self._listeners.pop(done.request_id, None)
        if self.on_finish is not None:
            self.on_finish(done)
        if listener is not None:
            listener.put(Done(done))

    def _cancel_all(self, reason: str) -> None:
        now = time.perf_counter()
        self.engine.reset()
        for request_id in list(self._listeners):
            self._finished(FinishedRequest(request_id, error=reason, finish=now))
