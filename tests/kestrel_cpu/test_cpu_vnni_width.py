"""The 256-bit VNNI kernels (AVX-VNNI CPUs: Intel's client cores) and the AVX2 int4 ones pass the kernel tests too.

The packed kernels' width is fixed when ``kestrel_cpu.packed`` is imported, so the 256-bit build runs in a
process of its own (``KESTREL_CPU_VNNI=256``) wherever this CPU can run it: AVX-512 VNNI CPUs run it as EVEX
code, with the same results as an AVX-VNNI CPU's VEX code. The AVX2 build runs in a process whose numba
target has AVX2 and FMA but no VNNI (``NUMBA_CPU_FEATURES``), as a Zen 2 or 3 or an Intel core before Alder
Lake compiles it.
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
    (AVX512, " 256 ", 8),  # stripped, as every KESTREL_* variable
    (AVX512, "512", 16),
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


@pytest.mark.parametrize("value", ["yes", "128", "0"])
def test_a_bad_width_is_one_line_naming_the_variable(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel_core.errors import KestrelError

    monkeypatch.setenv(packed.WIDTH_ENV, value)
    with pytest.raises(KestrelError, match=f"^KESTREL_CPU_VNNI must be 512 or 256, got '{value}'$"):
        packed.host_vnni_width(AVX512)


def test_a_bad_width_keeps_the_cpu_backend_from_binding_not_on_the_reference() -> None:
    """The width is read when the kernels are imported: a bad one is the open's error, not a silent fallback
    to the numpy reference."""
    env = {**os.environ, packed.WIDTH_ENV: "yes"}
    code = ("from kestrel_core.registry import Registry; b = Registry().bind('cpu'); "
            "print(b.status); print(b.reason)")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    status, reason = run.stdout.splitlines()[:2]
    assert status == "not_bound" and "KESTREL_CPU_VNNI must be 512 or 256, got 'yes'" in reason, run.stdout


@pytest.mark.skipif(packed.host_vnni_width() == 0 or os.environ.get(packed.WIDTH_ENV) == "256",
                    reason="this CPU runs no VNNI kernels, or this process already runs the 256-bit ones")
def test_the_256_bit_kernels_pass_the_kernel_tests() -> None:
    env = {**os.environ, packed.WIDTH_ENV: "256"}
    tests = [Path(__file__).with_name(name) for name in ("test_cpu_kernels.py", "test_layer.py")]
    probe = subprocess.run([sys.executable, "-c", "from kestrel_cpu import packed; print(packed.PACK_COLS)"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "8"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                          *map(str, tests)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1]


@pytest.mark.parametrize(("features", "width", "bits"), [
    (AVX512, 16, (8, 4)),
    ({"+avx2", "+avxvnni"}, 8, (8, 4)),
    ({"+avx2", "+fma"}, 8, (4,)),  # int4 only: vpmaddubsw is exact for nibbles, saturates on int8 codes
    ({"+avx2"}, 0, ()),
    (set(), 0, ()),
])
def test_int4_weights_pack_on_avx2_alone(features: set[str], width: int, bits: tuple[int, ...],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(packed.WIDTH_ENV, raising=False)
    assert packed.host_pack_width(features) == width
    assert ((8, 4) if packed.host_vnni_width(features) else (4,) if width else ()) == bits


AVX2_FEATURES = "+sse,+sse2,+sse3,+ssse3,+sse4.1,+sse4.2,+popcnt,+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+lzcnt,+movbe"


def _host_features() -> set[str]:
    import llvmlite.binding as llvm

    return set(llvm.get_host_cpu_features().flatten().split(","))


@pytest.mark.skipif(not {"+avx2", "+fma", "+f16c", "+bmi2"} <= _host_features(), reason="this CPU has no AVX2")
def test_the_avx2_int4_kernels_pass_the_kernel_tests(tmp_path: Path) -> None:
    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": AVX2_FEATURES,
           "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop(packed.WIDTH_ENV, None)
    probe = subprocess.run([sys.executable, "-c", "from kestrel_cpu import packed; print(packed.PACKED_BITS, "
                            "packed.PACK_COLS)"], env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "(4,) 8"
    tests = [Path(__file__).with_name(name) for name in ("test_cpu_kernels.py", "test_layer.py", "test_experts.py")]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:randomly", "-p", "no:cacheprovider",
                          *map(str, tests)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    passed = {line.split("::", 1)[1] for line in run.stdout.splitlines() if line.startswith("PASSED ")}
    assert {"test_int4_weights_pack_at_half_the_bytes_and_fuse_with_int8",
            "test_packed_layout_holds_each_weight_exactly[1-576-576-32-4]",
            "test_a_dense_layer_gives_the_op_by_op_bits[qwen3-q4]",  # the compiled layer on the AVX2 int4 GEMMs
            "test_a_dense_layer_gives_the_op_by_op_bits[gemma3-q4]",
            "test_the_compiled_experts_give_the_op_by_op_bits[glm4.5-air-q4]"} <= passed, run.stdout[-3000:]


def test_the_width_follows_the_features_numba_compiles_for(monkeypatch: pytest.MonkeyPatch) -> None:
    from numba.core import config

    monkeypatch.delenv(packed.WIDTH_ENV, raising=False)
    monkeypatch.setattr(config, "CPU_FEATURES", "")
    assert packed.host_vnni_width() == 0
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+avxvnni")
    assert packed.host_vnni_width() == 8


def test_a_generic_numba_target_runs_the_gemms_without_vnni(tmp_path: Path) -> None:
    """NUMBA_CPU_NAME=generic with no features (numba's advice for a cache shared between machines): the
    kernels compiled for it give the reference's bits, where a VNNI intrinsic would abort the process."""
    script = (
        "import numpy as np, kestrel_cpu\n"
        "from kestrel_cpu import packed\n"
        "from kestrel_core.contract import quantize_weight, quantize_activations, reference_gemm_q8\n"
        "assert packed.VNNI_WIDTH == 0\n"
        "rng = np.random.default_rng(0)\n"
        "w = quantize_weight(rng.standard_normal((40, 64)).astype(np.float32), 8, 32)\n"
        "a, s = quantize_activations(rng.standard_normal((3, 64)).astype(np.float32), 32)\n"
        "device = kestrel_cpu.kestrel_open(options={})\n"
        "got = kestrel_cpu.kestrel_gemm_q8(device=device, a_codes=a, a_scales=s, weight=w, wkey=3)\n"
        "assert np.array_equal(got, reference_gemm_q8(a, s, w)) and 'VNNI' not in device.description\n"
    )
    env = {**os.environ, "NUMBA_CPU_NAME": "generic", "NUMBA_CPU_FEATURES": "", "NUMBA_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
