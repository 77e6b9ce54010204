"""Binding with real backend modules on KESTREL_BACKEND_PATH: each failure ends not bound, with its reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kestrel_core import API_VERSION, Offload, Proj, Registry, quantize_weight, wkey
from kestrel_core.errors import KestrelError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "backends"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kestrel-backend-example"


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Registry:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(FIXTURES))
    reg = Registry()
    reg.bind_all()
    yield reg
    reg.close()


@pytest.mark.parametrize(("name", "reason"), [
    ("missing_hook", "missing required hook(s): kestrel_gemm_f32"),
    ("bad_api", f"incompatible API version 2.0 (kestrel has {API_VERSION[0]}.{API_VERSION[1]})"),
    ("open_raises", "device open failed: RuntimeError: driver exploded"),
    ("unavailable", "no widget attached"),
    ("bad_signature", "invalid hook"),
    ("import_error", "import failed: ModuleNotFoundError: No module named 'kestrel_missing_driver'"),
])
def test_broken_backends_are_not_bound_with_their_reason(registry: Registry, name: str, reason: str) -> None:
    backend = registry.backends[name]
    assert backend.status == "not_bound"
    assert reason in backend.reason
    assert backend.pm is None and backend.device is None  # nothing half-registered stays behind


def test_bad_signature_names_the_argument(registry: Registry) -> None:
    assert "stream" in registry.backends["bad_signature"].reason


@pytest.mark.parametrize(("signature", "reason"), [
    ("device, seq_id, *, queue", "takes the keyword-only argument 'queue', which no call passes"),
    ("*args, **kwargs", "takes *args, which no call fills"),  # a decorator's wrapper without functools.wraps
    ("device, **extra", "takes **extra, which no call fills"),
])
def test_a_hook_with_an_argument_no_call_fills_is_not_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           signature: str, reason: str) -> None:
    source = (FIXTURES / "good_gpu.py").read_text().replace('"good_gpu"', '"kwonly"')
    hook = f"\n\n@hookimpl\ndef kestrel_release_sequence({signature}):\n    return None\n"
    (tmp_path / "kwonly.py").write_text(source + hook)
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "kwonly.py"))
    reg = Registry()
    try:
        backend = reg.bind("kwonly")
        assert not backend.bound and reason in backend.reason
    finally:
        reg.close()


def test_good_backends_bind_and_report_their_source(registry: Registry) -> None:
    for name in ("cpu", "good_gpu", "gemm_raises", "wrong_shape"):
        assert registry.backends[name].bound, registry.backends[name].reason
    assert registry.backends["good_gpu"].source == f"path {FIXTURES / 'good_gpu.py'}"
    assert registry.backends["cpu"].source.startswith("entry point")


def test_cpu_is_built_in_without_its_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel_core import registry as registry_mod

    monkeypatch.setattr(registry_mod, "entry_points", lambda group: [])  # kestrel not pip-installed
    reg = Registry()
    cpu = reg.cpu()
    assert cpu.source == "built in kestrel_cpu" and cpu.named_by == cpu.probe == "built in"
    assert cpu.plugin is sys.modules["kestrel_cpu"] and cpu.info is not None and cpu.info.name == "cpu"
    assert cpu.as_dict()["offload"] == "reference"
    reg.close()


def test_the_plugin_api_imports_no_registry_and_the_registry_no_backend() -> None:
    """A backend imports its names before the registry exists; the registry loads the reference by name."""
    code = ("import sys\n"
            "from kestrel_core.hookspecs import (API_VERSION, KINDS, BackendInfo, BackendUnavailable, BatchEntry,\n"
            "                                    hookimpl)\n"
            "assert 'kestrel_core.registry' not in sys.modules\n"
            "import kestrel_core.registry as r\n"
            "reg = r.Registry()\n"
            "assert r.BackendInfo is BackendInfo and 'kestrel_cpu' not in sys.modules\n"
            "reg.cpu()\n"
            "assert 'kestrel_cpu' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


def test_auto_picks_the_bound_accelerator_and_explicit_unbound_is_an_error(registry: Registry) -> None:
    assert registry.select("auto").name in {"good_gpu", "gemm_raises", "wrong_shape", "cuda"}
    with pytest.raises(KestrelError, match="backend 'open_raises' is not bound: device open failed"):
        registry.select("open_raises")
    with pytest.raises(KestrelError, match="unknown backend 'nope'"):
        registry.select("nope")


def test_auto_without_accelerators_is_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_PLUGINS", "")
    reg = Registry()
    assert reg.select("auto").name == "cpu"
    assert all(b.reason == "not in KESTREL_PLUGINS" for n, b in reg.backends.items() if n != "cpu")


def test_allow_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(FIXTURES))
    monkeypatch.setenv("KESTREL_PLUGINS", "good_gpu")
    reg = Registry()
    reg.bind_all()
    assert reg.backends["good_gpu"].bound and reg.backends["cpu"].bound
    assert reg.backends["unavailable"].reason == "not in KESTREL_PLUGINS"


def test_explicit_path_wins_over_entry_point_of_the_same_name(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "npu_sim.py").write_text((FIXTURES / "good_gpu.py").read_text().replace('"good_gpu"', '"npu_sim"'))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "npu_sim.py"))
    reg = Registry()
    assert reg.backends["npu_sim"].source == f"path {tmp_path / 'npu_sim.py'}"
    shadowed = [b for b in reg.shadowed if b.name == "npu_sim"]
    assert len(shadowed) == 1 and "shadowed by" in shadowed[0].reason and shadowed[0].source.startswith("entry")


@pytest.mark.parametrize("found", ["first", "last"])
def test_kestrels_own_backends_keep_their_names_whatever_the_discovery_order(tmp_path: Path, found: str,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Another package's entry point named ``cuda`` (one whose import would end the process) never takes the name
    from kestrel's own CUDA backend, whether it is found before it on the path or after (how kestrel is started
    decides): it is listed as not bound, with the reason, and never imported; the probe runs kestrel's own."""
    site = tmp_path / "site"
    (site / "impostor-1.0.dist-info").mkdir(parents=True)
    (site / "impostor-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: impostor\nVersion: 1.0\n")
    (site / "impostor-1.0.dist-info" / "entry_points.txt").write_text("[kestrel.backends]\ncuda = impostor_cuda\n")
    (site / "impostor_cuda.py").write_text("import os\n\nos._exit(7)  # kestrel_backend_info\n")
    if found == "first":
        monkeypatch.syspath_prepend(str(site))
    else:
        monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
    monkeypatch.setenv("KESTREL_PROBE", "always")
    reg = Registry()
    cuda = reg.describe("cuda")
    assert cuda.source == "entry point kestrel_cuda" and cuda.probe.startswith("ok"), (cuda.source, cuda.probe)
    clashing = [(b.source, b.status, b.reason) for b in reg.candidates() if b.name == "cuda" and b is not cuda]
    assert clashing == [("entry point impostor_cuda", "not_bound", "the name cuda is kestrel's own")]
    assert "impostor_cuda" not in sys.modules
    reg.close()


def test_a_path_backend_named_as_an_installed_module_is_not_bound(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Imported under its file name, it would stand in for that module (here the standard library's colorsys)
    for everything imported after it."""
    (tmp_path / "colorsys.py").write_text((FIXTURES / "good_gpu.py").read_text().replace('"good_gpu"', '"colorsys"'))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "colorsys.py"))
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    reg = Registry()
    reg.bind_all()
    try:
        backend = reg.backends["colorsys"]
        assert backend.status == "not_bound" and "is the name of the installed module" in backend.reason
        import colorsys
        assert hasattr(colorsys, "rgb_to_hsv")
    finally:
        reg.close()


def _problem(seed: int = 0) -> tuple[np.ndarray, object]:
    rng = np.random.default_rng(seed)
    w = quantize_weight(rng.standard_normal((48, 128)).astype(np.float32))
    return rng.standard_normal((5, 128)).astype(np.float32), w


@pytest.mark.parametrize(("name", "reason"), [
    ("gemm_raises", "error: MemoryError"),
    ("wrong_shape", "bad result: shape [5, 49], expected [5, 48]"),
])
def test_failing_offloads_are_declined_and_the_cpu_result_is_used(registry: Registry, name: str,
                                                                  reason: str) -> None:
    x, w = _problem()
    offload = Offload(registry.backends[name], registry.cpu())
    got = offload.linear(x, w, wkey(0, Proj.Q))
    on_cpu = Offload(registry.cpu(), registry.cpu()).linear(x, w, wkey(0, Proj.Q))
    np.testing.assert_array_equal(got, on_cpu)  # the CPU path's result, bit for bit
    offload.linear(x, w, wkey(0, Proj.Q))
    counters = offload.stats()["kestrel_gemm_q8"]
    assert counters["offered"] == 2 and counters["accepted"] == 0
    assert counters["declined_reasons"] == {reason: 2}


def test_wrong_dtype_is_a_failure_too(registry: Registry) -> None:
    x, w = _problem()
    offload = Offload(registry.backends["wrong_shape"], registry.cpu())
    np.testing.assert_allclose(offload.gemm_f32(x, w, 0), registry.cpu().hook.kestrel_gemm_f32(
        device=registry.cpu().device, a=x, weight=w, wkey=0))
    assert offload.stats()["kestrel_gemm_f32"]["declined_reasons"] == {"bad result: dtype float64, expected float32": 1}


def test_force_cpu_declines_everything_with_identical_results(registry: Registry,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = _problem(1)
    offload = Offload(registry.backends["good_gpu"], registry.cpu())
    normal = offload.linear(x, w, wkey(2, Proj.UP))
    monkeypatch.setenv("KESTREL_FORCE_CPU", "1")
    forced = offload.linear(x, w, wkey(2, Proj.UP))
    np.testing.assert_array_equal(normal, forced)
    assert registry.backends["good_gpu"].bound  # the backend stays open
    assert offload.stats()["kestrel_gemm_q8"]["declined_reasons"] == {"KESTREL_FORCE_CPU": 1}
    assert registry.backends["good_gpu"].as_dict()["offload"].startswith("forced to CPU")


def test_min_flops_threshold_declines_small_gemms(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = _problem()
    monkeypatch.setenv("KESTREL_GOOD_GPU_MIN_FLOPS", str(2 * 5 * 48 * 128 + 1))
    offload = Offload(registry.backends["good_gpu"], registry.cpu())
    offload.linear(x, w, wkey(0, Proj.K))
    offload.linear(np.vstack([x, x]), w, wkey(0, Proj.K))
    counters = offload.stats()["kestrel_gemm_q8"]
    assert counters["declined_reasons"] == {"below min FLOPs": 1} and counters["accepted"] == 1


def test_bad_min_flops_env_is_a_clear_error(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_GOOD_GPU_MIN_FLOPS", "lots")
    with pytest.raises(KestrelError, match="KESTREL_GOOD_GPU_MIN_FLOPS must be a finite number >= 0, got 'lots'"):
        Offload(registry.backends["good_gpu"], registry.cpu()).linear(*_problem(), wkey(0, Proj.K))


def test_kestrel_backends_json_lists_every_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel_core.cli import main

    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(FIXTURES))
    capture = subprocess.run([sys.executable, "-m", "kestrel_core.cli", "backends", "--json"], capture_output=True,
                             text=True, check=True, env=dict(os.environ))
    rows = {r["name"]: r for r in json.loads(capture.stdout)}
    assert rows["cpu"]["status"] == "bound" and rows["cpu"]["kind"] == "cpu"
    assert rows["bad_api"]["status"] == "not_bound" and "incompatible API version" in rows["bad_api"]["reason"]
    assert rows["cuda"]["status"] in ("bound", "not_bound") and rows["cuda"]["source"].startswith("entry point")
    for row in rows.values():
        assert {"name", "status", "reason", "version", "source", "kind"} <= row.keys()
    assert main(["backends"]) == 0  # the rich table renders too


def test_example_third_party_package_installs_and_binds(tmp_path: Path) -> None:
    """pip-install examples/kestrel-backend-example into a target dir; kestrel finds it by entry point."""
    source, target = tmp_path / "src", tmp_path / "site"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-m", "kestrel_core.cli", "selftest", "--backend", "example", "--json"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] and report["passed"] >= 24
