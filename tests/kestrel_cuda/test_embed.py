"""Embeddings on the GPU: the host forward with every projection through the CUDA GEMM hooks (the device's whole
steps give logits, not hidden states), against the CPU's vectors and sentence-transformers' golden ones.

Skipped where CuPy or a CUDA device is missing (CI); run on the H200 machine.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

import kestrel_core  # noqa: E402

from .forward_check import FIXTURES, cuda_device_count  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]


def test_embeddings_match_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_CUDA_MIN_FLOPS", "0")  # the fixture's GEMMs are below the backend's threshold
    golden = np.load(FIXTURES / "tiny-qwen3-embed" / "golden.npz")
    ids = [golden[f"ids_{i}"].tolist() for i in range(len(golden["embeddings"]))]
    out = {}
    for backend in ("cpu", "cuda"):
        with kestrel_core.load(str(FIXTURES / "tiny-qwen3-embed"), backend=backend, activations="q8") as engine:
            out[backend] = engine.embed(ids)
            if backend == "cuda":
                offload = engine.stats["offload"]
                assert sum(offload.get(h, {}).get("accepted", 0)
                           for h in ("kestrel_gemm_q8", "kestrel_gemm_fused_q8")) > 0, offload
    assert (np.sum(out["cuda"] * out["cpu"], axis=1)).min() >= 0.9999
    assert (np.sum(out["cuda"] * golden["embeddings"], axis=1)).min() >= 0.995  # int8 activations
