"""A server process we start and stop: its own process group, a log file, health polling (issue 17).

:class:`ManagedServer` runs one command as a process group (``start_new_session``), its output to a log;
``wait_healthy`` polls ``GET /health`` and fails early — with the log's first exception and last lines —
when the process exits, or names the timeout setting when it never becomes healthy; ``stop`` sends
SIGTERM to the group, then SIGKILL, and returns only when no member is left (Ctrl-C included; an
``atexit`` hook covers an interpreter that exits without the context manager).
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from spectoolkit.config import is_loopback
from spectoolkit.errors import SpecToolkitError

LOG_TAIL_LINES = 30
# "ValueError: ..." or "pydantic_core._pydantic_core.ValidationError: ..." at a line start or after a log prefix.
EXCEPTION_LINE = re.compile(r"(?:^|\] )(?:\w+\.)*\w*(?:Error|Exception): ")
POLL_TIMEOUT_S = 2.0  # one GET /health; a busy server answers in milliseconds
KILL_WAIT_S = 5.0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class ManagedServer:
    """One server process (its own process group), logging to ``log_path``; a context manager.

    ``with ManagedServer(cmd, host=..., port=..., log_path=...) as server: server.wait_healthy(600)``
    starts it on entry and stops it on exit, whatever happened inside (Ctrl-C included).
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        host: str,
        port: int,
        log_path: str | Path,
        env: Mapping[str, str] | None = None,
        name: str = "vllm",
        allow_remote: bool = False,
    ) -> None:
        if not (allow_remote or is_loopback(host)):
            raise SpecToolkitError(
                f"server host {host} is not a loopback address: set backend.allow_remote=true to use it"
            )
        self.command = [str(part) for part in command]
        self.host, self.port, self.name = host, port, name
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self._process: subprocess.Popen[bytes] | None = None
        self._log: BinaryIO | None = None

    @property
    def root_url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``http://host:port/v1``)."""
        return f"{self.root_url}/v1"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the process in a new session (its group id is its pid), stdout and stderr to the log."""
        if self._process is not None:
            raise RuntimeError(f"{self.name} server already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        try:
            self._process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        except OSError as exc:
            self._close_log()
            raise SpecToolkitError(f"cannot start the {self.name} server ({self.command[0]}): {exc}") from None
        atexit.register(self.stop)

    def wait_healthy(self, timeout_s: float, *, timeout_name: str = "backend.startup_timeout_s") -> None:
        """Poll ``GET /health`` until 200; on exit, timeout or interrupt the server is stopped and this raises."""
        if self._process is None:
            raise RuntimeError(f"{self.name} server not started")
        try:
            self._poll_health(time.monotonic() + timeout_s, timeout_s, timeout_name)
        except BaseException:
            self.stop()
            raise

    def _poll_health(self, deadline: float, timeout_s: float, timeout_name: str) -> None:
        assert self._process is not None
        while True:
            code = self._process.poll()
            if code is not None:
                raise SpecToolkitError(
                    f"the {self.name} server exited with code {code} before it was healthy; "
                    f"{self._first_exception()}last lines of {self.log_path}:\n{self.log_tail()}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SpecToolkitError(
                    f"the {self.name} server was not healthy at {self.root_url}/health after {timeout_s:g} s: "
                    f"raise {timeout_name} (a cold vLLM start compiles for minutes); "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            if self._healthy(min(POLL_TIMEOUT_S, remaining)):
                return
            time.sleep(min(0.25, max(deadline - time.monotonic(), 0)))

    def _healthy(self, timeout_s: float) -> bool:
        try:
            with urllib.request.urlopen(f"{self.root_url}/health", timeout=timeout_s) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError, ValueError):  # refused, reset, timed out, 5xx
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group, wait up to ``timeout_s``, then SIGKILL it; idempotent."""
        process, self._process = self._process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        try:
            _signal_group(process.pid, signal.SIGTERM)
            if not _wait_group_gone(process, timeout_s):
                _signal_group(process.pid, signal.SIGKILL)
                _wait_group_gone(process, KILL_WAIT_S)
        except BaseException:  # Ctrl-C while waiting: no graceful exit then
            _signal_group(process.pid, signal.SIGKILL)
            raise
        finally:
            self._close_log()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the log ("" when there is none)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(log.tell() - 64 * 1024, 0))
                text = log.read().decode("utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _first_exception(self) -> str:
        """The log's first exception line and the two after it (vLLM's root cause precedes pages of traceback)."""
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        first = next((i for i, line in enumerate(lines) if EXCEPTION_LINE.search(line)), None)
        return "" if first is None else "first error:\n" + "\n".join(lines[first : first + 3]) + "\n"

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the whole group is gone already
        pass


def _wait_group_gone(process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether the leader (reaped here) and every other member of its group exited within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        leader_done = process.poll() is not None
        if leader_done and not _group_alive(process.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (an orphan zombie no one has reaped does not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # members exist but are not ours to signal
        return True
    return _has_live_member(pgid)


def _has_live_member(pgid: int) -> bool:
    if not os.path.isdir("/proc"):
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):  # exited while we read
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False
