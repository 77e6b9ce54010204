"""Prometheus metrics of one server (all the models it serves), in a registry of its own.

Each app gets its own ``CollectorRegistry`` (not prometheus-client's global one), so several servers in one
process, as in the tests, do not clash. Request counters and latency histograms are updated as requests
go; the engine's state (queue depth, batch size, steps) and the backend's offload counters are read at
scrape time by a custom collector, so they are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector(Collector):
    """The AsyncEngines' gauges and counters, and each ``engine.offload.stats()`` per hook, read at each scrape
    (summed over the models a server serves)."""

    def __init__(self, async_engines: Sequence[Any]) -> None:
        self.async_engines = list(async_engines)

    def collect(self) -> Iterator[Metric]:
        engines = self.async_engines
        waiting = GaugeMetricFamily("kestrel_num_requests_waiting", "Requests queued for the running batch.")
        waiting.add_metric([], sum(ae.num_waiting for ae in engines))
        running = GaugeMetricFamily("kestrel_num_requests_running", "Sequences in the running batch.")
        running.add_metric([], sum(ae.num_running for ae in engines))
        yield waiting
        yield running
        steps = CounterMetricFamily("kestrel_engine_steps", "Batched engine steps run.")
        steps.add_metric([], sum(ae.counters.steps for ae in engines))
        failed = CounterMetricFamily("kestrel_engine_failed_steps", "Batched engine steps that raised.")
        failed.add_metric([], sum(ae.counters.failed_steps for ae in engines))
        finished = CounterMetricFamily("kestrel_engine_finished_requests", "Requests the engine finished, by reason.",
                                       labels=["reason"])
        for reason, n in sorted(_summed(dict(ae.counters.finished) for ae in engines).items()):
            finished.add_metric([reason], n)
        yield steps
        yield failed
        yield finished
        drafted = CounterMetricFamily("kestrel_spec_decode_draft_tokens",
                                      "Draft tokens greedy steps guessed (--speculate).")
        drafted.add_metric([], sum(ae.scheduler.drafted for ae in engines))
        accepted = CounterMetricFamily("kestrel_spec_decode_accepted_tokens", "Draft tokens the model confirmed.")
        accepted.add_metric([], sum(ae.scheduler.accepted for ae in engines))
        yield drafted
        yield accepted
        pools = [ae.engine.pool for ae in engines if getattr(ae.engine, "pool", None) is not None]
        if pools:
            hits = CounterMetricFamily("kestrel_prefix_cache_hit_tokens",
                                       "Prompt positions attached from the prefix cache instead of computed.")
            hits.add_metric([], sum(pool.prefix_hit_tokens for pool in pools))
            cached = GaugeMetricFamily("kestrel_prefix_cache_blocks", "KV blocks the prefix cache holds.")
            cached.add_metric([], sum(pool.cached_blocks for pool in pools))
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
        stats = [_offload_stats(ae.engine) for ae in self.async_engines]
        for hook in sorted({hook for s in stats for hook in s}):
            per = [s[hook] for s in stats if hook in s]
            offered.add_metric([hook], sum(s.get("offered", 0) for s in per))
            accepted.add_metric([hook], sum(s.get("accepted", 0) for s in per))
            reasons = _summed(s.get("declined_reasons") or {} for s in per)
            if reasons:
                for reason, n in sorted(reasons.items()):
                    declined.add_metric([hook, str(reason)], n)
            elif any(s.get("declined") for s in per):
                declined.add_metric([hook, "unknown"], sum(s.get("declined", 0) for s in per))
        yield offered
        yield accepted
        yield declined


def _summed(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for key, n in c.items():
            out[key] = out.get(key, 0) + n
    return out


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

    def __init__(self, async_engines: Sequence[Any]) -> None:
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
        r.register(_EngineCollector(async_engines))

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
