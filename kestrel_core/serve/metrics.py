"""Prometheus metrics of one server (the engines' labelled by model), in a registry of its own.

Each app gets its own ``CollectorRegistry`` (not prometheus-client's global one), so several servers in one
process, as in the tests, do not clash. Request counters and latency histograms are updated as requests
go; the engine's state (queue depth, batch size, steps) and the backend's offload counters are read at
scrape time by a custom collector, so they are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector(Collector):
    """Each served model's AsyncEngine gauges and counters, and its ``engine.offload.stats()`` per hook, read at
    each scrape and labelled with the model's name (as vLLM labels its metrics)."""

    def __init__(self, async_engines: Mapping[str, Any]) -> None:
        self.async_engines = dict(async_engines)

    def collect(self) -> Iterator[Metric]:
        def family(kind: type, name: str, doc: str, *labels: str) -> Any:
            return kind(name, doc, labels=["model", *labels])

        waiting = family(GaugeMetricFamily, "kestrel_num_requests_waiting", "Requests queued for the running batch.")
        running = family(GaugeMetricFamily, "kestrel_num_requests_running", "Sequences in the running batch.")
        steps = family(CounterMetricFamily, "kestrel_engine_steps", "Batched engine steps run.")
        failed = family(CounterMetricFamily, "kestrel_engine_failed_steps", "Batched engine steps that raised.")
        finished = family(CounterMetricFamily, "kestrel_engine_finished_requests",
                          "Requests the engine finished, by reason.", "reason")
        drafted = family(CounterMetricFamily, "kestrel_spec_decode_draft_tokens",
                         "Draft tokens greedy steps guessed (--speculate).")
        accepted = family(CounterMetricFamily, "kestrel_spec_decode_accepted_tokens",
                          "Draft tokens the model confirmed.")
        preempted = family(CounterMetricFamily, "kestrel_num_preemptions",
                           "Running sequences put back in the queue for want of KV blocks (recomputed later).")
        hits = family(CounterMetricFamily, "kestrel_prefix_cache_hit_tokens",
                      "Prompt positions requests attached from the prefix cache instead of computing them, when "
                      "first admitted (not again after a preemption).")
        cached = family(GaugeMetricFamily, "kestrel_prefix_cache_blocks", "KV blocks the prefix cache holds.")
        usage = family(GaugeMetricFamily, "kestrel_kv_cache_usage_perc",
                       "Fraction of the KV cache's blocks sequences hold (1: full); the prefix cache's idle "
                       "blocks count as free, as they are taken back when needed.")
        offered = family(CounterMetricFamily, "kestrel_offload_offered", "Offloads offered to the backend, per hook.",
                         "hook")
        taken = family(CounterMetricFamily, "kestrel_offload_accepted", "Offloads the backend computed, per hook.",
                       "hook")
        declined = family(CounterMetricFamily, "kestrel_offload_declined",
                          "Offloads computed by the CPU instead, per hook and reason.", "hook", "reason")
        for model, ae in self.async_engines.items():
            waiting.add_metric([model], ae.num_waiting)
            running.add_metric([model], ae.num_running)
            steps.add_metric([model], ae.counters.steps)
            failed.add_metric([model], ae.counters.failed_steps)
            for reason, n in sorted(dict(ae.counters.finished).items()):
                finished.add_metric([model, reason], n)
            drafted.add_metric([model], ae.scheduler.drafted)
            accepted.add_metric([model], ae.scheduler.accepted)
            preempted.add_metric([model], ae.scheduler.preemptions)
            pool = getattr(ae.engine, "pool", None)
            if pool is not None:
                hits.add_metric([model], pool.prefix_hit_tokens)
                cached.add_metric([model], pool.cached_blocks)
                usage.add_metric([model], 1 - pool.free_blocks / pool.num_blocks)
            for hook, s in _offload_stats(ae.engine).items():
                offered.add_metric([model, hook], s.get("offered", 0))
                taken.add_metric([model, hook], s.get("accepted", 0))
                reasons = s.get("declined_reasons") or {}
                if reasons:
                    for reason, n in sorted(reasons.items()):
                        declined.add_metric([model, hook, str(reason)], n)
                elif s.get("declined"):
                    declined.add_metric([model, hook, "unknown"], s["declined"])
        yield from (waiting, running, steps, failed, finished, drafted, accepted, preempted, hits, cached, usage,
                    offered, taken, declined)


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

    def __init__(self, async_engines: Mapping[str, Any]) -> None:
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
