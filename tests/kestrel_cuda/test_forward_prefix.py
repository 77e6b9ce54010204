"""The prefix cache in the CUDA backend's pool on the GPU: test_forward_prefix_host.py's scenarios through the
real backend (its tiled GEMM for the prompt chunks, the captured steps, the pipelined greedy decode).
Skipped where CuPy or a CUDA device is missing (CI)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

import kestrel_core  # noqa: E402
from kestrel_core.model.kv_pool import BLOCK_SIZE  # noqa: E402
from kestrel_core.model.presets import synthetic_model  # noqa: E402
from kestrel_core.model.sampling import SamplingParams  # noqa: E402

from .forward_check import FACTOR, SMALL_CONFIGS, cpu_logits, cuda_device_count, greedy_agrees, jitter_effect  # noqa: E402
from .test_forward_batch_host import serve_alone  # noqa: E402
from .test_forward_prefix_host import SYSTEM, run_both_ways, serve_first_then_rest, shared_prompts  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]


@pytest.mark.parametrize("together", [False, True])
def test_the_cuda_backend_computes_a_shared_system_prompt_once(together: bool) -> None:
    """Four requests that start with one system prompt, one after another or the first alone and then three
    at once: with the prefix cache the device computes its whole blocks once, and every request's tokens are
    the CPU's choice at each step (or tie with it within the nudge's range)."""
    model = synthetic_model(SMALL_CONFIGS["qwen3"], "q8", seed=9)
    prompts = shared_prompts(model)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with kestrel_core.load(model, backend="cuda") as engine:
        assert engine.prefix_cache and engine.device_prefixes
        (_, rows_off), (got, rows_on) = run_both_ways(
            engine, prompts, params, serve_first_then_rest if together else serve_alone,
            lambda e: e.backend.device.forward_engine())
        hits = engine.pool.prefix_hit_tokens
        declined = engine.stats["offload"]["kestrel_forward_batch"]["declined"]
    assert hits == SYSTEM // BLOCK_SIZE * BLOCK_SIZE * (len(prompts) - 1) and rows_off - rows_on == hits
    assert declined == 0
    for p, tokens in zip(prompts, got):
        seq = np.array(p + tokens)
        ref = cpu_logits(model, seq, len(seq))
        tol = FACTOR * jitter_effect(model, seq, len(seq), ref)[1]
        assert greedy_agrees(tokens, model, np.array(p), tol) == [], (p, tokens)


def test_the_cuda_backend_serves_evicted_and_reused_prefix_blocks() -> None:
    """A pool of 8 blocks, four system prompts twice each (test_forward_prefix_host's eviction scenario): cached
    blocks go to other sequences before their family comes back; no step is declined and every request's
    tokens are the CPU's choice at each step (or tie with it within the nudge's range)."""
    from kestrel_core.model.kv_pool import bytes_per_position

    model = synthetic_model(SMALL_CONFIGS["qwen3"], "q8", seed=9)
    families = [shared_prompts(model, owns=(4, 6), seed=s) for s in range(4)]
    prompts = [family[i] for i in range(2) for family in families]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    megabytes = 8 * BLOCK_SIZE * bytes_per_position(model.config) / 2 ** 20
    with kestrel_core.load(model, backend="cuda", kv_cache_mb=megabytes) as engine:
        (_, _), (got, _) = run_both_ways(engine, prompts, params, serve_first_then_rest,
                                         lambda e: e.backend.device.forward_engine())
        evictions, hits = engine.pool.evictions, engine.pool.prefix_hit_tokens
        declined = engine.stats["offload"]["kestrel_forward_batch"]["declined"]
    assert evictions > 0 and hits > 0 and declined == 0
    for p, tokens in zip(prompts, got):
        seq = np.array(p + tokens)
        ref = cpu_logits(model, seq, len(seq))
        tol = FACTOR * jitter_effect(model, seq, len(seq), ref)[1]
        assert greedy_agrees(tokens, model, np.array(p), tol) == [], (p, tokens)
