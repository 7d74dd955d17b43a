"""Small deterministic fake OpenAI servers for the endpoint back-end's fault tests (no model).

One stdlib :class:`~http.server.ThreadingHTTPServer` on 127.0.0.1, port 0, in a daemon thread. How it
answers ``POST .../completions`` is chosen by the first path segment of the base URL
(``http://127.0.0.1:PORT/<mode>/v1``), or, for mode ``byprompt``, by the request's first prompt id
(``MODES[prompt[0]]``) so that one engine can send good and failing requests side by side:

- ``ok``: the completion ``expected_ids(prompt, max_tokens)`` in 3 chunks with ``token_ids``, a usage
  chunk, ``data: [DONE]``;
- ``http500`` / ``http400``: an OpenAI error body with that status;
- ``cut``: two chunks, then the connection closes (close-delimited body: a clean end of stream) with
  no finish_reason and no [DONE];
- ``cut_chunked``: two chunks of a chunked body, then the socket closes without the last chunk;
- ``stall``: one chunk, then silence for ``STALL_S`` (longer than the tests' read timeout);
- ``trickle``: a token every ``TRICKLE_GAP_S`` for ever (each gap under the read timeout; the whole
  request outlasts the request timeout);
- ``error_chunk``: one chunk, then ``data: {"error": ...}``;
- ``text`` / ``text_split``: ``TEXT_CHUNKS`` / ``TEXT_SPLIT_CHUNKS`` as text only, no ``token_ids``;
- ``llama`` (llama-server's own ``POST /completion``): one chunk per token with ``content`` and ``tokens``,
  then a last chunk with ``stop: true``, ``stop_type: "limit"``, no tokens and ``tokens_predicted``;
- ``llama_gap``: as llama-server sends a token that ends inside a UTF-8 character: the text of
  ``TEXT_CHUNKS`` in 3 chunks, the middle one without its token id, ``tokens_predicted`` counting it;
- ``drop``: the connection closes without a response; ``drop_once``: so the first time a prompt comes, as
  ``ok`` after that.

``GET /<mode>/v1/models`` lists ``MODEL`` (mode ``nomodels``: 404); ``GET /prom/metrics`` answers
``.metrics_text``, any other ``/metrics`` 404; mode ``html`` answers every GET with an HTML page (200).
Every completion body received is kept in ``.received``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "fake-model"
MODES = ("ok", "http500", "http400", "cut", "cut_chunked", "stall", "trickle", "error_chunk", "text", "text_split",
         "llama", "llama_gap", "drop", "drop_once")  # fmt: skip
CHUNK_GAP_S = 0.02  # between two chunks of a normal stream: each chunk arrives at its own time
STALL_S = 6.0  # silence of "stall" (the tests' read timeout is well under it)
TRICKLE_GAP_S = 0.05
TEXT_CHUNKS = ("Hello world", ", this is", " a test.")
TEXT_SPLIT_CHUNKS = ("Hel", "lo wor", "ld.")  # chunk ends inside words, as a detokenizing server may send
ERROR_MESSAGES = {500: "the fake engine crashed", 400: "max_tokens is too large for this fake"}


def expected_ids(prompt: list[int], max_tokens: int) -> list[int]:
    """[max_tokens] the ids mode "ok" answers ``prompt`` with (a function of the prompt: no mix-ups)."""
    return [1000 + 7 * prompt[-1] + i for i in range(max_tokens)]


def _thirds(ids: list[int]) -> list[list[int]]:
    """``ids`` in 3 chunks (sizes as equal as possible, none empty while ids has >= 3)."""
    size = -(-len(ids) // 3)
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def _chunk(ids: list[int] | None, text: str, finish_reason: str | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish_reason}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "cmpl-fake", "object": "text_completion", "model": MODEL, "choices": [choice]}


def _llama_end(generated: int) -> dict[str, Any]:
    return {"content": "", "tokens": [], "stop": True, "stop_type": "limit", "tokens_predicted": generated}


class _Handler(BaseHTTPRequestHandler):
    server: FakeOpenAIServer
    protocol_version = "HTTP/1.1"  # keep-alive, and chunked bodies for the streams that need them

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  quiet test output
        pass

    # ---- routing -------------------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802  http.server's naming
        mode = self.path.strip("/").split("/")[0]
        if mode == "html":  # a web page, not an API, on every route
            self._text(200, "<html><body>Welcome</body></html>", "text/html")
        elif self.path.endswith("/v1/models") and mode != "nomodels":
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        elif self.path.endswith("/metrics") and mode == "prom":
            self._text(200, self.server.metrics_text, "text/plain; version=0.0.4")
        else:
            self._json(404, {"error": {"message": f"no route {self.path}", "type": "not_found", "code": 404}})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        self.server.record(body)
        mode = self.path.strip("/").split("/")[0]
        if mode == "byprompt":
            mode = MODES[body["prompt"][0]]
        prompt, max_tokens = list(body.get("prompt") or [0]), int(body.get("max_tokens") or body.get("n_predict") or 16)
        try:
            self._answer(mode, prompt, max_tokens)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout, reset())
            self.close_connection = True

    def _answer(self, mode: str, prompt: list[int], max_tokens: int) -> None:
        ids = expected_ids(prompt, max_tokens)
        if mode == "drop" or (mode == "drop_once" and self.server.first_time(tuple(prompt))):
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        mode = "ok" if mode == "drop_once" else mode
        if mode in ("http500", "http400"):
            status = int(mode[4:])
            error = {"message": ERROR_MESSAGES[status], "type": "BadRequestError", "param": None, "code": status}
            self._json(status, {"error": error})
        elif mode == "ok":
            chunks = _thirds(ids)
            self._stream([_chunk(c, "x", "length" if i == len(chunks) - 1 else None) for i, c in enumerate(chunks)])
        elif mode == "cut":
            self._stream([_chunk(c, "x") for c in _thirds(ids)[:2]], done=False)
        elif mode == "cut_chunked":
            self._stream([_chunk(c, "x") for c in _thirds(ids)[:2]], done=False, chunked=True, cut=True)
        elif mode == "stall":
            self._stream([_chunk(ids[:1], "x")], done=False, chunked=True, hold_s=STALL_S)
        elif mode == "trickle":
            self._trickle()
        elif mode == "error_chunk":
            error = {"error": {"message": "the fake engine stopped mid-stream", "type": "InternalServerError"}}
            self._stream([_chunk(ids[:2], "x"), error], done=False)
        elif mode in ("text", "text_split"):
            parts = TEXT_CHUNKS if mode == "text" else TEXT_SPLIT_CHUNKS
            self._stream([_chunk(None, t, "length" if i == len(parts) - 1 else None) for i, t in enumerate(parts)])
        elif mode == "llama":
            self._stream([*({"content": "x", "tokens": [i], "stop": False} for i in ids), _llama_end(len(ids))], False)
        elif mode == "llama_gap":
            pieces = [{"content": text, "tokens": [] if i == 1 else [7 + i], "stop": False}
                      for i, text in enumerate(TEXT_CHUNKS)]  # fmt: skip
            self._stream([*pieces, _llama_end(len(TEXT_CHUNKS))], done=False)
        else:
            self._json(404, {"error": {"message": f"unknown fake mode {mode!r}", "type": "not_found", "code": 404}})

    # ---- writing -------------------------------------------------------------------------------

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _text(self, status: int, text: str, content_type: str) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _start_stream(self, chunked: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:  # close-delimited: the end of the body is the end of the connection
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()

    def _write(self, payload: str, chunked: bool) -> None:
        data = f"data: {payload}\n\n".encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n" if chunked else data)
        self.wfile.flush()

    def _stream(
        self, events: list[dict], done: bool = True, chunked: bool = False, cut: bool = False, hold_s: float = 0.0
    ) -> None:
        self._start_stream(chunked)
        for index, event in enumerate(events):
            if index:
                time.sleep(CHUNK_GAP_S)
            self._write(json.dumps(event), chunked)
        if done:
            usage = {"id": "cmpl-fake", "object": "text_completion", "model": MODEL, "choices": [],
                     "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}  # fmt: skip
            self._write(json.dumps(usage), chunked)
            self._write("[DONE]", chunked)
        self.server.wait(hold_s)
        if cut:  # drop the connection without the chunked body's terminating chunk
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
        elif chunked:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    def _trickle(self) -> None:
        self._start_stream(chunked=True)
        for index in range(10_000):
            if self.server.stopping.is_set():
                return
            self._write(json.dumps(_chunk([index], "x")), chunked=True)
            time.sleep(TRICKLE_GAP_S)


class FakeOpenAIServer(ThreadingHTTPServer):
    """``with FakeOpenAIServer() as fake: fake.url("ok")`` — the fake on 127.0.0.1, an ephemeral port."""

    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.received: list[dict[str, Any]] = []
        self.metrics_text = ""  # what GET /prom/metrics answers (Prometheus exposition text)
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._seen: set[tuple[int, ...]] = set()
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def url(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{mode}/v1"

    def first_time(self, prompt: tuple[int, ...]) -> bool:
        with self._lock:
            seen = prompt in self._seen
            self._seen.add(prompt)
        return not seen

    def record(self, body: dict[str, Any]) -> None:
        with self._lock:
            self.received.append(body)

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds`` unless the server is stopping (a stalled handler never outlives its test)."""
        self.stopping.wait(seconds)

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=5)


class ClosedPort:
    """A loopback port bound but not listening: a connection there is refused (the server is down)."""

    def __enter__(self) -> str:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{self._socket.getsockname()[1]}/v1"

    def __exit__(self, *exc: object) -> None:
        self._socket.close()
