"""Speculation counters from a server's Prometheus ``/metrics``, and their change over a run (issue 17).

vLLM's names (our server exports the same): ``vllm:spec_decode_num_drafts_total``,
``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total`` and
``..._num_accepted_tokens_per_pos_total{position="j"}``, summed over every other label (model, engine);
llama-server (``--metrics``) exports the same names under ``llamacpp:``.
A run's acceptance is the delta of two scrapes around it: acceptance_rate = accepted / draft tokens,
mean acceptance length = 1 + accepted / drafts. A server without these metrics (a baseline, or a
server that exports none) gives no counters — never zeros that would read as "nothing accepted".
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from spectoolkit.backends.wire import server_root
from spectoolkit.metrics.spec_counters import SpecCounters

DRAFTS = "spec_decode_num_drafts_total"
DRAFT_TOKENS = "spec_decode_num_draft_tokens_total"
ACCEPTED = "spec_decode_num_accepted_tokens_total"
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos_total"
PREFIXES = ("vllm:", "llamacpp:")


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The speculation counters in a Prometheus exposition ``text``; None when it has none."""
    found: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = _unprefixed(sample.name)
            if name == PER_POSITION:
                position = int(sample.labels.get("position", -1))
                per_position[position] = per_position.get(position, 0.0) + sample.value
            elif name in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
                found[name] = found.get(name, 0.0) + sample.value
    if DRAFTS not in found:
        return None
    width = max(per_position, default=-1) + 1
    positions = [per_position.get(j, 0.0) for j in range(width)]
    return SpecCounters(found[DRAFTS], found.get(DRAFT_TOKENS, 0.0), found.get(ACCEPTED, 0.0), positions)


def _unprefixed(name: str) -> str | None:
    prefix = next((p for p in PREFIXES if name.startswith(p)), None)
    return None if prefix is None else name[len(prefix) :]


def metrics_url(base_url: str) -> str:
    """``http://host:port/v1`` -> ``http://host:port/metrics``."""
    return f"{server_root(base_url)}/metrics"


def scrape(base_url: str, timeout_s: float) -> SpecCounters | None:
    """The server's speculation counters now; None when it exports none or ``/metrics`` cannot be read."""
    try:
        reply = httpx.get(metrics_url(base_url), timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if reply.status_code != 200:
        return None
    try:
        return parse_spec_counters(reply.text)
    except ValueError:  # a page that is not Prometheus text (a proxy, a web UI): no counters
        return None
