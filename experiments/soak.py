"""Soak our OpenAI-compatible server (issue 28): many requests at a fixed concurrency, some aborted by the client
mid-stream, some malformed; then every good output against the batch-1 reference, KV usage back to 0, RSS flat.

    python experiments/soak.py                        # 1,000 requests, concurrency 8, the embedded model
    python experiments/soak.py --requests 200 --set model.target_path=/path/to/ckpt --set draft.kind=model

The server is ``python -m spectoolkit.serve`` as a subprocess on 127.0.0.1 (a free port): greedy, n-gram drafts
(γ = 4), ``serve.batch_invariant=true`` (a row cannot depend on its batch, so outputs must equal batch 1 token for
token; README "Exactness"), ``runtime.kernels=auto`` (the choice is cached per machine: the reference below, built
first, measures and stores it, and the server reads the same one).

- **Requests** (:func:`make_plan`, seeded): ``abort_share`` are streams whose client closes the connection after
  1–3 chunks with tokens (asking ABORT_MAX_TOKENS, so the server must abort them); ``malformed_share`` are bad
  requests (MALFORMED) that must get a 4xx error; the rest completions and chats, streamed or not, 8–24 tokens.
- **Reference** (:func:`batch1_references`): each prompt's greedy output from the target alone at batch 1 (the
  ``baseline`` arm: one request in flight, same target, precision, kernels and KV precision, in its own engine
  and pool), computed in this process before the server starts — not the server's engine, batch, or rows mode.
- **Checks** (:func:`soak`): good outputs equal the reference (ids and text); an aborted stream's tokens are a
  prefix of it; ``/metrics`` deltas show one abort per aborted stream and one success per good request; after the
  run the target and draft KV gauges and the running/waiting gauges are 0; the server's RSS (``/proc/<pid>``,
  read idle) at the end is within ``rss_tolerance`` of its RSS after the first ``checkpoint`` requests. Nothing
  is sent after ``deadline_s``: what did not run is a failure, never a hang.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from soak_client import (
    COUNTERS,
    IDLE_GAUGES,
    Outcome,
    PlannedRequest,
    Reference,
    check_outcomes,
    check_server,
    rss_kb,
    scrape,
    send,
)

ABORT_MAX_TOKENS = 128  # an aborted stream asks for this many: far more than the 1–3 chunks its client reads
GOOD_MAX_TOKENS = (8, 24)
SETTLE_S = 60.0  # for the engine to go idle (aborts land between steps) after a phase
SETTINGS = {  # the server's config (and the reference's: the same target, precision, kernels, KV)
    "draft": {"kind": "ngram"},
    "speculate": {"gamma": 4},
    "runtime": {"kernels": "auto"},
    "serve": {"max_kv_tokens": 4096, "batch_invariant": True},
    "server": {"request_timeout_s": 300, "shutdown_timeout_s": 5},
}
PROMPTS = {  # key -> a completions prompt (text) or a chat (messages)
    "count": "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,",
    "code": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "cat": "The cat sat on the mat. The cat sat on the",
    "list": "Monday, Tuesday, Wednesday, Thursday,",
    "story": "Once upon a time, in a small village by the sea, there lived",
    "json": '{"name": "Ada", "age": 36, "city": "London"}\n{"name": "Alan", "age": 41, "city":',
    "chat-count": [{"role": "user", "content": "Count: one, two, three, one, two,"}],
    "chat-poem": [{"role": "user", "content": "Write a short poem about the sea."}],
}
MALFORMED = ("bad_json", "missing_prompt", "wrong_type", "zero_max_tokens", "overlong", "unknown_model",
             "empty_messages", "n_two")  # fmt: skip


@dataclass
class SoakResult:
    counts: dict[str, int]  # requests per kind
    concurrency: int
    wall_s: float
    rss_checkpoint_kb: int | None  # the server's RSS after the first `checkpoint` requests (idle)
    rss_end_kb: int | None  # ... after all of them (idle)
    metrics_delta: dict[str, float]  # /metrics counters: end minus start
    metrics_end: dict[str, float]  # /metrics gauges at the end
    latency_s: dict[str, float]  # good requests: p50, p99
    failures: list[str]

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> dict[str, Any]:
        delta, start, end = self.metrics_delta, self.rss_checkpoint_kb, self.rss_end_kb
        drafts, accepted = (delta[f"vllm:spec_decode_num_{what}_total"] for what in ("drafts", "accepted_tokens"))
        return {
            "ok": self.ok, "requests": self.counts, "concurrency": self.concurrency, "wall_s": round(self.wall_s, 1),
            "requests_per_s": round(sum(self.counts.values()) / self.wall_s, 2), "latency_s": self.latency_s,
            "rss_checkpoint_mib": start and round(start / 1024, 1), "rss_end_mib": end and round(end / 1024, 1),
            "rss_change_pct": round(100 * (end / start - 1), 2) if start and end else None,
            "gauges_end": self.metrics_end, "aborted": delta["spectoolkit:aborted_requests_total"],
            "succeeded": delta["vllm:request_success_total"],
            "mean_accept_length": round(1 + accepted / drafts, 3) if drafts else None,
            "num_failures": len(self.failures), "failures": self.failures[:20],
        }  # fmt: skip


# ---- the plan ---------------------------------------------------------------------------------------


def make_plan(
    num_requests: int, abort_share: float, malformed_share: float, seed: int, model: str, context: int,
    abortable: list[str],
) -> list[PlannedRequest]:  # fmt: skip
    """The seeded request mix: round(n·abort_share) aborted streams (prompts from ``abortable``: their reference
    runs ABORT_MAX_TOKENS without EOS), round(n·malformed_share) malformed, the rest good."""
    rng = random.Random(seed)
    num_abort, num_bad = round(num_requests * abort_share), round(num_requests * malformed_share)
    kinds = ["abort"] * num_abort + ["malformed"] * num_bad + ["good"] * (num_requests - num_abort - num_bad)
    rng.shuffle(kinds)
    plan = []
    for index, kind in enumerate(kinds):
        if kind == "malformed":
            mistake = MALFORMED[rng.randrange(len(MALFORMED))]
            path, body = _malformed(mistake, model, context)
            plan.append(PlannedRequest(index, kind, path, body, mistake=mistake))
            continue
        key = rng.choice(abortable if kind == "abort" else sorted(PROMPTS))
        max_tokens = ABORT_MAX_TOKENS if kind == "abort" else rng.randint(*GOOD_MAX_TOKENS)
        stream = kind == "abort" or rng.random() < 0.5
        path, body = _body(model, key, max_tokens, stream)
        plan.append(PlannedRequest(index, kind, path, body, key, max_tokens, rng.randint(1, 3) * (kind == "abort")))
    return plan


def _body(model: str, key: str, max_tokens: int, stream: bool) -> tuple[str, dict[str, Any]]:
    prompt = PROMPTS[key]
    body = {"model": model, "max_tokens": max_tokens, "stream": stream, "return_token_ids": True}
    if isinstance(prompt, str):
        return "/v1/completions", {**body, "prompt": prompt}
    return "/v1/chat/completions", {**body, "messages": prompt}


def _malformed(mistake: str, model: str, context: int) -> tuple[str, dict[str, Any] | bytes]:
    good = {"model": model, "prompt": PROMPTS["cat"], "max_tokens": 8}
    bodies = {
        "bad_json": b'{"model": "' + model.encode() + b'", "prompt": "cut', "missing_prompt": {"model": model},
        "wrong_type": {**good, "max_tokens": "eight"}, "zero_max_tokens": {**good, "max_tokens": 0},
        "overlong": {**good, "prompt": " hello" * context}, "unknown_model": {**good, "model": "no-such-model"},
        "n_two": {**good, "n": 2},
    }  # fmt: skip
    if mistake == "empty_messages":
        return "/v1/chat/completions", {"model": model, "messages": [], "max_tokens": 8}
    return "/v1/completions", bodies[mistake]


# ---- the reference ----------------------------------------------------------------------------------


def batch1_references(settings: dict[str, Any], max_tokens: int = ABORT_MAX_TOKENS) -> dict[str, Reference]:
    """Every PROMPTS entry's greedy output (``max_tokens`` at most) from the target alone at batch 1: the
    ``baseline`` arm (one request in flight) of a run with ``settings`` and no drafter."""
    from spectoolkit.config import run_config_from_dict
    from spectoolkit.wiring.setup import build

    setup = build(run_config_from_dict(merged(settings, {"draft": {"kind": "none"}})))
    tokenizer, engine = setup.models.tokenizer, setup.arm_set.baseline.engine
    out = {}
    for key, prompt in PROMPTS.items():
        if isinstance(prompt, str):
            ids = [int(i) for i in tokenizer(prompt).input_ids]
        else:  # as ServedModel.encode_chat renders it
            encoded = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            ids = [int(i) for i in (encoded["input_ids"] if hasattr(encoded, "keys") else encoded)]
        output = list(engine.generate(ids, max_tokens, None).output_ids)
        out[key] = Reference(ids, output, lambda n, o=output: tokenizer.decode(o[:n], skip_special_tokens=True))
    return out


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


# ---- the server -------------------------------------------------------------------------------------


def hydra_overrides(settings: dict[str, Any], prefix: str = "") -> list[str]:
    """``{"serve": {"batch_invariant": True}}`` -> ``["serve.batch_invariant=true"]``."""
    out = []
    for key, value in settings.items():
        if isinstance(value, dict):
            out += hydra_overrides(value, f"{prefix}{key}.")
        else:
            text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            out.append(f"{prefix}{key}={text}")
    return out


@dataclass(frozen=True)
class Served:
    url: str  # http://127.0.0.1:PORT
    pid: int


@contextmanager
def serving(settings: dict[str, Any], workdir: Path, startup_s: float = 600.0) -> Iterator[Served]:
    """``python -m spectoolkit.serve`` with ``settings`` on a free 127.0.0.1 port, its log in ``workdir/server.log``;
    SIGTERM (then kill) on exit."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = merged(settings, {"server": {"host": "127.0.0.1", "port": port}})
    command = [sys.executable, "-m", "spectoolkit.serve", f"hydra.run.dir={workdir}/hydra", *hydra_overrides(settings)]
    with open(workdir / "server.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    served, deadline = Served(f"http://127.0.0.1:{port}", process.pid), time.monotonic() + startup_s
    try:
        while not _healthy(served.url):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = (workdir / "server.log").read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError("the server did not start:\n" + "\n".join(tail))
            time.sleep(0.5)
        yield served
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# ---- the soak ---------------------------------------------------------------------------------------


def soak(
    url: str, plan: list[PlannedRequest], references: dict[str, Reference], concurrency: int = 8,
    deadline_s: float = 3600.0, server_pid: int | None = None, checkpoint: int = 100, rss_tolerance: float = 0.05,
    timeout_s: float = 300.0,
) -> SoakResult:  # fmt: skip
    """Send ``plan`` to the server at ``url`` (http://127.0.0.1:PORT) with ``concurrency`` clients, in two phases
    (the first ``checkpoint`` requests, then the rest; the server waited idle after each and its RSS read when
    ``server_pid`` is given), and check every outcome and the server's state. Nothing is sent after ``deadline_s``;
    waiting for idle adds at most SETTLE_S per phase."""
    deadline = time.monotonic() + deadline_s
    outcomes: dict[int, Outcome] = {}
    before = scrape(url)
    wall = _run_phase(url, plan[:checkpoint], concurrency, deadline, timeout_s, outcomes)
    _settle(url)
    rss_checkpoint = rss_kb(server_pid) if server_pid else None
    wall += _run_phase(url, plan[checkpoint:], concurrency, deadline, timeout_s, outcomes)
    end = _settle(url)
    rss_end = rss_kb(server_pid) if server_pid else None
    delta = {name: end.get(name, 0.0) - before.get(name, 0.0) for name in COUNTERS}
    gauges = {name: end.get(name, float("nan")) for name in IDLE_GAUGES}
    counts = {kind: sum(r.kind == kind for r in plan) for kind in ("good", "abort", "malformed")}
    failures = check_outcomes(plan, outcomes, references)
    failures += check_server(counts, delta, gauges, rss_checkpoint, rss_end, rss_tolerance)
    times = sorted(outcomes[r.index].seconds for r in plan if r.kind == "good" and r.index in outcomes) or [0.0]
    latency = {"p50": round(statistics.median(times), 3), "p99": round(times[int(0.99 * (len(times) - 1))], 3)}
    return SoakResult(counts, concurrency, wall, rss_checkpoint, rss_end, delta, gauges, latency, failures)


def _run_phase(url: str, requests: list[PlannedRequest], concurrency: int, deadline: float, timeout_s: float,
               outcomes: dict[int, Outcome]) -> float:  # fmt: skip
    """Send ``requests`` with ``concurrency`` client threads (each its own connection) until done or ``deadline``;
    the wall seconds it took."""
    todo: queue.SimpleQueue[PlannedRequest] = queue.SimpleQueue()
    for request in requests:
        todo.put(request)

    def client() -> None:
        with httpx.Client(base_url=url) as http:
            while time.monotonic() < deadline:
                try:
                    request = todo.get_nowait()
                except queue.Empty:
                    return
                outcomes[request.index] = send(http, request, min(timeout_s, max(1.0, deadline - time.monotonic())))

    start = time.perf_counter()
    threads = [threading.Thread(target=client, name=f"soak-client-{i}", daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:  # a client stuck past the deadline is left behind (daemon): its request is not run
        thread.join(timeout=max(0.0, deadline - time.monotonic()) + 5.0)
    return time.perf_counter() - start


def _settle(url: str) -> dict[str, float]:
    """/metrics once two scrapes 0.2 s apart found nothing running or waiting and no KV in use (or SETTLE_S)."""
    stop, idle_before = time.monotonic() + SETTLE_S, False
    while True:
        samples = scrape(url)
        idle = all(samples.get(name) == 0 for name in IDLE_GAUGES)
        if (idle and idle_before) or time.monotonic() > stop:
            return samples
        idle_before = idle
        time.sleep(0.2)


# ---- all together, and the CLI ----------------------------------------------------------------------


def run_soak(
    settings: dict[str, Any], workdir: Path, num_requests: int = 1000, concurrency: int = 8, abort_share: float = 0.1,
    malformed_share: float = 0.05, seed: int = 0, deadline_s: float = 3600.0, checkpoint: int = 100,
    rss_tolerance: float = 0.05,
) -> SoakResult:  # fmt: skip
    """References in this process, then a server subprocess with ``settings``, the plan, the soak."""
    references = batch1_references(settings)
    abortable = sorted(key for key, ref in references.items() if len(ref.output_ids) == ABORT_MAX_TOKENS)
    if abort_share > 0 and not abortable:
        raise RuntimeError(f"every prompt's batch-1 output ends before {ABORT_MAX_TOKENS} tokens: none can be aborted")
    with serving(settings, workdir) as server:
        card = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
        plan = make_plan(num_requests, abort_share, malformed_share, seed, card["id"], card["max_model_len"], abortable)
        return soak(server.url, plan, references, concurrency, deadline_s, server.pid, checkpoint, rss_tolerance)


def _setting(text: str) -> dict[str, Any]:
    """``a.b=value`` -> ``{"a": {"b": value}}`` (value read as JSON when it parses: numbers, true, null)."""
    dotted, _, raw = text.partition("=")
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--abort-share", type=float, default=0.1)
    parser.add_argument("--malformed-share", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline-s", type=float, default=3600.0, help="nothing is sent after this")
    parser.add_argument("--checkpoint", type=int, default=100, help="RSS is compared with RSS after this many")
    parser.add_argument("--rss-tolerance", type=float, default=0.05)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a server setting")
    parser.add_argument("--workdir", type=Path, default=None, help="server log and Hydra dir (default: a temp dir)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through serving(): the server stops too
    settings = SETTINGS
    for text in args.set:
        settings = merged(settings, _setting(text))
    with tempfile.TemporaryDirectory(prefix="soak-") as temp:
        workdir = args.workdir or Path(temp)
        workdir.mkdir(parents=True, exist_ok=True)
        mix = (args.requests, args.concurrency, args.abort_share, args.malformed_share, args.seed)
        try:
            result = run_soak(settings, workdir, *mix, args.deadline_s, args.checkpoint, args.rss_tolerance)
        except RuntimeError as exc:  # the server did not start, or no prompt can be aborted
            sys.exit(f"error: {exc}")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")  # fmt: skip
    print(json.dumps({**result.summary(), "cpu": cpu, "cores": os.cpu_count(), "settings": settings}, indent=2))
    sys.exit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
