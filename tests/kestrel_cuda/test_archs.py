"""Gemma 2 and 3, Granite and the mixtures of experts on the GPU: GLM-4.5 and ERNIE 4.5 MoE (routers with a choice
bias, dense layers among the experts), the hybrids (Qwen3.5, Qwen3-Next: linear attention, and fused groups of four),
multi-head latent attention (DeepSeek-V2/V3) and Cohere's decoders (LayerNorms, parallel blocks) through the GEMM
hooks, their steps not offered to the device forward (``kestrel_forward_supports``); Gemma 2 (soft caps), Gemma 3,
Granite (its multipliers), gpt-oss (sinks, biases, its clamped SwiGLU) and the other mixtures of experts through the
device forward. Every projection (each expert's too) is preloaded and the logits are the CPU's within the measured
tolerance.

Skipped where CuPy or a CUDA device is missing (CI); run on the H200 machine.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

import kestrel_core  # noqa: E402
from kestrel_core.model.weights import engine_weights  # noqa: E402

from .forward_check import FIXTURES, compare, cpu_logits, cuda_device_count, jitter_effect  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]


@pytest.mark.parametrize(("fixture", "path"), [("tiny-gemma2", "forward"), ("tiny-gpt-oss", "forward"),
                                              ("tiny-gemma3", "forward"), ("tiny-granite", "forward"),
                                              ("tiny-granite.gguf", "forward"),
                                              ("tiny-qwen3-moe", "forward"), ("tiny-qwen2-moe", "forward"),
                                              ("tiny-mixtral.gguf", "forward"), ("tiny-phi3-longrope", "forward"),
                                              ("tiny-qwen3-yarn.gguf", "forward"), ("tiny-smollm3", "forward"),
                                              ("tiny-seed-oss.gguf", "forward"), ("tiny-glm4", "forward"),
                                              ("tiny-ernie4_5", "forward"), ("tiny-qwen3_5", "hooks"),
                                              ("tiny-qwen3_5-moe.gguf", "hooks"), ("tiny-qwen3-next", "hooks"),
                                              ("tiny-lfm2.gguf", "hooks"), ("tiny-granite4-h-moe", "hooks"),
                                              ("tiny-glm4-moe.gguf", "hooks"), ("tiny-ernie4_5-moe", "hooks"),
                                              ("tiny-qwen3-vl", "forward"), ("tiny-qwen3-vl-moe", "forward"),
                                              ("tiny-lfm2-moe.gguf", "hooks"), ("tiny-olmo3.gguf", "hooks"),
                                              ("tiny-ministral3", "hooks"), ("tiny-deepseek-v3", "hooks"),
                                              ("tiny-deepseek-v2.gguf", "hooks"), ("tiny-glm4-moe-lite.gguf", "hooks"),
                                              ("tiny-minimax-m2.gguf", "hooks"), ("tiny-dots1", "hooks"),
                                              ("tiny-cohere", "hooks"), ("tiny-cohere2.gguf", "hooks")])
def test_each_architecture_matches_the_cpu(fixture: str, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_CUDA_MIN_FLOPS", "0")  # the fixtures' GEMMs are below the backend's threshold
    ids = np.load(FIXTURES / fixture.removesuffix(".gguf") / "golden.npz")["ids"]
    with kestrel_core.load(str(FIXTURES / fixture), backend="cuda", activations="q8") as engine:
        got = engine.logits(ids)
        whole_steps = engine.whole_step
        offload = engine.stats["offload"]
        counters = engine.stats["backend_stats"]
        model = engine.model
    forward = sum(offload.get(h, {}).get("accepted", 0) for h in ("kestrel_forward", "kestrel_forward_batch"))
    hooks = sum(offload.get(h, {}).get("accepted", 0) for h in ("kestrel_gemm_q8", "kestrel_gemm_fused_q8"))
    assert (forward > 0, hooks > 0) == ((True, False) if path == "forward" else (False, True)), offload
    assert whole_steps == (path == "forward")  # the hooks' models are never offered a whole step
    assert whole_steps or not {"kestrel_forward", "kestrel_forward_batch"} & set(offload), offload
    assert counters["preload_weights"] == len(engine_weights(model)), counters  # every expert resident
    ref = cpu_logits(model, ids, len(ids))
    result = compare(got, ref, jitter_effect(model, ids, len(ids), ref))
    assert result.ok, result
