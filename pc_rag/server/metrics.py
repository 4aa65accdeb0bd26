"""The server's Prometheus metrics (``GET /metrics``), named as vLLM names the same quantities, prefixed ``pc_rag:``.

Counters and histograms are observed when a request ends; gauges (requests running and waiting, KV bytes) are
read from the scheduler when scraped. Each ``ServerMetrics`` has a registry of its own: two servers in one
process never share a metric. This module knows nothing about HTTP or how requests are served.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pc_rag.runtime.generate import GenerationResult

if TYPE_CHECKING:
    from pc_rag.runtime.prefix_cache import PrefixCache
    from pc_rag.runtime.scheduler import Scheduler

# vLLM's buckets for the same histograms (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)  # fmt: skip


class ServerMetrics:
    """The metrics of one server over ``scheduler``, labelled with ``model_name``; ``render()`` is the scrape."""

    def __init__(self, scheduler: Scheduler, model_name: str, prefix_cache: PrefixCache | None = None) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        except ImportError as e:
            msg = "the server's metrics need prometheus_client: pip install 'pc-rag[serve]'"
            raise ImportError(msg) from e
        self.registry = registry = CollectorRegistry()
        name = {"model_name": model_name}
        labels = list(name)

        def counter(metric: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"pc_rag:{metric}", doc, [*labels, *extra], registry=registry)

        def histogram(metric: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"pc_rag:{metric}", doc, labels, buckets=buckets, registry=registry).labels(**name)

        def gauge(metric: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"pc_rag:{metric}", doc, [*labels, *extra], registry=registry)

        self._name = name
        self.success = counter("request_success", "Requests finished, by finish reason (stop, length, abort).",
                               ("finished_reason",))  # fmt: skip
        self.rejected = counter("request_rejected", "Requests refused before serving, by HTTP status.", ("status",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(**name)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(**name)
        self.cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in a cache (every prompt token)."
        ).labels(**name)
        self.cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens read from cached KV (store chunks, shared prefixes, history)."
        ).labels(**name)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between generated tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from request to last token.", E2E_BUCKETS)
        gauge("num_requests_running", "Requests decoding.").labels(**name).set_function(lambda: scheduler.active)
        waiting = gauge("num_requests_waiting", "Requests queued for a decoding slot.").labels(**name)
        waiting.set_function(lambda: scheduler.waiting)
        kv = gauge("kv_cache_bytes", "Bytes of KV memory held, by kind.", ("kind",))
        for kind, read in scheduler.kv_memory().items():
            kv.labels(**name, kind=kind).set_function(read)
        if prefix_cache is not None:
            kv.labels(**name, kind="prefix_cache").set_function(prefix_cache.held_bytes)

    def finished(self, result: GenerationResult, finish_reason: str) -> None:
        """Count a request that ended with ``result``."""
        stats = result.stats
        prompt = stats.cached_tokens + stats.computed_tokens
        self.success.labels(**self._name, finished_reason=finish_reason).inc()
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(stats.new_tokens)
        self.cache_queries.inc(prompt)
        self.cache_hits.inc(stats.cached_tokens)
        self.ttft.observe(stats.ttft_ms / 1000)
        self.e2e.observe(stats.total_ms / 1000)
        if stats.new_tokens > 1:  # each gap after the first token, at the request's mean gap
            gap = (stats.total_ms - stats.ttft_ms) / 1000 / (stats.new_tokens - 1)
            for _ in range(stats.new_tokens - 1):
                self.itl.observe(gap)

    def aborted(self) -> None:
        """Count a request whose client left before it ended."""
        self.success.labels(**self._name, finished_reason="abort").inc()

    def refused(self, status: int) -> None:
        self.rejected.labels(**self._name, status=str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        """The scrape body and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
