"""The whole-step device forward on the GPU (its kernels through CupyOps) against the CPU decoder: prefill and
captured decode steps on the small configs in every quant mode, with and without PDL, sliding windows, mixtures of
experts, attention at several head shapes and past 1,024 positions, prompts longer than a prefill chunk, greedy
tokens, and the engine's steps offered to the forward (a declined one recomputed on the CPU) and through the real
cuda backend. Bit-for-bit agreements between device paths, single kernels, the experts' kernels and the pipelined
greedy decode have test_forward modules of their own.


Skipped where CuPy or a CUDA device is missing (CI); run on the H200 machine.
The tolerance is measured, not fixed (forward_check explains why): the CPU is re-run with its linear inputs and
outputs nudged by a few ulps, and the device must stay within FACTOR times that effect, its argmax must be the CPU's
or tie with it within the nudge's range, and greedy decoding must pick the CPU's tokens.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cupy")

import kestrel_core  # noqa: E402
from kestrel_core.model.decoder import PREFILL_CHUNK  # noqa: E402
from kestrel_core.model.presets import synthetic_model  # noqa: E402
from kestrel_cuda.config import CudaConfig  # noqa: E402
from kestrel_cuda.forward import CAP_CHUNK, DeviceForward  # noqa: E402

from .forward_check import (  # noqa: E402
    DECLINING_BACKEND,
    FACTOR,
    SMALL_CONFIGS,
    _check,
    compare,
    cpu_logits,
    cuda_device_count,
    device_logits,
    greedy_agrees,
    jitter_effect,
    random_tokens,
    stepwise_greedy,
)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]

QUANTS = ("q8", "q4", "q8-g256", "q4-g256")


@pytest.mark.parametrize("n_prefill", [8, 20])
def test_a_sliding_window_matches_the_cpu(n_prefill, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """Mistral with a window of 12: attn_prefill within and past it, then captured attn_decode steps past it."""
    model = synthetic_model(replace(SMALL_CONFIGS["llama"], arch="mistral", sliding_window=12), "q8", seed=3)
    toks = random_tokens(model.config, 40)
    _check(model, toks, n_prefill, device_logits(DeviceForward(stream=stream, gemm=gemm), model, toks, n_prefill))


@pytest.mark.parametrize("fixture", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-qwen2-moe"])
def test_a_mixture_of_experts_matches_the_cpu(fixture, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """Routed on the device: a 12-token prefill (tiled GEMMs on each chosen expert's rows), then captured
    decode steps (the chosen experts' GEMVs over the layer's expert tables)."""
    from kestrel_core.model.loader import load_model

    model = load_model(str(Path(__file__).resolve().parents[1] / "fixtures" / "models" / fixture), "q8",
                       cache="off").model
    toks = random_tokens(model.config, 20)
    fwd = DeviceForward(stream=stream, gemm=gemm)
    _check(model, toks, 12, device_logits(fwd, model, toks, 12))
    assert fwd.counters["graph_captures"] == 1 and fwd.counters["graph_replays"] == 8


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", list(SMALL_CONFIGS))
def test_prefill_and_decode_logits_match_the_cpu(arch, quant, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """24-token prefill (tiled GEMM path), then 16 graph-replayed decode steps, teacher-forced."""
    model = synthetic_model(SMALL_CONFIGS[arch], quant, seed=3)
    toks = random_tokens(model.config, 40)
    fwd = DeviceForward(stream=stream, gemm=gemm)
    _check(model, toks, 24, device_logits(fwd, model, toks, 24))
    assert fwd.counters["graph_captures"] == 1 and fwd.counters["graph_replays"] == 16


@pytest.mark.parametrize("pdl", ("0", "1"))
@pytest.mark.parametrize("arch", list(SMALL_CONFIGS))
def test_graph_decode_with_and_without_pdl_matches_the_cpu(arch, pdl, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """The captured decode step with its kernels launched in plain stream order and with programmatic
    dependent launch (pdl: each kernel may start under its predecessor's tail)."""
    model = synthetic_model(SMALL_CONFIGS[arch], "q4", seed=14)
    toks = random_tokens(model.config, 30)
    fwd = DeviceForward(config=CudaConfig(pdl=pdl == "1"), stream=stream, gemm=gemm)
    assert fwd.ops.pdl == (pdl == "1")
    _check(model, toks, 10, device_logits(fwd, model, toks, 10))
    assert fwd.counters["graph_replays"] == 20


@pytest.mark.parametrize("n_prefill", (5, 24))
def test_fused_gemv_prefill_without_the_tiled_gemm(n_prefill, stream) -> None:  # type: ignore[no-untyped-def]
    """Without cuda-kernels' GEMM every prefill row runs the fused GEMV (8 rows per weight pass)."""
    model = synthetic_model(SMALL_CONFIGS["qwen2"], "q8", seed=4)
    toks = random_tokens(model.config, n_prefill + 6)
    _check(model, toks, n_prefill, device_logits(DeviceForward(stream=stream), model, toks, n_prefill))


@pytest.mark.parametrize("quant", ("q8", "q4-g256"))
def test_chunked_gemv_with_several_chunks_per_block(quant, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """qgemv at M = 1 with few blocks: several chunks a block (down's K = 768: three 256-row chunks)."""
    model = synthetic_model(SMALL_CONFIGS["qwen3"], quant, seed=11)
    toks = random_tokens(model.config, 20)
    fwd = DeviceForward(stream=stream, gemm=gemm, target_blocks=2)
    _check(model, toks, 12, device_logits(fwd, model, toks, 12))
    assert any(lin.chunks > lin.ksplit for lin in fwd._st.layers[0].weights.gate_up + [fwd._st.layers[0].weights.down])


# qwen3 with 6 query heads per KV head (and head_dim 64); Gemma 3's head_dim of 256 (its 1B-12B)
ATTN_CONFIGS = {**SMALL_CONFIGS, "qwen3-gqa6": replace(SMALL_CONFIGS["qwen3"], num_heads=12, num_kv_heads=2,
                                                        head_dim=64, num_layers=1),
                "gemma3-hd256": replace(SMALL_CONFIGS["gemma3"], head_dim=256)}


@pytest.mark.parametrize("arch", list(ATTN_CONFIGS))
def test_attention_matches_the_cpu(arch, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """attn_prefill and attn_decode: prefill, graph decode, and a prefill continued at a nonzero start (rows
    see earlier positions)."""
    model = synthetic_model(ATTN_CONFIGS[arch], "q8", seed=12)
    toks = random_tokens(model.config, 60)
    fwd = DeviceForward(stream=stream, gemm=gemm)
    _check(model, toks, 37, device_logits(fwd, model, toks, 37))
    fwd.forward(model, 6, toks[:23], 0, False)
    cont = fwd.forward(model, 6, toks[23:], 23, True)  # second chunk of a prompt, 37 rows after 23 cached
    ref = cpu_logits(model, toks, len(toks))
    result = compare(cont, ref[23:], jitter_effect(model, toks, len(toks), ref))
    assert result.ok, str(result)


@pytest.mark.parametrize("pdl", ("0", "1"))
def test_attention_long_context_and_graph(pdl, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """Decode past 1,024 positions: each warp of attn_decode runs several rounds of positions."""
    model = synthetic_model(replace(SMALL_CONFIGS["qwen2"], num_layers=1), "q4", seed=13)
    n = CAP_CHUNK - 2
    toks = random_tokens(model.config, n + 5)
    graph = device_logits(DeviceForward(config=CudaConfig(pdl=pdl == "1"), stream=stream, gemm=gemm), model, toks, n)
    _check(model, toks, n, graph)
    eager = device_logits(DeviceForward(config=CudaConfig(pdl=pdl == "1", graph=False), stream=stream, gemm=gemm),
                          model, toks, n)
    assert np.array_equal(graph, eager)


@pytest.mark.parametrize("arch", list(SMALL_CONFIGS))
def test_greedy_tokens_are_the_cpus_for_16_steps(arch, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    model = synthetic_model(SMALL_CONFIGS[arch], "q8", seed=6)
    prompt = random_tokens(model.config, 12)
    tokens, _ = stepwise_greedy(DeviceForward(stream=stream, gemm=gemm), model, prompt, 15)
    seq = np.concatenate([prompt, tokens[:-1]])
    ref = cpu_logits(model, seq, len(prompt))
    _, jitter_max = jitter_effect(model, seq, len(prompt), ref)
    assert greedy_agrees(tokens, model, prompt, tol=FACTOR * jitter_max) == []
    cpu_greedy = ref[len(prompt) - 1:].argmax(1).tolist()
    print(f"{arch}: device greedy == cpu argmax on {sum(a == b for a, b in zip(tokens, cpu_greedy))}/16 steps")


def test_long_prefill_in_chunks_and_kv_growth(stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """A prompt longer than one prefill chunk (512 + a remainder), all logits; then decode steps that
    cross the first KV-capacity chunk (graph re-captured on the grown cache)."""
    model = synthetic_model(replace(SMALL_CONFIGS["llama"], num_layers=1), "q8", seed=7)
    n = CAP_CHUNK - 2
    toks = random_tokens(model.config, n + 5)
    fwd = DeviceForward(stream=stream, gemm=gemm)
    got = device_logits(fwd, model, toks, n)
    assert n > PREFILL_CHUNK
    _check(model, toks, n, got)
    assert fwd.counters["graph_captures"] == 2


def test_engine_recomputes_a_declined_step_on_the_cpu(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """End to end: the engine offers each step to the device forward; step 3 is declined, the host decoder
    catches up and runs it, and the device is later offered the tokens it missed."""
    model = synthetic_model(SMALL_CONFIGS["qwen3"], "q8", seed=9)
    prompt = random_tokens(model.config, 10).tolist()
    (tmp_path / "fwdcuda.py").write_text(DECLINING_BACKEND.format(decline={3}, make="DeviceForward", greedy=None))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "fwdcuda.py"))
    with kestrel_core.load(model, backend="fwdcuda") as engine:
        tokens = list(engine.generate(prompt, max_tokens=12, stop_at_eos=False))
        stats = engine.stats["offload"]["kestrel_forward"]
        calls = list(engine.backend.plugin.CALLS)
    assert stats["accepted"] == 11 and stats["declined"] == 1
    assert calls[:5] == [0, 10, 11, 11, 13]  # call 3 (position 11) declined: the device catches up from 11
    seq = np.concatenate([prompt, tokens[:-1]])
    ref = cpu_logits(model, seq, len(prompt))
    _, jitter_max = jitter_effect(model, seq, len(prompt), ref)
    assert greedy_agrees(tokens, model, np.asarray(prompt), tol=FACTOR * jitter_max) == []


@pytest.mark.skipif(os.environ.get("KESTREL_SKIP_CUDA_BACKEND") == "1", reason="asked to skip")
def test_cuda_backend_runs_the_whole_step_forward() -> None:
    """Through the real cuda backend (cuda-kernels' hookimpl): the engine's steps go to DeviceForward."""
    model = synthetic_model(SMALL_CONFIGS["llama"], "q8", seed=10)
    prompt = random_tokens(model.config, 9).tolist()
    with kestrel_core.load(model, backend="cuda") as engine:
        tokens = list(engine.generate(prompt, max_tokens=8, stop_at_eos=False))
        fwd = engine.stats["offload"].get("kestrel_forward_batch", {})
        pipe = engine.stats["offload"].get("kestrel_decode_greedy", {})
        counters = engine.stats["backend_stats"]
    assert fwd.get("accepted", 0) == 1 and pipe.get("accepted", 0) == 1, (fwd, pipe)  # prefill, then pipelined
    assert counters["forward_decode_tokens"] >= 7, counters
    seq = np.concatenate([prompt, tokens[:-1]])
    ref = cpu_logits(model, seq, len(prompt))
    _, jitter_max = jitter_effect(model, seq, len(prompt), ref)
    assert greedy_agrees(tokens, model, np.asarray(prompt), tol=FACTOR * jitter_max) == []
