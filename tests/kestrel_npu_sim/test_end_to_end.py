"""The conformance suite and whole models on the simulated NPU, against the CPU backend."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_core.selftest import run_selftest


def test_selftest_passes(npu_backend) -> None:  # noqa: ANN001
    report = run_selftest("npu_sim", seeds=1)
    assert report.ok, [(c.name, c.detail) for c in report.cases if not c.passed]
    names = [c.name for c in report.cases]
    assert any("N4160" in n for n in names) and any("K10496" in n for n in names)  # its own extra cases
    assert not any(c.declined for c in report.cases)


def _greedy(engine, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    return list(engine.generate(prompt, max_tokens=n, temperature=0.0, stop_at_eos=False))


def _run(backend: str, prompt: list[int], tokens: int = 8) -> tuple[np.ndarray, list[int], dict, dict]:
    from kestrel_core.model.engine_load import load_preset

    with load_preset("smollm2-135m", backend=backend, quant="q8", seed=3, num_layers=2, activations="q8") as engine:
        logits = engine.logits(prompt)
        generated = _greedy(engine, prompt, tokens) if tokens else []
        return logits, generated, engine.stats["backend_stats"], engine.stats["offload"]


def test_synthetic_model_matches_cpu(npu_backend, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Two real-shaped SmolLM2 layers with seeded weights.

    Logits are compared with the CPU running the contract's numpy reference: any other implementation
    differs by float rounding order, and one rounding flip of a re-quantized activation code moves the
    later positions' logits by ~1e-2 through attention, which says nothing about this backend. Greedy
    tokens are compared with the default (compiled) CPU backend too.
    """
    prompt = list(b"One artifact")
    npu_logits, npu_tokens, npu_stats, offload = _run("npu_sim", prompt)
    cpu_tokens = _run("cpu", prompt)[1]
    monkeypatch.setenv("KESTREL_CPU_REFERENCE", "1")  # slow: logits only
    ref_logits = _run("cpu", prompt, tokens=0)[0]
    np.testing.assert_allclose(npu_logits, ref_logits, rtol=1e-5, atol=1e-5 * np.abs(ref_logits).max())
    assert npu_tokens == cpu_tokens and len(npu_tokens) == 8
    for hook in ("kestrel_gemm_q8", "kestrel_gemm_fused_q8"):
        assert offload[hook]["declined"] == 0 and offload[hook]["accepted"] > 0
    # preloaded once: per layer fused q|k|v, o, fused gate|up, down; then lm_head
    assert npu_stats["npu_sim_time_s"] > 0 and npu_stats["npu_sim_repacks"] == 2 * 4 + 1


@pytest.mark.default_model
@pytest.mark.parametrize("activations", ["q8", "mixed"])
def test_the_default_model_gives_the_cpus_tokens(npu_backend, activations: str) -> None:  # noqa: ANN001
    """The CPU kernels follow the contract's float order bit for bit, as the simulated NPU does, so the two
    backends agree token for token even through the int8 re-quantization of every layer's input."""
    import kestrel_core

    tokens = {}
    for backend in ("cpu", "npu_sim"):
        with kestrel_core.load(None, backend=backend, activations=activations) as engine:
            prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
            tokens[backend] = _greedy(engine, prompt, 16)
    assert tokens["npu_sim"] == tokens["cpu"]


@pytest.mark.parametrize("fixture", ["tiny-mistral", "tiny-phi3", "tiny-phi3.gguf", "tiny-gemma3", "tiny-gemma3.gguf",
                                     "tiny-qwen3-moe", "tiny-qwen3-moe.gguf", "tiny-mixtral.gguf", "tiny-qwen2-moe",
                                     "tiny-gemma2", "tiny-gpt-oss", "tiny-phi3-longrope", "tiny-smollm3.gguf",
                                     "tiny-granite", "tiny-olmo2.gguf", "tiny-exaone4", "tiny-glm4.gguf",
                                     "tiny-glm4-moe.gguf", "tiny-ernie4_5-moe", "tiny-qwen3-vl-moe",
                                     "tiny-lfm2-moe.gguf", "tiny-deepseek-v3", "tiny-glm4-moe-lite.gguf",
                                     "tiny-minimax-m2", "tiny-dots1.gguf", "tiny-cohere", "tiny-cohere2.gguf"])
def test_windowed_fused_and_expert_architectures_give_the_cpu_logits(npu_backend, fixture: str) -> None:  # noqa: ANN001
    """Mistral's window, Phi-3's split tensors, Gemma 3's and Cohere's norms, routing and the latent attention's
    norms are the host's; the simulated NPU's GEMMs over the same artifact (every expert's too) give the CPU's logits
    bit for bit."""
    from pathlib import Path

    import kestrel_core

    root = Path(__file__).resolve().parents[1] / "fixtures" / "models"
    ids = np.load(root / fixture.removesuffix(".gguf") / "golden.npz")["ids"]
    out = {}
    for backend in ("cpu", "npu_sim"):
        with kestrel_core.load(str(root / fixture), backend=backend, activations="q8") as engine:
            out[backend] = engine.logits(ids)
            if backend == "npu_sim":
                offload = engine.stats["offload"]
                assert sum(offload[h]["accepted"] for h in ("kestrel_gemm_q8", "kestrel_gemm_fused_q8")) > 0
    np.testing.assert_array_equal(out["npu_sim"], out["cpu"])


def test_an_expert_artifact_gives_the_cpu_logits(npu_backend, tmp_path) -> None:  # noqa: ANN001
    """The .kst of a mixture of experts (every expert a strip-cache under its wkey, the router float32): the
    simulated NPU over the artifact gives the CPU's logits bit for bit."""
    from pathlib import Path

    import kestrel_core
    from kestrel_core.model.loader import load_model, write_artifact

    root = Path(__file__).resolve().parents[1] / "fixtures" / "models"
    kst = write_artifact(load_model(str(root / "tiny-qwen3-moe.gguf"), "q4", cache="off"), tmp_path / "moe.kst")
    ids = np.load(root / "tiny-qwen3-moe" / "golden.npz")["ids"]
    out = {}
    for backend in ("cpu", "npu_sim"):
        with kestrel_core.load(str(kst), backend=backend, activations="q8") as engine:
            assert engine.model.layers[0].experts and engine.model.layers[0].router.dtype == np.float32
            out[backend] = engine.logits(ids)
    np.testing.assert_array_equal(out["npu_sim"], out["cpu"])


def test_an_embedding_artifact_gives_the_cpu_vectors(npu_backend, tmp_path) -> None:  # noqa: ANN001
    """An embedding model's .kst keeps its pooling; the simulated NPU's GEMMs give the CPU's vectors bit for bit."""
    from pathlib import Path

    import kestrel_core
    from kestrel_core.model.loader import load_model, write_artifact

    root = Path(__file__).resolve().parents[1] / "fixtures" / "models"
    kst = write_artifact(load_model(str(root / "tiny-qwen3-embed"), "q8", cache="off"), tmp_path / "embed.kst")
    golden = np.load(root / "tiny-qwen3-embed" / "golden.npz")
    ids = [golden[f"ids_{i}"].tolist() for i in range(len(golden["embeddings"]))]
    out = {}
    for backend in ("cpu", "npu_sim"):
        with kestrel_core.load(str(kst), backend=backend, activations="q8") as engine:
            assert engine.config.pooling == "last"
            out[backend] = engine.embed(ids)
            if backend == "npu_sim":
                offload = engine.stats["offload"]
                assert sum(offload[h]["accepted"] for h in ("kestrel_gemm_q8", "kestrel_gemm_fused_q8")) > 0
    np.testing.assert_array_equal(out["npu_sim"], out["cpu"])
    assert (np.sum(out["cpu"] * golden["embeddings"], axis=1)).min() >= 0.995  # int8 activations: 0.9988 measured
