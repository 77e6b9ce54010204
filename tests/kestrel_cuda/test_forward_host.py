"""The device forward's host side on the CPU: orchestration over the numpy mirrors of its kernels.

``DeviceForward(ops=NumpyOps())`` runs every step of the GPU path (weight packing into the K-major device
layout, fused and per-projection projections, sequences, chunks, rewinds, graph record/replay, the residency
window through a real ``WeightCache``) with numpy standing in for the kernels, checked against the CPU
decoder. The kernels themselves are checked on the GPU (test_forward.py) against the same references.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kestrel_core.model.config import ModelConfig
from kestrel_core.model.decoder import PREFILL_CHUNK
from kestrel_core.model.presets import synthetic_model
from kestrel_cuda import kernels, plan
from kestrel_cuda.allocator import NumpyAllocator
from kestrel_cuda.config import CudaConfig
from kestrel_cuda.forward import CAP_CHUNK, DeviceForward, unsupported_reason
from kestrel_cuda.layout import Geometry, pack_kmajor, pad_n, unpack_kmajor
from kestrel_cuda.ops_numpy import NumpyOps
from kestrel_cuda.residency import WeightCache

from .forward_check import (
    DECLINING_BACKEND,
    FACTOR,
    SMALL_CONFIGS,
    cache_source,
    compare,
    cpu_logits,
    device_logits,
    greedy_agrees,
    jitter_effect,
    stepwise_greedy,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"

CONFIGS = SMALL_CONFIGS
QUANTS = ("q8", "q4", "q8-g256", "q4-g256")


def _tokens(cfg: ModelConfig, n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, n)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_mirror_matches_cpu_decoder(arch: str, quant: str) -> None:
    model = synthetic_model(CONFIGS[arch], quant, seed=3)
    toks = _tokens(model.config, 40)
    ref = cpu_logits(model, toks, 24)
    fwd = DeviceForward(ops=NumpyOps())
    got = device_logits(fwd, model, toks, 24)
    result = compare(got, ref, jitter_effect(model, toks, 24, ref))
    assert result.ok, str(result)
    assert result.argmax_same >= 0.9 * len(toks), str(result)
    assert fwd.counters["graph_captures"] == 1 and fwd.counters["graph_replays"] == 16


def _assert_in_the_band(model, n_tokens: int, n_prefill: int) -> DeviceForward:  # type: ignore[no-untyped-def]
    """A prefill of ``n_prefill`` tokens and decode steps to ``n_tokens`` over the numpy mirrors: the CPU
    decoder's logits within the band. Returns the forward, for its counters."""
    toks = _tokens(model.config, n_tokens)
    ref = cpu_logits(model, toks, n_prefill)
    fwd = DeviceForward(ops=NumpyOps())
    result = compare(device_logits(fwd, model, toks, n_prefill), ref, jitter_effect(model, toks, n_prefill, ref))
    assert result.ok, str(result)
    return fwd


def _assert_leaves_the_band(model, ops, n_tokens: int = 40, n_prefill: int = 24) -> None:  # type: ignore[no-untyped-def]
    """A forward over ``ops`` (a deliberately wrong mirror) lands far outside the CPU's band: over twice it."""
    toks = _tokens(model.config, n_tokens)
    ref = cpu_logits(model, toks, n_prefill)
    result = compare(device_logits(DeviceForward(ops=ops), model, toks, n_prefill), ref,
                     jitter_effect(model, toks, n_prefill, ref))
    assert not result.ok and result.rel_err > 2 * result.tol, str(result)


def test_comparison_catches_a_wrong_forward() -> None:
    """The tolerance is tight enough to fail: a 10% error in the attention scale is far outside it."""

    class WrongScale(NumpyOps):
        def attention(self, q, kc, vc, heads, hd, scale, meta, out, **kw):  # type: ignore[no-untyped-def]
            super().attention(q, kc, vc, heads, hd, scale * 1.1, meta, out, **kw)

    _assert_leaves_the_band(synthetic_model(CONFIGS["qwen3"], "q8", seed=3), WrongScale())


def test_graph_replay_equals_eager_bitwise() -> None:
    model = synthetic_model(CONFIGS["qwen2"], "q4", seed=4)
    toks = _tokens(model.config, 30)
    a = device_logits(DeviceForward(ops=NumpyOps(), config=CudaConfig(graph=True)), model, toks, 10)
    b = device_logits(DeviceForward(ops=NumpyOps(), config=CudaConfig(graph=False)), model, toks, 10)
    assert np.array_equal(a, b)


def test_graph_is_captured_once_per_sequence_and_survives_kv_growth() -> None:
    cfg = replace(CONFIGS["llama"], num_layers=1)
    model = synthetic_model(cfg, "q8", seed=5)
    fwd = DeviceForward(ops=NumpyOps())
    toks = _tokens(cfg, CAP_CHUNK + 3)
    ref = cpu_logits(model, toks, CAP_CHUNK - 2)  # decode steps cross the first capacity chunk
    got = device_logits(fwd, model, toks, CAP_CHUNK - 2)
    assert compare(got, ref, jitter_effect(model, toks, CAP_CHUNK - 2, ref)).ok
    assert fwd._seqs[1].capacity == 2 * CAP_CHUNK
    assert fwd.counters["graph_captures"] == 2  # re-captured after the KV cache moved


def test_long_prefill_runs_in_chunks_with_all_logits() -> None:
    cfg = replace(CONFIGS["qwen3"], num_layers=1)
    model = synthetic_model(cfg, "q8", seed=6)
    toks = _tokens(cfg, PREFILL_CHUNK + 37)
    ref = cpu_logits(model, toks, len(toks))
    fwd = DeviceForward(ops=NumpyOps())
    got = fwd.forward(model, 7, toks, 0, True)
    assert got.shape == (len(toks), cfg.vocab_size)
    assert compare(got, ref, jitter_effect(model, toks, len(toks), ref)).ok
    last = fwd.forward(model, 8, toks, 0, False)
    assert last.shape == (1, cfg.vocab_size) and np.array_equal(last[0], got[-1])


def test_sequence_semantics_rewind_reset_decline_release() -> None:
    model = synthetic_model(CONFIGS["qwen2"], "q8", seed=7)
    toks = _tokens(model.config, 12)
    fwd = DeviceForward(ops=NumpyOps())
    full = fwd.forward(model, 1, toks, 0, True)
    # rewind: re-running the last 4 positions gives the same rows
    again = fwd.forward(model, 1, toks[8:], 8, True)
    assert np.array_equal(again, full[8:])
    # ahead of the device cache: declined, state kept
    assert fwd.forward(model, 1, toks[:1], 13, False) is None
    assert fwd.forward(model, 2, toks[:1], 3, False) is None  # unknown sequence not at 0
    # start 0 resets
    assert np.array_equal(fwd.forward(model, 1, toks[:5], 0, True), full[:5])
    # two sequences are independent
    other = fwd.forward(model, 3, toks[::-1].copy(), 0, False)
    assert np.array_equal(fwd.forward(model, 1, toks[5:], 5, True), full[5:])
    assert other.shape == (1, model.config.vocab_size)
    fwd.release(1)
    assert fwd.forward(model, 1, toks[:1], 12, False) is None
    assert fwd.counters["declined"] == 3


def test_a_released_sequence_lends_its_kv_cache_and_graph_to_the_next() -> None:
    """The second prompt replays the first one's graph on its KV cache (stale positions are rewritten before
    they are read): the same logits as a fresh forward, one capture; a sequence in use is never lent."""
    model = synthetic_model(CONFIGS["qwen3"], "q4", seed=8)
    a, b = _tokens(model.config, 20, seed=1), _tokens(model.config, 14, seed=2)
    fwd = DeviceForward(ops=NumpyOps())
    device_logits(fwd, model, a, 12, seq_id=1)
    fwd.release(1)
    got = device_logits(fwd, model, b, 6, seq_id=2)
    assert fwd.counters["graph_captures"] == 1 and fwd.counters["sequences_reused"] == 1
    assert np.array_equal(got, device_logits(DeviceForward(ops=NumpyOps()), model, b, 6, seq_id=2))
    fwd.forward(model, 3, b[:4], 0, False)  # nothing released since: a cache of its own
    assert fwd.counters["sequences_reused"] == 1 and fwd._seqs[3].kv is not fwd._seqs[2].kv


def test_declines_bad_tokens_context_and_unsupported_models() -> None:
    model = synthetic_model(CONFIGS["llama"], "q8", seed=8)
    fwd = DeviceForward(ops=NumpyOps(), config=CudaConfig(max_context=16))
    assert fwd.forward(model, 1, np.array([model.config.vocab_size]), 0, False) is None
    assert fwd.forward(model, 1, np.array([-1]), 0, False) is None
    assert fwd.forward(model, 1, np.array([], np.int64), 0, False) is None
    assert fwd.forward(model, 1, np.arange(17), 0, False) is None
    assert fwd.forward(model, 1, np.arange(16), 0, False) is not None
    assert fwd.forward(model, 1, np.arange(1), 16, False) is None  # position 16 is the 17th
    wide = replace(CONFIGS["llama"], head_dim=320, num_heads=2, num_kv_heads=2, num_layers=1)
    assert unsupported_reason(synthetic_model(wide, "q8")) is not None
    assert fwd.forward(synthetic_model(wide, "q8"), 1, np.arange(3), 0, False) is None
    assert "head_dim" in fwd.last_decline


def test_window_path_through_the_weight_cache_matches_own_upload() -> None:
    """Per-layer fetches through a real WeightCache with keep=1: evictions, re-uploads, same logits."""
    model = synthetic_model(CONFIGS["qwen3"], "q4", seed=9)
    toks = _tokens(model.config, 20)
    cache = WeightCache(NumpyAllocator(1 << 30), budget=1 << 30, keep=1)
    uploads: list[int] = []
    windowed = DeviceForward(cache_source(cache, uploads), cache.on_layer_boundary, ops=NumpyOps())
    assert not windowed.use_graph
    a = device_logits(windowed, model, toks, 8)
    b = device_logits(DeviceForward(ops=NumpyOps()), model, toks, 8)
    assert np.array_equal(a, b)
    stats = cache.stats()
    assert stats["evictions"] > 0 and len(uploads) > 2 * 4 + 1  # layer 0 re-uploaded at every step
    assert windowed.greedy(model, 1, int(toks[-1]), len(toks), 2) is None
    assert "residency window" in windowed.last_decline  # eager steps, and the reason said


def test_a_mixture_of_experts_through_the_window_matches_the_resident_forward() -> None:
    """Per-layer fetches of every expert through a WeightCache with keep=1 (each step's expert tables made from
    what the cache holds then): the resident forward's logits, bit for bit."""
    from kestrel_core.model.loader import load_model

    model = load_model(str(FIXTURES / "tiny-qwen2-moe"), "q8", cache="off").model
    toks = _tokens(model.config, 16)
    cache = WeightCache(NumpyAllocator(1 << 30), budget=1 << 30, keep=1)
    uploads: list[int] = []
    windowed = DeviceForward(cache_source(cache, uploads), cache.on_layer_boundary, ops=NumpyOps())
    a = device_logits(windowed, model, toks, 8)
    b = device_logits(DeviceForward(ops=NumpyOps()), model, toks, 8)
    assert np.array_equal(a, b) and cache.stats()["evictions"] > 0


def test_weight_source_pins_what_the_graph_captured() -> None:
    model = synthetic_model(CONFIGS["llama"], "q8", seed=10)
    cache = WeightCache(NumpyAllocator(1 << 30), budget=1 << 30, keep=0)

    def source(key, strips):  # type: ignore[no-untyped-def]
        geo = Geometry.fused(strips) if len(strips) > 1 else Geometry.of(strips[0])

        def upload(dw) -> None:  # type: ignore[no-untyped-def]
            codes = np.concatenate([s.codes for s in strips])
            dw.codes[:] = pack_kmajor(codes, 8).reshape(-1).view(np.int8)
            sc = np.zeros((geo.ngroups, geo.npad), np.float32)
            sc[:, :codes.shape[0]] = np.concatenate([s.scales for s in strips]).T
            dw.scales[...] = sc
        return cache.get_or_upload(key, geo, upload, source=strips[0])

    fwd = DeviceForward(source, pin=cache.pin, unpin=cache.unpin, ops=NumpyOps())
    toks = _tokens(model.config, 6)
    ref = device_logits(DeviceForward(ops=NumpyOps()), model, toks, 4)
    assert np.array_equal(device_logits(fwd, model, toks, 4), ref)
    pinned = [e for e in cache.entries() if e.pins]
    assert len(pinned) == 2 * 4 + 1  # fused qkv, o, fused gate|up, down per layer, and lm_head
    fwd.close()
    assert not any(e.pins for e in cache.entries())


def test_greedy_check_accepts_the_cpu_and_rejects_other_tokens() -> None:
    model = synthetic_model(CONFIGS["qwen3"], "q8", seed=11)
    prompt = _tokens(model.config, 8)
    ref = cpu_logits(model, prompt, 8)
    greedy = [int(ref[-1].argmax())]
    fwd = DeviceForward(ops=NumpyOps())
    fwd.forward(model, 1, prompt, 0, False)
    for i in range(15):
        row = fwd.forward(model, 1, np.array(greedy[-1:]), len(prompt) + i, False)
        greedy.append(int(row[0].argmax()))
    assert greedy_agrees(greedy, model, prompt, tol=0.05) == []
    wrong = [(t + 1) % model.config.vocab_size for t in greedy]
    assert len(greedy_agrees(wrong, model, prompt, tol=0.05)) >= 8


def test_engine_recomputes_a_declined_step_on_the_cpu(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The GPU test's engine scenario over the numpy mirrors: decline at call 3, host catch-up, same tokens."""
    import kestrel_core

    model = synthetic_model(SMALL_CONFIGS["qwen3"], "q8", seed=9)
    prompt = _tokens(model.config, 10).tolist()
    make = "lambda: DeviceForward(ops=__import__('kestrel_cuda.ops_numpy').ops_numpy.NumpyOps())"
    (tmp_path / "fwdcuda.py").write_text(DECLINING_BACKEND.format(decline={3}, make=make, greedy=None))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "fwdcuda.py"))
    with kestrel_core.load(model, backend="fwdcuda") as engine:
        tokens = list(engine.generate(prompt, max_tokens=12, stop_at_eos=False))
        stats = engine.stats["offload"]["kestrel_forward"]
        calls = list(engine.backend.plugin.CALLS)
    assert stats["accepted"] == 11 and stats["declined"] == 1
    assert calls[:5] == [0, 10, 11, 11, 13]
    seq = np.concatenate([prompt, tokens[:-1]])
    ref = cpu_logits(model, seq, len(prompt))
    _, jitter_max = jitter_effect(model, seq, len(prompt), ref)
    assert greedy_agrees(tokens, model, np.asarray(prompt), tol=FACTOR * jitter_max) == []


# -- the device layout and the kernels' byte tricks ------------------------------------------------


@pytest.mark.parametrize("bits", (8, 4))
def test_pack_kmajor_layout(bits: int) -> None:
    lo, hi = (-127, 127) if bits == 8 else (-8, 7)
    codes = np.random.default_rng(0).integers(lo, hi + 1, size=(13, 64)).astype(np.int8)
    packed = pack_kmajor(codes, bits)
    assert packed.shape == ((64, 16) if bits == 8 else (8, 64))
    assert np.array_equal(unpack_kmajor(packed, bits)[:, :13], codes.T)
    assert np.all(unpack_kmajor(packed, bits)[:, 13:] == 0)
    if bits == 4:  # common.cuh's layout: word (kw, n), byte b = (c[8kw + b] + 8) | (c[8kw + 4 + b] + 8) << 4
        kw, n, b = 5, 7, 2
        assert packed[kw, 4 * n + b] == (int(codes[n, 8 * kw + b]) + 8) | ((int(codes[n, 8 * kw + 4 + b]) + 8) << 4)


def _byte_perm(x: int, y: int, s: int) -> int:
    src = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(s >> (4 * i)) & 0x7] << (8 * i) for i in range(4))


def _transpose4x4_from_source() -> list[tuple[str, str, str, int]]:
    """The __byte_perm calls of common.cuh's transpose4x4, in order: (dest, x, y, selector)."""
    text = (kernels.HERE / "common.cuh").read_text()
    body = text[text.index("void transpose4x4("):]
    body = body[:body.index("\n}\n")]
    calls = re.findall(r"(\w+) = __byte_perm\((\w+), (\w+), (0x[0-9a-fA-F]+)\)", body)
    return [(d, x, y, int(s, 16)) for d, x, y, s in calls]


@pytest.mark.parametrize("sources", (kernels.SOURCES, kernels.FORWARD_SOURCES))
def test_each_module_is_its_headers_then_its_kernel_files(sources: tuple[str, ...]) -> None:
    headers = [name for name in sources if name.endswith(".cuh")]
    assert list(sources[:len(headers)]) == headers and all((kernels.HERE / name).is_file() for name in sources)


def test_forward_sources_define_each_kernel_the_ops_load_once() -> None:
    from kestrel_cuda import ops_cupy

    text = kernels.source_text(kernels.FORWARD_SOURCES)
    for name in ("qgemv", "attn_decode", "quantize_rows", *ops_cupy.KERNELS):
        assert len(re.findall(rf"__global__ void (?:__launch_bounds__\([^)]*\) )?{name}\(", text)) == 1, name


def test_the_routers_constants_are_moe_cus() -> None:
    """plan.ROUTE_ROWS and ROUTE_MAX_EXPERTS (the launch's grid, the experts the device forward takes) are
    moe.cu's: router rows a block, one logit per thread of NT."""
    text = kernels.source_text(kernels.FORWARD_SOURCES)
    define = {name: value for name, value in re.findall(r"#define (\w+) (\w+)", text)}
    assert int(define["ROUTE_ROWS"]) == plan.ROUTE_ROWS
    assert define["ROUTE_MAX_EXPERTS"] == "NT" and int(define["NT"]) == plan.ROUTE_MAX_EXPERTS


def test_the_attn_rows_constants_are_attention_cus() -> None:
    """plan.ATTN_ROWS_HEADS (the launch's parts of a group), ATTN_ROWS_WARPS (its block), ATTN_ROWS_MAX_SPLITS
    (the planner's cap), ATTN_ROWS_BUFFERS (its shared memory) and KV_BLOCK (a staged page) are attention.cu's."""
    text = kernels.source_text(kernels.FORWARD_SOURCES)
    define = {name: value for name, value in re.findall(r"#define (\w+) (\w+)", text)}
    assert int(define["ROWS_BUFFERS"]) == plan.ATTN_ROWS_BUFFERS
    assert int(define["ROWS_HEADS"]) == plan.ATTN_ROWS_HEADS
    assert int(define["ROWS_WARPS"]) == plan.ATTN_ROWS_WARPS
    assert int(define["ROWS_MAX_SPLITS"]) == plan.ATTN_ROWS_MAX_SPLITS
    assert int(define["PT"]) == plan.KV_BLOCK


def test_the_quantize_rows_chunk_is_rows_cus() -> None:
    """ops_cupy.QUANT_CHUNK (the launch's blocks a row) is rows.cu's NT * QUANT_LOADS."""
    from kestrel_cuda.ops_cupy import QUANT_CHUNK

    text = kernels.source_text(kernels.FORWARD_SOURCES)
    define = {name: value for name, value in re.findall(r"#define (\w+) (\w+)", text)}
    assert int(define["NT"]) * int(define["QUANT_LOADS"]) == QUANT_CHUNK


def test_common_cuh_transpose4x4_transposes_a_4x4_byte_block() -> None:
    calls = _transpose4x4_from_source()
    assert len(calls) == 8
    rng = np.random.default_rng(1)
    for _ in range(20):
        block = rng.integers(0, 256, size=(4, 4))  # block[r][c]: row r (k), column c
        env = {f"w{r}": int(sum(int(block[r, c]) << (8 * c) for c in range(4))) for r in range(4)}
        for dest, x, y, sel in calls:
            env[dest] = _byte_perm(env[x], env[y], sel)
        for c in range(4):
            col = env[f"c{c}"]
            assert [(col >> (8 * r)) & 0xFF for r in range(4)] == [int(block[r, c]) for r in range(4)]


def test_int4_word_dot_product_as_the_kernels_compute_it() -> None:
    """gemv.cu's dot_slot on the int4 words: dp4a of (w & 0x0F0F0F0F) with a[k0..k0+3], dp4a.u32.s32 of
    (w & 0xF0F0F0F0) with a[k0+4..k0+7] (16 x the codes), that sum shifted right by 4, minus 8 * sum(a)."""
    rng = np.random.default_rng(2)
    codes = rng.integers(-8, 8, size=(4, 32)).astype(np.int8)  # [N=4][K=32]
    a = rng.integers(-127, 128, size=32)
    packed = pack_kmajor(codes, 4)  # [4][16]: 4 word rows x 4 columns x 4 bytes
    lo_sum, hi_sum = [0] * 4, [0] * 4
    for kw in range(4):
        for c in range(4):
            w = int.from_bytes(bytes(packed[kw, 4 * c:4 * c + 4]), "little")
            lo, hi = w & 0x0F0F0F0F, w & 0xF0F0F0F0
            for b in range(4):
                lo_sum[c] += ((lo >> (8 * b)) & 0xFF) * int(a[8 * kw + b])
                hi_sum[c] += ((hi >> (8 * b)) & 0xFF) * int(a[8 * kw + 4 + b])
    assert all(h % 16 == 0 for h in hi_sum)
    signed = [lo_sum[c] + (hi_sum[c] >> 4) - 8 * int(a.sum()) for c in range(4)]
    assert signed == (codes.astype(np.int64) @ a).tolist()


def test_attn_rows_splits_fill_whole_waves() -> None:
    """396 slots (132 SMs x 3 blocks): 32 rows x 8 KV heads (256 blocks) split 3 ways fill 768 of 792; 48 rows
    (384 blocks) need no split; a small batch takes the most splits."""
    assert plan.attn_rows_splits(256, 396) == 3
    assert plan.attn_rows_splits(512, 396) == 3
    assert plan.attn_rows_splits(384, 396) == 1
    assert plan.attn_rows_splits(16, 396) == plan.ATTN_ROWS_MAX_SPLITS


def test_attn_rows_instances_and_residency() -> None:
    """A head_dim runs in the smallest power-of-two instance holding it, with three page buffers up to 128 and
    two at 256; the H200's 228 KiB hold 4 blocks of qwen3-8b's (hd 128, 4 heads: 54,400 bytes), 3 of hd 256,
    and never more than 32; 255 and 168 registers a thread leave room for 4 and 6 in the 64 K registers."""
    from kestrel_cuda.ops_cupy import _attn_rows_smem

    assert [plan.attn_rows_instance(hd) for hd in (16, 32, 36, 64, 96, 128, 200, 256)] == [
        16, 32, 64, 64, 128, 128, 256, 256]
    with pytest.raises(StopIteration):
        plan.attn_rows_instance(plan.MAX_HEAD_DIM + 4)
    assert [plan.attn_rows_buffers(h) for h in plan.ATTN_ROWS_HEAD_DIMS] == [3, 3, 3, 3, 2]
    assert _attn_rows_smem(128, 4) == 54_400
    assert plan.attn_rows_per_sm(_attn_rows_smem(128, 4), 233_472) == 4
    assert plan.attn_rows_per_sm(_attn_rows_smem(256, 2), 233_472) == 3
    assert plan.attn_rows_per_sm(4096, 233_472) == plan.BLOCKS_PER_SM_MAX
    assert plan.attn_rows_per_sm(_attn_rows_smem(64, 4), 233_472) == 7
    assert plan.attn_rows_per_sm(_attn_rows_smem(64, 4), 233_472, regs=255) == 4  # 2 warps x 8,192
    assert plan.attn_rows_per_sm(_attn_rows_smem(64, 4), 233_472, regs=168) == 6


def test_plan_ksplit_fills_the_gpu_without_exceeding_chunks() -> None:
    lin = plan.Lin(None, None, 4096, 4096, 4096, 32, 8)
    assert plan.plan_ksplit(lin, 1056) == 16  # 32 tiles x 16 chunks
    big = plan.Lin(None, None, 4096, 151936, 151936, 32, 8)
    assert plan.plan_ksplit(big, 1056) == 1
    down = plan.Lin(None, None, 12288, 4096, 4096, 32, 8)
    assert plan.plan_ksplit(down, 1056) == 33


@pytest.mark.parametrize("bits", (8, 4))
def test_plan_ksplit_prefers_an_even_split_of_two_chunks_or_more(bits: int) -> None:
    """qwen3-8b on 132 SMs: the fused gate|up (192 tiles, 16 chunks) wants 6 splits, which leave some blocks a
    third chunk: 8 splits of 2 each instead; the unfused gate/up (96 tiles) wants 11, and no even split above
    it keeps 2 chunks a block: 11."""
    fused = plan.Lin(None, None, 4096, 24576, 24576, 32, bits)
    assert (fused.tiles, fused.chunks, plan.plan_ksplit(fused, 1056)) == (192, 16, 8)
    assert plan.plan_split(fused, 132) == 8
    unfused = plan.Lin(None, None, 4096, 12288, 12288, 32, bits)
    assert plan.plan_ksplit(unfused, 1056) == 11
    assert plan.plan_ksplit(fused, 192 * 3) == 4  # 3 wanted: 4 of 4 chunks


def test_factor_is_documented_in_the_comparison() -> None:
    model = synthetic_model(replace(CONFIGS["llama"], num_layers=1), "q8", seed=12)
    toks = _tokens(model.config, 10)
    ref = cpu_logits(model, toks, 6)
    text = str(compare(ref, ref, jitter_effect(model, toks, 6, ref)))
    assert f"{FACTOR:g} x jitter" in text and "rel L2 err 0" in text


class _ScratchRecordingOps(NumpyOps):
    """NumpyOps with CupyOps' split-K scratch reservation recorded (the numpy mirror needs none)."""

    def __init__(self) -> None:
        super().__init__()
        self.reserved: list[tuple[int, int, int]] = []

    def reserve(self, part: int, counters: int, attn_part: int, heads: int, merge_tiles: int = 0) -> None:
        self.reserved.append((part, counters, merge_tiles))


@pytest.mark.parametrize("target", (None, 64))
@pytest.mark.parametrize("quant", QUANTS)
def test_split_k_scratch_covers_every_planned_gemv(quant: str, target: int | None) -> None:
    """The split-K scratch is sized from shapes before any upload; it must hold what each projection's actual
    plan (its own bits, int4 included; the default target and an explicit one) writes: partial sums, and the
    tagged merge's slots for every tile of a split projection."""
    cfg = replace(CONFIGS["qwen3"], hidden_size=1024, intermediate_size=1536)  # several chunks per projection
    model = synthetic_model(cfg, quant, seed=13)
    ops = _ScratchRecordingOps()
    fwd = DeviceForward(ops=ops, target_blocks=target)
    device_logits(fwd, model, _tokens(model.config, 6), 4)
    part, counters, merge_tiles = ops.reserved[-1]
    lins = [lin for layer in fwd._st.layers for lin in [*layer.weights.qkv, layer.weights.o,
                                                         *layer.weights.gate_up, layer.weights.down]]
    need_part, need_counters, need_tiles = plan.gemv_scratch(lins)
    assert part >= need_part and counters >= need_counters and merge_tiles >= need_tiles
    assert need_tiles == max(lin.tiles for lin in lins if lin.ksplit > 1)


@pytest.mark.parametrize("k,n,bits,cluster", [(4096, 6144, 4, 8), (4096, 4096, 4, 0), (4096, 24576, 4, 0),
                                              (12288, 4096, 4, 0), (4096, 6144, 8, 8), (4096, 4096, 8, 0),
                                              (12288, 4096, 8, 0), (4096, 151936, 4, 0), (3840, 8192, 8, 5),
                                              (3840, 8192, 4, 5), (4096, 3840, 8, 0)])
def test_cluster_splits_only_within_one_wave(k: int, n: int, bits: int, cluster: int) -> None:
    """Qwen3-8B's projections on 132 SMs (256-row chunks at both widths): q|k|v runs as clusters of 8 splits
    (two chunks a block, 384 blocks: more than half the wave), o does not (256 blocks); gate|up, down and
    lm_head keep the planner's splits and the global merge. Gemma 3 12B's q|k|v (15 chunks, which 8 splits
    would share unevenly) runs 5 as clusters of three chunks a block (320 blocks); its o (240 blocks at 8
    splits) keeps the planner's 16."""
    lin = plan.Lin(None, None, k, n, pad_n(n), 32, bits)
    free = plan.plan_split(lin, 132)
    assert not lin.cluster
    split = plan.plan_split(lin, 132, clusters=True)
    assert lin.cluster == (cluster > 0)
    assert split == (cluster or free)
    if lin.cluster:
        blocks = lin.tiles * split
        assert blocks <= 4 * 132 and (lin.chunks <= split or (2 * blocks > 4 * 132 and lin.chunks % split == 0
                                                              and lin.chunks <= 3 * split))


@pytest.mark.parametrize("k,n,slots,free,cluster", [(2048, 1536, 8, 8, 4), (768, 2048, 8, 3, 3),
                                                      (4096, 28672, 2, 4, 0)])
def test_routed_experts_cluster_by_the_whole_grid(k: int, n: int, slots: int, free: int, cluster: int) -> None:
    """Routed experts on 132 SMs. Qwen3-30B-A3B's 8 slots: down (16 tiles x 3 splits x 8 = 384 blocks, a chunk
    each) runs a cluster a tile and slot; gate|up, whose planned 8 splits (768 blocks) are beyond one wave, runs
    4 splits of two chunks as clusters (384 blocks). Mixtral's gate|up (224 tiles, 2 slots) has no one-wave
    split of at most three chunks a block and keeps the counters' merge."""
    lin = plan.Lin(None, None, k, n, pad_n(n), 32, 8)
    assert plan.plan_routed(lin, slots, 132) == free and not lin.cluster
    split = plan.plan_routed(lin, slots, 132, clusters=True)
    assert lin.cluster == (cluster > 0) and split == (cluster or free)
    if lin.cluster:
        assert lin.tiles * split * slots <= 4 * 132 and lin.chunks % split == 0 and lin.chunks <= 3 * split


# -- pipelined greedy decode ---------------------------------------------


@pytest.mark.parametrize("quant", ("q8", "q4"))
def test_pipelined_greedy_yields_the_step_by_step_argmax(quant: str) -> None:
    """The device's own argmax fed back on the device gives the tokens the host's argmax gives; taking fewer
    than asked leaves the cache at the consumer's position (the extra step is rewound over)."""
    model = synthetic_model(CONFIGS["qwen3"], quant, seed=21)
    prompt = _tokens(model.config, 9)
    expect, rows = stepwise_greedy(DeviceForward(ops=NumpyOps()), model, prompt, 12)
    fwd = DeviceForward(ops=NumpyOps())
    first = int(fwd.forward(model, 1, prompt, 0, False)[0].argmax())
    assert first == expect[0]
    got = list(fwd.greedy(model, 1, first, len(prompt), 12))
    assert [first] + got == expect
    assert fwd.counters["graph_captures"] == 1 and fwd.counters["decode_tokens"] == 12

    fwd = DeviceForward(ops=NumpyOps())
    fwd.forward(model, 1, prompt, 0, False)
    stream = fwd.greedy(model, 1, first, len(prompt), 12)
    taken = [next(stream) for _ in range(4)]
    stream.close()
    assert taken == expect[1:5] and fwd._seqs[1].length == len(prompt) + 5  # one step ran ahead
    row = fwd.forward(model, 1, np.array(taken[-1:]), len(prompt) + 4, False)
    assert np.array_equal(row, rows[4])


def test_pipelined_greedy_declines_without_the_graph_or_with_a_bad_request() -> None:
    model = synthetic_model(CONFIGS["llama"], "q8", seed=22)
    prompt = _tokens(model.config, 6)
    fwd = DeviceForward(ops=NumpyOps(), config=CudaConfig(graph=False))
    fwd.forward(model, 1, prompt, 0, False)
    assert fwd.greedy(model, 1, 5, len(prompt), 4) is None and "graph" in fwd.last_decline
    fwd = DeviceForward(ops=NumpyOps())
    fwd.forward(model, 1, prompt, 0, False)
    assert fwd.greedy(model, 1, model.config.vocab_size, len(prompt), 4) is None
    assert fwd.greedy(model, 1, 5, len(prompt) + 3, 4) is None and "behind" in fwd.last_decline


@pytest.mark.parametrize("greedy", (-1, 3))
def test_engine_takes_the_pipelined_greedy_decode(greedy: int, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Greedy generation goes through kestrel_decode_greedy after the prefill and gives the step-by-step
    tokens; an error in the middle hands over to the step path at the position the pipeline reached, with
    the same tokens; sampling never offers it."""
    import kestrel_core

    model = synthetic_model(SMALL_CONFIGS["qwen3"], "q8", seed=9)
    prompt = _tokens(model.config, 10).tolist()
    make = "lambda: DeviceForward(ops=__import__('kestrel_cuda.ops_numpy').ops_numpy.NumpyOps())"
    runs = {}
    for mode in (None, greedy):
        path = tmp_path / str(mode) / "fwdcuda.py"  # the backend is named after its file
        path.parent.mkdir()
        path.write_text(DECLINING_BACKEND.format(decline=set(), make=make, greedy=mode))
        monkeypatch.setenv("KESTREL_BACKEND_PATH", str(path))
        with kestrel_core.load(model, backend="fwdcuda") as engine:
            runs[mode] = list(engine.generate(prompt, max_tokens=12, stop_at_eos=False))
            offload = engine.stats["offload"]
            calls = list(engine.backend.plugin.CALLS)
    assert runs[greedy] == runs[None]
    assert offload["kestrel_decode_greedy"]["accepted"] == 1
    if greedy < 0:
        assert calls == [0]  # the prefill; every decode step came from the pipeline
    else:  # the prefill, 3 tokens from the pipeline, then one step each from the position it reached
        assert calls == [0] + list(range(len(prompt) + greedy, len(prompt) + 11))
    with kestrel_core.load(model, backend="fwdcuda") as engine:  # sampling: never offered
        list(engine.generate(prompt, max_tokens=4, temperature=0.8, stop_at_eos=False))
        assert "kestrel_decode_greedy" not in engine.stats["offload"]


def test_fused_rope_equals_the_qkv_rope_kernel_and_drops_its_launches() -> None:
    """head_dim 128 (one head per GEMV tile): the q|k|v projection's epilogue does qkv_rope's work, with the
    same logits as the separate kernel and one launch fewer per layer and step; other head sizes keep it."""
    model = synthetic_model(CONFIGS["qwen3"], "q8", seed=24)
    toks = _tokens(model.config, 10)
    runs, launches = {}, {}
    for mode in ("1", "0"):
        ops = NumpyOps()
        fwd = DeviceForward(ops=ops, fuse_rope=mode == "1")
        runs[mode] = device_logits(fwd, model, toks, 6)
        before = ops.launches
        fwd.forward(model, 1, toks[-1:], len(toks), False)
        launches[mode] = ops.launches - before
    assert np.array_equal(runs["1"], runs["0"])
    assert launches["0"] - launches["1"] == model.config.num_layers
    other = synthetic_model(CONFIGS["qwen2"], "q8", seed=24)  # head_dim 64: the kernel of its own
    ops = NumpyOps()
    calls = []
    ops.qkv_rope = lambda *a, **k: calls.append(1) or NumpyOps.qkv_rope(ops, *a, **k)  # type: ignore[method-assign]
    DeviceForward(ops=ops, config=CudaConfig(graph=False)).forward(other, 1, toks[:3], 0, False)
    assert len(calls) == other.config.num_layers


def test_narrow_projections_run_one_wave_of_k_splits() -> None:
    """qwen3-8b's down (32 column tiles) on 132 SMs: one wave of 16 splits instead of the two-wave target's 33;
    wider projections keep the target; an explicit target wins."""
    sm, resident = 132, plan.CHUNK_BLOCKS_PER_SM * 132
    for bits in (8, 4):
        down = plan.Lin(None, None, 12288, 4096, 4096, 32, bits)
        assert plan.plan_split(down, sm) == 16 and down.tiles * 16 <= resident
        assert plan.plan_split(down, sm, target_blocks=8 * sm) == min(down.chunks, 33)
        gate_up = plan.Lin(None, None, 4096, 24576, 24576, 32, bits)
        assert plan.plan_split(gate_up, sm) == plan.plan_ksplit(gate_up, 8 * sm)
    qkv = plan.Lin(None, None, 4096, 6144, 6144, 32, 8)  # one wave would be 11 splits: the target's 16
    assert plan.plan_split(qkv, sm) == 16


def test_pipelined_greedy_grows_the_kv_cache_as_it_goes() -> None:
    """The pipeline reserves one position ahead, not its whole count: crossing the capacity it drains, grows
    the cache (a second capture) and goes on with the same tokens as step by step."""
    cfg = replace(CONFIGS["llama"], num_layers=1)
    model = synthetic_model(cfg, "q8", seed=26)
    prompt = _tokens(cfg, CAP_CHUNK - 3)
    expect, _ = stepwise_greedy(DeviceForward(ops=NumpyOps()), model, prompt, 8)
    fwd = DeviceForward(ops=NumpyOps())
    first = int(fwd.forward(model, 1, prompt, 0, False)[0].argmax())
    tokens = fwd.greedy(model, 1, first, len(prompt), 4000)
    assert fwd._seqs[1].capacity == CAP_CHUNK  # not 4000 positions' worth up front
    got = [next(tokens) for _ in range(8)]
    assert [first] + got == expect
    assert fwd._seqs[1].capacity == 2 * CAP_CHUNK and fwd.counters["graph_captures"] == 2


@pytest.mark.parametrize("mode,blocks,tagged", [("auto", 1056, True), ("auto", 528, False), ("auto", 529, True),
                                                ("counter", 1056, False), ("tagged", 64, True)])
def test_split_merge_is_tagged_only_beyond_one_wave(mode: str, blocks: int, tagged: bool) -> None:
    """By default ("auto") split GEMVs of more than one wave (4 blocks per SM, 132 SMs) merge tagged, one wave
    through the counter; "tagged" / "counter" (CupyOps(merge=...)) force one."""
    assert plan.tagged_merge(mode, blocks, 132) is tagged


def test_k_splits_never_exceed_the_merge_slots() -> None:
    """A tile's tagged merge slots hold MERGE_SPLITS splits: the planner stays within them at any K."""
    for k in (4096, 32768, 65536):
        lin = plan.Lin(None, None, k, 128, 128, 32, 8)  # one tile, K / 256 chunks
        assert plan.plan_split(lin, 132) <= plan.MERGE_SPLITS
        assert plan.plan_ksplit(lin, 10**6) == min(lin.chunks, plan.MERGE_SPLITS)


@pytest.mark.parametrize("n_prefill", [8, 20])
def test_a_sliding_window_on_the_device_matches_the_cpu(n_prefill: int) -> None:
    """Mistral's window of 12: a prefill within it or past it (the prefill attention's first tile starts at the
    window), then decode steps past it: the CPU decoder's logits, which apply the window, within the band;
    the same without the window leaves it."""
    cfg = replace(CONFIGS["llama"], arch="mistral", sliding_window=12)
    model = synthetic_model(cfg, "q8", seed=3)
    toks = _tokens(model.config, 40)
    ref = cpu_logits(model, toks, n_prefill)
    fwd = DeviceForward(ops=NumpyOps())
    result = compare(device_logits(fwd, model, toks, n_prefill), ref, jitter_effect(model, toks, n_prefill, ref))
    assert result.ok, str(result)

    class NoWindow(NumpyOps):
        def attention(self, *args, **kw):  # type: ignore[no-untyped-def]
            super().attention(*args, **{**kw, "window": 0})

    wrong = compare(device_logits(DeviceForward(ops=NoWindow()), model, toks, n_prefill), ref,
                    jitter_effect(model, toks, n_prefill, ref))
    assert not wrong.ok, str(wrong)


class _NoPostNorm(NumpyOps):
    def norm_add(self, x, w, eps, y, ssq_out=None):  # type: ignore[no-untyped-def]
        super().norm_add(x * 0, w, eps, y, ssq_out)  # the projection's output dropped with its norm


class _NoFoldedPostNorm(NumpyOps):
    def gemv(self, lin, x, pro, pw, eps, xoff, y, epi, bias, post=None, **kw):  # type: ignore[no-untyped-def]
        if post is not None and pro == plan.PRO_POSTNORM:  # the decode steps' post-norms: the output dropped
            post = replace(post, out=post.out * 0)
        super().gemv(lin, x, pro, pw, eps, xoff, y, epi, bias, post=post, **kw)


class _NoEmbedScale(NumpyOps):
    def embed(self, codes, scales, group, ids, h, ssq_out=None, mul=1.0):  # type: ignore[no-untyped-def]
        super().embed(codes, scales, group, ids, h, ssq_out)


class _SiluForGelu(NumpyOps):
    def gemv(self, lin, x, pro, pw, eps, xoff, y, epi, bias, **kw):  # type: ignore[no-untyped-def]
        super().gemv(lin, x, plan.PRO_SILU_MUL if pro == plan.PRO_GELU_MUL else pro, pw, eps, xoff, y, epi, bias,
                     **kw)


@pytest.mark.parametrize("wrong", [_NoPostNorm, _NoFoldedPostNorm, _NoEmbedScale, _SiluForGelu],
                         ids=lambda c: c.__name__)
def test_gemma3_done_wrong_on_the_device_leaves_the_band(wrong: type) -> None:
    _assert_leaves_the_band(synthetic_model(CONFIGS["gemma3"], "q8", seed=3), wrong())


def test_gemma3_decode_steps_fold_their_post_norms_into_the_gemvs() -> None:
    """At M = 1 no post-norm runs as a kernel of its own: the projection before it leaves its sums and the
    normed GEMV after it applies it (plan.PostNorm); prefill chunks keep norm_add. Within the band."""

    class Counting(NumpyOps):
        def __init__(self) -> None:
            super().__init__()
            self.norm_adds: list[int] = []  # the rows of each norm_add

        def norm_add(self, x, w, eps, y, ssq_out=None):  # type: ignore[no-untyped-def]
            self.norm_adds.append(x.shape[0])
            super().norm_add(x, w, eps, y, ssq_out)

    model = synthetic_model(CONFIGS["gemma3"], "q8", seed=5)
    toks = _tokens(model.config, 30)
    ref = cpu_logits(model, toks, 12)
    ops = Counting()
    result = compare(device_logits(DeviceForward(ops=ops), model, toks, 12), ref,
                     jitter_effect(model, toks, 12, ref))
    assert result.ok, str(result)
    assert ops.norm_adds and 1 not in ops.norm_adds  # the prompt's, and none of a decode step


def test_a_head_dim_of_256_matches_the_cpu() -> None:
    """Gemma 3 1B-12B's head_dim: one forward and its decode steps, the fused RoPE epilogue off (a head is
    two GEMV column tiles)."""
    model = synthetic_model(replace(CONFIGS["gemma3"], head_dim=256), "q8", seed=4)
    assert unsupported_reason(model) is None
    _assert_in_the_band(model, 30, 20)


def test_gemma3_from_its_checkpoint_matches_the_cpu() -> None:
    """tiny-gemma3 as transformers wrote it (sliding window 8, five sliding layers and a full one with their own
    RoPE, query_pre_attn_scalar, tied embedding): a prefill past the window and decode steps, the CPU
    decoder's logits within the band."""
    from kestrel_core.model.loader import load_model

    model = load_model(str(FIXTURES / "tiny-gemma3"), "q8", cache="off").model
    assert unsupported_reason(model) is None
    _assert_in_the_band(model, 24, 13)


@pytest.mark.parametrize("fixture", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-qwen2-moe"])
def test_a_mixture_of_experts_from_its_checkpoint_matches_the_cpu(fixture: str) -> None:
    """The routed experts (and Qwen2-MoE's gated shared one), routed on the device: a prefill (each chosen
    expert on its rows) and captured decode steps (the chosen experts' GEMVs) within the band; the pipelined
    greedy decode gives the step-by-step tokens."""
    from kestrel_core.model.loader import load_model

    model = load_model(str(FIXTURES / fixture), "q8", cache="off").model
    assert unsupported_reason(model) is None
    fwd = _assert_in_the_band(model, 20, 12)
    assert fwd.counters["graph_captures"] == 1 and fwd.counters["graph_replays"] == 8
    prompt = _tokens(model.config, 7)
    expect, _ = stepwise_greedy(DeviceForward(ops=NumpyOps()), model, prompt, 6)
    fwd = DeviceForward(ops=NumpyOps())
    fwd.forward(model, 1, prompt, 0, False)
    assert [expect[0]] + list(fwd.greedy(model, 1, expect[0], len(prompt), 6)) == expect


def test_expert_groups_sort_each_rows_experts_into_blocks() -> None:
    """Every (row, slot) once, sorted by expert then row; blocks of one expert and at most ``rows``."""
    rng = np.random.default_rng(2)
    top = np.sort(np.stack([rng.choice(9, 3, replace=False) for _ in range(30)]), axis=1)
    source, position, groups = plan.expert_groups(top, rows=4)
    flat = top.reshape(-1)
    assert sorted(position.tolist()) == list(range(90))
    assert np.array_equal(source[position], np.repeat(np.arange(30), 3))
    experts = flat[np.argsort(position)]
    assert np.all(np.diff(experts) >= 0)
    assert groups[:, 2].max() <= 4 and groups[:, 2].sum() == 90
    for e, first, rows in groups:
        assert np.all(experts[first:first + rows] == e)
        assert np.all(np.diff(source[first:first + rows]) > 0)


@pytest.mark.parametrize("m,k,e", [(1, 8, 128), (32, 8, 128), (100, 4, 16), (7, 2, 8)])
def test_group_capacity_holds_every_grouping_and_the_mirror_pads_to_it(m: int, k: int, e: int) -> None:
    """The grouped GEMM's grid, group_capacity blocks, takes every grouping of m rows' k of e experts, the
    most groups included (every expert chosen, its count just past a block); the mirror of moe_group fills
    the blocks past the rows' own with (0, 0, 0), the GEMM's sign of a block that does nothing."""
    rng = np.random.default_rng(m + e)
    top = np.sort(np.stack([rng.choice(e, k, replace=False) for _ in range(m)]), axis=1)
    rows = plan.grouped_rows(m * k, e)
    cap = plan.group_capacity(m * k, e, rows)
    source, position, groups = plan.expert_groups(top, rows)
    assert len(groups) <= cap
    for r in (plan.GROUPED_ROWS, plan.GROUPED_ROWS_FEW):
        worst = (e * (r + 1), e)  # pairs and experts for the most groups: e x 2
        assert plan.group_capacity(*worst, r) >= 2 * e
    ops = NumpyOps()
    got = (np.full(m * k, -1, np.int32), np.full(m * k, -1, np.int32), np.full((cap, 3), -1, np.int32))
    ops.moe_group(top, e, *got, rows)
    assert np.array_equal(got[0], source) and np.array_equal(got[1], position)
    assert np.array_equal(got[2][:len(groups)], groups) and not got[2][len(groups):].any()


def test_grouped_blocks_are_small_for_a_decode_batch_and_large_for_a_prefill() -> None:
    """Qwen3-30B-A3B (8 of 128 experts): up to 256 decode rows (at most 16 pairs an expert on average) take
    blocks of 16 positions; a 512-token prefill chunk's (32 an expert) blocks of 64."""
    assert plan.grouped_rows(32 * 8, 128) == plan.grouped_rows(256 * 8, 128) == 16
    assert plan.grouped_rows(257 * 8, 128) == plan.grouped_rows(512 * 8, 128) == 64


def test_device_routing_chooses_the_cpu_decoders_experts() -> None:
    """moe_route's mirror against kestrel_core's route: the same experts (in increasing order) and weights,
    with and without renormalising over the k, the shared gate's sigmoid last."""
    from kestrel_core.model.decoder import rmsnorm, route, shared_expert_scale

    rng = np.random.default_rng(5)
    m, d, e, k = 6, 64, 16, 4
    h = rng.standard_normal((m, d)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    router = rng.standard_normal((e, d)).astype(np.float32)
    gate = rng.standard_normal((1, d)).astype(np.float32)
    for norm_topk in (True, False):
        sel, wts, xn = np.zeros((m, k), np.int32), np.zeros((m, k + 1), np.float32), np.zeros((m, d), np.float32)
        NumpyOps().moe_route(h, norm, 1e-6, np.concatenate([router, gate]), e, k, norm_topk, xn, None, sel, wts)
        x = rmsnorm(h, norm, np.float32(1e-6))
        top, weights = route(x, router, k, norm_topk)
        order = np.argsort(top, axis=1)
        assert np.array_equal(sel, np.take_along_axis(top, order, axis=1))
        np.testing.assert_allclose(wts[:, :k], np.take_along_axis(weights, order, axis=1), rtol=1e-5)
        np.testing.assert_allclose(wts[:, k:], shared_expert_scale(x, gate), rtol=1e-5)


def test_a_mixture_of_experts_done_wrong_on_the_device_leaves_the_band() -> None:
    """Each row's experts summed without their router weights: far outside the band."""
    from kestrel_core.model.loader import load_model

    class Unweighted(NumpyOps):
        def moe_combine(self, y, k, wts, h, *args):  # type: ignore[no-untyped-def]
            super().moe_combine(y, k, np.ones_like(wts), h, *args)

    _assert_leaves_the_band(load_model(str(FIXTURES / "tiny-qwen3-moe"), "q8", cache="off").model, Unweighted(),
                            n_tokens=20, n_prefill=12)


def test_a_mixture_of_experts_decoded_with_the_wrong_experts_leaves_the_band() -> None:
    """The decode steps' GEMVs or the prefill's grouped GEMMs taking the expert after each chosen one: far
    outside the band."""
    from kestrel_core.model.loader import load_model

    class NextExpert(NumpyOps):
        def gemv(self, lin, x, *args, experts=None, **kw):  # type: ignore[no-untyped-def]
            if experts is not None:
                table, sel, slots = experts
                experts = (table, (sel + 1) % len(table), slots)
            super().gemv(lin, x, *args, experts=experts, **kw)

    class NextGroup(NumpyOps):
        def experts_gemm(self, lin, x, pro, xoff, y, table, groups, blocks, rows):  # type: ignore[no-untyped-def]
            shifted = groups.copy()
            shifted[:, 0] = (shifted[:, 0] + 1) % len(table)
            super().experts_gemm(lin, x, pro, xoff, y, table, shifted, blocks, rows)

    model = load_model(str(FIXTURES / "tiny-qwen3-moe"), "q8", cache="off").model
    for wrong in (NextExpert(), NextGroup()):
        _assert_leaves_the_band(model, wrong, n_tokens=20, n_prefill=12)


@pytest.mark.parametrize(("fixture", "why"), [("tiny-gemma2", "architecture 'gemma2'")])
def test_device_forward_names_what_it_cannot_run(fixture: str, why: str) -> None:
    """Gemma 2 (soft caps) goes through the GEMM hooks; the reason names the architecture."""
    from kestrel_core.model.loader import load_model

    model = load_model(str(FIXTURES / fixture), "q8", cache="off").model
    assert unsupported_reason(model) == why


def test_layer_groups_of_an_expert_layer_cover_every_expert() -> None:
    """What the CUDA preload uploads: attention groups, then each expert's gate|up and down under its wkeys."""
    from kestrel_core.model.loader import load_model
    from kestrel_core.model.weights import engine_weights
    from kestrel_cuda.layout import layer_groups

    model = load_model(str(FIXTURES / "tiny-qwen3-moe"), "q8", cache="off").model
    keys = [g.fused_key or g.keys[0] for i, lw in enumerate(model.layers) for g in layer_groups(i, lw)]
    assert keys == [k for k, _ in engine_weights(model)][:-1]
    assert len(layer_groups(0, model.layers[0])) == 2 + 2 * model.config.num_experts
