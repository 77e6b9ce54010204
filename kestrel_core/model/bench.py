"""Throughput of an engine: batch-1 prefill and decode (the median of several runs), and continuous
batching at several concurrency levels."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from kestrel_core.errors import KestrelError
from kestrel_core.model.engine import Engine
from kestrel_core.model.kv_pool import bytes_per_position

log = logging.getLogger("kestrel")


@dataclass
class BenchResult:
    model: str
    backend: str
    device: str
    quant: str
    prompt_tokens: int
    decode_tokens: int
    runs: int
    load_s: float
    preload_s: float
    weights_mb: float
    prefill_tok_s: float  # median over runs
    decode_tok_s: float  # median over runs
    prefill_tok_s_runs: list[float] = field(default_factory=list)
    decode_tok_s_runs: list[float] = field(default_factory=list)
    offload: dict[str, Any] = field(default_factory=dict)
    backend_stats: dict[str, Any] = field(default_factory=dict)
    upload_mb_per_token: float = 0.0  # weights the backend uploaded in the measured runs, per generated token
    upload_gb_s: float = 0.0  # and the rate of those uploads
    bus_gb_s: float = 0.0  # the backend's host-to-device bandwidth from pinned memory, measured in the same run
    bus_ratio: float = 0.0  # a decode step's time over the time its uploads take at bus_gb_s (1: at the bus's speed)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


UPLOAD_BYTES, UPLOAD_S = "weight_upload_bytes", "weight_upload_s"  # kestrel_stats keys of a streaming backend
BUS_GB_S = "bus_h2d_pinned_gb_s"  # and its bus, measured with one large copy from page-locked memory


def run_bench(engine: Engine, *, prompt_tokens: int = 256, decode_tokens: int = 64, runs: int = 3,
              warmup: int = 1, seed: int = 0, quant: str = "") -> BenchResult:
    """Greedy generation of ``decode_tokens`` after a random ``prompt_tokens`` prompt, never stopping at EOS.

    The warmup runs (not counted) let a backend compile kernels and fill its caches. Each run reads a prompt of
    its own: the same prompt again would be read from the prefix cache, and its prefill time would be a block's.
    """
    if prompt_tokens < 1 or decode_tokens < 1 or runs < 1 or warmup < 0:
        raise KestrelError("bench needs --prompt-tokens >= 1, --decode-tokens >= 1, --runs >= 1, --warmup >= 0")
    context, answer = engine.config.max_position, decode_tokens + 1  # the first token, then decode_tokens
    if prompt_tokens + answer > context:
        raise KestrelError(f"{prompt_tokens} prompt tokens and an answer of {answer} (the first and "
                           f"{decode_tokens} decode tokens) exceed the model's context of {context}")
    if (blocks := engine.pool.blocks_for(prompt_tokens + answer)) > engine.pool.num_blocks:
        raise KestrelError(f"{prompt_tokens} prompt tokens and an answer of {answer} need more than the "
                           f"{engine.pool.capacity} positions the KV cache holds (--kv-cache-mb "
                           f"{_cache_mb(engine, blocks)} gives them room)")
    prompts = np.random.default_rng(seed).integers(0, engine.config.vocab_size, (warmup + runs, prompt_tokens))
    prefill, decode = [], []
    uploads = (0.0, 0.0)
    for i, prompt in enumerate(prompts.tolist()):
        if i == warmup:
            uploads = _uploads(engine.offload.backend_stats())
        n = sum(1 for _ in engine.generate(prompt, max_tokens=answer, stop_at_eos=False))
        if n != answer:
            raise KestrelError(f"a run stopped after {n} of its {answer} tokens")
        if i >= warmup:
            prefill.append(engine.last.prefill_tok_s)
            decode.append(engine.last.decode_tok_s)
    stats = engine.stats
    end = _uploads(stats["backend_stats"])
    moved, seconds = end[0] - uploads[0], end[1] - uploads[1]
    per_token = moved / (runs * (decode_tokens + 1))  # bytes a forward pass (prefill passes count as one)
    bus = _number(stats["backend_stats"], BUS_GB_S)
    decode_tok_s = statistics.median(decode)
    return BenchResult(
        model=engine.source, backend=engine.backend_name, device=engine.backend.device_description, quant=quant,
        prompt_tokens=prompt_tokens, decode_tokens=decode_tokens, runs=runs, load_s=engine.load_s,
        preload_s=engine.preload_s, weights_mb=engine.model.nbytes / 1e6,
        prefill_tok_s=statistics.median(prefill), decode_tok_s=decode_tok_s,
        prefill_tok_s_runs=prefill, decode_tok_s_runs=decode, offload=stats["offload"],
        backend_stats=stats["backend_stats"], upload_mb_per_token=per_token / 1e6,
        upload_gb_s=moved / 1e9 / seconds if seconds > 0 else 0.0, bus_gb_s=bus,
        bus_ratio=(1 / decode_tok_s) / (per_token / 1e9 / bus) if bus > 0 and per_token > 0 and decode_tok_s > 0
        else 0.0)


def _number(backend_stats: dict[str, Any], key: str) -> float:
    value = backend_stats.get(key, 0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _uploads(backend_stats: dict[str, Any]) -> tuple[float, float]:
    """(bytes, seconds) of weight uploads so far, from a backend's ``UPLOAD_BYTES`` / ``UPLOAD_S`` stats."""
    return _number(backend_stats, UPLOAD_BYTES), _number(backend_stats, UPLOAD_S)


@dataclass
class ConcurrencyResult:
    """One concurrency level: ``concurrency`` requests submitted at once, run to their end."""

    concurrency: int
    duration_s: float
    output_tok_s: float  # every generated token over the whole run
    decode_tok_s: float  # all_decoding_rate: while every stream decodes
    stream_tok_s: float  # median over requests of (tokens - 1) / (last token - first token)
    ttft_p50_s: float
    ttft_p99_s: float
    steps: int
    preemptions: int


@dataclass
class ConcurrencyBench:
    model: str
    backend: str
    device: str
    quant: str
    prompt_tokens: int
    decode_tokens: int
    levels: list[ConcurrencyResult] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cache_mb(engine: Engine, blocks: int) -> int:
    """The --kv-cache-mb that holds ``blocks`` blocks of ``engine``'s KV cache."""
    pool = engine.pool
    return math.ceil(blocks * pool.block_size * bytes_per_position(engine.config, pool.kv_type) / 2 ** 20)


def all_decoding_rate(streams: Sequence[Sequence[float]], counts: Sequence[Sequence[int]] | None = None) -> float:
    """Aggregate tokens per second while every stream decodes: from the last stream's first token to the first
    stream's last (the tokens of that window over its length). ``streams``: each stream's token time stamps,
    the first its first token; ``counts``: the tokens each stamp carries (1 each if not given)."""
    live = [(s, c) for s, c in zip(streams, counts or [[1] * len(s) for s in streams]) if s]
    if not live:
        return 0.0
    if any(len(c) != len(s) for s, c in live):
        raise ValueError("a stream needs a token count for every stamp")
    lo, hi = max(s[0] for s, _ in live), min(s[-1] for s, _ in live)
    if hi <= lo:
        return 0.0
    return sum(n for s, c in live for t, n in zip(s, c) if lo < t <= hi) / (hi - lo)


def run_concurrency_bench(engine: Engine, levels: list[int], *, prompt_tokens: int = 256, decode_tokens: int = 64,
                          seed: int = 0, quant: str = "", token_budget: int | None = None,
                          warn: Callable[[str], None] | None = None) -> ConcurrencyBench:
    """Continuous batching at each concurrency level: that many requests with distinct random prompts of
    ``prompt_tokens``, greedy, ``decode_tokens`` each (EOS ignored), all submitted at once to the scheduler.
    Decode tok/s is ``all_decoding_rate``: while all of them decode, not in the prompts' ramp or the tail.
    A KV cache too small for one stream is a KestrelError; one too small for the largest level's streams at once
    is said through ``warn`` (default: logged), and they take turns."""
    from kestrel_core.model.sampling import SamplingParams
    from kestrel_core.model.scheduler import Scheduler

    if not levels or min(levels) < 1 or prompt_tokens < 1 or decode_tokens < 1:
        raise KestrelError("bench needs --concurrency levels >= 1, --prompt-tokens >= 1, --decode-tokens >= 1")
    if prompt_tokens + decode_tokens > engine.config.max_position:
        raise KestrelError(f"{prompt_tokens} prompt + {decode_tokens} decode tokens exceed the model's context "
                           f"of {engine.config.max_position}")
    pool = engine.pool
    stream = pool.blocks_for(prompt_tokens + decode_tokens + 1)
    if stream > pool.num_blocks:  # the scheduler would end the lone stream early, at "length"
        raise KestrelError(f"{prompt_tokens} prompt + {decode_tokens} decode tokens need more than the "
                           f"{pool.capacity} positions the KV cache holds: not even one stream fits "
                           f"(--kv-cache-mb {_cache_mb(engine, stream)} gives it room)")
    if max(levels) * stream > pool.num_blocks:
        (warn or log.warning)(f"the KV cache holds {pool.capacity} positions, {max(levels)} streams need "
                              f"{max(levels) * stream * pool.block_size}: they will not all run at once "
                              f"(--kv-cache-mb {_cache_mb(engine, max(levels) * stream)} gives them room)")
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
    result = ConcurrencyBench(engine.source, engine.backend_name, engine.backend.device_description, quant,
                              prompt_tokens, decode_tokens)
    warm = Scheduler(engine, max_batch=2, token_budget=token_budget)  # compiles, caches: untimed
    for _ in range(2):
        warm.add(rng.integers(0, engine.config.vocab_size, prompt_tokens).tolist(), replace(params, max_tokens=4))
    while warm.has_work:
        warm.step()
    for level in levels:
        scheduler = Scheduler(engine, max_batch=level, token_budget=token_budget, max_waiting=level)
        prompts = [rng.integers(0, engine.config.vocab_size, prompt_tokens).tolist() for _ in range(level)]
        t0 = time.perf_counter()
        requests = [scheduler.add(p, params) for p in prompts]
        stamps: dict[str, list[float]] = {r.request_id: [] for r in requests}
        while scheduler.has_work:
            outputs = scheduler.step()
            now = time.perf_counter()
            for out in outputs:
                stamps[out.request_id].extend([now] * len(out.new_token_ids))
        end = time.perf_counter()
        firsts = [s[0] for s in stamps.values()]
        total = sum(len(s) for s in stamps.values())
        per_stream = [(len(s) - 1) / (s[-1] - s[0]) for s in stamps.values() if len(s) > 1 and s[-1] > s[0]]
        ttft = np.array(firsts) - t0
        result.levels.append(ConcurrencyResult(
            concurrency=level, duration_s=end - t0, output_tok_s=total / (end - t0),
            decode_tok_s=all_decoding_rate(list(stamps.values())),
            stream_tok_s=statistics.median(per_stream) if per_stream else 0.0,
            ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p99_s=float(np.percentile(ttft, 99)),
            steps=scheduler.steps, preemptions=scheduler.preemptions))
    return result
