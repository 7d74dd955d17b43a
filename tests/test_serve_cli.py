"""``python -m spectoolkit.serve`` as a user runs it: Hydra config, one-line errors, graceful shutdown."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.integration
STARTUP_S = 180


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(tmp_path, *overrides: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "spectoolkit.serve", f"hydra.run.dir={tmp_path}", *overrides]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_config_mistake_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "spectoolkit.serve", f"hydra.run.dir={tmp_path}",
                             "server.host=0.0.0.0"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: server.host=0.0.0.0 is not a loopback address: set server.allow_remote=true to listen there"
    ]


def _wait_healthy(process: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the server did not become healthy")


def test_sigterm_finishes_the_in_flight_stream_then_exits(tmp_path):
    port = _free_port()
    process = _serve(tmp_path, f"server.port={port}", "server.shutdown_timeout_s=120", "+draft=ngram",
                     "runtime.kernels=reference", "serve.max_kv_tokens=4096")  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(process, url)
        events: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"model": "smollm2-135m", "prompt": "Count: 1, 2, 3, 4,", "max_tokens": 12, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=150) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        client = threading.Thread(target=stream)
        client.start()
        assert first.wait(60)
        process.send_signal(signal.SIGTERM)
        client.join(timeout=150)
        assert process.wait(timeout=150) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
        assert events[-1] == "[DONE]"  # the request in flight finished: graceful, not cut
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
