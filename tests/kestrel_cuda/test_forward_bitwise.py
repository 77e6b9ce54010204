"""Device paths that must give the very same logits on the GPU: graph replay and eager launches (with and without
PDL), a released sequence's graph replayed for the next one, clusters' split sums and the global merges, the fused
rope epilogue and the qkv_rope kernel, attention folded into the q|k|v GEMV (also against the CPU), an on_launch
hook, and weights through the residency window.


Skipped where CuPy or a CUDA device is missing (CI); run on the H200 machine.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("cupy")

from kestrel_core.model.presets import synthetic_model  # noqa: E402
from kestrel_cuda.config import CudaConfig  # noqa: E402
from kestrel_cuda.forward import DeviceForward  # noqa: E402

from .forward_check import SMALL_CONFIGS, _check, cuda_device_count, device_logits, random_tokens  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]


@pytest.mark.parametrize("pdl", ("0", "1"))
def test_graph_replay_equals_eager_and_runs_are_deterministic(pdl, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """Bitwise: graph replay (with PDL: kernels overlapping their predecessors) == eager launches."""
    model = synthetic_model(SMALL_CONFIGS["qwen3"], "q4", seed=5)
    toks = random_tokens(model.config, 30)

    def run(graph: bool) -> np.ndarray:
        fwd = DeviceForward(config=CudaConfig(pdl=pdl == "1", graph=graph), stream=stream, gemm=gemm)
        return device_logits(fwd, model, toks, 10)

    graph, eager, again = run(True), run(False), run(True)
    assert np.array_equal(graph, eager)
    assert np.array_equal(graph, again)


@pytest.mark.parametrize("pdl", ("0", "1"))
def test_next_sequence_replays_the_released_ones_graph(pdl, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """A longer first prompt leaves stale keys past the second's positions: bitwise the same as a fresh
    forward, with one capture for both."""
    model = synthetic_model(SMALL_CONFIGS["qwen3"], "q4", seed=9)
    a, b = random_tokens(model.config, 40, seed=1), random_tokens(model.config, 24, seed=2)
    config = CudaConfig(pdl=pdl == "1")
    fwd = DeviceForward(config=config, stream=stream, gemm=gemm)
    device_logits(fwd, model, a, 30, seq_id=1)
    fwd.release(1)
    got = device_logits(fwd, model, b, 9, seq_id=2)
    assert fwd.counters["graph_captures"] == 1 and fwd.counters["sequences_reused"] == 1
    assert np.array_equal(got, device_logits(DeviceForward(config=config, stream=stream, gemm=gemm), model, b, 9,
                                             seq_id=2))


@pytest.mark.parametrize("quant", ("q4", "q8-g256"))
def test_cluster_split_sums_equal_the_global_merge_bitwise(quant, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """Clusters (chosen where they fit, at most 8 splits) add each tile's K splits in shared memory in the same
    order as the global merges (counter and tagged): the same bits as without clusters when the plan is the
    same."""
    from kestrel_cuda.ops_cupy import CupyOps

    model = synthetic_model(replace(SMALL_CONFIGS["qwen3"], hidden_size=1024, intermediate_size=2048), quant,
                            seed=11)
    toks = random_tokens(model.config, 14)
    runs, plans = {}, []
    for mode in ("0", "1"):  # target 64 blocks: several splits per tile at this size
        fwd = DeviceForward(config=CudaConfig(cluster=mode == "1"), stream=stream, gemm=gemm, target_blocks=64,
                            fuse_attention=False)  # the split sums alone: attention in its own kernel
        runs[mode] = device_logits(fwd, model, toks, 6)
        lins = [lin for layer in fwd._st.layers for lin in (*layer.weights.qkv, layer.weights.o)]
        assert max(lin.ksplit for lin in lins) > 1
        assert any(lin.cluster for lin in lins) == (mode == "1")
        plans = plans if mode == "1" else [lin.ksplit for lin in lins]
    assert [lin.ksplit for lin in lins] == plans  # small splits: clusters keep the plan
    assert np.array_equal(runs["1"], runs["0"])
    tagged = CupyOps(stream, gemm, cluster=False, merge="tagged")  # the decode graph's splits merged tagged
    assert np.array_equal(device_logits(DeviceForward(ops=tagged, target_blocks=64), model, toks, 6), runs["0"])
    _check(model, toks, 6, runs["1"])


@pytest.mark.parametrize("quant", ("q8", "q4", "q4-g256"))
@pytest.mark.parametrize("arch", ("qwen3", "qwen2-hd128"))
def test_fused_rope_epilogue_equals_the_qkv_rope_kernel_bitwise(arch, quant, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """head_dim 128: the q|k|v GEMV's epilogue (clusters at q4, the L2 merge at q8) runs rope_head on the
    head it merged, the same function as qkv_rope: bit-identical logits, with q/k norms or with a bias."""
    cfg = SMALL_CONFIGS["qwen3"] if arch == "qwen3" else replace(SMALL_CONFIGS["qwen2"], head_dim=128)
    model = synthetic_model(replace(cfg, hidden_size=1024), quant, seed=25)
    toks = random_tokens(model.config, 12)
    runs = {}
    for mode in ("1", "0"):  # attention in its own kernel both ways (the fold needs the fused epilogue)
        fwd = DeviceForward(stream=stream, gemm=gemm, fuse_rope=mode == "1", fuse_attention=False)
        runs[mode] = device_logits(fwd, model, toks, 6)
        assert fwd.stepper.fuse_rope == (mode == "1")
    assert np.array_equal(runs["1"], runs["0"])
    _check(model, toks, 6, runs["1"])


@pytest.mark.parametrize("quant", ("q8", "q4", "q4-g256"))
@pytest.mark.parametrize("window", [None, 12])
def test_attention_folded_into_qkv_matches_attn_decode_and_the_cpu(quant, window, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """head_dim 128, the q|k|v GEMV's K splits as clusters (hidden 1024): decode attention in its clusters
    (attend.cuh; a sliding window's last positions too) matches the CPU as attn_decode does (their outputs
    differ by float32 rounding, which the next GEMV's int8 input codes may turn into a code's step), with the
    same logits from graph replays and eager steps, and runs no attention kernel."""
    from kestrel_cuda.ops_cupy import CupyOps

    model = synthetic_model(replace(SMALL_CONFIGS["qwen3"], hidden_size=1024, sliding_window=window), quant, seed=32)
    toks = random_tokens(model.config, 40)
    runs = {}
    for fold in (True, False):
        fwd = DeviceForward(stream=stream, gemm=gemm, fuse_attention=fold)
        runs[fold] = device_logits(fwd, model, toks, 8)
        assert fwd.projections.layer(model, 0).qkv[0].cluster
    _check(model, toks, 8, runs[True])
    _check(model, toks, 8, runs[False])
    seen: list[str] = []

    def observe(name: str, launch) -> None:  # type: ignore[no-untyped-def]
        seen.append(name)
        launch()

    eager = DeviceForward(ops=CupyOps(stream, gemm, on_launch=observe), config=CudaConfig(graph=False))
    np.testing.assert_array_equal(device_logits(eager, model, toks, 8), runs[True])
    assert "attn_decode" not in seen and "attn_prefill" in seen


def test_on_launch_sees_every_kernel_and_changes_nothing(stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """CupyOps' on_launch is called instead of each launch, tiled GEMM included, with the kernel's name; the
    launches it runs give the same logits as without it."""
    from kestrel_cuda.ops_cupy import CupyOps

    model = synthetic_model(SMALL_CONFIGS["qwen2"], "q8", seed=28)
    toks = random_tokens(model.config, 20)
    seen: list[str] = []

    def observe(name: str, launch) -> None:  # type: ignore[no-untyped-def]
        seen.append(name)
        launch()

    ops = CupyOps(stream, gemm, on_launch=observe)
    got = device_logits(DeviceForward(ops=ops, config=CudaConfig(graph=False)), model, toks, 16)
    ref = device_logits(DeviceForward(config=CudaConfig(graph=False), stream=stream, gemm=gemm), model, toks, 16)
    assert np.array_equal(got, ref)
    assert len(seen) == ops.launches
    assert {"embed_rows", "quantize_rows", "gemm_q8 (tiled)", "add_rows", "qgemv", "qkv_rope", "attn_prefill",
            "attn_decode", "lm_finish"} == set(seen)


def test_residency_window_gives_the_same_logits() -> None:
    """Weights through the CUDA device's cache: keep=1 evicts and re-uploads every step, no graph."""
    from kestrel_cuda.binding import open_device

    model = synthetic_model(SMALL_CONFIGS["qwen3"], "q4", seed=8)
    toks = random_tokens(model.config, 16)
    dev = open_device({})
    try:
        plain = DeviceForward(dev.weight, None, stream=dev.stream, gemm=dev.gemm, pin=dev.cache.pin,
                              unpin=dev.cache.unpin)
        ref = device_logits(plain, model, toks, 8)
        plain.close()
    finally:
        dev.close()
    dev = open_device({"window": "1"})
    try:
        windowed = DeviceForward(dev.weight, dev.layer_boundary, stream=dev.stream, gemm=dev.gemm)
        got = device_logits(windowed, model, toks, 8)
        evictions = dev.cache.stats()["evictions"]
    finally:
        dev.close()
    assert np.array_equal(got, ref)
    assert evictions > 0 and not windowed.use_graph
