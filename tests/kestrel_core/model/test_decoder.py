"""The numpy decoder against an independent per-head reference, and its KV cache against teacher forcing."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from kestrel_core.contract import StripCache, quantize_activations, read_only_strip, reference_gemm_q8
from kestrel_core.dispatch import Offload
from kestrel_core.errors import KestrelError
from kestrel_core.model import decoder as decoder_mod
from kestrel_core.model.config import normalize_rope_scaling
from kestrel_core.model.decoder import Decoder
from kestrel_core.model.kv_pool import KVPool
from kestrel_core.model.presets import synthetic_model
from kestrel_core.model.rope import rope_inv_freq
from kestrel_core.model.validate import ValidationError
from kestrel_core.registry import Registry
from kestrel_core.wkey import Proj, fused_wkey, lm_head_wkey, wkey

# -- an independent reference: one head at a time, HF's rotate_half written out, float64 softmax -----------


def _meta_llama3_inv_freq(theta: float, hd: int, s: dict) -> np.ndarray:
    """Meta's apply_scaling from the Llama 3.1 reference code, one frequency at a time."""
    out = []
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    for i in range(0, hd, 2):
        freq = 1.0 / theta ** (i / hd)
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            out.append((1 - smooth) * freq / s["factor"] + smooth * freq)
    return np.array(out)


def _reference_logits(model, tokens: list[int]) -> np.ndarray:
    c = model.config
    eps = c.rms_norm_eps
    hd, n_heads, n_kv = c.head_dim, c.num_heads, c.num_kv_heads
    t = len(tokens)

    def lin(x, w):
        codes, scales = quantize_activations(np.asarray(x, np.float32), w.group_size)
        return reference_gemm_q8(codes, scales, w)

    def norm(x, w):
        x = np.asarray(x, np.float32)
        return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))) * w

    if c.rope_scaling:
        inv_freq = _meta_llama3_inv_freq(c.rope_theta, hd, c.rope_scaling)
    else:
        inv_freq = np.array([1.0 / c.rope_theta ** (i / hd) for i in range(0, hd, 2)])
    angles = np.outer(np.arange(t), inv_freq)
    emb = np.concatenate([angles, angles], axis=1)  # [T, hd], HF's layout
    cos, sin = np.cos(emb), np.sin(emb)

    def rotate_half(x):
        return np.concatenate([-x[:, hd // 2:], x[:, :hd // 2]], axis=1)

    h = model.embedding.dequantize()[tokens]
    for lw in model.layers:
        x = norm(h, lw.attn_norm)
        q, k, v = lin(x, lw.q), lin(x, lw.k), lin(x, lw.v)
        if lw.q_bias is not None:
            q, k, v = q + lw.q_bias, k + lw.k_bias, v + lw.v_bias
        heads = []
        for head in range(n_heads):
            kv = head * n_kv // n_heads  # HF repeat_kv: consecutive query heads share a kv head
            qh = q[:, head * hd:(head + 1) * hd]
            kh = k[:, kv * hd:(kv + 1) * hd]
            vh = v[:, kv * hd:(kv + 1) * hd].astype(np.float16).astype(np.float64)  # cached at float16
            if lw.q_norm is not None:
                qh, kh = norm(qh, lw.q_norm), norm(kh, lw.k_norm)
            qh = qh * cos + rotate_half(qh) * sin
            kh = (kh * cos + rotate_half(kh) * sin).astype(np.float32).astype(np.float16)
            scores = (qh @ kh.T) / math.sqrt(hd)
            scores[np.triu_indices(t, 1)] = -np.inf
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            heads.append(p @ vh)
        attn = np.concatenate(heads, axis=1).astype(np.float32)
        h = h + lin(attn, lw.o)
        x = norm(h, lw.mlp_norm)
        g, u = lin(x, lw.gate), lin(x, lw.up)
        h = h + lin(g / (1 + np.exp(-g)) * u, lw.down)
    return lin(norm(h, model.final_norm), model.lm_head)


def _tokens(n: int, seed: int = 0, vocab: int = 320) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


# Two correct float32 implementations differ by ~1e-7, but once in a while that puts an activation on the
# other side of a Q8_0 rounding boundary, and the flipped code moves later logits by up to ~1% of their
# range (measured: <= 0.8% over 24 model/seed pairs). Real bugs (wrong RoPE layout, wrong kv head for a
# query head) move them by 60-75%, so 3% separates the two.
TOL = 3e-2


def _close(a: np.ndarray, b: np.ndarray, tol: float = TOL) -> None:
    """Agreement relative to the logit range."""
    err = float(np.abs(a - b).max()) / float(np.ptp(b))
    assert err < tol, f"max error {err:.2e} of the logit range"


# -- tests --------------------------------------------------------------------------------------------------


def test_llama3_inverse_frequencies_match_metas_formula(tiny_config, llama3_scaling) -> None:
    cfg = tiny_config("llama3", rope_scaling={**llama3_scaling, "original_max_position_embeddings": 64})
    ours = rope_inv_freq(cfg)
    ref = _meta_llama3_inv_freq(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling)
    wavelen = 2 * math.pi / (1.0 / cfg.rope_theta ** (np.arange(0, 16, 2) / 16))
    assert (wavelen < 16).any() and ((wavelen >= 16) & (wavelen <= 64)).any() and (wavelen > 64).any()
    np.testing.assert_allclose(ours, ref, rtol=2e-6)
    assert not np.allclose(ours, rope_inv_freq(tiny_config("llama", rope_theta=cfg.rope_theta)), rtol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama3"])
def test_teacher_forced_logits_match_the_per_head_reference(arch: str, tiny_config, llama3_scaling,
                                                            cpu_offload, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decoder_mod, "PREFILL_CHUNK", 7)  # the prompt in chunks, a ragged end
    scaling = {**llama3_scaling, "original_max_position_embeddings": 64}
    cfg = tiny_config(arch, **({"rope_scaling": scaling} if arch == "llama3" else {}))
    model = synthetic_model(cfg, "q8", seed=3)
    dec = Decoder(model, cpu_offload)
    tokens = _tokens(40, seed=1)
    ours = dec.forward(tokens, dec.new_cache(), all_logits=True)
    assert ours.shape == (40, cfg.vocab_size) and ours.dtype == np.float32
    _close(ours, _reference_logits(model, tokens))


@pytest.mark.parametrize("quant", ["q4", "q8-g256", "q4-g256"])
def test_other_quant_modes_match_the_reference(quant: str, tiny_config, cpu_offload) -> None:
    cfg = tiny_config("qwen3", hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2, head_dim=32)
    model = synthetic_model(cfg, quant, seed=4)
    groups = {w.group_size for _, w in model.weights()}
    assert groups == ({256} if quant.endswith("g256") else {32})
    dec = Decoder(model, cpu_offload)
    tokens = _tokens(12, seed=2)
    _close(dec.forward(tokens, dec.new_cache(), all_logits=True), _reference_logits(model, tokens))


def test_wrong_gqa_mapping_would_be_caught(tiny_config, cpu_offload) -> None:
    """The reference is sensitive to which kv head a query head reads (guards the test above)."""
    model = synthetic_model(tiny_config("llama"), "q8", seed=3)
    tokens = _tokens(16)
    ref = _reference_logits(model, tokens)
    for lw in model.layers:  # swap the two kv heads' K rows: a different model if the mapping matters
        rows = lw.k.codes.reshape(2, 16, -1)
        scales = lw.k.scales.reshape(2, 16, -1)
        rows[:] = rows[::-1].copy()
        scales[:] = scales[::-1].copy()
    dec = Decoder(model, cpu_offload)
    err = np.abs(dec.forward(tokens, dec.new_cache(), all_logits=True) - ref).max() / np.ptp(ref)
    assert err > 5 * TOL


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_with_the_kv_cache_equals_teacher_forcing(arch: str, monkeypatch: pytest.MonkeyPatch, tiny_config,
                                                        cpu_offload) -> None:
    monkeypatch.setattr(decoder_mod, "CACHE_CHUNK", 4)  # the RoPE tables grow many times
    model = synthetic_model(tiny_config(arch), "q8", seed=5)
    dec = Decoder(model, cpu_offload, KVPool(model.config, 10, block_size=16))  # blocks out of order below
    tokens = _tokens(40, seed=6)
    other = dec.new_cache()
    dec.forward(tokens[:5], other)  # takes blocks first, so the caches below are not contiguous
    full = dec.forward(tokens, dec.new_cache(), all_logits=True)
    other.release()
    monkeypatch.setattr(decoder_mod, "PREFILL_CHUNK", 3)  # the prefill runs in chunks
    cache = dec.new_cache()
    first = dec.forward(tokens[:7], cache)
    assert first.shape == (1, model.config.vocab_size)
    steps = [first[0]] + [dec.forward([tokens[i]], cache)[0] for i in range(7, 40)]
    np.testing.assert_array_equal(np.stack(steps), full[6:])  # a row's bits do not depend on chunking
    assert cache.length == 40 and cache.capacity >= 40


def _keys_values(cache) -> tuple[np.ndarray, np.ndarray]:
    """A sequence's keys [L, KV, hd, T] and values [L, T, KV, hd], gathered from its blocks."""
    pool, n = cache.pool, cache.length
    kt = np.concatenate([pool.kt[:, b] for b in cache.blocks], axis=-1)[..., :n]
    v = np.concatenate([pool.v[:, b] for b in cache.blocks], axis=2)[:, :, :n].transpose(0, 2, 1, 3)
    return kt, v


def test_prefill_and_step_by_step_fill_the_same_cache(tiny_config, cpu_offload) -> None:
    model = synthetic_model(tiny_config("qwen2"), "q8", seed=7)
    dec = Decoder(model, cpu_offload)
    tokens = _tokens(20, seed=8)
    batched, stepped = dec.new_cache(), dec.new_cache()
    dec.forward(tokens, batched, logits=False)
    for t in tokens:
        dec.forward([t], stepped, logits=False)
    for a, b in zip(_keys_values(batched), _keys_values(stepped)):
        np.testing.assert_array_equal(a, b)


def test_the_context_limit_is_a_one_line_error(tiny_config, cpu_offload) -> None:
    model = synthetic_model(tiny_config("llama", max_position=16), "q8")
    dec = Decoder(model, cpu_offload)
    cache = dec.new_cache()
    dec.forward(_tokens(10), cache)
    with pytest.raises(KestrelError, match="context is 16"):
        dec.forward(_tokens(7), cache)
    with pytest.raises(KestrelError, match="out of range"):
        dec.forward([320], dec.new_cache())


def test_unsupported_rope_scaling_is_named(tiny_config) -> None:
    with pytest.raises(ValidationError, match="rope_type is one of linear, llama3, yarn, longrope.*dynamic"):
        tiny_config("llama", rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(KestrelError, match="config.json: rope scaling type 'dynamic' is not supported"):
        normalize_rope_scaling({"rope_type": "dynamic", "factor": 4.0}, "config.json")


RECORDER = '''
from kestrel_core import API_VERSION, BackendInfo, hookimpl
from kestrel_core.contract import reference_gemm_q8
from kestrel_cpu import kestrel_close, kestrel_gemm_f32, kestrel_open  # noqa: F401
SEEN = []

@hookimpl
def kestrel_backend_info():
    return BackendInfo("recorder", "1", API_VERSION, "gpu")

@hookimpl
def kestrel_gemm_q8(device, a_codes, a_scales, weight, wkey):
    SEEN.append(("gemm", wkey, id(weight), a_codes.shape[0]))
    return reference_gemm_q8(a_codes, a_scales, weight)

@hookimpl
def kestrel_gemm_fused_q8(device, a_codes, a_scales, weights, wkeys, fused_wkey):
    SEEN.append(("fused", fused_wkey, tuple(wkeys), tuple(id(w) for w in weights)))
    return [reference_gemm_q8(a_codes, a_scales, w) for w in weights]

@hookimpl
def kestrel_layer_boundary(device, layer):
    SEEN.append(("layer", layer))
'''


def test_every_projection_is_offered_with_its_wkey(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  tiny_config) -> None:
    (tmp_path / "recorder.py").write_text(RECORDER)
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "recorder.py"))
    registry = Registry()
    backend = registry.select("recorder")
    model = synthetic_model(tiny_config("qwen3", tie_word_embeddings=False), "q8", seed=9)
    dec = Decoder(model, Offload(backend, registry.cpu()))
    tokens = _tokens(5)
    ours = dec.forward(tokens, dec.new_cache())
    seen = backend.plugin.SEEN
    expected = []

    def handed(w: StripCache) -> int:  # the weight's read-only object, the one engine_weights names too
        return id(read_only_strip(w))

    for i, lw in enumerate(model.layers):
        expected += [("layer", i),
                     ("fused", fused_wkey(i, Proj.QKV), (wkey(i, Proj.Q), wkey(i, Proj.K), wkey(i, Proj.V)),
                      (handed(lw.q), handed(lw.k), handed(lw.v))),
                     ("gemm", wkey(i, Proj.O), handed(lw.o), 5),
                     ("fused", fused_wkey(i, Proj.GATE_UP), (wkey(i, Proj.GATE), wkey(i, Proj.UP)),
                      (handed(lw.gate), handed(lw.up))),
                     ("gemm", wkey(i, Proj.DOWN), handed(lw.down), 5)]
    expected.append(("gemm", lm_head_wkey(), handed(model.lm_head), 1))  # only the last row's logits
    assert seen == expected
    np.testing.assert_allclose(ours[0], _reference_logits(model, tokens)[-1], rtol=0,
                               atol=2e-3 * float(np.ptp(ours)))


def test_heads_matmul_is_each_heads_product_and_a_rows_bits_do_not_depend_on_its_batch() -> None:
    """kernels.heads_matmul (a latent attention's absorbed projections): x[m, h] @ w[h] for every row and head,
    against float64 einsum, and each row the same bits computed alone as in a batch of 7."""
    from kestrel_core.model import kernels

    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 3, 40)).astype(np.float32)  # [M, H, K]
    w = rng.standard_normal((3, 40, 24)).astype(np.float32)  # [H, K, N]
    out = np.empty((7, 3, 24), np.float32)
    kernels.heads_matmul(x, w, out)
    np.testing.assert_allclose(out, np.einsum("mhk,hkn->mhn", x.astype(np.float64), w), rtol=1e-5, atol=1e-5)
    for r in range(7):
        alone = np.empty((1, 3, 24), np.float32)
        kernels.heads_matmul(np.ascontiguousarray(x[r:r + 1]), w, alone)
        np.testing.assert_array_equal(alone[0], out[r])
