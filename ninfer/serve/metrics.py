"""Prometheus metrics: request and token counters, latency, and the engine's live stats as gauges.

Each app owns its own registry (several servers can live in one process, e.g. in tests). Engine gauges
are read from `backend.stats()` at scrape time: every numeric entry becomes `ninfer_engine_<name>`, and the
headline ones also get stable names (lanes busy, queue depth, KV pages used/free, acceptance rate).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ninfer.serve.generation import Usage

disable_created_metrics()  # the *_created series only add noise to every scrape
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# stable names for the engine stats a dashboard needs, whatever the engine calls them internally
_HEADLINE = {
    "lanes_busy": ("ninfer_lanes_busy", "requests decoding now"),
    "lanes_total": ("ninfer_lanes_total", "--max-concurrency"),
    "queue_depth": ("ninfer_queue_depth", "requests waiting for a lane"),
    "kv_pages_used": ("ninfer_kv_pages_used", "KV pool pages in use"),
    "kv_pages_free": ("ninfer_kv_pages_free", "KV pool pages free"),
    "spec_acceptance_rate": ("ninfer_spec_acceptance_rate", "accepted draft tokens / drafted"),
}


def numeric_stats(stats: Any) -> dict[str, float]:
    """Flatten an engine stats object (dataclass, mapping or object) into name → number."""
    if stats is None:
        return {}
    if not isinstance(stats, Mapping):
        stats = getattr(stats, "__dict__", {}) or {
            k: getattr(stats, k) for k in getattr(stats, "__dataclass_fields__", {})
        }
    out: dict[str, float] = {}
    for key, value in stats.items():
        if isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, (int, float)):
            out[key] = float(value)
    return out


class _EngineCollector(Collector):
    def __init__(self, read_stats: Callable[[], Any]):
        self._read_stats = read_stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            stats = numeric_stats(self._read_stats())
        except Exception:  # a scrape must never fail because the engine is loading or stopping
            stats = {}
        for key, value in sorted(stats.items()):
            if key in _HEADLINE:
                name, doc = _HEADLINE[key]
                yield GaugeMetricFamily(name, doc, value=value)
                continue
            yield GaugeMetricFamily(f"ninfer_engine_{_sanitize(key)}", f"engine stat {key}", value=value)


def _sanitize(key: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in key)


class Metrics:
    def __init__(self, read_stats: Callable[[], Any]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "ninfer_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "ninfer_prompt_tokens", "prompt tokens of finished generations", registry=r
        )
        self.cached_tokens = Counter(
            "ninfer_cached_prompt_tokens", "prompt tokens served from cache", registry=r
        )
        self.generation_tokens = Counter("ninfer_generation_tokens", "tokens generated", registry=r)
        self.generations = Counter(
            "ninfer_generations", "finished generations by reason", ["reason"], registry=r
        )
        self.in_flight = Gauge(
            "ninfer_generations_in_flight", "generations streaming or waiting now", registry=r
        )
        self.ttft = Histogram(
            "ninfer_time_to_first_token_seconds",
            "time to first token",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.decode_tps = Gauge(
            "ninfer_decode_tokens_per_second", "decode tok/s of the last request", registry=r
        )
        self.prefill_tps = Gauge(
            "ninfer_prefill_tokens_per_second", "prefill tok/s of the last request", registry=r
        )
        r.register(_EngineCollector(read_stats))

    def observe_request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def observe_generation(self, reason: str, usage: Usage | None) -> None:
        self.generations.labels(reason=reason).inc()
        if usage is None:
            return
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        if usage.time_to_first_token_s is not None:
            self.ttft.observe(usage.time_to_first_token_s)
        if usage.decode_tok_per_s is not None:
            self.decode_tps.set(usage.decode_tok_per_s)
        if usage.prefill_tok_per_s is not None:
            self.prefill_tps.set(usage.prefill_tok_per_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
