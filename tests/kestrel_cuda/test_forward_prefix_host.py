"""The engine's prefix cache in the device forward's pool (``BatchEntry.shared`` / ``publish``), on the CPU with
the numpy mirrors: prompts that start with the same system prompt compute it once, on the device, whether the
later ones run alone (their own cache, filled from the pool) or together (the pool), and give the tokens they
give without the prefix cache. test_forward_prefix.py runs the same on the GPU."""

from __future__ import annotations

import numpy as np

import kestrel_core
from kestrel_core.model.kv_pool import BLOCK_SIZE, KVPool
from kestrel_core.model.sampling import SamplingParams

from .test_forward_batch_host import _bind_batch_backend, _model, serve_all, serve_alone

SYSTEM = 70  # tokens of the shared system prompt: two whole blocks and some


def shared_prompts(model, owns=(5, 12, 3, 9), seed: int = 2) -> list[list[int]]:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    system = rng.integers(0, model.config.vocab_size, SYSTEM).tolist()
    return [system + rng.integers(0, model.config.vocab_size, n).tolist() for n in owns]


def device_rows(fwd) -> int:  # type: ignore[no-untyped-def]
    """Rows the device forward computed: its lone sequences' and its batched steps'."""
    return fwd.counters["prefill_tokens"] + fwd.counters["decode_tokens"] + fwd.counters["batch_rows"]


def host_forward(engine):  # type: ignore[no-untyped-def]
    """The numpy-mirror backend's DeviceForward (made at its first step), or None."""
    made = engine.backend.plugin.FWD
    return made[0] if made else None


def run_both_ways(engine, prompts, params, serve, forward_of=host_forward):  # type: ignore[no-untyped-def]
    """(tokens, device rows) with the prefix cache off, then on, each from empty pools (the engine's and the
    device's)."""
    out = []
    for cached in (False, True):
        engine.prefix_cache = cached
        engine.pool = engine.decoder.pool = KVPool(engine.config, engine.pool.num_blocks)
        fwd = forward_of(engine)
        if fwd is not None:
            fwd.reset_pool()  # nothing left in the pool's blocks by the round before
        before = device_rows(fwd) if fwd is not None else 0
        got = serve(engine, prompts, params)
        out.append((got, device_rows(forward_of(engine)) - before))
    return out


def serve_first_then_rest(engine, prompts, params):  # type: ignore[no-untyped-def]
    """The first prompt alone, then the others at once."""
    return serve_all(engine, prompts[:1], params) + serve_all(engine, prompts[1:], params)


def test_later_prompts_take_a_shared_prefix_from_the_pool(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """One request after another (each alone: its own cache): every later one attaches the system prompt's two
    whole blocks, which the first left in the pool, computes only the rest, and generates what it generates
    without the prefix cache; the device computes 64 prompt rows fewer for each."""
    model = _model("qwen3", "q8", seed=9)
    prompts = shared_prompts(model)
    _bind_batch_backend(tmp_path, monkeypatch)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    with kestrel_core.load(model, backend="fwdcuda") as engine:
        assert engine.prefix_cache and engine.device_prefixes
        (want, rows_off), (got, rows_on) = run_both_ways(engine, prompts, params, serve_alone)
        hits = engine.pool.prefix_hit_tokens
        fwd = engine.backend.plugin.FWD[0]
    assert got == want
    shared = SYSTEM // BLOCK_SIZE * BLOCK_SIZE
    assert hits == shared * (len(prompts) - 1)
    assert rows_off - rows_on == hits
    assert fwd.counters["declined"] == 0
    # the first request's two blocks copied from its own cache into the pool, each later one started from them
    assert fwd.counters["prefix_blocks_published"] == 2 and fwd.counters["prefix_positions"] == hits


def test_sequences_running_together_read_the_prefix_in_the_pool(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The first request alone, then three at once: those run in batched steps over the pool, starting from
    the blocks the first one published; the tokens are those without the prefix cache."""
    model = _model("qwen3", "q8", seed=9)
    first, *rest = shared_prompts(model)
    _bind_batch_backend(tmp_path, monkeypatch)
    params = SamplingParams(max_tokens=5, ignore_eos=True)

    with kestrel_core.load(model, backend="fwdcuda") as engine:
        (want, rows_off), (got, rows_on) = run_both_ways(engine, [first, *rest], params, serve_first_then_rest)
        hits = engine.pool.prefix_hit_tokens
        fwd = engine.backend.plugin.FWD[0]
    assert got == want
    assert hits == SYSTEM // BLOCK_SIZE * BLOCK_SIZE * len(rest) and rows_off - rows_on == hits
    assert fwd.counters["batch_steps"] > 0 and fwd.counters["declined"] == 0
    assert fwd.counters["prefix_positions"] == hits


def test_a_device_that_lost_the_prefix_computes_it_again(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The device's pool is gone between two requests (another model's pages, a reset): the second request's
    step with the shared prefix is declined (the host computes it) and the device runs the sequence from
    position 0 afterwards: the same tokens, nothing read from a pool that does not hold them."""
    model = _model("qwen3", "q8", seed=9)
    a, b = shared_prompts(model)[:2]
    _bind_batch_backend(tmp_path, monkeypatch)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    with kestrel_core.load(model, backend="fwdcuda") as engine:
        engine.prefix_cache = False
        want = serve_alone(engine, [a, b], params)
        engine.prefix_cache = True
        fwd = engine.backend.plugin.FWD[0]
        got = serve_alone(engine, [a], params)
        fwd.reset_pool()
        got += serve_alone(engine, [b], params)
        offload = engine.stats["offload"]["kestrel_forward_batch"]
    assert got == want
    # the one step that found no prefix; the device ran the sequence from position 0 after it
    assert offload["declined"] == 1 and fwd.last_decline != ""


def test_evicted_prefixes_are_never_read_for_the_blocks_new_owners_wrote(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A pool of 8 blocks and prompts of four system prompts, each family twice: cached blocks go to other
    sequences (whose prompts the device then writes there) before their family comes back, alone and all at
    once (admission waits for room): every request's tokens are those without the prefix cache."""
    from kestrel_core.model.kv_pool import bytes_per_position

    model = _model("qwen3", "q8", seed=9)
    families = [shared_prompts(model, owns=(4, 6), seed=s) for s in range(4)]
    prompts = [family[i] for i in range(2) for family in families]
    _bind_batch_backend(tmp_path, monkeypatch)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    megabytes = 8 * BLOCK_SIZE * bytes_per_position(model.config) / 2 ** 20
    with kestrel_core.load(model, backend="fwdcuda", kv_cache_mb=megabytes) as engine:
        assert engine.pool.num_blocks == 8
        alone = run_both_ways(engine, prompts, params, serve_alone)
        together = run_both_ways(engine, prompts, params, serve_all)
        evictions, hits = engine.pool.evictions, engine.pool.prefix_hit_tokens  # of the last round
        declined = engine.stats["offload"]["kestrel_forward_batch"]["declined"]
    for (want, _), (got, _) in (alone, together):
        assert got == want
    assert evictions > 0 and hits > 0
    assert declined == 0  # every prefix the engine attached was in the device's pool


def test_a_device_without_room_for_the_pool_publishes_nothing(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Where the pool cannot be allocated, lone sequences run in their own caches as before and publish
    nothing; a later request's shared prefix is declined once and computed again: the same tokens."""
    from kestrel_cuda import paged

    def no_room(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise MemoryError("out of memory allocating the pool")

    model = _model("qwen3", "q8", seed=9)
    prompts = shared_prompts(model)[:2]
    _bind_batch_backend(tmp_path, monkeypatch)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    with kestrel_core.load(model, backend="fwdcuda") as engine:
        engine.prefix_cache = False
        want = serve_alone(engine, prompts, params)
        engine.prefix_cache = True
        monkeypatch.setattr(paged, "new_pool", no_room)
        host_forward(engine).reset_pool()
        got = serve_alone(engine, prompts, params)
        fwd = host_forward(engine)
        declined = engine.stats["offload"]["kestrel_forward_batch"]["declined"]
    assert got == want
    assert fwd.counters["pool_out_of_memory"] > 0 and fwd.counters["prefix_blocks_published"] == 0
    assert declined == 1
