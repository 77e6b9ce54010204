"""The 256-bit VNNI kernels (AVX-VNNI CPUs: Intel's client cores) pass the kernel tests too.

The packed kernels' width is fixed when ``kestrel_cpu.packed`` is imported, so the 256-bit build runs in a
process of its own (``KESTREL_CPU_VNNI=256``) wherever this CPU can run it: AVX-512 VNNI CPUs run it as EVEX
code, with the same results as an AVX-VNNI CPU's VEX code.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

packed = pytest.importorskip("kestrel_cpu.packed", reason="numba is a runtime dependency of kestrel_cpu")

AVX512 = {"+avx512f", "+avx512bw", "+avx512vnni", "+avx512vl", "+avx2"}


@pytest.mark.parametrize(("features", "env", "width"), [
    (AVX512, None, 16),
    (AVX512, "256", 8),
    ({"+avx2", "+avxvnni"}, None, 8),  # Alder Lake and later client cores: no AVX-512
    ({"+avx2", "+avxvnni"}, "256", 8),
    ({"+avx2"}, None, 0),  # the vpmaddwd kernels
    ({"+avx512f", "+avx512bw", "+avx512vnni", "+avx2"}, "256", 0),  # no 256-bit vpdpbusd without VL
])
def test_the_width_follows_the_cpu_features(features: set[str], env: str | None, width: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    if env is None:
        monkeypatch.delenv(packed.WIDTH_ENV, raising=False)
    else:
        monkeypatch.setenv(packed.WIDTH_ENV, env)
    assert packed.host_vnni_width(features) == width


@pytest.mark.skipif(packed.host_vnni_width() == 0 or os.environ.get(packed.WIDTH_ENV) == "256",
                    reason="this CPU runs no VNNI kernels, or this process already runs the 256-bit ones")
def test_the_256_bit_kernels_pass_the_kernel_tests() -> None:
    env = {**os.environ, packed.WIDTH_ENV: "256"}
    tests = Path(__file__).with_name("test_cpu_kernels.py")
    probe = subprocess.run([sys.executable, "-c", "from kestrel_cpu import packed; print(packed.PACK_COLS)"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "8"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                          str(tests)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1]
