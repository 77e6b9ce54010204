"""The host KV pool: blocks, page tables, and prefix caching (shared prompt blocks give the bits a recomputation
would)."""

from __future__ import annotations

import numpy as np
import pytest

import kestrel_core
from kestrel_core.errors import KestrelError
from kestrel_core.model.kv_pool import KVPool
from kestrel_core.model.presets import synthetic_model
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.scheduler import Scheduler


@pytest.fixture
def pool(tiny_config) -> KVPool:
    return KVPool(tiny_config("llama", max_position=256), num_blocks=8)


def _filled(pool: KVPool, tokens: list[int], prompt_len: int):
    seq = pool.new_sequence()
    seq.prompt_len = prompt_len
    assert pool.reserve(seq, len(tokens))
    seq.length = len(tokens)
    pool.publish_prefix(seq, tokens, prompt_len)
    return seq


def test_full_prompt_blocks_are_shared_and_stay_cached_until_needed(pool: KVPool) -> None:
    a = _filled(pool, list(range(80)), prompt_len=80)  # blocks 0-1 full, block 2 partial
    assert pool.cached_blocks == 2
    b = pool.new_sequence()
    assert pool.attach_prefix(b, list(range(70)) + [999] * 10, limit=79) == 64 and b.blocks == a.blocks[:2]
    c = pool.new_sequence()
    assert pool.attach_prefix(c, [5] + list(range(1, 80)), limit=79) == 0  # another first block: nothing
    a.release()
    b.release()
    assert pool.free_blocks == 8 and pool.cached_blocks == 2  # idle but cached
    d = pool.new_sequence()
    assert pool.attach_prefix(d, list(range(64)), limit=63) == 32  # short of the last token: one block
    d.release()
    hog = pool.new_sequence()
    assert pool.reserve(hog, 8 * 32)  # needs every block: the cached ones are evicted, oldest first
    assert pool.cached_blocks == 0 and pool.free_blocks == 0
    hog.release()
    e = pool.new_sequence()
    assert pool.attach_prefix(e, list(range(80)), limit=79) == 0


def test_only_blocks_inside_the_prompt_are_published(pool: KVPool) -> None:
    """A block with generated tokens ran another activation mode (mixed): never shared."""
    seq = _filled(pool, list(range(96)), prompt_len=40)  # block 0 is prompt, block 1 straddles, block 2 output
    assert pool.cached_blocks == 1
    other = pool.new_sequence()
    assert pool.attach_prefix(other, list(range(96)), limit=95) == 32
    with pytest.raises(KestrelError, match="shared prefix"):
        seq.truncate(10)
    seq.truncate(50)  # past the shared block: allowed
    assert seq.length == 50


def test_a_prefix_attaches_only_to_an_empty_sequence(pool: KVPool) -> None:
    seq = _filled(pool, list(range(40)), prompt_len=40)
    with pytest.raises(KestrelError, match="empty sequence"):
        pool.attach_prefix(seq, list(range(40)), 39)


def _run(engine, prompts: list[list[int]], params: SamplingParams, token_budget: int = 64) -> list[list[int]]:
    scheduler = Scheduler(engine, max_batch=4, token_budget=token_budget)
    requests = [scheduler.add(p, params) for p in prompts]
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while scheduler.has_work:
        for o in scheduler.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[r.request_id] for r in requests]


@pytest.mark.parametrize("activations", ["mixed", "q8", "f32"])
def test_shared_prompts_give_the_tokens_of_a_recomputation_and_skip_the_work(tiny_config, activations: str,
                                                                             monkeypatch) -> None:
    """A system prompt and a conversation's earlier turn, sent again: the later requests attach their blocks,
    run fewer prompt rows, and decode exactly the tokens of the same requests with prefix caching off."""
    model = synthetic_model(tiny_config("qwen3", max_position=256), "q8", seed=3)
    rng = np.random.default_rng(1)
    system = rng.integers(0, model.config.vocab_size, 70).tolist()
    turns = [system + rng.integers(0, model.config.vocab_size, int(n)).tolist() for n in (5, 12, 33)]
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=2, ignore_eos=True)
    results = {}
    for cached in (False, True):
        with kestrel_core.load(model, backend="cpu", activations=activations, kv_cache_mb=2) as engine:
            engine.prefix_cache = cached
            rows: list[int] = []

            def counting(batch, rows=rows, real=engine.decoder.forward_batch):  # type: ignore[no-untyped-def]
                rows.append(sum(len(t) for _, t, _ in batch))
                return real(batch)

            monkeypatch.setattr(engine.decoder, "forward_batch", counting)
            first = _run(engine, turns[:1], params)
            again = _run(engine, turns, params)  # the first prompt again, and two that share its first 64
            results[cached] = (first, again, sum(rows), engine.stats["prefix_hit_tokens"])
    assert results[True][:2] == results[False][:2]
    assert results[False][3] == 0 and results[True][3] == 3 * 64
    assert results[True][2] == results[False][2] - 3 * 64


def test_evicted_prefixes_are_recomputed_to_the_same_tokens(tiny_config) -> None:
    """A pool too small to keep every prefix: cached blocks give way to running sequences, and every request
    still gets its tokens exactly."""
    model = synthetic_model(tiny_config("llama", max_position=256), "q8", seed=5)
    rng = np.random.default_rng(7)
    shared = rng.integers(0, model.config.vocab_size, 64).tolist()
    prompts = [shared + rng.integers(0, model.config.vocab_size, 40).tolist() for _ in range(6)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    outs = {}
    for cached in (False, True):
        with kestrel_core.load(model, backend="cpu") as engine:
            engine.prefix_cache = cached
            engine.pool = engine.decoder.pool = KVPool(model.config, num_blocks=8)
            outs[cached] = _run(engine, prompts, params, token_budget=48)
            assert engine.pool.free_blocks == engine.pool.num_blocks
            assert (engine.stats["prefix_hit_tokens"] > 0) == cached
            assert engine.pool.evictions > 0 if cached else engine.pool.cached_blocks == 0
    assert outs[True] == outs[False]


def test_a_context_beyond_half_the_memory_does_not_size_the_default_pool(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The default pool holds one sequence at the full context, unless that takes more than half the machine's
    memory (llama.cpp writes a context of 2^20 for Granite 4.0-H): then the default budget, or half the memory."""
    from kestrel_core.model import kv_pool
    from kestrel_core.model.config import ModelConfig

    config = ModelConfig(arch="llama", vocab_size=64, hidden_size=256, intermediate_size=96, num_layers=8,
                         num_heads=4, num_kv_heads=4, head_dim=64, max_position=1 << 20)
    per_block = kv_pool.bytes_per_position(config) * kv_pool.BLOCK_SIZE  # 256 KiB: the full context is 8 GiB
    blocks = kv_pool.KVPool.budget_blocks
    monkeypatch.setattr(kv_pool, "_memory_bytes", lambda: 1 << 40)
    assert blocks(config) == (1 << 20) // kv_pool.BLOCK_SIZE
    monkeypatch.setattr(kv_pool, "_memory_bytes", lambda: 16 << 30)
    assert blocks(config) == (8 << 30) // per_block
    monkeypatch.setattr(kv_pool, "_memory_bytes", lambda: 1 << 30)
    assert blocks(config) == kv_pool.DEFAULT_KV_MB * 2 ** 20 // per_block
    assert blocks(config, 64) == 256


def test_a_latent_attention_caches_its_latent_not_each_heads_key_and_value() -> None:
    """GLM-4.7-Flash's KV cache holds a position's latent (512) and RoPE key (64) once for its 20 heads, and the
    latent again as the value: 2 x 47 x (576 + 512) float16 bytes, 102 KB, where each head's key (256) and value (256)
    would take 0.96 MB."""
    from kestrel_core.model import kv_pool
    from kestrel_core.model.presets import preset_config

    config = preset_config("glm-4.7-flash")
    assert config.attention_dims == (1, 576, 512)
    assert kv_pool.bytes_per_position(config) == 2 * 47 * (576 + 512)
    pool = kv_pool.KVPool(config, 2)
    assert pool.kt.shape == (47, 2, 1, 576, kv_pool.BLOCK_SIZE) and pool.v.shape == (47, 2, 1, kv_pool.BLOCK_SIZE, 512)


def test_an_int8_pool_takes_a_byte_a_dim_and_a_scale_every_32() -> None:
    """q8: GLM-4.7-Flash's 47 x (576 + 512) dims a position at 1 + 4/32 bytes each, against float16's 2: a budget
    holds 16/9 the blocks."""
    from kestrel_core.model import kv_pool
    from kestrel_core.model.presets import preset_config

    config = preset_config("glm-4.7-flash")
    assert kv_pool.bytes_per_position(config, "q8") == 47 * (576 + 512) * 9 // 8
    pool = kv_pool.KVPool.for_budget(config, 64, kv_type="q8")
    assert pool.num_blocks == kv_pool.KVPool.budget_blocks(config, 64, "q8") > kv_pool.KVPool.budget_blocks(config, 64)
    assert pool.kt.dtype == pool.v.dtype == np.int8
    assert pool.ks.shape == (47, pool.num_blocks, 1, 576 // 32, kv_pool.BLOCK_SIZE)
    assert pool.vs.shape == (47, pool.num_blocks, 1, kv_pool.BLOCK_SIZE, 512 // 32)
    kt, vc, ks, vs = pool.layer_arrays(config.attention_layers[3])
    assert kt.base is pool.kt and ks.base is pool.ks and vs.shape == pool.vs.shape[1:]
    f16 = kv_pool.KVPool(config, 2)
    kt, vc, ks, vs = f16.layer_arrays(config.attention_layers[0])
    assert kt.dtype == vc.dtype == np.uint16 and ks.size == vs.size == 0


def test_a_kept_recurrent_state_comes_back_with_its_prefix_and_goes_with_its_block(monkeypatch) -> None:
    """A model with recurrent layers: a prefix attaches only as far as a state kept at its end, which becomes
    the new sequence's; the state goes when its last block is given to another sequence, and the oldest
    states go past the budget."""
    from pathlib import Path

    from kestrel_core.model import kv_pool

    with kestrel_core.load(str(Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-lfm2"),
                           backend="cpu") as engine:
        config = engine.config
    pool = KVPool(config, num_blocks=4)
    assert pool.states is not None
    tokens = list(range(100))
    a = pool.new_sequence()
    assert pool.reserve(a, 65)
    a.length = 64
    for arr in pool.states.conv.values():
        arr[pool.state_slot(a)] = 1.5
    pool.publish_prefix(a, tokens, 64)
    assert pool.attach_prefix(pool.new_sequence(), tokens, 99) == 0  # blocks, but no state at their end
    pool.publish_prefix(a, tokens, 64, keep_state=True)
    b = pool.new_sequence()
    assert pool.attach_prefix(b, tokens, 99) == 64 and b.blocks == a.blocks[:2] and pool.cached_states == 1
    assert all((arr[pool.state_slot(b)] == 1.5).all() for arr in pool.states.conv.values())
    assert pool.attach_prefix(pool.new_sequence(), tokens[:40] + [7] * 60, 99) == 0  # its second block differs
    a.release()
    b.release()
    c = pool.new_sequence()
    assert pool.reserve(c, 128)  # every block, the cached ones too
    assert pool.cached_states == 0 and pool.attach_prefix(pool.new_sequence(), tokens, 99) == 0
    c.release()
    monkeypatch.setattr(kv_pool, "STATE_CACHE_MB", 0)  # room for one state
    for first in (0, 200):
        seq = pool.new_sequence()
        assert pool.reserve(seq, 33)
        seq.length = 32
        ids = list(range(first, first + 40))
        pool.publish_prefix(seq, ids, 32, keep_state=True)
        seq.release()
    assert pool.cached_states == 1
    assert pool.attach_prefix(pool.new_sequence(), list(range(200, 240)), 39) == 32
