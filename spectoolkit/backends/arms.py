"""Serving arms on OpenAI-compatible servers: what each server says about itself, and the arms (issue 17).

``backend=endpoint``: "baseline" on ``backend.baseline_url`` (the target alone) and, with
``backend.spec_url``, "spec" (speculative) there. Each server is probed before anything is measured:
``/v1/models`` must answer (else one clear error naming the URL); ``/version`` and ``/info`` (ours) are
read when present and recorded in the run's conditions. Only loopback addresses are targeted unless
``backend.allow_remote=true``: a load test never reaches a machine the user did not name for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from spectoolkit.backends.endpoint import EndpointEngine, LoopThread, Timeouts
from spectoolkit.backends.scrape import SpecCounters, scrape
from spectoolkit.backends.wire import OPENAI, Wire, server_root
from spectoolkit.config import BackendConfig, RunConfig, is_loopback
from spectoolkit.errors import SpecToolkitError


@dataclass
class EndpointArm:
    """A serving arm (``ServingArmLike``) whose engine is a server at ``url``."""

    name: str
    engine: EndpointEngine
    gamma: int
    drafter: str
    target_precision: str
    draft_precision: str | None
    reference: str | None
    policy: str
    url: str
    server: dict[str, Any] = field(default_factory=dict)  # /v1/models, /version, /info as it answered

    def snapshot(self) -> SpecCounters | None:
        """The server's speculation counters now (None: it exports none)."""
        return scrape(self.url, self.engine.timeouts.connect_s)


@dataclass(frozen=True)
class Declared:
    """What the run knows about a server's speculation when the server does not say (managed vLLM)."""

    drafter: str
    gamma: int
    policy: str = "fixed"
    target_precision: str = "server"
    draft_precision: str | None = None


def check_address(url: str, allow_remote: bool, setting: str) -> None:
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise SpecToolkitError(f"{setting}={url} is not a URL ({exc}): give e.g. http://127.0.0.1:8000/v1") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise SpecToolkitError(f"{setting}={url} must be an http(s) base URL such as http://127.0.0.1:8000/v1")
    if not allow_remote and not is_loopback(parsed.host):
        raise SpecToolkitError(
            f"{setting}={url} is not a loopback address: a load test only targets machines you name for it — "
            "set backend.allow_remote=true to measure it"
        )


def probe(url: str, backend: BackendConfig) -> dict[str, Any]:
    """``/v1/models`` (required), ``/version`` and ``/info`` (when present) of the server at ``url``."""
    headers = {"Authorization": f"Bearer {backend.api_key}"} if backend.api_key else {}
    root = server_root(url)
    try:
        models = httpx.get(f"{url.rstrip('/')}/models", headers=headers, timeout=backend.connect_timeout_s)
    except httpx.HTTPError as exc:
        raise SpecToolkitError(f"cannot reach the server at {url} ({type(exc).__name__}: {exc}): is it up?") from None
    if models.status_code != 200:
        raise SpecToolkitError(f"{url}/models answered HTTP {models.status_code}: is {url} an OpenAI base URL?")
    try:
        cards = models.json().get("data", [])
    except (ValueError, AttributeError):  # not JSON, or JSON that is not an object
        cards = None
    if not isinstance(cards, list):
        raise SpecToolkitError(f"{url}/models did not answer OpenAI JSON: is {url} an OpenAI base URL?")
    report: dict[str, Any] = {"url": url, "models": cards}
    for name in ("version", "info"):
        try:
            reply = httpx.get(f"{root}/{name}", headers=headers, timeout=backend.connect_timeout_s)
        except httpx.HTTPError:
            continue
        if reply.status_code == 200 and reply.headers.get("content-type", "").startswith("application/json"):
            report[name] = reply.json()
    return report


def served_model(report: dict[str, Any], wanted: str | None) -> str:
    ids = [card.get("id") for card in report["models"]]
    if wanted is not None:
        if wanted not in ids:
            raise SpecToolkitError(f"{report['url']} serves {ids}, not backend.model={wanted}")
        return wanted
    if not ids:
        raise SpecToolkitError(f"{report['url']}/models lists no model")
    return ids[0]


def max_model_len(reports: list[dict[str, Any]]) -> int | None:
    """The smallest context any server reports (``max_model_len`` of its model card)."""
    lengths = [card.get("max_model_len") for report in reports for card in report["models"]]
    lengths = [n for n in lengths if isinstance(n, int) and n > 0]
    return min(lengths) if lengths else None


def endpoint_arms(
    cfg: RunConfig,
    loop: LoopThread,
    tokenizer: Any,
    declared: dict[str, Declared] | None = None,
    wire: Wire = OPENAI,
) -> list[EndpointArm]:
    """ "baseline" on ``backend.baseline_url`` and "spec" on ``backend.spec_url`` (when given), probed."""
    backend = cfg.backend
    urls = {"baseline": backend.baseline_url, "spec": backend.spec_url}
    arms = []
    for name, url in urls.items():
        if not url:
            continue
        check_address(url, backend.allow_remote, f"backend.{name}_url")
        report = probe(url, backend)
        timeouts = Timeouts(backend.connect_timeout_s, backend.read_timeout_s, backend.request_timeout_s)
        engine = EndpointEngine(name, url, served_model(report, backend.model), cfg.sampling, timeouts, loop,
                                tokenizer, backend.api_key, wire)  # fmt: skip
        arms.append(_arm(name, engine, url, report, cfg, (declared or {}).get(name)))
    return arms


def _arm(name: str, engine: EndpointEngine, url: str, report: dict, cfg: RunConfig, declared: Declared | None):
    info = report.get("info") or {}
    if name == "baseline":
        precision = info.get("target_precision") or (declared.target_precision if declared else "server")
        return EndpointArm(name, engine, 0, "none", precision, None, None, "none", url, report)
    if info.get("engine") == "spectoolkit":  # our server says what it runs
        return EndpointArm(name, engine, int(info.get("gamma") or cfg.speculate.gamma), str(info.get("drafter")),
                           str(info.get("target_precision")), info.get("draft_precision"), "baseline",
                           str(info.get("policy") or "fixed"), url, report)  # fmt: skip
    known = declared or Declared("server (as configured there)", cfg.speculate.gamma)
    return EndpointArm(name, engine, known.gamma, known.drafter, known.target_precision, known.draft_precision,
                       "baseline", known.policy, url, report)  # fmt: skip
