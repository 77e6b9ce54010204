"""Hostile backends written to files as a third party would ship them: what they return or raise never takes
kestrel down, never reaches the engine unchecked, and is reported in one short line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kestrel_core import Offload, Proj, Registry, quantize_weight, wkey
from kestrel_core.contract import quantize_activations, reference_gemm_q8
from kestrel_core.selftest import run_selftest
from kestrel_core.wkey import fused_wkey

PLUGIN = '''
import sys
import numpy as np
from kestrel_core import API_VERSION, BackendInfo, hookimpl
from kestrel_core.contract import reference_gemm_f32, reference_gemm_q8

class Handle:
    description = "a handle"

MODE = {{}}

@hookimpl
def kestrel_backend_info():
    return BackendInfo("{name}", {version}, API_VERSION, "gpu", min_flops={min_flops})

@hookimpl
def kestrel_open(options):
    return {handle}

@hookimpl
def kestrel_close(device):
    pass

def _spoil(out, a, weight):
    mode = MODE.get("mode")
    if mode == "matrix":
        return np.asmatrix(out)
    if mode == "read-only":
        out.flags.writeable = False
    if mode == "write-input":
        a[...] = 0
    if mode == "write-weight":
        weight.codes[...] = 0
    if mode == "raise-unprintable":
        class Unprintable(Exception):
            def __str__(self):
                raise SystemExit(3)
        raise Unprintable()
    if mode == "raise-huge":
        raise RuntimeError("line1\\\\n" + "z" * 100_000)
    return out

@hookimpl
def kestrel_gemm_q8(a_codes, a_scales, weight):
    return _spoil(reference_gemm_q8(a_codes, a_scales, weight), a_codes, weight)

@hookimpl
def kestrel_gemm_f32(a, weight):
    return _spoil(reference_gemm_f32(a, weight), a, weight)

REUSED = {{}}

@hookimpl
def kestrel_gemm_fused_q8(a_codes, a_scales, weights):
    outs = [reference_gemm_q8(a_codes, a_scales, w) for w in weights]
    if MODE.get("mode") == "one-buffer":  # every result a view of one array's first columns
        buf = np.zeros((len(a_codes), max(o.shape[1] for o in outs)), np.float32)
        return [buf[:, :o.shape[1]] for o in outs]
    if MODE.get("mode") == "reused":  # a buffer kept per shape and handed out again on the next call
        for i, o in enumerate(outs):
            keep = REUSED.setdefault((i, o.shape), np.empty_like(o))
            keep[...] = o
            outs[i] = keep
    return outs
'''


def _plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str = "hostile", version: str = '"1.0"',
            min_flops: str = "0", handle: str = "Handle()") -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(PLUGIN.format(name=name, version=version, min_flops=min_flops, handle=handle))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(path))
    monkeypatch.setenv("KESTREL_PROBE", "0")
    return path


def _weights(n: int = 3) -> tuple[np.ndarray, list]:
    rng = np.random.default_rng(n)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    return x, [quantize_weight(rng.standard_normal((48, 64)).astype(np.float32)) for _ in range(n)]


@pytest.mark.parametrize(("handle", "description"), [
    ("type('H', (), {'description': property(lambda s: sys.exit(4))})()", "gpu"),
    ("type('H', (), {'description': property(lambda s: 1 / 0)})()", "gpu"),
    ("Handle()", "a handle"),
])
def test_a_handle_whose_description_fails_still_binds(tmp_path, monkeypatch, handle: str, description: str) -> None:
    _plugin(tmp_path, monkeypatch, handle=handle)
    reg = Registry()
    try:
        backend = reg.bind("hostile")
        assert backend.bound and backend.device_description == description
    finally:
        reg.close()


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"min_flops": '"lots"'}, "BackendInfo.min_flops must be a finite number >= 0"),
    ({"min_flops": 'float("nan")'}, "BackendInfo.min_flops must be a finite number >= 0"),
    ({"version": "object()"}, "BackendInfo.version and .description must be strings"),
    ({"version": "type('S', (str,), {'__str__': lambda s: 1 / 0})('1.0')"},  # shown by `kestrel backends`
     "BackendInfo.version and .description must be strings"),
    ({"name": "auto"}, "not a valid name"),
    ({"name": "x" * 65}, "not a valid name"),
])
def test_backend_info_fields_are_checked_before_binding(tmp_path, monkeypatch, kwargs: dict, reason: str) -> None:
    _plugin(tmp_path, monkeypatch, **kwargs)
    reg = Registry()
    try:
        backend = next(iter(reg.backends[n] for n in reg.backends if n != "cpu"))
        assert not reg.bind(backend.name).bound and reason in backend.reason
        assert reg.select("auto").name == "cpu"
    finally:
        reg.close()


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.asmatrix's own
@pytest.mark.parametrize(("mode", "reason"), [
    ("matrix", "bad result: got matrix, expected a numpy.ndarray"),
    ("read-only", "bad result: a read-only array"),
    ("write-input", "error: ValueError"),  # its inputs are read-only views: the CPU computes from them intact
    ("write-weight", "error: ValueError"),  # and so are the weights' codes and scales
    ("raise-unprintable", "error: Unprintable"),
    ("raise-huge", "error: RuntimeError"),
])
def test_results_the_engine_cannot_own_are_declined_and_the_cpu_computes(tmp_path, monkeypatch, caplog,
                                                                        mode: str, reason: str) -> None:
    _plugin(tmp_path, monkeypatch)
    reg = Registry()
    try:
        backend = reg.select("hostile")
        backend.plugin.MODE["mode"] = mode
        offload, on_cpu = Offload(backend, reg.cpu()), Offload(reg.cpu(), reg.cpu())
        x, ws = _weights(1)
        want_q8, want_f32 = on_cpu.linear(x, ws[0], 1), on_cpu.gemm_f32(x, ws[0], 1)
        got_q8, got_f32 = offload.linear(x, ws[0], 1), offload.gemm_f32(x, ws[0], 1)
        np.testing.assert_array_equal(got_q8, want_q8)
        np.testing.assert_array_equal(got_f32, want_f32)
        assert type(got_q8) is np.ndarray and got_q8.flags.writeable
        for hook in ("kestrel_gemm_q8", "kestrel_gemm_f32"):
            assert list(offload.stats()[hook]["declined_reasons"]) == [reason]
        assert all(len(r.getMessage()) < 1000 for r in caplog.records)  # a plugin's huge message, cut short
    finally:
        reg.close()


def test_fused_results_sharing_one_buffer_are_declined(tmp_path, monkeypatch) -> None:
    _plugin(tmp_path, monkeypatch)
    reg = Registry()
    try:
        backend = reg.select("hostile")
        backend.plugin.MODE["mode"] = "one-buffer"
        offload = Offload(backend, reg.cpu())
        x, ws = _weights(3)
        outs = offload.linear_fused(x, ws, [wkey(0, p) for p in (Proj.Q, Proj.K, Proj.V)], fused_wkey(0, Proj.QKV))
        a_codes, a_scales = quantize_activations(x, 32)
        for out, w in zip(outs, ws):
            np.testing.assert_array_equal(out, reference_gemm_q8(a_codes, a_scales, w))
        reasons = offload.stats()["kestrel_gemm_fused_q8"]["declined_reasons"]
        assert list(reasons) == ["bad result: an array sharing memory with the call's input or another result"]
    finally:
        reg.close()


def test_selftest_gives_the_hooks_read_only_inputs_as_the_engine_does(tmp_path, monkeypatch) -> None:
    path = _plugin(tmp_path, monkeypatch)
    path.write_text(path.read_text().replace('MODE = {}', 'MODE = {"mode": "write-input"}'))
    report = run_selftest("hostile", seeds=1)
    single = [c for c in report.cases if c.hook in ("kestrel_gemm_q8", "kestrel_gemm_f32")]
    assert single and all(not c.passed and "ValueError" in c.detail for c in single)


def test_selftest_fails_a_backend_that_hands_out_one_buffer_twice(tmp_path, monkeypatch) -> None:
    """Each call's results right, but the next call of the same shapes overwrites them: what the engine's K and
    V (one shape) would then read. Only a second call shows it; selftest makes one."""
    path = _plugin(tmp_path, monkeypatch)
    path.write_text(path.read_text().replace('MODE = {}', 'MODE = {"mode": "reused"}'))
    report = run_selftest("hostile", seeds=1)
    fused = [c for c in report.cases if c.hook == "kestrel_gemm_fused_q8"]
    assert fused and not any(c.passed for c in fused)
    assert all("a buffer handed out twice" in c.detail for c in fused)
    assert all(c.passed for c in report.cases if c.hook != "kestrel_gemm_fused_q8")


@pytest.mark.parametrize("hook", [
    'return [dict(hook="kestrel_gemm_q8", m=2, ns=(40,), k=64, group_size=32, bits=8, seed=1),\n'
    '        dict(hook="kestrel_gemm_q8", m=2, ns=40, k=64, group_size=32, bits=8, seed=1),\n'
    '        dict(hook="kestrel_gemm_q8", m=2, ns=(40,), k=64, group_size=32, bits=5, seed=1),\n'
    '        dict(hook="kestrel_gemm_q8", m=0, ns=(40,), k=64, group_size=32, bits=8, seed=1)]',
    'raise RuntimeError("no cases today")',
])
def test_a_backends_own_cases_are_checked_and_the_built_in_ones_run_anyway(tmp_path, monkeypatch, hook) -> None:
    path = _plugin(tmp_path, monkeypatch)
    path.write_text(path.read_text() + f"\n@hookimpl\ndef kestrel_selftest_cases(device):\n    {hook}\n")
    report = run_selftest("hostile", seeds=1)
    built_in = [c for c in report.cases if c.hook != "kestrel_selftest_cases"]
    assert built_in and all(c.passed for c in built_in)
    refused = [c.detail for c in report.cases if c.hook == "kestrel_selftest_cases"]
    if "raise" in hook:
        assert refused == ["raised RuntimeError: no cases today"]
    else:
        assert any(c.name.endswith("N40 K64 s1") for c in built_in)  # the good one ran
        assert len(refused) == 3 and "ns a non-empty tuple" in refused[0] and "bits one of" in refused[1]
        assert "m must be >= 1" in refused[2]


COUNTERS = '''
import numpy as np
from kestrel_core import API_VERSION, BackendInfo, hookimpl
from kestrel_cpu import kestrel_close, kestrel_gemm_f32, kestrel_gemm_q8, kestrel_open  # noqa: F401


@hookimpl
def kestrel_backend_info():
    return BackendInfo("counters", "1", API_VERSION, "gpu")


class Unprintable:
    def __str__(self):
        raise SystemExit(5)


class Loud(float):
    def __format__(self, spec):
        raise ValueError("no format")


@hookimpl
def kestrel_stats(device):
    return {"unprintable": Unprintable(), 7: "seven", "loud": Loud(0.5), "per_layer": np.array([1, 2], np.int16),
            "widgets": np.int32(3), "pairs": [Unprintable(), np.int64(4)]}
'''


def test_a_backends_counters_are_shown_whatever_they_are(tmp_path, monkeypatch, capsys) -> None:
    """``kestrel run --stats`` shows the backend's counters as plain values: a name or a value whose printing exits
    or raises is its text, and the command ends 0."""
    from kestrel_core.cli import main

    (tmp_path / "counters.py").write_text(COUNTERS)
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "counters.py"))
    tiny = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "tiny-qwen3"
    assert main(["run", "--model", str(tiny), "--backend", "counters", "-n", "1", "--no-chat", "--stats", "hi"]) == 0
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in capsys.readouterr().err.splitlines() if line.count("│") == 3}
    cannot = "<a Unprintable that cannot be printed>"
    assert rows == {"unprintable": cannot, "7": "seven", "loud": "0.5", "per_layer": "[1, 2]", "widgets": "3",
                    "pairs": f"['{cannot}', 4]"}
