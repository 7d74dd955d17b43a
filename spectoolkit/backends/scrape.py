"""Speculation counters from a server's Prometheus ``/metrics``, and their change over a run (issue 17).

vLLM's names (our server exports the same): ``vllm:spec_decode_num_drafts_total``,
``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total`` and
``..._num_accepted_tokens_per_pos_total{position="j"}``, summed over every other label (model, engine).
A run's acceptance is the delta of two scrapes around it: acceptance_rate = accepted / draft tokens,
mean acceptance length = 1 + accepted / drafts. A server without these metrics (a baseline, or a
server that exports none) gives no counters — never zeros that would read as "nothing accepted".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass
class SpecCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_per_position: list[float] = field(default_factory=list)

    def minus(self, before: SpecCounters) -> SpecCounters:
        width = max(len(self.accepted_per_position), len(before.accepted_per_position))
        mine = self.accepted_per_position + [0.0] * (width - len(self.accepted_per_position))
        theirs = before.accepted_per_position + [0.0] * (width - len(before.accepted_per_position))
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted_tokens - before.accepted_tokens,
                            [a - b for a, b in zip(mine, theirs, strict=True)])  # fmt: skip

    def plus(self, other: SpecCounters) -> SpecCounters:
        return self.minus(SpecCounters(-other.drafts, -other.draft_tokens, -other.accepted_tokens,
                                       [-v for v in other.accepted_per_position]))  # fmt: skip

    def as_json(self) -> dict:
        rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else None
        length = 1 + self.accepted_tokens / self.drafts if self.drafts else None
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "accepted_per_position": self.accepted_per_position, "acceptance_rate": rate,
                "mean_accept_length": length}  # fmt: skip


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The speculation counters in a Prometheus exposition ``text``; None when it has none."""
    found: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == PER_POSITION:
                position = int(sample.labels.get("position", -1))
                per_position[position] = per_position.get(position, 0.0) + sample.value
            elif sample.name in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    if DRAFTS not in found:
        return None
    width = max(per_position, default=-1) + 1
    positions = [per_position.get(j, 0.0) for j in range(width)]
    return SpecCounters(found[DRAFTS], found.get(DRAFT_TOKENS, 0.0), found.get(ACCEPTED, 0.0), positions)


def metrics_url(base_url: str) -> str:
    """``http://host:port/v1`` -> ``http://host:port/metrics``."""
    root = base_url.rstrip("/")
    return (root[: -len("/v1")] if root.endswith("/v1") else root) + "/metrics"


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
