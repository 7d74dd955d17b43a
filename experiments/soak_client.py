"""The client side of the soak (``experiments/soak.py``): a planned request sent as its client would send it —
read to the end, or left mid-stream — and the checks of what came back and of what the server's ``/metrics`` and
``/proc/<pid>`` say afterwards. Each check returns failure lines (empty: passed)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

COUNTERS = ("spectoolkit:aborted_requests_total", "vllm:request_success_total", "vllm:spec_decode_num_drafts_total",
            "vllm:spec_decode_num_accepted_tokens_total", "vllm:generation_tokens_total")  # fmt: skip
IDLE_GAUGES = ("vllm:kv_cache_usage_perc", "spectoolkit:draft_kv_cache_bytes", "vllm:num_requests_running",
               "vllm:num_requests_waiting")  # fmt: skip


@dataclass(frozen=True)
class Reference:
    prompt_ids: list[int]  # [P] as the server encodes the prompt (chat: through the chat template)
    output_ids: list[int]  # [<= ABORT_MAX_TOKENS] greedy, target alone, batch 1
    text: Callable[[int], str]  # n -> the text of output_ids[:n] (special tokens skipped, as the server does)


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    kind: str  # "good" | "abort" | "malformed"
    path: str  # "/v1/completions" | "/v1/chat/completions"
    body: dict[str, Any] | bytes  # bytes: sent as they are (not JSON)
    key: str | None = None  # PROMPTS key (good, abort)
    max_tokens: int = 0
    close_after: int = 0  # abort: chunks with tokens the client reads before it closes the connection
    mistake: str | None = None  # malformed: which MALFORMED

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))


@dataclass
class Outcome:
    status: int | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_ids: list[int] | None = None
    finish_reason: str | None = None
    error: str | None = None  # what went wrong on the client's side, or the server's error message
    seconds: float = 0.0


# ---- the client -------------------------------------------------------------------------------------


def send(http: httpx.Client, request: PlannedRequest, timeout_s: float) -> Outcome:
    """One request as its client sends it; an aborting client closes the connection after ``close_after`` chunks."""
    outcome, start = Outcome(), time.perf_counter()
    try:
        (_streamed if request.stream else _plain)(http, request, outcome, timeout_s)
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        outcome.error = f"unreadable response: {type(exc).__name__}: {exc}"
    outcome.seconds = time.perf_counter() - start
    return outcome


def _plain(http: httpx.Client, request: PlannedRequest, outcome: Outcome, timeout_s: float) -> None:
    raw = isinstance(request.body, bytes)
    body = {"content": request.body, "headers": {"content-type": "application/json"}} if raw else {"json": request.body}
    response = http.post(request.path, timeout=timeout_s, **body)
    outcome.status, payload = response.status_code, response.json()
    if response.status_code != 200:
        outcome.error = str(payload["error"]["message"])
        return
    choice = payload["choices"][0]
    outcome.token_ids, outcome.prompt_ids = choice["token_ids"], choice["prompt_token_ids"]
    outcome.text = choice["text"] if "text" in choice else choice["message"]["content"]
    outcome.finish_reason = choice["finish_reason"]


def _streamed(http: httpx.Client, request: PlannedRequest, outcome: Outcome, timeout_s: float) -> None:
    with http.stream("POST", request.path, json=request.body, timeout=timeout_s) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            outcome.error = str(json.loads(response.read())["error"]["message"])
            return
        chunks = 0  # chunks that carried tokens
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return
            payload = json.loads(line.removeprefix("data: "))
            if "error" in payload:
                outcome.error = str(payload["error"]["message"])
            for choice in payload.get("choices", []):
                outcome.token_ids += choice.get("token_ids") or []
                outcome.text += choice["text"] if "text" in choice else choice["delta"].get("content") or ""
                outcome.finish_reason = choice["finish_reason"] or outcome.finish_reason
                chunks += bool(choice.get("token_ids"))
            if request.close_after and chunks >= request.close_after:
                return  # leaving the `with` unread closes the connection mid-stream: the server must abort
        outcome.error = outcome.error or "the stream ended without data: [DONE]"


# ---- the checks -------------------------------------------------------------------------------------


def check_outcomes(plan: list[PlannedRequest], outcomes: dict[int, Outcome], refs: dict[str, Reference]) -> list[str]:
    """One line per request whose outcome is wrong for its kind."""
    failures = []
    for request in plan:
        what = f"request {request.index} ({request.kind} {request.mistake or request.key}"
        what += f"{', streamed' if request.stream else ''})"
        outcome = outcomes.get(request.index)
        if outcome is None:
            failures.append(f"{what}: not run before the deadline")
            continue
        problem = _CHECKS[request.kind](request, outcome, refs.get(request.key))
        if problem:
            failures.append(f"{what}: {problem}")
    return failures


def _check_good(request: PlannedRequest, outcome: Outcome, ref: Reference) -> str | None:
    if outcome.status != 200 or outcome.error:
        return f"status {outcome.status}: {outcome.error}"
    want = ref.output_ids[: request.max_tokens]
    if outcome.token_ids != want:
        got = outcome.token_ids
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        return f"token ids differ from batch 1 at position {at}: got {outcome.token_ids}, want {want}"
    if outcome.text != ref.text(request.max_tokens):
        return f"text {outcome.text!r} differs from batch 1's {ref.text(request.max_tokens)!r}"
    if outcome.prompt_ids is not None and outcome.prompt_ids != ref.prompt_ids:
        return "the server encoded the prompt differently from the reference"
    return None if outcome.finish_reason in ("length", "stop") else f"finish_reason {outcome.finish_reason!r}"


def _check_abort(request: PlannedRequest, outcome: Outcome, ref: Reference) -> str | None:
    if outcome.status != 200 or outcome.error:
        return f"status {outcome.status}: {outcome.error}"
    if outcome.finish_reason is not None:
        return "the stream finished before its client left (raise ABORT_MAX_TOKENS)"
    if not outcome.token_ids or outcome.token_ids != ref.output_ids[: len(outcome.token_ids)]:
        return f"the tokens received {outcome.token_ids} are not a prefix of batch 1's output"
    return None


def _check_malformed(request: PlannedRequest, outcome: Outcome, _: Reference | None) -> str | None:
    if outcome.status is None or not 400 <= outcome.status < 500 or not outcome.error:
        return f"status {outcome.status} ({outcome.error}): want a 4xx with an error message"
    return None


_CHECKS = {"good": _check_good, "abort": _check_abort, "malformed": _check_malformed}


def check_server(counts: dict[str, int], delta: dict[str, float], gauges: dict[str, float], rss_checkpoint: int | None,
                 rss_end: int | None, rss_tolerance: float) -> list[str]:  # fmt: skip
    """The server's view: one abort per aborted stream, one success per good request, idle with no KV in use,
    RSS flat between the checkpoint and the end."""
    failures = []
    for name, kind in (("spectoolkit:aborted_requests_total", "abort"), ("vllm:request_success_total", "good")):
        if delta[name] != counts[kind]:
            failures.append(f"/metrics {name} rose by {delta[name]:g}, want {counts[kind]} ({kind} requests)")
    failures += [f"/metrics {name} = {value:g} after the run, want 0" for name, value in gauges.items() if value != 0]
    if rss_checkpoint and rss_end and abs(rss_end - rss_checkpoint) > rss_tolerance * rss_checkpoint:
        failures.append(f"server RSS {rss_end / 1024:.1f} MiB at the end vs {rss_checkpoint / 1024:.1f} MiB after the "
                        f"checkpoint: more than {rss_tolerance:.0%} apart")  # fmt: skip
    return failures


# ---- the server's side -----------------------------------------------------------------------------


def rss_kb(pid: int) -> int:
    """VmRSS of process ``pid`` in KiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def scrape(url: str) -> dict[str, float]:
    """Every sample of ``/metrics`` by name (summed over labels; histograms' _bucket samples left out)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples
