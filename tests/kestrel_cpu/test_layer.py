"""The CPU backend's compiled dense layer (kestrel_cpu.layer): one call a layer, the op-by-op decoder's bits."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kestrel_core.contract import quantize_weight
from kestrel_core.dispatch import Offload
from kestrel_core.model.config import ModelConfig
from kestrel_core.model.decoder import Decoder
from kestrel_core.model.kv_pool import KVPool
from kestrel_core.model.loader import load_model
from kestrel_core.model.presets import synthetic_model
from kestrel_core.model.weights import Model

from .conftest import cpu_offload

kernels = pytest.importorskip("kestrel_cpu.kernels")
PACKED_BITS = kernels.packed.PACKED_BITS
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"


def _config(arch: str, **overrides: object) -> ModelConfig:
    base: dict[str, object] = dict(
        arch=arch, vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position=128, tie_word_embeddings=True)
    base.update({"qwen2": dict(qkv_bias=True), "qwen3": dict(qk_norm=True, head_dim=32),
                 # Gemma 2 and 3: norms after attention and the MLP, GELU, a sliding window every other layer
                 "gemma2": dict(post_norms=True, activation="gelu_tanh", attn_softcap=50.0, sliding_window=8,
                                layer_types=("sliding", "full"), embed_scale=8.0, query_scale=0.2),
                 "gemma3": dict(post_norms=True, activation="gelu_tanh", qk_norm=True, sliding_window=8,
                                layer_types=("sliding", "full"), rope_local_theta=10000.0, rope_theta=1e6),
                 "granite": dict(residual_scale=0.22, embed_scale=12.0),
                 # Command R+: LayerNorms, the MLP beside the attention, q/k norms with a weight a head
                 "cohere": dict(norm_type="layer", parallel_block=True, rope_interleaved=True, qk_norm=True,
                                qk_norm_heads=True)}.get(arch, {}))
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


def _needs(*bits: int) -> None:
    if not set(bits) <= set(PACKED_BITS):
        pytest.skip(f"this CPU's packed kernels take {PACKED_BITS}-bit weights; the layer needs {bits}")


def _offloads() -> tuple[Offload, Offload]:
    """The CPU's offload, and one whose layers all run op by op (``KESTREL_CPU_LAYERS=0``)."""
    return cpu_offload(), cpu_offload(layers=False)


def _same_run(model: Model) -> None:
    """``_run`` compiled and op by op: the same logits and cache, bit for bit, every layer compiled in the first."""
    fast, slow = _offloads()
    got, fast_dec, fast_caches = _run(model, fast)
    want, slow_dec, slow_caches = _run(model, slow)
    layers = range(model.config.num_layers)
    assert all(fast_dec.dense[i] is not None for i in layers)  # the compiled layer ran
    assert all(slow_dec.dense[i] is None for i in layers)
    assert len(got) == len(want) == 7
    for g, w in zip(got, want):
        assert _same_bits(g, w)
    for g, w in zip(_pool(fast_dec, fast_caches), _pool(slow_dec, slow_caches)):
        assert _same_bits(g, w)
    assert fast.stats()["kestrel_gemm_q8"] == slow.stats()["kestrel_gemm_q8"]  # counted as the GEMMs it ran


def _run(model: Model, offload: Offload, activations: str = "q8",
         kv_type: str = "f16") -> tuple[list[np.ndarray], Decoder, list]:
    """Logits of a prompt, decode steps and a two-sequence step (keys and values in blocks out of order)."""
    dec = Decoder(model, offload, KVPool(model.config, 12, block_size=16, kv_type=kv_type), activations=activations)
    rng = np.random.default_rng(9)
    other = dec.new_cache()
    dec.forward(rng.integers(0, 320, 5).tolist(), other)  # takes the first block
    a, b = dec.new_cache(), dec.new_cache()
    for cache in (a, b):
        cache.prompt_len = 21
    outs = [dec.forward(rng.integers(0, 320, 21).tolist(), a, all_logits=True)]
    outs += [dec.forward([int(t)], a) for t in rng.integers(0, 320, 4)]
    dec.forward(rng.integers(0, 320, 9).tolist(), b)
    outs += dec.forward_batch([(a, np.array([7]), 1), (b, np.array([11, 12]), 2)])
    return outs, dec, [a, b]


def _same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    return x.dtype == y.dtype and np.array_equal(*(np.ascontiguousarray(a).view(np.uint8) for a in (x, y)))


def _pool(dec: Decoder, caches: list) -> list[np.ndarray]:
    """Each cache's keys and values at its positions: [L, KV, hd] and [L, KV, vdp] each (and an int8 pool's
    scales)."""
    pool, bs = dec.pool, dec.pool.block_size
    at = [(c.blocks[p // bs], p % bs) for c in caches for p in range(c.length)]
    out = [pool.kt[:, b, :, :, o] for b, o in at] + [pool.v[:, b, :, o] for b, o in at]
    if pool.kv_type == "q8":
        out += [pool.ks[:, b, :, :, o] for b, o in at] + [pool.vs[:, b, :, o] for b, o in at]
    return out


@pytest.mark.parametrize(("arch", "quant"), [(a, q) for a in ("llama", "qwen2", "qwen3")
                                             for q in ("q8", "q4", "q8-g256")]
                         + [("gemma2", "q8"), ("gemma3", "q4"), ("granite", "q8")])
def test_a_dense_layer_gives_the_op_by_op_bits(arch: str, quant: str) -> None:
    _needs(4 if quant == "q4" else 8)
    cfg = _config(arch, hidden_size=256, intermediate_size=512) if quant.endswith("g256") else _config(arch)
    _same_run(synthetic_model(cfg, quant, seed=2))


@pytest.mark.parametrize("quant", ["q8", "q4", "q8-g256"])
@pytest.mark.parametrize("name", ["tiny-cohere", "tiny-cohere2"])
def test_a_cohere_layer_gives_the_op_by_op_bits(name: str, quant: str) -> None:
    """Command R's (LayerNorms without a bias, the MLP beside the attention, q/k norms with a weight a head) and
    Command R7B's (three sliding layers with RoPE to one full one without): the fixtures' weights, and at 256-wide
    blocks their configs widened to hold them (the fixtures' 64-wide rows keep 32)."""
    _needs(4 if quant == "q4" else 8)
    if quant.endswith("g256"):
        config = load_model(str(FIXTURES / name), quant="q8", cache="off").model.config
        model = synthetic_model(replace(config, hidden_size=256, intermediate_size=512), quant, seed=2)
        assert model.layers[0].q.group_size == 256
    else:
        model = load_model(str(FIXTURES / name), quant=quant, cache="off").model
    c = model.config
    assert c.norm_type == "layer" and c.parallel_block
    assert c.qk_norm_heads if name == "tiny-cohere" else (c.nope_layers and c.sliding_window)
    _same_run(model)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "cohere"])
def test_a_dense_layer_on_an_int8_kv_cache_gives_the_op_by_op_bits(arch: str) -> None:
    _needs(8)
    model = synthetic_model(_config(arch, head_dim=32), "q8", seed=7)
    fast, slow = _offloads()
    got, fast_dec, fast_caches = _run(model, fast, kv_type="q8")
    want, slow_dec, slow_caches = _run(model, slow, kv_type="q8")
    assert fast_dec.dense[0] is not None and slow_dec.dense[0] is None
    for g, w in zip(got, want):
        assert _same_bits(g, w)
    pools = _pool(fast_dec, fast_caches), _pool(slow_dec, slow_caches)
    assert pools[0][0].dtype == np.int8 and pools[0][-1].dtype == np.float32  # codes, and scales compared too
    for g, w in zip(*pools):
        assert _same_bits(g, w)
    float16 = _run(model, slow)[0]  # the int8 cache moves the logits, a little
    assert all(np.abs(g - f).max() > 0 for g, f in zip(got[1:], float16[1:]))
    np.testing.assert_allclose(got[-1], float16[-1], atol=0.05 * float(np.ptp(float16[-1])))


def test_each_gemm_takes_its_own_bits_but_a_fused_group_needs_one() -> None:
    _needs(8, 4)
    model = synthetic_model(_config("llama"), "q8", seed=3)
    rng = np.random.default_rng(4)
    layers = list(model.layers)
    layers[0] = replace(layers[0], down=quantize_weight(rng.standard_normal((64, 96)).astype(np.float32), bits=4))
    layers[1] = replace(layers[1], v=quantize_weight(rng.standard_normal((32, 64)).astype(np.float32), bits=4))
    model = replace(model, layers=layers)
    fast, slow = _offloads()
    got, dec, _ = _run(model, fast)
    want, _, _ = _run(model, slow)
    assert dec.dense[0] is not None and dec.dense[0][0].bits == (8, 8, 8, 4)
    assert dec.dense[1] is None  # q|k|v of 8, 8 and 4 bits: op by op
    for g, w in zip(got, want):
        assert _same_bits(g, w)


def test_layers_it_does_not_take_and_prompt_rows_run_op_by_op() -> None:
    _needs(8)
    olmo = synthetic_model(_config("olmo2", qk_norm=True, qk_norm_full=True, pre_norms=False, post_norms=True), "q8",
                           seed=5)  # no norm before attention, q/k norms over the whole projection
    fast, slow = _offloads()
    got, dec, _ = _run(olmo, fast)
    assert all(dec.dense[i] is None for i in range(2))
    for g, w in zip(got, _run(olmo, slow)[0]):
        assert _same_bits(g, w)

    model = synthetic_model(_config("qwen3"), "q8", seed=6)
    fast, slow = _offloads()
    runs = []
    real = fast.host_dense_layer
    fast.host_dense_layer = lambda *args: runs.append(1) or real(*args)  # type: ignore[method-assign]
    got, dec, _ = _run(model, fast, activations="mixed")  # the prompt's rows at float32: op by op
    for g, w in zip(got, _run(model, slow, activations="mixed")[0]):
        assert _same_bits(g, w)
    assert len(runs) == 2 and all(dec.dense[i] is not None for i in range(2))  # prepared for the decode steps


@pytest.mark.parametrize("config", [
    _config("cohere", qk_norm=False, qk_norm_heads=False), _config("llama", qk_norm=True, qk_norm_heads=True),
    _config("llama", norm_type="layer", qk_norm=True), _config("cohere", parallel_block=False)],
    ids=["LayerNorms, parallel blocks, no q/k norms", "RMSNorms with a q/k norm weight a head",
         "LayerNorms with one q/k norm weight for every head", "LayerNorms, the MLP after the attention"])
def test_each_of_cohere_s_rules_alone_gives_the_op_by_op_bits(config: ModelConfig) -> None:
    _needs(8)
    _same_run(synthetic_model(config, "q8", seed=8))


def test_a_layer_that_cannot_compile_runs_op_by_op(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    _needs(8)
    from numba.core.errors import TypingError

    from kestrel_cpu import layer

    def broken(*args: object) -> None:
        raise TypingError("no implementation here")

    model = synthetic_model(_config("qwen2"), "q8", seed=7)
    monkeypatch.setattr(layer, "_BUILDS", {(8, 8, 8, 8): broken})
    fast, slow = _offloads()
    got, dec, _ = _run(model, fast)
    for g, w in zip(got, _run(model, slow)[0]):
        assert _same_bits(g, w)
    assert all(dec.dense[i] is None for i in range(2)) and layer._BUILDS[8, 8, 8, 8] is None
    assert "failed to compile (TypingError: no implementation here)" in caplog.text
