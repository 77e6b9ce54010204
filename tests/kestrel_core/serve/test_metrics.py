"""The metrics registry: its own per server, the engine's state and offload counters read at scrape time."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kestrel_core.model.async_engine import EngineCounters
from kestrel_core.serve.metrics import ServerMetrics


class _Offload:
    def __init__(self) -> None:
        self.counts: dict[str, dict[str, Any]] = {}

    def stats(self) -> dict[str, dict[str, Any]]:
        return self.counts


def _fake_async_engine() -> Any:
    return SimpleNamespace(num_waiting=3, num_running=2, counters=EngineCounters(steps=7, finished={"stop": 2}),
                           engine=SimpleNamespace(offload=_Offload()),
                           scheduler=SimpleNamespace(drafted=40, accepted=25, preemptions=4))


M = (("model", "m"),)  # the engine metrics' label: the model's name


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def test_engine_state_and_offload_counters_are_read_at_scrape_time() -> None:
    ae = _fake_async_engine()
    metrics = ServerMetrics({"m": ae})
    s = _samples(metrics)
    assert s[("kestrel_num_requests_waiting", M)] == 3 and s[("kestrel_num_requests_running", M)] == 2
    assert s[("kestrel_engine_steps_total", M)] == 7
    assert s[("kestrel_engine_finished_requests_total", (("model", "m"), ("reason", "stop")))] == 2
    assert s[("kestrel_spec_decode_draft_tokens_total", M)] == 40
    assert s[("kestrel_spec_decode_accepted_tokens_total", M)] == 25
    assert s[("kestrel_num_preemptions_total", M)] == 4
    assert not any(name.startswith("kestrel_offload") for name, _ in s)  # nothing offered yet
    ae.num_running = 0
    ae.engine.offload.counts["kestrel_gemm_q8"] = {"offered": 5, "accepted": 3, "declined": 2,
                                                   "declined_reasons": {"below min FLOPs": 2}}
    s = _samples(metrics)
    assert s[("kestrel_num_requests_running", M)] == 0
    assert s[("kestrel_offload_offered_total", (("hook", "kestrel_gemm_q8"), ("model", "m")))] == 5
    assert s[("kestrel_offload_accepted_total", (("hook", "kestrel_gemm_q8"), ("model", "m")))] == 3
    assert s[("kestrel_offload_declined_total", (("hook", "kestrel_gemm_q8"), ("model", "m"),
                                              ("reason", "below min FLOPs")))] == 2


def test_request_metrics_and_separate_registries() -> None:
    a, b = ServerMetrics({"m": _fake_async_engine()}), ServerMetrics({"m": _fake_async_engine()})  # no clash
    a.observe_request("/v1/completions", 200, 0.5, prompt_tokens=4, completion_tokens=6)
    a.observe_request("/v1/completions", 429, 0.001, prompt_tokens=0, completion_tokens=0)
    a.time_to_first_token.observe(0.2)
    s = _samples(a)
    assert s[("kestrel_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 1
    assert s[("kestrel_requests_total", (("endpoint", "/v1/completions"), ("status", "429")))] == 1
    assert s[("kestrel_prompt_tokens_total", ())] == 4 and s[("kestrel_generation_tokens_total", ())] == 6
    assert s[("kestrel_time_to_first_token_seconds_count", ())] == 1
    assert s[("kestrel_request_duration_seconds_count", (("endpoint", "/v1/completions"),))] == 2
    assert ("kestrel_requests_total", (("endpoint", "/v1/completions"), ("status", "200"))) not in _samples(b)


def test_prefix_cache_figures_are_the_pools() -> None:
    ae = _fake_async_engine()
    ae.engine.pool = SimpleNamespace(prefix_hit_tokens=128, cached_blocks=5, free_blocks=6, num_blocks=8)
    s = _samples(ServerMetrics({"m": ae}))
    assert s[("kestrel_prefix_cache_hit_tokens_total", M)] == 128 and s[("kestrel_prefix_cache_blocks", M)] == 5
    assert s[("kestrel_kv_cache_usage_perc", M)] == 0.25
    ae.engine.pool.prefix_hit_tokens = 192
    assert _samples(ServerMetrics({"m": ae}))[("kestrel_prefix_cache_hit_tokens_total", M)] == 192


def test_each_model_has_its_own_figures() -> None:
    a, b = _fake_async_engine(), _fake_async_engine()
    b.num_running = 5
    s = _samples(ServerMetrics({"chat": a, "embed": b}))
    assert s[("kestrel_num_requests_running", (("model", "chat"),))] == 2
    assert s[("kestrel_num_requests_running", (("model", "embed"),))] == 5
