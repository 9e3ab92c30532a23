"""Prometheus metrics under vLLM's names, each mirrored under `twinspark:` (dashboards built for vLLM just work).

Two kinds: what the gateway sees per request (tokens, latencies, finish reasons: prometheus_client counters and
histograms, updated as requests finish), and what only the scheduler knows (queue lengths, KV pool use, prefix
cache totals: read from its Health reply when /metrics is scraped and exposed by a custom collector).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from twinspark.v1 import generate_pb2

PREFIXES = ("vllm", "twinspark")

# vLLM's buckets, so histograms from both servers can be compared bucket by bucket.
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
         80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
            960.0, 1920.0, 7680.0)


class _Mirrored:
    """One metric registered under every prefix; updates go to all copies."""

    def __init__(self, kind: type, name: str, doc: str, registry: CollectorRegistry, labels: tuple[str, ...],
                 **kwargs: Any) -> None:
        self._copies = [kind(f"{p}:{name}", doc, labelnames=labels, registry=registry, **kwargs) for p in PREFIXES]

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount > 0:
            for m in self._copies:
                m.labels(**labels).inc(amount)

    def observe(self, value: float, **labels: str) -> None:
        for m in self._copies:
            m.labels(**labels).observe(max(0.0, value))


@dataclass
class RequestRecord:
    """What one request contributes to the metrics when it ends."""

    finish_reason: str  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    e2e_s: float = 0.0
    finished: generate_pb2.Finished | None = None  # the scheduler's timings, when its Finished event arrived


class _HealthCollector(Collector):
    """Scheduler-side figures from the latest Health reply (None: the scheduler did not answer)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.reply: generate_pb2.HealthReply | None = None

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("twinspark:scheduler_up", "1 when the scheduler answered Health at this scrape",
                               labels=["model_name"])
        up.add_metric([self.model_name], 1.0 if self.reply is not None else 0.0)
        yield up
        reply = self.reply
        if reply is None:
            return
        total = reply.pool.total_blocks
        usage = 1.0 - reply.pool.free_blocks / total if total > 0 else 0.0
        for p in PREFIXES:
            for name, doc, value in (
                ("num_requests_running", "Number of requests in model execution batches.", reply.running),
                ("num_requests_waiting", "Number of requests waiting to be processed.", reply.waiting),
                ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
            ):
                g = GaugeMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
                g.add_metric([self.model_name], float(value))
                yield g
            for name, doc, value in (
                ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                 reply.prefix_cache_queries),
                ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                 reply.prefix_cache_hits),
            ):
                c = CounterMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
                c.add_metric([self.model_name], float(value))
                yield c
        if reply.tiers:
            yield from self._tiers(reply)

    def _tiers(self, reply: generate_pb2.HealthReply) -> Iterator[Metric]:
        """KV tiers behind the pool: vLLM's external-cache counters (its name for KV connectors / offloading),
        and per tier (label `tier`: host, disk) what only twinspark has."""
        for p in PREFIXES:
            for name, doc, value in (
                ("external_prefix_cache_queries", "External prefix cache queries, in terms of number of queried "
                 "tokens.", reply.prefix_cache_queries),
                ("external_prefix_cache_hits", "External prefix cache hits, in terms of number of cached tokens.",
                 sum(t.hits for t in reply.tiers)),
            ):
                c = CounterMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
                c.add_metric([self.model_name], float(value))
                yield c
        labels = ["model_name", "tier"]
        for kind, name, doc, field in (
            (CounterMetricFamily, "kv_tier_hits", "Prompt tokens whose KV blocks came back from this tier.", "hits"),
            (CounterMetricFamily, "kv_tier_evictions", "Entries pushed out of this tier (host: to disk or dropped).",
             "evictions"),
            (CounterMetricFamily, "kv_tier_corrupt", "Entries that failed their checksum on load (dropped on every "
             "rank and recomputed).", "corrupt"),
            (GaugeMetricFamily, "kv_tier_bytes", "Bytes this tier holds per rank.", "bytes"),
            (GaugeMetricFamily, "kv_tier_capacity_bytes", "Capacity of this tier per rank.", "capacity"),
            (GaugeMetricFamily, "kv_tier_entries", "Blocks and KDA states this tier holds.", "entries"),
        ):
            m = kind(f"twinspark:{name}", doc, labels=labels)
            for t in reply.tiers:
                m.add_metric([self.model_name, t.tier], float(getattr(t, field)))
            yield m


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        # `*_created` timestamp series double the page for nothing a dashboard reads (process-wide switch).
        disable_created_metrics()
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, m = self.registry, ("model_name",)
        self._prompt_tokens = _Mirrored(Counter, "prompt_tokens", "Number of prefill tokens processed.", r, m)
        self._generation_tokens = _Mirrored(Counter, "generation_tokens", "Number of generation tokens processed.",
                                            r, m)
        self._success = _Mirrored(Counter, "request_success", "Count of successfully processed requests.", r,
                                  m + ("finished_reason",))
        self._ttft = _Mirrored(Histogram, "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                               r, m, buckets=_TTFT)
        self._itl = _Mirrored(Histogram, "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                              r, m, buckets=_ITL)
        self._e2e = _Mirrored(Histogram, "e2e_request_latency_seconds",
                              "Histogram of end to end request latency in seconds.", r, m, buckets=_LATENCY)
        self._queue = _Mirrored(Histogram, "request_queue_time_seconds",
                                "Histogram of time spent in WAITING phase for request.", r, m, buckets=_LATENCY)
        self._prefill = _Mirrored(Histogram, "request_prefill_time_seconds",
                                  "Histogram of time spent in PREFILL phase for request.", r, m, buckets=_LATENCY)
        self._decode = _Mirrored(Histogram, "request_decode_time_seconds",
                                 "Histogram of time spent in DECODE phase for request.", r, m, buckets=_LATENCY)
        self._drafted = _Mirrored(Counter, "spec_decode_num_draft_tokens", "Number of draft tokens.", r, m)
        self._accepted = _Mirrored(Counter, "spec_decode_num_accepted_tokens", "Number of accepted tokens.", r, m)
        self._health = _HealthCollector(model_name)
        self.registry.register(self._health)

    # ------------------------------------------------------------------------------------------- per request
    def first_token(self, ttft_s: float) -> None:
        self._ttft.observe(ttft_s, model_name=self.model_name)

    def inter_token(self, gap_s: float, tokens: int) -> None:
        """A chunk of `tokens` ids arrived `gap_s` after the previous one: each token is charged its share, so
        drafted rounds (several tokens at once) show the per-token latency users experience."""
        for _ in range(max(0, tokens)):
            self._itl.observe(gap_s / tokens, model_name=self.model_name)

    def request_done(self, rec: RequestRecord) -> None:
        labels = {"model_name": self.model_name}
        self._prompt_tokens.inc(rec.prompt_tokens, **labels)
        self._generation_tokens.inc(rec.completion_tokens, **labels)
        if rec.finish_reason != "error":
            self._success.inc(1, finished_reason=rec.finish_reason, **labels)
            self._e2e.observe(rec.e2e_s, **labels)
        f = rec.finished
        if f is not None:
            self._queue.observe(f.queue_s, **labels)
            self._prefill.observe(f.prefill_s, **labels)
            self._decode.observe(f.decode_s, **labels)
            self._drafted.inc(f.drafted_tokens, **labels)
            self._accepted.inc(f.accepted_tokens, **labels)

    # ---------------------------------------------------------------------------------------------- scrape
    def set_health(self, reply: generate_pb2.HealthReply | None) -> None:
        self._health.reply = reply

    def render(self) -> bytes:
        return generate_latest(self.registry)
