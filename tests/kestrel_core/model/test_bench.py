"""``kestrel bench``'s batch-1 runs: each reads a prompt of its own, so prefill is never a prefix-cache hit."""

from __future__ import annotations

import pytest

from kestrel_core.model import presets
from kestrel_core.model.bench import run_bench
from kestrel_core.model.engine import load_preset


def test_each_run_prefills_a_prompt_of_its_own(monkeypatch: pytest.MonkeyPatch, tiny_config) -> None:
    monkeypatch.setitem(presets.PRESETS, "tiny", tiny_config("qwen3", max_position=256))
    engine = load_preset("tiny", backend="cpu")
    assert engine.prefix_cache  # the host runs the steps: the same prompt again would be read from the cache
    length = 3 * engine.pool.block_size
    prompt = list(range(3, 3 + length))
    for _ in range(2):
        list(engine.generate(prompt, max_tokens=1))
    hits = engine.pool.prefix_hit_tokens
    assert hits > 0
    result = run_bench(engine, prompt_tokens=length, decode_tokens=2, runs=2, warmup=1)
    assert engine.pool.prefix_hit_tokens == hits
    assert len(result.prefill_tok_s_runs) == 2
