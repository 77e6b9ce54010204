"""On the CPU backend, the engine's fused projections (Q/K/V, gate/up) run as one pass of the CPU's fused hook,
bit-identical to one GEMM per weight, and are counted as the GEMMs they compute."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_core.contract import quantize_weight
from kestrel_core.dispatch import Offload
from kestrel_core.registry import Registry
from kestrel_core.wkey import Proj, fused_wkey, wkey

kernels = pytest.importorskip("kestrel_cpu.kernels")


@pytest.mark.parametrize("m", [1, 7])
def test_cpu_linear_fused_is_one_pass(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = Registry()
    offload = Offload(reg.cpu(), reg.cpu())
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, 96)).astype(np.float32)
    ws = [quantize_weight(rng.standard_normal((n, 96)).astype(np.float32)) for n in (64, 21, 21)]
    keys = [wkey(0, p) for p in (Proj.Q, Proj.K, Proj.V)]
    separate = [offload.linear(x, w, k) for w, k in zip(ws, keys)]

    passes = []
    real = kernels.gemm_q8_multi
    monkeypatch.setattr(kernels, "gemm_q8_multi", lambda *a, **kw: passes.append(len(a[2])) or real(*a, **kw))
    fused = offload.linear_fused(x, ws, keys, fused_wkey(0, Proj.QKV))
    assert passes == [3]
    for got, want in zip(fused, separate):
        np.testing.assert_array_equal(got, want)
    stats = offload.stats()
    assert stats["kestrel_gemm_q8"]["accepted"] == 6 and "kestrel_gemm_fused_q8" not in stats

