"""Paged attention over the float16 pool and the int8 one: float16 rounding as numpy's, int8 codes as the
contract's activation quantizer, attention against float64 softmax attention over the values the pool holds, the
same bits however a row's query heads are split into work items, from the Python fallback, and from the integer
float16 widening a CPU without F16C compiles."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kestrel_core.contract import quantize_activations
from kestrel_core.errors import KestrelError
from kestrel_core.model import paged_attention as pa
from kestrel_core.model.kv_pool import KVPool


def _edge_floats(rng: np.random.Generator) -> np.ndarray:
    """Random float32 bit patterns and every rounding edge of float16: ties, overflow, subnormals, NaN."""
    rand = rng.integers(0, 2 ** 32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    near = (rng.standard_normal(20000) * 10.0 ** rng.integers(-9, 6, 20000)).astype(np.float32)
    halves = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(invalid="ignore"):
        ties = (halves[:-1].astype(np.float64) + halves[1:]) / 2  # midpoints (NaN where a neighbour is)
    edges = np.array([0.0, -0.0, 65504, 65519.996, 65520, -65520, 2 ** -14, 2 ** -24, 2 ** -25, 3 * 2 ** -26,
                      1e-30, np.inf, -np.inf, np.nan], np.float32)
    return np.concatenate([rand, near, halves, ties.astype(np.float32), edges])


@pytest.mark.parametrize("fn", ["compiled", "python"])
def test_float16_bits_are_numpys_rounding(fn: str) -> None:
    x = _edge_floats(np.random.default_rng(3))
    if fn == "python":
        x = x[::40]  # the plain loop is slow
    out = np.empty(len(x), np.uint16)
    (pa.half_bits if fn == "compiled" else pa._half_bits)(x, out)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(out[~nan], want[~nan].view(np.uint16))
    assert np.isnan(out[nan].view(np.float16)).all()


def _int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., dims] as the int8 pool holds it: codes [..., dims] and scales [..., dims / KV_GROUP]."""
    codes, scales = quantize_activations(np.ascontiguousarray(x.reshape(-1, x.shape[-1]), np.float32), pa.KV_GROUP)
    return codes.reshape(x.shape), scales.reshape(*x.shape[:-1], -1)


def _problem(seed: int, n_heads: int, n_kv: int, hd: int, vd: int, bs: int, lengths: list[int],
             firsts: list[int] | None = None, kv_type: str = "f16") -> dict:
    """A pool of float16 (or int8) keys and values, blocks out of order, and a query row per length."""
    rng = np.random.default_rng(seed)
    m = len(lengths)
    n_blocks = -(-max(lengths) // bs) + 2
    vdp = pa.padded_dims(vd)
    keys = rng.standard_normal((n_blocks, n_kv, bs, hd)).astype(np.float32)  # [blocks, KV, BS, hd]
    values = np.zeros((n_blocks, n_kv, bs, vdp), np.float32)  # [blocks, KV, BS, vdp]
    values[..., :vd] = rng.standard_normal((n_blocks, n_kv, bs, vd))
    p = dict(q=(rng.standard_normal((m, n_heads, hd)) / np.sqrt(hd)).astype(np.float32),
             tables=np.stack([rng.permutation(n_blocks) for _ in range(m)]).astype(np.int64),
             firsts=np.array(firsts or [0] * m, np.int64), lengths=np.array(lengths, np.int64),
             sinks=rng.standard_normal(n_heads).astype(np.float32), vd=vd)
    if kv_type == "q8":
        (kc, ks), (vc, vs) = _int8(keys), _int8(values)
        p.update(kt=np.ascontiguousarray(kc.transpose(0, 1, 3, 2)), vc=vc,
                 ks=np.ascontiguousarray(ks.transpose(0, 1, 3, 2)), vs=vs)  # [blocks, KV, hd, BS], [.., hd/G, BS]
    else:
        p.update(kt=np.ascontiguousarray(keys.transpose(0, 1, 3, 2)).astype(np.float16), vc=values.astype(np.float16))
    return p


def _pool(p: dict) -> tuple[np.ndarray, ...]:
    """The problem's kt, vc, ks, vs as ``attend`` takes them (``KVPool.layer_arrays``)."""
    if "ks" in p:
        return p["kt"], p["vc"], p["ks"], p["vs"]
    empty = np.zeros((0, 0, 0, 0), np.float32)
    return p["kt"].view(np.uint16), p["vc"].view(np.uint16), empty, empty


def _held(p: dict) -> tuple[np.ndarray, np.ndarray]:
    """The keys [blocks, KV, hd, BS] and values [blocks, KV, BS, vdp] the pool holds, as float64."""
    if "ks" not in p:
        return p["kt"].astype(np.float64), p["vc"].astype(np.float64)
    g = pa.KV_GROUP
    return (p["kt"] * np.repeat(p["ks"], g, axis=2).astype(np.float64),
            p["vc"] * np.repeat(p["vs"], g, axis=3).astype(np.float64))


def _attend(p: dict, heads: int, softcap: float = 0.0, fn=None) -> np.ndarray:
    m, n_heads, hd = p["q"].shape
    ones, zeros = np.ones((m, hd), np.float32), np.zeros((m, hd), np.float32)  # RoPE at position 0: none
    out = np.empty((m, n_heads * p["vd"]), np.float32)
    (fn or pa.attend)(p["q"], *_pool(p), p["tables"], np.arange(m), p["firsts"], p["lengths"], ones, zeros,
                      np.float32(softcap), p["sinks"], heads, out)
    return out


def _reference(p: dict, softcap: float = 0.0) -> np.ndarray:
    """float64 softmax attention with a sink logit, over each row's positions firsts .. lengths - 1."""
    (kt, vc), q, vd = _held(p), p["q"], p["vd"]
    m, n_heads, hd = q.shape
    n_kv = kt.shape[1]
    out = np.empty((m, n_heads * vd))
    for r in range(m):
        blocks = p["tables"][r]
        keys = kt[blocks].transpose(0, 3, 1, 2).reshape(-1, n_kv, hd)  # [positions, KV, hd]
        values = vc[blocks].transpose(0, 2, 1, 3).reshape(-1, n_kv, vc.shape[3])[..., :vd]
        seen = slice(p["firsts"][r], p["lengths"][r])
        for h in range(n_heads):
            kv = h // (n_heads // n_kv)
            scores = keys[seen, kv] @ q[r, h]
            if softcap:
                scores = np.tanh(scores / softcap) * softcap
            sink = p["sinks"][h]
            weights = np.exp(np.append(scores, sink) - max(scores.max(), sink))
            out[r, h * vd:(h + 1) * vd] = weights[:-1] @ values[seen, kv] / weights.sum()
    return out


CASES = [  # n_heads, n_kv, hd, vd, bs, lengths, firsts
    (9, 3, 64, 64, 32, [300, 257, 1], None),
    (8, 1, 32, 32, 16, [40, 33, 17], None),
    (4, 4, 80, 72, 32, [100, 64, 65], [0, 10, 40]),  # value dims padded; a sliding window
    (4, 1, 576, 512, 32, [70, 5], None),  # a latent attention's shapes
]


@pytest.mark.parametrize("kv_type", ["f16", "q8"])
@pytest.mark.parametrize("case", CASES)
def test_attention_matches_float64_softmax_attention_whatever_heads_an_item_takes(case: tuple, kv_type: str) -> None:
    n_heads, n_kv, hd, vd, bs, lengths, firsts = case
    if kv_type == "q8" and hd % pa.KV_GROUP:
        pytest.skip("an int8 pool needs key dims in whole blocks (the next test)")
    p = _problem(len(lengths) + hd, n_heads, n_kv, hd, vd, bs, lengths, firsts, kv_type)
    outs = [_attend(p, heads) for heads in (n_heads // n_kv, 1)]
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0], _reference(p), rtol=1e-4, atol=1e-5)
    capped = _attend(p, 1, softcap=0.5)
    np.testing.assert_allclose(capped, _reference(p, softcap=0.5), rtol=1e-4, atol=1e-5)
    assert np.abs(capped - outs[0]).max() > 1e-3  # the cap was applied


def test_an_int8_pool_needs_whole_blocks_of_dims(tiny_config) -> None:
    from dataclasses import replace

    config = tiny_config("llama")
    odd = replace(config, hidden_size=config.num_heads * 48, head_dim=48)
    with pytest.raises(KestrelError, match="blocks of 32 dims; this model's keys have 48"):
        KVPool(odd, 4, kv_type="q8")
    with pytest.raises(KestrelError, match="unknown KV cache type 'q4'"):
        KVPool(config, 4, kv_type="q4")


@pytest.mark.parametrize("kv_type", ["f16", "q8"])
def test_a_wrong_key_position_or_scale_is_caught(kv_type: str) -> None:
    p = _problem(5, 9, 3, 64, 64, 32, [300, 257, 1], kv_type=kv_type)
    good = _attend(p, 3)
    p["kt"][p["tables"][0, 4], 1, :, 7] += p["kt"].dtype.type(1)  # one key of row 0's fifth block
    bad = _attend(p, 3)
    assert np.abs(bad[0] - good[0]).max() > 1e-3 and np.array_equal(bad[2], good[2])
    np.testing.assert_allclose(bad, _reference(p), rtol=1e-4, atol=1e-5)
    if kv_type == "q8":  # a key's second block's scale, a value's first
        p["ks"][p["tables"][1, 2], 2, 1, 5] *= 2
        p["vs"][p["tables"][1, 3], 0, 9, 0] *= 2
        worse = _attend(p, 3)
        assert np.abs(worse[1] - bad[1]).max() > 1e-3
        np.testing.assert_allclose(worse, _reference(p), rtol=1e-4, atol=1e-5)


def test_the_int8_pool_holds_the_contracts_codes_of_each_rotated_key_and_value(tiny_config) -> None:
    """rope_write into an int8 pool: each head's rotated key and value quantized per KV_GROUP dims, bit for bit as
    the contract's activation quantizer (itself checked against gguf-py's Q8_0) does it, compiled or not."""
    rng = np.random.default_rng(4)
    m, n_kv, hd, vd, bs = 5, 2, 64, 64, 16
    k = rng.standard_normal((m, n_kv, hd)).astype(np.float32) * 3
    v = rng.standard_normal((m, n_kv, vd)).astype(np.float32)
    angle = rng.random((m, hd // 2)).astype(np.float32) * 6
    cos = np.cos(np.concatenate([angle, angle], 1)).astype(np.float32)
    sin = np.sin(np.concatenate([angle, angle], 1)).astype(np.float32) * np.repeat(np.float32([-1, 1]), hd // 2)
    slots = np.array([0, 17, 5, 31, 40], np.int64)
    half = hd // 2
    turned = k * cos[:, None] + np.concatenate([k[..., half:], k[..., :half]], -1) * sin[:, None]
    (kc, kscale), (vc_, vscale) = _int8(turned), _int8(v)
    for fn in (pa.rope_write, pa._rope_write):
        kt, vc = np.zeros((3, n_kv, hd, bs), np.int8), np.zeros((3, n_kv, bs, vd), np.int8)
        ks, vs = np.zeros((3, n_kv, hd // 32, bs), np.float32), np.zeros((3, n_kv, bs, vd // 32), np.float32)
        fn(k, v, kt, vc, ks, vs, slots, cos, sin)
        blk, off = slots // bs, slots % bs
        np.testing.assert_array_equal(kt[blk, :, :, off], kc)
        np.testing.assert_array_equal(ks[blk, :, :, off], kscale)
        np.testing.assert_array_equal(vc[blk, :, off], vc_)
        np.testing.assert_array_equal(vs[blk, :, off], vscale)


def test_the_softmax_exp_is_within_two_ulp_of_e_to_the_x() -> None:
    x = np.concatenate([-np.random.default_rng(1).random(100000).astype(np.float32) * 90,
                        np.float32([0, -0.0, -1e-8, -0.5 * np.log(2), pa.EXP_FLOOR, -np.inf, np.nan])])
    got = pa._exp(x)
    want = np.exp(x.astype(np.float64))
    kept = x >= pa.EXP_FLOOR
    assert (np.abs(got[kept] - want[kept]) <= 2 * np.spacing(want[kept].astype(np.float32))).all()
    assert (got[~kept & ~np.isnan(x)] == 0).all() and np.isnan(got[np.isnan(x)]).all()
    assert got[x == 0].tolist() == [1.0, 1.0]


def _fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pa._attend`` as plain Python over the vector kernels' numpy twins."""
    for name, fallback in (("key_scores", pa._key_scores), ("value_sums", pa._value_sums),
                           ("softmax", pa._softmax), ("prange", range)):
        monkeypatch.setattr(pa, name, fallback)


def test_the_python_fallback_gives_the_compiled_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vector kernels' plain-numpy twins: the softmax's bits; the sums' within the fused multiply-adds'
    rounding (exactly where the CPU has no FMA: the next test); the whole attention run on them likewise."""
    import numba

    p = _problem(11, 4, 2, 48, 40, 16, [37, 20], [0, 3])
    q8 = _problem(12, 4, 2, 64, 64, 16, [37, 20], [0, 3], kv_type="q8")
    kt, vc = p["kt"].view(np.uint16).reshape(-1), p["vc"].view(np.uint16).reshape(-1)
    kt8, vc8, ks, vs = (q8[name].reshape(-1) for name in ("kt", "vc", "ks", "vs"))
    empty = np.zeros(0, np.float32)
    rng = np.random.default_rng(0)
    q = rng.standard_normal(96).astype(np.float32)
    offs = rng.integers(0, kt.size - 12 * 16 - 16, pa.SCORE_TILE).astype(np.int64)
    offs8 = rng.integers(0, kt8.size - 64 * 16 - 16, pa.SCORE_TILE).astype(np.int64)
    soffs = rng.integers(0, ks.size - 2 * 16 - 16, pa.SCORE_TILE).astype(np.int64)
    weights = rng.random(40).astype(np.float32)
    logits = (rng.standard_normal(80) * 30).astype(np.float32)

    def kernels(key_scores, value_sums, softmax):  # type: ignore[no-untyped-def]
        def calls(q, kt, offs, weights, vc, scores, sums, logits, totals,  # type: ignore[no-untyped-def]
                  kt8, ks, offs8, soffs, vc8, vs, empty, scores8, sums8):
            key_scores(q, 3, 7, 12, kt, empty, offs, offs, 16, scores, 3, 130)
            key_scores(q, 3, 1, 64, kt8, ks, offs8, soffs, 16, scores8, 0, 130)
            for vectors in range(1, pa.VALUE_TILE + 1):
                value_sums(weights, 5, 30, vc, empty, 7, 2 * 48, 0, 0, 0, sums, 16 * (vectors - 1), vectors)
                value_sums(weights, 5, 30, vc8, vs, 64 + 16 * (4 - vectors), 64, 2, 2, 16 * (4 - vectors), sums8,
                           16 * (4 - vectors), vectors)
            totals[0] = softmax(logits, 3, 37, np.float32(-np.inf))
            totals[1] = softmax(logits, 55, 1, np.float32(2.5))
        return calls

    compiled = numba.njit(kernels(pa.key_scores, pa.value_sums, pa.softmax))
    python = kernels(pa._key_scores, pa._value_sums, pa._softmax)
    start = rng.standard_normal(16 * 7).astype(np.float32)
    outs = []
    for fn in (compiled, python):
        out = (np.full(3 + 7 * 130, np.nan, np.float32), start.copy(), logits.copy(),
               np.zeros(2, np.float32), np.full(130, np.nan, np.float32), start[:64].copy())
        fn(q, kt, offs, weights, vc, out[0], out[1], out[2], out[3], kt8, ks, offs8, soffs, vc8, vs, empty, out[4],
           out[5])
        outs.append(out)
    for k in (4, 5):  # the int8 sums: each block's scale applied
        np.testing.assert_allclose(outs[1][k], outs[0][k], rtol=1e-5, atol=1e-5)
    assert not np.isnan(outs[0][4][:128]).any() and not np.array_equal(outs[0][5], start[:64])
    for k in (0, 1):
        np.testing.assert_allclose(outs[1][k], outs[0][k], rtol=1e-5, atol=1e-5)
    kept = np.r_[3:40, 55]  # the compiled softmax also writes its last vector's spare lanes, which nothing reads
    np.testing.assert_array_equal(outs[1][2][kept], outs[0][2][kept])
    np.testing.assert_array_equal(outs[1][3], outs[0][3])
    assert not np.array_equal(outs[0][1], start) and not np.array_equal(outs[0][2], logits)
    e = np.exp(logits[3:40].astype(np.float64) - logits[3:40].max())
    np.testing.assert_allclose(outs[0][2][3:40], e, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(outs[0][3][0], e.sum(), rtol=1e-6)

    want = _attend(p, 2), _attend(q8, 2)
    _fallback(monkeypatch)
    np.testing.assert_allclose(_attend(p, 2, fn=pa._attend), want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_attend(q8, 2, fn=pa._attend), want[1], rtol=1e-5, atol=1e-6)


def test_a_cpu_without_f16c_or_fma_gives_the_fallbacks_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NUMBA_CPU_NAME=generic with no features (x86 without F16C, where fpext would call a function numba's JIT
    cannot resolve, and without FMA): attention widens float16 in integer steps, to the same values, and
    multiplies and adds apart, as the numpy twins do, bit for bit."""
    p = _problem(13, 9, 3, 64, 64, 32, [300, 257, 1])
    first = p["tables"][0, 0]  # row 0's first block
    p["kt"][first, 0, 0, :8] = np.array([0, -0.0, 6e-8, -6e-5, 65504, 1e-5, 7e-7, 2.5], np.float16)  # subnormals
    p["vc"][first, 0, 0, :8] = np.array([np.inf, -np.inf, 6e-8, -6e-5, 65504, 1e-5, 7e-7, 2.5], np.float16)
    np.savez(tmp_path / "p.npz", **{k: v for k, v in p.items() if k != "vd"})
    script = (
        "import sys, numpy as np\n"
        "from kestrel_core import codegen\n"
        "from kestrel_core.model import paged_attention as pa\n"
        "p = dict(np.load(sys.argv[1])); m, h, hd = p['q'].shape; out = np.empty((m, h * 64), np.float32)\n"
        "e = np.zeros((0, 0, 0, 0), np.float32)\n"
        "pa.attend(p['q'], p['kt'].view(np.uint16), p['vc'].view(np.uint16), e, e, p['tables'], np.arange(m),\n"
        "          p['firsts'], p['lengths'], np.ones((m, hd), np.float32), np.zeros((m, hd), np.float32),\n"
        "          np.float32(0), p['sinks'], 3, out)\n"
        "np.save(sys.argv[2], out)\n"
        "print(codegen.native_half())\n"
    )
    env = {**os.environ, "NUMBA_CPU_NAME": "generic", "NUMBA_CPU_FEATURES": "", "NUMBA_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "p.npz"), str(tmp_path / "out.npy")],
                         env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    import llvmlite.binding as llvm

    if llvm.get_process_triple().startswith("x86_64"):
        assert run.stdout.strip() == "False"  # the integer route ran
    got = np.load(tmp_path / "out.npy")
    assert np.isinf(got[0, :2]).all() and np.isfinite(got[0, 2:64]).all()  # the infinities came through
    np.testing.assert_allclose(got, _attend(p, 3), rtol=1e-5, atol=1e-6)
    _fallback(monkeypatch)
    np.testing.assert_array_equal(got, _attend(p, 3, fn=pa._attend))


def test_a_block_holds_whole_key_vectors(tiny_config) -> None:
    with pytest.raises(KestrelError, match="multiple of 16"):
        KVPool(tiny_config("llama"), 4, block_size=24)
    pool = KVPool(tiny_config("llama"), 4, block_size=48)
    assert pool.kt.dtype == np.float16 and pool.v.shape[-1] == pa.padded_dims(pool.v.shape[-1])
