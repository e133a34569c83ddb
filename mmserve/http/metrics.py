"""Prometheus metrics of one server (its own registry, so two servers in one process never share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from mmserve.ipc.messages import RouterStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mmserve_requests", "Requests accepted (sent to the router)", registry=r)
        self.generated_tokens = Counter("mmserve_generated_tokens", "Tokens generated", registry=r)
        self.running = Gauge("mmserve_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("mmserve_requests_waiting", "Requests waiting for admission", registry=r)
        self.kv_used = Gauge("mmserve_kv_tokens_used", "KV cache token slots held now", registry=r)
        self.kv_total = Gauge("mmserve_kv_tokens_total", "KV cache token slots in all", registry=r)
        self.prefix_cache_tokens = Gauge(
            "mmserve_prefix_cache_tokens", "KV token slots the prefix cache holds (in use or evictable)", registry=r
        )
        self.prefix_cache_hits = Counter(
            "mmserve_prefix_cache_hit_tokens", "Prompt tokens whose KV came from the prefix cache", registry=r
        )
        self._hits_seen = 0  # the router reports a running total
        self.ttft = Histogram(
            "mmserve_time_to_first_token_seconds",
            "Time from arrival to the first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "mmserve_time_per_output_token_seconds",
            "Mean time per output token after the first",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def on_stats(self, stats: RouterStats) -> None:
        engine = stats.engine
        self.running.set(engine.running)
        self.waiting.set(stats.waiting)
        self.kv_used.set(engine.kv_used)
        self.kv_total.set(engine.kv_total)
        self.prefix_cache_tokens.set(engine.prefix_cache_tokens)
        if engine.prefix_cache_hit_tokens > self._hits_seen:
            self.prefix_cache_hits.inc(engine.prefix_cache_hit_tokens - self._hits_seen)
            self._hits_seen = engine.prefix_cache_hit_tokens

    def render(self) -> bytes:
        return generate_latest(self.registry)
