"""Fault injection: plugins that exit, crash, hang, hijack signals or leave threads never take kestrel down.

Each broken plugin in tests/fixtures/backends/faults ends as one line (not bound, or a decline with its reason)
and kestrel carries on on the CPU. The faults Python cannot catch run only in subprocesses: ``kestrel`` itself
is run as ``python -m kestrel_core.cli`` with KESTREL_BACKEND_PATH at the fixtures, so a fault the probe missed
would fail the test, not kill the test process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kestrel_core import probe_run
from kestrel_core.errors import KestrelError
from kestrel_core.registry import Registry

from .waits import HANG_GUARD_S

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "backends"
FAULTS = FIXTURES / "faults"
SITE = FIXTURES / "site"
PRESET = ["--preset", "smollm2-135m", "-n", "3", "--no-chat"]

# name -> (status, what its reason says)
EXPECTED = {
    "exit_import": ("not_bound", "import failed: SystemExit (the plugin called sys.exit(3))"),
    "exit_info": ("not_bound", "validation failed: SystemExit (the plugin called sys.exit(4))"),
    "exit_open": ("not_bound", "device open failed: SystemExit (the plugin called sys.exit(0))"),
    "exit_close": ("bound", ""),
    "exit_gemm": ("bound", ""),
    "base_exception": ("not_bound", "device open failed: PluginPanic (a BaseException): the driver panicked"),
    "os_exit": ("not_bound", "probe: ends the process (exit code 9) in import"),
    "segfault": ("not_bound", "probe: crashes the process (SIGSEGV) in kestrel_open"),
    "atexit_hook": ("not_bound", "probe: changes the process's exit code to 7 at exit (an atexit hook)"),
    "thread": ("not_bound", "probe: leaves non-daemon thread 'driver-poller' running after kestrel_close"),
    "sigint": ("not_bound", "probe: replaces the SIGINT handler in import"),
    "hang": ("not_bound", "probe: hangs in import (no answer in 1.5 s"),
}
UNCATCHABLE = ["os_exit", "segfault", "atexit_hook", "thread", "sigint", "hang"]


@pytest.fixture(scope="module")
def fault_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of the kestrel subprocesses: the faults on the path, a probe cache of this module's, and
    the hang guard for a probe's timeout (a busy machine can hold a probe past the default) but the hang's."""
    cache = tmp_path_factory.mktemp("faults-probe") / "probes.json"
    keep = {k: v for k, v in os.environ.items() if not k.startswith("KESTREL_") or k == "KESTREL_HOME"}
    return {**keep, "KESTREL_BACKEND_PATH": str(FAULTS), "KESTREL_PROBE_CACHE": str(cache),
            "KESTREL_PROBE_TIMEOUT": str(HANG_GUARD_S), "KESTREL_HANG_PROBE_TIMEOUT": "1.5",
            "KESTREL_MODEL_CACHE": "0"}


def kestrel(args: list[str], env: dict[str, str], timeout: float = HANG_GUARD_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kestrel_core.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _rows(out: str) -> dict[str, dict[str, Any]]:
    """The rows of ``kestrel backends --json`` by name (the reserved-name path plugin as "cpu.py")."""
    rows = {}
    for r in json.loads(out):
        rows["cpu.py" if r["name"] == "cpu" and r["source"].startswith("path") else r["name"]] = r
    assert rows["cpu"]["status"] == "bound" and rows["cpu"]["probe"] == "built in"
    return rows


def test_every_fault_ends_as_one_line_and_the_verdicts_are_cached(fault_env: dict[str, str]) -> None:
    first = kestrel(["backends", "--json"], fault_env)
    assert first.returncode == 0, first.stderr
    rows = _rows(first.stdout)
    for name, (status, reason) in EXPECTED.items():
        assert rows[name]["status"] == status, (name, rows[name])
        assert reason in rows[name]["reason"] and "\n" not in rows[name]["reason"], (name, rows[name]["reason"])
    assert rows["cpu"]["version"] != "6.6.6"
    assert rows["cpu.py"]["status"] == "not_bound" and "the name 'cpu' is reserved" in rows["cpu.py"]["reason"]
    assert rows["hang"]["probe"] == "failed" and rows["os_exit"]["probe"] == "failed"
    again = kestrel(["backends", "--json"], fault_env)
    rows2 = _rows(again.stdout)
    for name in EXPECTED:  # no probe ran: every verdict is the cache's
        assert rows2[name]["reason"] == rows[name]["reason"]
        assert rows2[name]["probe"].endswith("(cached)"), rows2[name]
    table = kestrel(["backends"], fault_env)
    assert table.returncode == 0 and "segfault" in table.stdout and "Traceback" not in table.stderr


def test_run_carries_on_whatever_auto_finds(fault_env: dict[str, str]) -> None:
    out = kestrel(["run", *PRESET, "--json", "hi"], fault_env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["tokens"]) == 3 and result["stats"]["backend"] in ("exit_close", "exit_gemm")
    assert "Traceback" not in out.stderr


def test_sys_exit_in_every_gemm_is_a_decline_and_the_cpu_computes(fault_env: dict[str, str]) -> None:
    out = kestrel(["run", *PRESET, "--json", "--backend", "exit_gemm", "hi"], fault_env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["tokens"]) == 3
    gemm = result["stats"]["offload"]["kestrel_gemm_q8"]
    assert gemm["accepted"] == 0 and set(gemm["declined_reasons"]) <= {"error: SystemExit", "below min FLOPs"}
    assert gemm["declined_reasons"]["error: SystemExit"] > 0


@pytest.mark.parametrize("name", UNCATCHABLE)
def test_asking_for_a_plugin_the_probe_refused_is_a_one_line_error(fault_env: dict[str, str], name: str) -> None:
    out = kestrel(["run", *PRESET, "--backend", name, "hi"], fault_env)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: backend {name!r} is not bound: probe: "), out.stderr


def test_a_real_ctrl_c_still_interrupts(fault_env: dict[str, str]) -> None:
    """The sigint plugin never reached kestrel's process: Ctrl-C stops a long generation."""
    proc = subprocess.Popen([sys.executable, "-m", "kestrel_core.cli", "run", "--preset", "smollm2-135m", "-n",
                             "100000", "--no-chat", "--backend", "exit_close", "hi"], env=fault_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()  # "backend: ..." once the model is loaded and generation starts
    assert line.startswith("backend: exit_close"), line
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    try:
        rc = proc.wait(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running {HANG_GUARD_S:.0f} s after the SIGINT; stderr: {proc.stderr.read()[-2000:]}")
    # 130, or -SIGINT: kestrel run has exited that way after printing "interrupted" since before the probe
    assert rc in (130, -signal.SIGINT) and "interrupted" in proc.stderr.read()


def test_a_site_packages_directory_contributes_only_its_backends(fault_env: dict[str, str]) -> None:
    """Only the package whose source mentions kestrel_backend_info is a candidate: the others (one exits at
    import, one calls os._exit) are never imported, with the probe and without it."""
    for probing in ("1", "0"):
        env = {**fault_env, "KESTREL_BACKEND_PATH": str(SITE), "KESTREL_PROBE": probing}
        out = kestrel(["backends", "--json"], env)
        assert out.returncode == 0, out.stderr
        paths = [r for r in json.loads(out.stdout) if r["source"].startswith("path")]
        assert [(r["name"], r["status"]) for r in paths] == [("site_backend", "bound")], paths
        assert paths[0]["source"] == f"path {SITE / 'kestrel_site_backend'}"


# -- in process: what Python can catch, with the probe and without it ---------------------------------------


@pytest.mark.parametrize("probing", ["1", "0"])
@pytest.mark.parametrize("name", ["exit_import", "exit_info", "exit_open", "base_exception"])
def test_catchable_faults_are_not_bound_in_process(monkeypatch: pytest.MonkeyPatch, name: str, probing: str) -> None:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(FAULTS / f"{name}.py"))
    monkeypatch.setenv("KESTREL_PROBE", probing)
    reg = Registry()
    backend = reg.bind(name)
    assert backend.status == "not_bound" and EXPECTED[name][1] in backend.reason
    assert backend.pm is None and backend.device is None
    assert reg.select("auto").name == "cpu"


@pytest.mark.parametrize("probing", ["1", "0"])
def test_sys_exit_in_close_is_a_warning(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                        probing: str) -> None:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(FAULTS / "exit_close.py"))
    monkeypatch.setenv("KESTREL_PROBE", probing)
    reg = Registry()
    assert reg.bind("exit_close").bound
    reg.close()
    assert "backend exit_close failed to close: SystemExit (the plugin called sys.exit(5))" in caplog.text


def test_without_the_probe_a_sigint_takeover_is_undone_and_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(FAULTS / "sigint.py"))
    monkeypatch.setenv("KESTREL_PROBE", "0")
    before = signal.getsignal(signal.SIGINT)
    reg = Registry()
    assert signal.getsignal(signal.SIGINT) is before
    backend = reg.backends["sigint"]
    assert backend.status == "not_bound" and backend.probe == "off (KESTREL_PROBE=0)"
    assert backend.reason == "its import replaced the SIGINT handler (restored; kestrel must stay interruptible)"


def test_a_keyboard_interrupt_passes_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ctrl_c.py").write_text("raise KeyboardInterrupt\n\ndef kestrel_backend_info(): ...\n")
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "ctrl_c.py"))
    monkeypatch.setenv("KESTREL_PROBE", "0")
    with pytest.raises(KeyboardInterrupt):
        Registry()


# -- the probe's cache and settings -------------------------------------------------------------------------

GOOD = (FIXTURES / "good_gpu.py").read_text()


def test_the_verdict_is_cached_by_the_plugins_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = tmp_path / "ident.py"
    plugin.write_text(GOOD.replace('"good_gpu"', '"ident"'))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(plugin))
    monkeypatch.setenv("KESTREL_PROBE_CACHE", str(tmp_path / "cache.json"))
    assert not Registry().backends["ident"].probe.endswith("(cached)")
    calls: list[int] = []
    real = probe_run.run_probes
    monkeypatch.setattr(probe_run, "run_probes", lambda targets: calls.append(len(targets)) or real(targets))
    assert Registry().backends["ident"].probe == "ok (cached)" and calls == []
    plugin.write_text(plugin.read_text() + "\n# changed\n")
    os.utime(plugin, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert Registry().backends["ident"].probe.startswith("ok (") and calls == [1]  # changed: probed again
    assert Registry().backends["ident"].probe == "ok (cached)" and calls == [1]
    monkeypatch.setenv("KESTREL_PROBE", "always")
    Registry()
    assert calls == [1, 1]
    assert Registry(options={"device": "2"}).backends["ident"].probe != "ok (cached)"  # other open options
    cache = json.loads((tmp_path / "cache.json").read_text())
    assert list(cache["plugins"]) == [f"path {plugin}"]


def test_a_probe_that_timed_out_is_probed_again_under_a_longer_timeout(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow first import times out; its verdict is cached for that timeout (and any shorter), and raising the
    timeout, as the reason advises (the general setting or the plugin's own), probes it again."""
    plugin = tmp_path / "slow.py"
    plugin.write_text("import time\n\ntime.sleep(1.5)\n" + GOOD.replace('"good_gpu"', '"slow"'))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(plugin))
    monkeypatch.setenv("KESTREL_PROBE_CACHE", str(tmp_path / "cache.json"))
    calls: list[int] = []
    real = probe_run.run_probes
    monkeypatch.setattr(probe_run, "run_probes", lambda targets: calls.append(len(targets)) or real(targets))
    monkeypatch.setenv("KESTREL_PROBE_TIMEOUT", "0.3")
    slow = Registry().backends["slow"]
    assert slow.probe == "failed" and "hangs in import (no answer in 0.3 s; KESTREL_PROBE_TIMEOUT" in slow.reason
    monkeypatch.setenv("KESTREL_PROBE_TIMEOUT", "0.2")
    assert Registry().backends["slow"].probe == "failed (cached)" and calls == [1]
    monkeypatch.setenv("KESTREL_PROBE_TIMEOUT", str(HANG_GUARD_S))
    assert Registry().bind("slow").bound and calls == [1, 1]
    monkeypatch.setenv("KESTREL_PROBE_TIMEOUT", "0.3")
    assert Registry().backends["slow"].probe == "ok (cached)" and calls == [1, 1]
    plugin.write_text(plugin.read_text().replace("time.sleep(1.5)", "time.sleep(1.6)"))
    os.utime(plugin, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert Registry().backends["slow"].probe == "failed" and calls == [1, 1, 1]
    monkeypatch.setenv("KESTREL_SLOW_PROBE_TIMEOUT", str(HANG_GUARD_S))
    assert Registry().backends["slow"].probe.startswith("ok (") and calls == [1, 1, 1, 1]


@pytest.mark.parametrize("probing", ["1", "0"])
def test_a_path_backend_refused_after_its_backend_info_is_listed_by_its_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, probing: str) -> None:
    """An API version kestrel does not have refuses it, but its BackendInfo.name was returned: the listing, and
    the name `--backend` takes, is that one, not the file's."""
    plugin = tmp_path / "kestrel_future.py"
    plugin.write_text(GOOD.replace('"good_gpu"', '"future"').replace('"1.0", API_VERSION', '"1.0", "1.99"'))
    assert '"1.99"' in plugin.read_text()
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(plugin))
    monkeypatch.setenv("KESTREL_PROBE_CACHE", str(tmp_path / "cache.json"))
    monkeypatch.setenv("KESTREL_PROBE", probing)
    reg = Registry()
    assert "kestrel_future" not in reg.backends
    future = reg.bind("future")
    assert future.status == "not_bound" and "incompatible API version 1.99" in future.reason
    assert future.named_by == "BackendInfo.name"


def test_a_path_backends_probe_timeout_is_named_by_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe runs before BackendInfo.name is known: the file's name keys the plugin's own timeout."""
    plugin = tmp_path / "kestrel_lazy.py"
    plugin.write_text("import time\n\ntime.sleep(1.5)\n" + GOOD.replace('"good_gpu"', '"lazy"'))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(plugin))
    monkeypatch.setenv("KESTREL_PROBE_CACHE", str(tmp_path / "cache.json"))
    monkeypatch.setenv("KESTREL_PROBE", "always")
    monkeypatch.setenv("KESTREL_KESTREL_LAZY_PROBE_TIMEOUT", "0.3")
    assert "no answer in 0.3 s" in Registry().backends["kestrel_lazy"].reason


def test_the_cache_lives_under_kestrel_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KESTREL_PROBE_CACHE")
    monkeypatch.setenv("KESTREL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(FIXTURES / "good_gpu.py"))
    assert Registry().bind("good_gpu").bound
    assert f"path {FIXTURES / 'good_gpu.py'}" in json.loads((tmp_path / "home" / "probes.json").read_text())["plugins"]


@pytest.mark.parametrize("kind", ["text", "json", "link", "directory"])
def test_a_file_the_cache_setting_names_that_is_no_probe_cache_is_left_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kind: str) -> None:
    """The backend still binds; the user's file (or link, or directory) is as it was, and a warning says why
    nothing is cached."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    notes.chmod(0o644)
    target = tmp_path / "target"
    if kind == "text":
        notes.rename(target)
    elif kind == "json":
        target.write_text('{"format": 1, "mine": true}')
    elif kind == "link":
        target.symlink_to(notes)
    else:
        target.mkdir()
    before = {p: (p.lstat().st_mode, p.read_bytes() if p.is_file() and not p.is_symlink() else None)
              for p in tmp_path.iterdir()}
    monkeypatch.setenv("KESTREL_PROBE_CACHE", str(target))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(FIXTURES / "good_gpu.py"))
    assert Registry().bind("good_gpu").bound
    after = {p: (p.lstat().st_mode, p.read_bytes() if p.is_file() and not p.is_symlink() else None)
             for p in tmp_path.iterdir()}
    assert after == before
    assert f"{target} is not a probe cache" in caplog.text


@pytest.mark.parametrize("kind", ["empty", "probe cache"])
def test_the_cache_is_written_over_an_empty_file_or_an_older_cache(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    target = tmp_path / "probes.json"
    target.write_text("" if kind == "empty" else '{"format": 0, "plugins": {"old": {}}}')
    monkeypatch.setenv("KESTREL_PROBE_CACHE", str(target))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(FIXTURES / "good_gpu.py"))
    assert Registry().bind("good_gpu").bound
    assert f"path {FIXTURES / 'good_gpu.py'}" in json.loads(target.read_text())["plugins"]


def test_the_cpu_is_never_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_PLUGINS", "")
    monkeypatch.setattr(probe_run, "run_probes", lambda targets: pytest.fail("probed"))
    reg = Registry()
    assert reg.select("auto").name == "cpu" and reg.backends["cpu"].probe == "built in"


@pytest.mark.parametrize(("var", "value", "message"), [
    ("KESTREL_PROBE", "maybe", "KESTREL_PROBE must be 1, 0 or always"),
    ("KESTREL_PROBE_TIMEOUT", "soon", "KESTREL_PROBE_TIMEOUT must be a number of seconds"),
    ("KESTREL_GOOD_GPU_PROBE_TIMEOUT", "-1", "KESTREL_GOOD_GPU_PROBE_TIMEOUT must be a number of seconds >= 0.001"),
    ("KESTREL_GOOD_GPU_PROBE_TIMEOUT", "0", "KESTREL_GOOD_GPU_PROBE_TIMEOUT must be a number of seconds >= 0.001"),
    ("KESTREL_PROBE_TIMEOUT", "nan", "KESTREL_PROBE_TIMEOUT must be a number of seconds"),
])
def test_bad_probe_settings_are_one_line_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, var: str,
                                                value: str, message: str) -> None:
    monkeypatch.setenv("KESTREL_PROBE_CACHE", str(tmp_path / "cache.json"))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(FIXTURES / "good_gpu.py"))
    monkeypatch.setenv(var, value)
    with pytest.raises(KestrelError, match=message):
        Registry().bind("good_gpu")


def test_a_probe_that_cannot_run_refuses_but_is_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_PROBE_CACHE", str(tmp_path / "cache.json"))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(FIXTURES / "good_gpu.py"))
    probe_run._stop_server()
    boot = probe_run._Server.BOOT
    monkeypatch.setattr(probe_run._Server, "BOOT", "raise SystemExit(1)")  # the server dies at once, twice
    backend = Registry().bind("good_gpu")
    assert backend.reason == "probe: the probe process could not run (KESTREL_PROBE=0 skips it)"
    probe_run._stop_server()
    monkeypatch.setattr(probe_run._Server, "BOOT", boot)
    assert Registry().bind("good_gpu").bound  # probed again, not read from the cache


def test_a_probe_cache_that_cannot_be_written_leaves_no_temp_file(tmp_path: Path, monkeypatch) -> None:
    """A full disk: the verdicts are probed again next time, and nothing is left in KESTREL_HOME."""
    from kestrel_core import probe

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(probe.json, "dump", full)
    probe._write_cache(tmp_path / "probes.json", {"x": {"identity": "i", "verdict": {}}})
    assert list(tmp_path.iterdir()) == []
