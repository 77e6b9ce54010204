"""The device forward's host side on the CPU: orchestration over the numpy mirrors of its kernels.

``DeviceForward(ops=NumpyOps())`` runs every step of the GPU path (weight packing into the K-major device
layout, fused and per-projection projections, sequences, chunks, rewinds, graph record/replay, the residency
window through a real ``WeightCache``) with numpy standing in for the kernels, checked against the CPU
decoder. The kernels themselves are checked on the GPU (the test_forward modules) against the same references.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kestrel_core.model.decoder import PREFILL_CHUNK
from kestrel_core.model.presets import synthetic_model
from kestrel_cuda import plan
from kestrel_cuda.allocator import NumpyAllocator
from kestrel_cuda.config import CudaConfig
from kestrel_cuda.forward import CAP_CHUNK, DeviceForward, unsupported_reason
from kestrel_cuda.layout import Geometry, pack_kmajor
from kestrel_cuda.ops_numpy import NumpyOps
from kestrel_cuda.residency import WeightCache

from .forward_check import (
    DECLINING_BACKEND,
    FACTOR,
    SMALL_CONFIGS,
    assert_leaves_the_band,
    cache_source,
    compare,
    cpu_logits,
    device_logits,
    greedy_agrees,
    jitter_effect,
    random_tokens,
    stepwise_greedy,
)

CONFIGS = SMALL_CONFIGS
QUANTS = ("q8", "q4", "q8-g256", "q4-g256")


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_mirror_matches_cpu_decoder(arch: str, quant: str) -> None:
    model = synthetic_model(CONFIGS[arch], quant, seed=3)
    toks = random_tokens(model.config, 40)
    ref = cpu_logits(model, toks, 24)
    fwd = DeviceForward(ops=NumpyOps())
    got = device_logits(fwd, model, toks, 24)
    result = compare(got, ref, jitter_effect(model, toks, 24, ref))
    assert result.ok, str(result)
    assert result.argmax_same >= 0.9 * len(toks), str(result)
    assert fwd.counters["graph_captures"] == 1 and fwd.counters["graph_replays"] == 16


def test_comparison_catches_a_wrong_forward() -> None:
    """The tolerance is tight enough to fail: a 10% error in the attention scale is far outside it."""

    class WrongScale(NumpyOps):
        def attention(self, q, kc, vc, heads, hd, scale, meta, out, **kw):  # type: ignore[no-untyped-def]
            return super().attention(q, kc, vc, heads, hd, scale * 1.1, meta, out, **kw)

    assert_leaves_the_band(synthetic_model(CONFIGS["qwen3"], "q8", seed=3), WrongScale())


def test_graph_replay_equals_eager_bitwise() -> None:
    model = synthetic_model(CONFIGS["qwen2"], "q4", seed=4)
    toks = random_tokens(model.config, 30)
    a = device_logits(DeviceForward(ops=NumpyOps(), config=CudaConfig(graph=True)), model, toks, 10)
    b = device_logits(DeviceForward(ops=NumpyOps(), config=CudaConfig(graph=False)), model, toks, 10)
    assert np.array_equal(a, b)


def test_graph_is_captured_once_per_sequence_and_survives_kv_growth() -> None:
    cfg = replace(CONFIGS["llama"], num_layers=1)
    model = synthetic_model(cfg, "q8", seed=5)
    fwd = DeviceForward(ops=NumpyOps())
    toks = random_tokens(cfg, CAP_CHUNK + 3)
    ref = cpu_logits(model, toks, CAP_CHUNK - 2)  # decode steps cross the first capacity chunk
    got = device_logits(fwd, model, toks, CAP_CHUNK - 2)
    assert compare(got, ref, jitter_effect(model, toks, CAP_CHUNK - 2, ref)).ok
    assert fwd._seqs[1].capacity == 2 * CAP_CHUNK
    assert fwd.counters["graph_captures"] == 2  # re-captured after the KV cache moved


def test_long_prefill_runs_in_chunks_with_all_logits() -> None:
    cfg = replace(CONFIGS["qwen3"], num_layers=1)
    model = synthetic_model(cfg, "q8", seed=6)
    toks = random_tokens(cfg, PREFILL_CHUNK + 37)
    ref = cpu_logits(model, toks, len(toks))
    fwd = DeviceForward(ops=NumpyOps())
    got = fwd.forward(model, 7, toks, 0, True)
    assert got.shape == (len(toks), cfg.vocab_size)
    assert compare(got, ref, jitter_effect(model, toks, len(toks), ref)).ok
    last = fwd.forward(model, 8, toks, 0, False)
    assert last.shape == (1, cfg.vocab_size) and np.array_equal(last[0], got[-1])


def test_sequence_semantics_rewind_reset_decline_release() -> None:
    model = synthetic_model(CONFIGS["qwen2"], "q8", seed=7)
    toks = random_tokens(model.config, 12)
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
    a, b = random_tokens(model.config, 20, seed=1), random_tokens(model.config, 14, seed=2)
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
    toks = random_tokens(model.config, 20)
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


def test_a_model_the_cache_cannot_hold_whole_is_declined_without_the_window() -> None:
    """Without the residency window every weight is fetched once, for the whole run: where the cache holds half
    the model, fetching the later layers evicts the first ones (their buffers then hold other weights), so the
    device declines the model, says why, and does not fetch it again at the next step; where it fits, it runs."""
    model = synthetic_model(CONFIGS["qwen3"], "q8", seed=9)
    toks = random_tokens(model.config, 12)
    whole = _fetched_bytes(model)
    for budget, fits in ((whole // 2, False), (2 * whole, True)):
        cache = WeightCache(NumpyAllocator(1 << 30), budget=budget, keep=0)
        uploads: list[int] = []
        fwd = DeviceForward(cache_source(cache, uploads), pin=cache.pin, unpin=cache.unpin, ops=NumpyOps())
        first = fwd.forward(model, 1, toks, 0, False)
        fetched = len(uploads)
        again = fwd.forward(model, 1, toks, 0, False)
        if fits:
            assert np.array_equal(first, again) and len(uploads) == fetched
        else:
            assert first is None and again is None and "KESTREL_CUDA_WINDOW" in fwd.last_decline
            assert len(uploads) == fetched and cache.stats()["evictions"] > 0


def _fetched_bytes(model) -> int:  # type: ignore[no-untyped-def]
    """The bytes of every weight the device fetches for ``model`` (a cache that holds them all, once)."""
    cache = WeightCache(NumpyAllocator(1 << 30), budget=1 << 30, keep=0)
    DeviceForward(cache_source(cache, []), ops=NumpyOps()).forward(model, 1, np.arange(2), 0, False)
    return int(cache.stats()["bytes_resident"])


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
    toks = random_tokens(model.config, 6)
    ref = device_logits(DeviceForward(ops=NumpyOps()), model, toks, 4)
    assert np.array_equal(device_logits(fwd, model, toks, 4), ref)
    pinned = [e for e in cache.entries() if e.pins]
    assert len(pinned) == 2 * 4 + 1  # fused qkv, o, fused gate|up, down per layer, and lm_head
    fwd.close()
    assert not any(e.pins for e in cache.entries())


def test_greedy_check_accepts_the_cpu_and_rejects_other_tokens() -> None:
    model = synthetic_model(CONFIGS["qwen3"], "q8", seed=11)
    prompt = random_tokens(model.config, 8)
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
    prompt = random_tokens(model.config, 10).tolist()
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


def test_factor_is_documented_in_the_comparison() -> None:
    model = synthetic_model(replace(CONFIGS["llama"], num_layers=1), "q8", seed=12)
    toks = random_tokens(model.config, 10)
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
    device_logits(fwd, model, random_tokens(model.config, 6), 4)
    part, counters, merge_tiles = ops.reserved[-1]
    lins = [lin for layer in fwd._st.layers for lin in [*layer.weights.qkv, layer.weights.o,
                                                         *layer.weights.gate_up, layer.weights.down]]
    need_part, need_counters, need_tiles = plan.gemv_scratch(lins)
    assert part >= need_part and counters >= need_counters and merge_tiles >= need_tiles
    assert need_tiles == max(lin.tiles for lin in lins if lin.ksplit > 1)


@pytest.mark.parametrize("quant", ("q8", "q4"))
def test_pipelined_greedy_yields_the_step_by_step_argmax(quant: str) -> None:
    """The device's own argmax fed back on the device gives the tokens the host's argmax gives; taking fewer
    than asked leaves the cache at the consumer's position (the extra step is rewound over)."""
    model = synthetic_model(CONFIGS["qwen3"], quant, seed=21)
    prompt = random_tokens(model.config, 9)
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
    prompt = random_tokens(model.config, 6)
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
    prompt = random_tokens(model.config, 10).tolist()
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
    toks = random_tokens(model.config, 10)
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


@pytest.mark.parametrize("window", [None, 6])
def test_decode_attention_folds_into_the_qkv_gemv_and_drops_its_launches(window: int | None) -> None:
    """head_dim 128 with the q|k|v GEMV's K splits as clusters (hidden 1024): decode attention runs in that
    GEMV (plan.AttendFold; with a sliding window too), with the same logits as its own kernel and one launch
    fewer per layer and step, and the CPU decoder's logits; without clusters it keeps its launch."""
    cfg = replace(CONFIGS["qwen3"], hidden_size=1024, sliding_window=window)
    model = synthetic_model(cfg, "q8", seed=31)
    toks = random_tokens(cfg, 12)
    runs, launches = {}, {}
    for fold in (True, False):
        ops = NumpyOps(cluster=True)
        fwd = DeviceForward(ops=ops, fuse_attention=fold)
        runs[fold] = device_logits(fwd, model, toks, 6)
        assert fwd._state(model).layers and fwd.projections.layer(model, 0).qkv[0].cluster
        before = ops.launches
        fwd.forward(model, 1, toks[-1:], len(toks), False)
        launches[fold] = ops.launches - before
    assert np.array_equal(runs[True], runs[False])
    assert launches[False] - launches[True] == cfg.num_layers
    ref = cpu_logits(model, toks, 6)
    assert compare(runs[True], ref, jitter_effect(model, toks, 6, ref)).ok
    ops = NumpyOps()  # no clusters: attn_decode's launch
    calls = []
    ops.attention = lambda *a, **k: calls.append(1) or NumpyOps.attention(ops, *a, **k)  # type: ignore[method-assign]
    DeviceForward(ops=ops, config=CudaConfig(graph=False)).forward(model, 1, toks[:3], 0, False)
    DeviceForward(ops=ops, config=CudaConfig(graph=False)).forward(model, 1, toks[:1], 0, False)
    assert len(calls) == 2 * cfg.num_layers


def test_pipelined_greedy_grows_the_kv_cache_as_it_goes() -> None:
    """The pipeline reserves one position ahead, not its whole count: crossing the capacity it drains, grows
    the cache (a second capture) and goes on with the same tokens as step by step."""
    cfg = replace(CONFIGS["llama"], num_layers=1)
    model = synthetic_model(cfg, "q8", seed=26)
    prompt = random_tokens(cfg, CAP_CHUNK - 3)
    expect, _ = stepwise_greedy(DeviceForward(ops=NumpyOps()), model, prompt, 8)
    fwd = DeviceForward(ops=NumpyOps())
    first = int(fwd.forward(model, 1, prompt, 0, False)[0].argmax())
    tokens = fwd.greedy(model, 1, first, len(prompt), 4000)
    assert fwd._seqs[1].capacity == CAP_CHUNK  # not 4000 positions' worth up front
    got = [next(tokens) for _ in range(8)]
    assert [first] + got == expect
    assert fwd._seqs[1].capacity == 2 * CAP_CHUNK and fwd.counters["graph_captures"] == 2


def test_declines_linear_attention_and_gated_attention_whatever_the_architecture() -> None:
    """Qwen3.5's Gated DeltaNet layers and gated attention have no kernels: the device forward declines them by
    name (even under an architecture it knows), and the GEMM hooks run them."""
    from kestrel_core.model.config import ModelConfig

    hybrid = ModelConfig(arch="qwen3_5", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=2, num_kv_heads=1, head_dim=32, max_position=32, qk_norm=True,
                         layer_types=("linear", "full"), attn_output_gate=True, linear_key_heads=1,
                         linear_key_dim=16, linear_value_heads=2, linear_value_dim=32, linear_conv_kernel=4)
    model = synthetic_model(hybrid, "q8", seed=1)
    assert unsupported_reason(model) == "architecture 'qwen3_5'"
    model.config = replace(hybrid, arch="qwen3")
    reason = "recurrent layers (linear attention, short convolutions, Mamba-2) or gated attention"
    assert unsupported_reason(model) == reason
