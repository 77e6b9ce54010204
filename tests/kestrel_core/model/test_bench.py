"""``kestrel bench``'s batch-1 runs: each reads a prompt of its own, so prefill is never a prefix-cache hit, and a
prompt's prefill time is all the steps it takes."""

from __future__ import annotations

import pytest

from kestrel_core.model import presets
from kestrel_core.model.bench import run_bench
from kestrel_core.model.engine_load import load_preset


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


def test_a_prompt_of_several_steps_counts_them_all_in_its_prefill(monkeypatch: pytest.MonkeyPatch,
                                                                   tiny_config) -> None:
    """A prompt longer than a step's token budget is prefilled over several scheduler steps (chunked prefill);
    its prefill time is all of them, not the last. A clock that moves one second a step counts them."""
    from kestrel_core.model import engine as engine_mod
    from kestrel_core.model.scheduler import Scheduler, default_token_budget

    monkeypatch.setitem(presets.PRESETS, "tiny", tiny_config("qwen3", max_position=2048))
    engine = load_preset("tiny", backend="cpu")
    clock = [0.0]
    step = Scheduler.step

    def timed_step(self):  # type: ignore[no-untyped-def]
        clock[0] += 1.0
        return step(self)

    monkeypatch.setattr(Scheduler, "step", timed_step)
    monkeypatch.setattr(engine_mod.time, "perf_counter", lambda: clock[0])
    steps = 3
    length = steps * default_token_budget(1) - 7
    result = run_bench(engine, prompt_tokens=length, decode_tokens=2, runs=1, warmup=0)
    assert engine.last.prefill_s == steps and engine.last.decode_tokens == 2 and engine.last.decode_s == 2
    assert result.prefill_tok_s == pytest.approx(length / steps)
