"""``/metrics`` in Prometheus format: vLLM's names for what vLLM also measures, ``spectoolkit:`` for the rest.

Counters are read live from the engine's :class:`~spectoolkit.serving.counters.EngineCounters` at every
scrape, so they move exactly as the engine's do. vLLM's convention (its ``spec_decode`` metrics): a
draft is a verify round with candidates; mean acceptance length = 1 + accepted_tokens / drafts;
``accepted_tokens_per_pos{position="j"}`` counts the drafts whose candidate j (0-based) was accepted.
Latency histograms (TTFT, TPOT, inter-token, end to end, queue) are observed once per finished request.
Prefix caching as vLLM counts it, in tokens (``vllm:prefix_cache_queries``/``hits``). What each request got:
``spectoolkit:requests{sampling="greedy"|"sampled", speculation="on"|"capped"|"off"}`` and their draft and
accepted tokens under the same labels.
The alert rules a report writes (``alerts.yml``) use these names, so they work on our server and vLLM.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from spectoolkit.metrics.timing import delivery_gaps, time_per_output_token
from spectoolkit.serving.api import FinishedRequest
from spectoolkit.serving.engine import ContinuousEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 20.0, 40.0, 80.0)  # fmt: skip

# (name without the _total suffix, help, EngineCounters field)
_VLLM_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "Verify rounds with at least one draft token.", "drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", "draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "accepted_tokens"),
    ("vllm:prompt_tokens", "Prompt tokens prefilled.", "prompt_tokens"),
    ("vllm:generation_tokens", "Output tokens generated.", "generation_tokens"),
    ("vllm:num_preemptions", "Preemptions (KV freed and recomputed).", "preemptions"),
    ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission.", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prompt tokens whose KV the prefix cache held.", "prefix_cache_hits"),
)
_OWN_COUNTERS = (
    ("spectoolkit:verify_rounds", "Decode rounds (target forwards emitting tokens after prefill).", "verify_rounds"),
    ("spectoolkit:rollback_rounds", "Drafts in which a candidate was rejected and its KV rolled back.",
     "rollback_rounds"),
    ("spectoolkit:steps", "Engine steps (one ragged target forward each).", "steps"),
    ("spectoolkit:step_seconds", "Seconds spent in engine steps, drafting included.", "step_seconds"),
    ("spectoolkit:draft_seconds", "Seconds spent drafting.", "draft_seconds"),
    ("spectoolkit:failed_requests", "Requests that failed inside the engine.", "failed_requests"),
    ("spectoolkit:aborted_requests", "Requests cancelled (client disconnect, stop string, shutdown).",
     "aborted_requests"),
)  # fmt: skip


class _EngineCollector:
    """Reads the engine's counters and queue at scrape time."""

    def __init__(self, engine: ContinuousEngine, model_name: str) -> None:
        self.engine, self.labels = engine, {"model_name": model_name}

    def collect(self):
        counters = self.engine.counters
        for name, text, field in (*_VLLM_COUNTERS, *_OWN_COUNTERS):
            yield self._counter(name, text, getattr(counters, field))
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Drafts whose candidate at this position was accepted.",
            labels=["model_name", "position"],
        )  # fmt: skip
        for position, count in enumerate(list(counters.accepted_per_position)):
            per_position.add_metric([self.labels["model_name"], str(position)], count)
        yield per_position
        yield from self._by_kind(counters)
        success = CounterMetricFamily("vllm:request_success", "Requests finished.", labels=["model_name"])
        success.add_metric([self.labels["model_name"]], counters.finished_requests)
        yield success
        scheduler = self.engine.scheduler
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.", len(scheduler.running))
        yield self._gauge("vllm:num_requests_waiting", "Requests queued.", len(scheduler.queue))
        allocator = self.engine.allocator
        used = (allocator.num_blocks - allocator.num_free) / max(1, allocator.num_blocks)
        yield self._gauge("vllm:kv_cache_usage_perc", "Share of KV blocks in use (1 = full).", used)
        draft_bytes = self.engine.kv_bytes()["draft_kv_bytes"]  # a draft model's own pool (0 for n-gram)
        yield self._gauge("spectoolkit:draft_kv_cache_bytes", "Draft-model KV bytes in use.", draft_bytes)

    def _by_kind(self, counters):
        """Finished requests, their draft and accepted tokens, by (sampling, speculation) as each asked."""
        families = (
            ("spectoolkit:requests", "Requests finished, by sampling and speculation.", counters.requests_by_kind),
            ("spectoolkit:request_draft_tokens", "Their draft tokens.", counters.drafted_by_kind),
            ("spectoolkit:request_accepted_tokens", "Their accepted draft tokens.", counters.accepted_by_kind),
        )
        for name, text, by_kind in families:
            family = CounterMetricFamily(name, text, labels=["model_name", "sampling", "speculation"])
            for (sampling, speculation), count in sorted(dict(by_kind).items()):
                family.add_metric([self.labels["model_name"], sampling, speculation], count)
            yield family

    def _counter(self, name: str, text: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, text, labels=["model_name"])
        family.add_metric([self.labels["model_name"]], value)
        return family

    def _gauge(self, name: str, text: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, text, labels=["model_name"])
        family.add_metric([self.labels["model_name"]], value)
        return family


class ServerMetrics:
    """The registry behind ``/metrics``; :meth:`observe` takes each finished request's latencies."""

    def __init__(self, engine: ContinuousEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.model_name = model_name

        def histogram(name: str, text: str) -> Histogram:
            return Histogram(name, text, ["model_name"], registry=self.registry, buckets=LATENCY_BUCKETS)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self.tpot = histogram("vllm:request_time_per_output_token_seconds", "Time per output token after the first.")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between consecutive token deliveries.")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.")
        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.")

    def observe(self, done: FinishedRequest) -> None:
        """Latencies of one finished request (failed ones are counted, not timed)."""
        if done.error or not done.token_times:
            return
        label = self.model_name
        self.ttft.labels(label).observe(max(0.0, done.token_times[0] - done.arrival))
        tpot = time_per_output_token(done.token_times)
        if tpot is not None:
            self.tpot.labels(label).observe(tpot)
        for gap in delivery_gaps(done.token_times):
            self.itl.labels(label).observe(gap)
        self.e2e.labels(label).observe(max(0.0, done.finish - done.arrival))
        if done.scheduled is not None:
            self.queue.labels(label).observe(max(0.0, done.scheduled - done.arrival))

    def render(self) -> bytes:
        return generate_latest(self.registry)
