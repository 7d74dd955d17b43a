"""The OpenAI-compatible ASGI app (FastAPI) over one continuous-batching engine (issue 17).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming over SSE and not),
``GET /v1/models``, ``/health``, ``/metrics`` (Prometheus), ``/version`` and ``/info`` (what the
server reports about itself: config, arm, precision — read into a benchmark's conditions).

A bad request gets an OpenAI-style error (:class:`~spectoolkit.server.protocol.APIError`) and never
reaches the engine: 400 for bad parameters, a body that is not JSON or a prompt past the context, 404
for an unknown model or route, 405 for a route's wrong method, 503 while the server shuts down. An
unexpected exception in one request is a 500 for that request only. The engine runner starts with the
app and stops with it: in-flight requests get ``drain_s`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from spectoolkit.server.completions import (
    Context,
    chat,
    chat_specs,
    complete,
    completion_specs,
    error_event,
    stream_chat,
    stream_completion,
)
from spectoolkit.server.metrics import CONTENT_TYPE, ServerMetrics
from spectoolkit.server.model import ServedModel
from spectoolkit.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, pydantic_message
from spectoolkit.server.runner import EngineRunner

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming request checks that its client is still there


def create_app(
    runner: EngineRunner, served: ServedModel, metrics: ServerMetrics, timeout_s: float, drain_s: float
) -> FastAPI:
    """The app; the runner thread starts at app startup and stops at shutdown."""
    ctx = Context(runner, served, timeout_s)
    runner.on_finish = metrics.observe

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        runner.start()
        try:
            yield
        finally:
            runner.stop(drain_s)

    app = FastAPI(title="spectoolkit", lifespan=lifespan, docs_url=None, redoc_url=None)
    _errors(app)

    @app.get("/health")
    async def health() -> Response:
        if not runner.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": served.name, "object": "model", "created": 0, "owned_by": "spectoolkit",
                "root": served.info.get("target_path"), "max_model_len": served.context}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": served.info.get("version", "unknown"), "engine": "spectoolkit"}

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return served.info

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if body.stream:
            specs = completion_specs(body, ctx)
            ctx.check_running()
            return _sse(stream_completion(body, ctx, specs))
        return JSONResponse(await _unless_disconnected(request, complete(body, ctx)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        if body.stream:
            specs = chat_specs(body, ctx)
            ctx.check_running()
            return _sse(stream_chat(body, ctx, specs))
        return JSONResponse(await _unless_disconnected(request, chat(body, ctx)))

    return app


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """``work``'s result; cancelled (its engine requests aborted, KV freed) if the client goes away first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError("the client disconnected", code="client_disconnected", status=499)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except APIError as exc:  # the stream has started: the error is its last event
            yield error_event(exc)
            yield "data: [DONE]\n\n"

    return StreamingResponse(guarded(), media_type="text/event-stream", headers=SSE_HEADERS)


def _errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own refusals (no such route, a route's wrong method) in OpenAI's shape."""
        asked = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"Invalid URL ({asked}): this server answers {_routes(app)}"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "another method")
            message = f"{asked} is not allowed: {request.url.path} takes {allowed}"
        else:
            message = f"{asked}: {exc.detail}"
        error = APIError(message, status=exc.status_code)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = pydantic_message(list(exc.errors()))
        return JSONResponse(APIError(message, param).body(), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        error = APIError(f"internal error: {type(exc).__name__}: {exc}", code="internal_error", status=500)
        return JSONResponse(error.body(), status_code=500)


def _routes(app: FastAPI) -> str:
    """``POST /v1/completions, ...``: the API's routes, for a client that asked for another."""
    return ", ".join(
        f"{' '.join(sorted(route.methods))} {route.path}" for route in app.routes if isinstance(route, APIRoute)
    )
