"""Prefill and decode throughput of an engine: the median of several timed runs."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kestrel_core.errors import KestrelError
from kestrel_core.model.engine import Engine


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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_bench(engine: Engine, *, prompt_tokens: int = 256, decode_tokens: int = 64, runs: int = 3,
              warmup: int = 1, seed: int = 0, quant: str = "") -> BenchResult:
    """Greedy generation of ``decode_tokens`` after a random ``prompt_tokens`` prompt, never stopping at EOS.

    The warmup runs (not counted) let a backend compile kernels and fill its caches.
    """
    if prompt_tokens < 1 or decode_tokens < 1 or runs < 1 or warmup < 0:
        raise KestrelError("bench needs --prompt-tokens >= 1, --decode-tokens >= 1, --runs >= 1, --warmup >= 0")
    context = engine.config.max_position
    if prompt_tokens + decode_tokens > context:
        raise KestrelError(f"{prompt_tokens} prompt + {decode_tokens} decode tokens exceed the model's context "
                           f"of {context}")
    prompt = np.random.default_rng(seed).integers(0, engine.config.vocab_size, prompt_tokens).tolist()
    prefill, decode = [], []
    for i in range(warmup + runs):
        n = sum(1 for _ in engine.generate(prompt, max_tokens=decode_tokens + 1, stop_at_eos=False))
        assert n == decode_tokens + 1
        if i >= warmup:
            prefill.append(engine.last.prefill_tok_s)
            decode.append(engine.last.decode_tok_s)
    stats = engine.stats
    return BenchResult(
        model=engine.source, backend=engine.backend_name, device=engine.backend.device_description, quant=quant,
        prompt_tokens=prompt_tokens, decode_tokens=decode_tokens, runs=runs, load_s=engine.load_s,
        preload_s=engine.preload_s, weights_mb=engine.model.nbytes / 1e6,
        prefill_tok_s=statistics.median(prefill), decode_tok_s=statistics.median(decode),
        prefill_tok_s_runs=prefill, decode_tok_s_runs=decode, offload=stats["offload"],
        backend_stats=stats["backend_stats"])
