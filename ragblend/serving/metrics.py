"""The server's Prometheus metrics (official ``prometheus_client``), one registry per server.

Named like vLLM's (``vllm:`` → ``ragblend:``) so its dashboards apply with the prefix
changed; ragblend's own (mode, chunk hits, decode rate) carry the same prefix.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from ragblend.decode import BlendStats

# TTFT from ~10 ms (a blended prompt on a GPU) to a minute (a long full prefill on a small CPU)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
RATE_WINDOW_S = 10.0


class ServerMetrics:
    """Tokens, latencies (TTFT, end to end, between tokens), queue, modes, chunk hits."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter(
            "ragblend:prompt_tokens", "Prompt tokens prefilled (any mode)", registry=r
        )
        self.cached_tokens = Counter(
            "ragblend:prompt_tokens_cached",
            "Prompt tokens whose K/V came from the chunk or prefix caches",
            registry=r,
        )
        self.generation_tokens = Counter(
            "ragblend:generation_tokens", "Tokens generated", registry=r
        )
        self.ttft = Histogram(
            "ragblend:time_to_first_token_seconds",
            "Time from a request's arrival to its first token (queueing and prefill)",
            ["mode"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "ragblend:e2e_request_latency_seconds",
            "Time from a request's arrival to its last token",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "ragblend:inter_token_latency_seconds",
            "Time between two tokens of one request",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.success = Counter(
            "ragblend:request_success",
            "Requests finished, by finish reason",
            ["finished_reason"],
            registry=r,
        )
        self.waiting = Gauge("ragblend:num_requests_waiting", "Requests waiting", registry=r)
        self.running = Gauge("ragblend:num_requests_running", "Requests decoding", registry=r)
        self.requests = Counter(
            "ragblend:requests", "Requests prefilled, by the mode that ran", ["mode"], registry=r
        )
        self.fallbacks = Counter(
            "ragblend:fallbacks",
            "Blend/reuse requests that ran a full prefill, by ragblend.fallback's reason",
            ["reason"],
            registry=r,
        )
        self.chunk_hits = Counter(
            "ragblend:chunk_hits", "Chunks served from the KV store", registry=r
        )
        self.chunk_misses = Counter(
            "ragblend:chunk_misses", "Chunks found in a prompt but not in the store", registry=r
        )
        self.chunk_tier_hits = Counter(
            "ragblend:chunk_tier_hits",
            "Chunks served from the KV store, by the tier that held them (ram, redis, disk)",
            ["tier"],
            registry=r,
        )
        self.decode_rate = Gauge(
            "ragblend:decode_tokens_per_second",
            f"Tokens per second of decode steps over the last {RATE_WINDOW_S:g} s (all slots)",
            registry=r,
        )
        self.errors = Counter(
            "ragblend:request_errors", "Requests answered with an error", ["status"], registry=r
        )
        self.cancelled = Counter(
            "ragblend:cancelled_requests",
            "Requests dropped because the client went away or the request timed out",
            registry=r,
        )
        self._steps: collections.deque[tuple[float, int, float]] = collections.deque()
        self._lock = threading.Lock()

    def first_token(self, stats: BlendStats) -> None:
        """A request's prefill ran (its first token is chosen)."""
        self.ttft.labels(mode=stats.mode).observe(stats.ttft_ms / 1000)
        self.requests.labels(mode=stats.mode).inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        if stats.fallback_reason:
            self.fallbacks.labels(reason=stats.fallback_reason).inc()
        self.chunk_hits.inc(stats.chunk_hits)
        self.chunk_misses.inc(stats.chunk_misses)
        for tier, n in (stats.extra.get("chunk_tiers") or {}).items():
            self.chunk_tier_hits.labels(tier=tier).inc(n)

    def token(self, since_last: float | None) -> None:
        """A token was handed out, ``since_last`` seconds after the request's previous one."""
        self.generation_tokens.inc()
        if since_last is not None:
            self.itl.observe(since_last)

    def finished(self, stats: BlendStats, seconds: float) -> None:
        """A request ended (``seconds`` after its arrival)."""
        self.e2e.observe(seconds)
        self.success.labels(finished_reason=stats.finish_reason).inc()

    def decoded(self, tokens: int, seconds: float) -> None:
        """One decode step produced ``tokens`` tokens in ``seconds``."""
        now = time.monotonic()
        with self._lock:
            self._steps.append((now, tokens, seconds))
            while self._steps and self._steps[0][0] < now - RATE_WINDOW_S:
                self._steps.popleft()
            busy = sum(s for _, _, s in self._steps)
            made = sum(n for _, n, _ in self._steps)
        self.decode_rate.set(made / busy if busy > 0 else 0.0)

    def occupancy(self, waiting: int, running: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)

    def error(self, status: int) -> None:
        self.errors.labels(status=str(status)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


def merge_labelled(texts: Mapping[str, str], label: str = "replica") -> bytes:
    """Several servers' Prometheus texts as one exposition: every sample of ``texts[name]``
    gains the label ``label="name"``, and each metric family is written once (``ragblend serve
    --ray``: one text per replica). Families keep their type, help and sample order."""
    families: dict[str, Metric] = {}
    for name, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for s in family.samples:
                labels = {**s.labels, label: name}
                merged.samples.append(s._replace(labels=labels))
    registry = CollectorRegistry()
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families(Collector):
    """A collector that yields fixed metric families (:func:`merge_labelled`)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families
