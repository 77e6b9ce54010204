"""Prometheus metrics of one server, in a registry of its own.

Each app gets its own ``CollectorRegistry`` (not prometheus-client's global one), so several servers in one
process, as in the tests, do not clash. Request counters and latency histograms are updated as requests
go; the engine's state (queue depth, batch size, steps) and the backend's offload counters are read at
scrape time by a custom collector, so they are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector(Collector):
    """The AsyncEngine's gauges and counters, and ``engine.offload.stats()`` per hook, read at each scrape."""

    def __init__(self, async_engine: Any) -> None:
        self.async_engine = async_engine

    def collect(self) -> Iterator[Metric]:
        ae = self.async_engine
        waiting = GaugeMetricFamily("kestrel_num_requests_waiting", "Requests queued for the running batch.")
        waiting.add_metric([], ae.num_waiting)
        running = GaugeMetricFamily("kestrel_num_requests_running", "Sequences in the running batch.")
        running.add_metric([], ae.num_running)
        yield waiting
        yield running
        c = ae.counters
        steps = CounterMetricFamily("kestrel_engine_steps", "Batched engine steps run.")
        steps.add_metric([], c.steps)
        failed = CounterMetricFamily("kestrel_engine_failed_steps", "Batched engine steps that raised.")
        failed.add_metric([], c.failed_steps)
        finished = CounterMetricFamily("kestrel_engine_finished_requests", "Requests the engine finished, by reason.",
                                       labels=["reason"])
        for reason, n in sorted(dict(c.finished).items()):
            finished.add_metric([reason], n)
        yield steps
        yield failed
        yield finished
        drafted = CounterMetricFamily("kestrel_spec_decode_draft_tokens",
                                      "Draft tokens greedy steps guessed (--speculate).")
        drafted.add_metric([], ae.scheduler.drafted)
        accepted = CounterMetricFamily("kestrel_spec_decode_accepted_tokens", "Draft tokens the model confirmed.")
        accepted.add_metric([], ae.scheduler.accepted)
        yield drafted
        yield accepted
        pool = getattr(ae.engine, "pool", None)
        if pool is not None:
            hits = CounterMetricFamily("kestrel_prefix_cache_hit_tokens",
                                       "Prompt positions attached from the prefix cache instead of computed.")
            hits.add_metric([], pool.prefix_hit_tokens)
            cached = GaugeMetricFamily("kestrel_prefix_cache_blocks", "KV blocks the prefix cache holds.")
            cached.add_metric([], pool.cached_blocks)
            yield hits
            yield cached
        yield from self._offload()

    def _offload(self) -> Iterator[Metric]:
        offered = CounterMetricFamily("kestrel_offload_offered", "Offloads offered to the backend, per hook.",
                                      labels=["hook"])
        accepted = CounterMetricFamily("kestrel_offload_accepted", "Offloads the backend computed, per hook.",
                                       labels=["hook"])
        declined = CounterMetricFamily("kestrel_offload_declined",
                                       "Offloads computed by the CPU instead, per hook and reason.",
                                       labels=["hook", "reason"])
        for hook, s in _offload_stats(self.async_engine.engine).items():
            offered.add_metric([hook], s.get("offered", 0))
            accepted.add_metric([hook], s.get("accepted", 0))
            reasons = s.get("declined_reasons") or {}
            if reasons:
                for reason, n in sorted(reasons.items()):
                    declined.add_metric([hook, str(reason)], n)
            elif s.get("declined"):
                declined.add_metric([hook, "unknown"], s["declined"])
        yield offered
        yield accepted
        yield declined


def _offload_stats(engine: Any) -> dict[str, dict[str, Any]]:
    """The offload counters; the scheduler thread may add a hook while we read, so retry once then skip."""
    offload = getattr(engine, "offload", None)
    if offload is None:
        return {}
    for _ in range(3):
        try:
            return dict(offload.stats())
        except RuntimeError:  # dictionary changed size during iteration
            continue
    return {}


class ServerMetrics:
    """The server's metrics; ``render()`` is the /metrics body."""

    def __init__(self, async_engine: Any) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kestrel_requests", "HTTP requests, by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("kestrel_prompt_tokens", "Prompt tokens of the requests served.", registry=r)
        self.generation_tokens = Counter("kestrel_generation_tokens", "Tokens generated.", registry=r)
        self.time_to_first_token = Histogram("kestrel_time_to_first_token_seconds",
                                             "From the request's arrival to its first generated token.",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("kestrel_inter_token_latency_seconds",
                                             "Between two generated tokens of one request.",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.request_duration = Histogram("kestrel_request_duration_seconds",
                                          "From arrival to the last byte of the response, by endpoint.",
                                          ["endpoint"], buckets=_DURATION_BUCKETS, registry=r)
        r.register(_EngineCollector(async_engine))

    def observe_request(self, endpoint: str, status: int, duration_s: float, prompt_tokens: int,
                        completion_tokens: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.request_duration.labels(endpoint).observe(duration_s)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if completion_tokens:
            self.generation_tokens.inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
