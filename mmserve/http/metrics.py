"""Prometheus metrics of one server (its own registry, so two servers in one process never share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from mmserve.ipc.messages import RouterStats, TextOutput

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# whole requests (vLLM's request-latency buckets, with short ones added for small outputs)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_MAX_TOKENS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

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
        self.last_stats: RouterStats | None = None  # the router's latest report (/token_load reads it)
        # Per request, under vLLM's names (with our prefix). Every engine request counts (n > 1 is n of them).
        self.prompt_tokens = Counter(
            "mmserve_prompt_tokens", "Prompt tokens prefilled (counted with each request's first token)", registry=r
        )
        self.request_success = Counter(
            "mmserve_request_success",
            "Requests finished, by finish reason (stop, length, abort, error)",
            ["finished_reason"],
            registry=r,
        )
        self.e2e_latency = Histogram(
            "mmserve_e2e_request_latency_seconds",
            "Time from arrival to the last output, of requests whose client stayed to the end",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "mmserve_request_queue_time_seconds",
            "Time from arrival (before tokenization and image encoding) until the engine admitted the request",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.inference_time = Histogram(
            "mmserve_request_inference_time_seconds",
            "Time from the engine's admission of the request to its last output",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            "mmserve_request_prefill_time_seconds",
            "Time from the engine's admission of the request to its first token (its prefill, chunks of other "
            "prompts' prefills and decode steps between them included)",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.decode_time = Histogram(
            "mmserve_request_decode_time_seconds",
            "Time from the request's first token to its last",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.max_tokens = Histogram(
            "mmserve_request_params_max_tokens",
            "max_new_tokens (max_tokens) of each request, as the engine runs it",
            buckets=_MAX_TOKENS_BUCKETS,
            registry=r,
        )
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
        self.last_stats = stats
        engine = stats.engine
        self.running.set(engine.running)
        self.waiting.set(stats.waiting)
        self.kv_used.set(engine.kv_used)
        self.kv_total.set(engine.kv_total)
        self.prefix_cache_tokens.set(engine.prefix_cache_tokens)
        if engine.prefix_cache_hit_tokens > self._hits_seen:
            self.prefix_cache_hits.inc(engine.prefix_cache_hit_tokens - self._hits_seen)
            self._hits_seen = engine.prefix_cache_hit_tokens

    def on_output(self, out: TextOutput) -> None:
        """Counts of every engine request's output, whether its client is still there or not."""
        if out.tokens and out.output_tokens == len(out.tokens):  # its first tokens: the prompt has been prefilled
            self.prompt_tokens.inc(out.prompt_tokens)
        if out.finished:
            self.request_success.labels(finished_reason=out.finish_reason or "error").inc()

    def on_finished(self, out: TextOutput, arrival: float, now: float, first_token: float | None = None) -> None:
        """Timings of a request whose client stayed to its end (times from time.monotonic(); first_token: when its
        first token came, None if none did)."""
        self.e2e_latency.observe(now - arrival)
        if out.scheduled_at is not None:
            self.inference_time.observe(max(now - out.scheduled_at, 0.0))
        if first_token is not None:
            self.decode_time.observe(now - first_token)
            if out.scheduled_at is not None:
                self.prefill_time.observe(max(first_token - out.scheduled_at, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
