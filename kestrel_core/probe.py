"""The plugin probe: a backend's first import, open and GEMMs run in a child process before kestrel's own.

Python catches what a plugin raises (the registry catches ``BaseException``s and ``sys.exit`` too); it
cannot catch a plugin that ends the process (``os._exit``, a segfault), hangs, replaces the SIGINT handler, or
leaves a non-daemon thread or an ``atexit`` hook that keeps the process from exiting or changes its exit
code. So each new or changed plugin first runs in a child process: import, ``kestrel_backend_info``,
``kestrel_open`` (with the registry's options), one tiny ``kestrel_gemm_q8`` and ``kestrel_gemm_f32``,
``kestrel_close``, then the interpreter's exit sequence (non-daemon threads joined, ``atexit`` hooks run).
A child that dies, overruns its timeout, changes a signal handler, leaves a thread or exits non-zero is a
failed probe, and the plugin is not bound: it is never imported into kestrel's process.

Errors Python can catch (an exception in ``kestrel_open``, ``BackendUnavailable``...) do not fail a probe:
the child stops there, as the in-process binding will, and reports them to the debug log only.

The verdict is cached in ``$KESTREL_PROBE_CACHE`` (default ``$KESTREL_HOME/probes.json``) under the
candidate's source (its path, or its entry point), with its identity: the size and mtime of every file of
the module or package, the distribution's name and version, kestrel's and Python's versions and the open
options. A later run with the same identity reads the verdict and starts nothing.

Children are forked from a probe server (one per kestrel process, started on the first probe, exiting when
idle or when kestrel exits) that has kestrel_core and the CPU backend imported, so a probe costs the plugin's
own work, not an interpreter's start; several plugins are probed in parallel. POSIX only: where ``os.fork``
is missing, plugins are not probed (the in-process guards still apply).

Environment: ``KESTREL_PROBE`` (``1``/unset: probe new or changed plugins; ``0``: never probe; ``always``:
ignore the cache), ``KESTREL_PROBE_TIMEOUT`` (seconds per plugin, default 20),
``KESTREL_<NAME>_PROBE_TIMEOUT`` (one plugin's), ``KESTREL_PROBE_CACHE`` (the cache file).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kestrel_core.errors import KestrelError

log = logging.getLogger("kestrel")

PROBE_ENV = "KESTREL_PROBE"
TIMEOUT_ENV = "KESTREL_PROBE_TIMEOUT"
CACHE_ENV = "KESTREL_PROBE_CACHE"
CHILD_ENV = "KESTREL_PROBE_CHILD"  # set in the probe's children (internal)
DEFAULT_TIMEOUT = 20.0
CACHE_FORMAT = 1
MAX_PARALLEL = 8
SERVER_IDLE_S = 60.0  # the probe server exits after this long without work
SERVER_START_S = 60.0  # how long the server may take to import kestrel_core and answer
KILL_GRACE_S = 5.0  # a probe killed for its timeout that has not died after this long is given up on
IDENTITY_MAX_FILES = 2000
WATCHED_SIGNALS = tuple(getattr(signal, s) for s in ("SIGINT", "SIGTERM") if hasattr(signal, s))

# What each phase of the child is, for the reasons: the child writes a phase's name before it starts.
PHASES = {
    "start": "its start", "import": "import", "info": "kestrel_backend_info", "open": "kestrel_open",
    "gemm_q8": "kestrel_gemm_q8", "gemm_f32": "kestrel_gemm_f32", "close": "kestrel_close",
    "done": "the checks after kestrel_close", "exit": "exit",
}


@dataclass(frozen=True)
class Target:
    """One candidate to probe: ``kind`` "path" (``spec`` a file or package directory) or "entry point"
    (``spec`` the entry point's name); ``key`` names it in the cache."""

    key: str
    name: str
    kind: str
    spec: str
    identity: dict[str, Any]
    options: dict[str, str]


@dataclass
class Verdict:
    ok: bool
    reason: str = ""  # why the plugin fails the probe: one line
    name: str = ""  # BackendInfo.name as the child saw it ("" where it got no BackendInfo)
    note: str = ""  # a catchable error where the child stopped (informational)
    seconds: float = 0.0
    cached: bool = False
    final: bool = True  # False: the probe itself failed (not the plugin): not cached

    @property
    def summary(self) -> str:
        """For the ``probe`` column of ``kestrel backends``."""
        if not self.ok:
            return "failed" + (" (cached)" if self.cached else "")
        return "ok (cached)" if self.cached else f"ok ({self.seconds:.1f} s)"


# -- settings ----------------------------------------------------------------------------------------------


def mode() -> str:
    """``on`` (probe new or changed plugins), ``off`` or ``always``."""
    raw = os.environ.get(PROBE_ENV, "").strip().lower()
    if raw in ("", "1", "on", "yes", "true"):
        return "on"
    if raw in ("0", "off", "no", "false"):
        return "off"
    if raw == "always":
        return "always"
    raise KestrelError(f"{PROBE_ENV} must be 1, 0 or always, got {os.environ[PROBE_ENV]!r}")


def in_child() -> bool:
    """Whether this process is a probe's child (a Registry built there by the plugin must not import or probe
    the other plugins on the path)."""
    return os.environ.get(CHILD_ENV) == "1"


def supported() -> bool:
    return hasattr(os, "fork") and sys.platform != "win32"


def _env_name(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.upper())


def timeout_for(name: str) -> float:
    for var in (f"KESTREL_{_env_name(name)}_PROBE_TIMEOUT", TIMEOUT_ENV):
        raw = os.environ.get(var)
        if raw is not None:
            try:
                value = float(raw)
            except ValueError:
                raise KestrelError(f"{var} must be a number of seconds, got {raw!r}") from None
            if not value > 0:
                raise KestrelError(f"{var} must be a positive number of seconds, got {raw!r}")
            return value
    return DEFAULT_TIMEOUT


def cache_path() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    from kestrel_core.model.pull import kestrel_home

    return kestrel_home() / "probes.json"


# -- identity ----------------------------------------------------------------------------------------------


def _files_signature(root: Path) -> list[Any]:
    """[size, mtime_ns] of a file, or [files, total size, newest mtime_ns, hash of the names+stats] of a
    package directory (its files, without __pycache__): any edit, added or removed file changes it."""
    try:
        if not root.is_dir():
            st = root.stat()
            return [st.st_size, st.st_mtime_ns]
        entries = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            for f in sorted(filenames):
                if f.endswith((".pyc", ".pyo")):
                    continue
                st = os.stat(os.path.join(dirpath, f))
                entries.append((os.path.relpath(os.path.join(dirpath, f), root), st.st_size, st.st_mtime_ns))
                if len(entries) >= IDENTITY_MAX_FILES:
                    break
            if len(entries) >= IDENTITY_MAX_FILES:
                break
    except OSError as exc:
        return [f"unreadable: {type(exc).__name__}"]
    import hashlib

    digest = hashlib.sha1(repr(entries).encode()).hexdigest()[:16]
    return [len(entries), sum(e[1] for e in entries), max((e[2] for e in entries), default=0), digest]


def _base_identity(options: Mapping[str, str]) -> dict[str, Any]:
    import kestrel_core

    return {"kestrel": kestrel_core.__version__, "python": sys.version.split()[0], "executable": sys.executable,
            "options": {str(k): str(v) for k, v in sorted(options.items())}}


def path_identity(path: Path, options: Mapping[str, str]) -> dict[str, Any]:
    return {**_base_identity(options), "path": str(path), "files": _files_signature(path)}


def entry_point_identity(ep: Any, options: Mapping[str, str]) -> dict[str, Any]:
    """Without importing anything: the distribution, and the files of the entry point's top-level module."""
    import importlib.util

    dist = getattr(ep, "dist", None)
    ident: dict[str, Any] = {**_base_identity(options), "entry_point": f"{ep.name} = {ep.value}",
                             "dist": f"{dist.metadata['Name']} {dist.version}" if dist is not None else ""}
    top = ep.value.split(":")[0].split(".")[0].strip()
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: found, not imported
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        locations = list(spec.submodule_search_locations)
        ident["files"] = [_files_signature(Path(p)) for p in locations]
        ident["location"] = locations
    elif spec is not None and spec.origin:
        ident["files"] = _files_signature(Path(spec.origin))
        ident["location"] = spec.origin
    else:
        ident["files"] = "not found"
    return ident


# -- the cache ---------------------------------------------------------------------------------------------


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("plugins"), dict):
        return {}
    return data["plugins"]


def _write_cache(path: Path, updates: Mapping[str, dict[str, Any]]) -> None:
    """Merge ``updates`` into the cache file (atomically: another kestrel may be writing it too)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        plugins = _read_cache(path)
        plugins.update(updates)
        fd, tmp = tempfile.mkstemp(prefix=".probes-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"format": CACHE_FORMAT, "plugins": plugins}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: probes are then repeated, nothing else changes
        log.debug("kestrel: cannot write the probe cache %s: %s", path, exc)


def cached(targets: Iterable[Target]) -> dict[str, Verdict]:
    """The cached verdicts of ``targets`` whose identity has not changed."""
    plugins = _read_cache(cache_path())
    found = {}
    for t in targets:
        entry = plugins.get(t.key)
        if isinstance(entry, dict) and entry.get("identity") == t.identity and isinstance(entry.get("verdict"), dict):
            try:
                found[t.key] = Verdict(**{**entry["verdict"], "cached": True})
            except TypeError:
                continue
    return found


def check(targets: list[Target]) -> dict[str, Verdict]:
    """The verdict for every target: cached where its identity is unchanged (unless KESTREL_PROBE=always),
    else probed now (in parallel) and cached."""
    if not targets:
        return {}
    verdicts = {} if mode() == "always" else cached(targets)
    todo = [t for t in targets if t.key not in verdicts]
    if todo:
        fresh = _probe(todo)
        _write_cache(cache_path(), {
            t.key: {"identity": t.identity, "verdict": {**asdict(fresh[t.key]), "cached": False},
                    "name": t.name, "probed_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
            for t in todo if fresh[t.key].final})
        verdicts.update(fresh)
    return verdicts


# -- the parent side ---------------------------------------------------------------------------------------


class _Server:
    """The probe server process and the line-delimited JSON on its pipes."""

    BOOT = "import sys, json; sys.path[:] = json.loads(sys.argv[1]); from kestrel_core.probe import _serve; _serve()"

    def __init__(self) -> None:
        env = {**os.environ, PROBE_ENV: "0"}
        self.proc = subprocess.Popen([sys.executable, "-c", self.BOOT, json.dumps(sys.path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                     start_new_session=True, close_fds=True)
        self._buf = b""

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, msg: dict[str, Any]) -> bool:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
            self.proc.stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def read(self, timeout: float) -> list[dict[str, Any]] | None:
        """Messages that arrive within ``timeout`` s; None once the server has gone (EOF)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], max(timeout, 0.0))
        if not ready:
            return []
        data = os.read(fd, 1 << 16)
        if not data:
            return None
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and every probe it forked
        except (OSError, AttributeError):
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass


_SERVER: _Server | None = None
_LOCK = threading.Lock()


def _server() -> _Server:
    global _SERVER
    if _SERVER is None or not _SERVER.alive:
        if _SERVER is not None:
            _SERVER.kill()
        _SERVER = _Server()
    return _SERVER


@atexit.register
def _stop_server() -> None:
    global _SERVER
    if _SERVER is not None:
        _SERVER.kill()
        _SERVER = None


def _forget_server() -> None:
    """In a forked child of kestrel: the server is the parent's, not ours to use or kill."""
    global _SERVER
    _SERVER = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_server)


def _probe(targets: list[Target]) -> dict[str, Verdict]:
    if not supported():
        return {t.key: Verdict(True, note="not probed: no os.fork on this platform") for t in targets}
    with _LOCK:
        tmp = Path(tempfile.mkdtemp(prefix="kestrel-probe-"))
        try:
            return _run(targets, tmp)
        except BaseException:
            _stop_server()  # interrupted: no probe outlives us
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _run(targets: list[Target], tmp: Path) -> dict[str, Verdict]:
    ids = {f"p{i}": t for i, t in enumerate(targets)}
    queue = list(ids)
    sent: dict[str, float] = {}  # id -> when it was sent (not yet acknowledged)
    running: dict[str, tuple[float, float]] = {}  # id -> (start, deadline)
    killed: dict[str, float] = {}  # id -> when its kill was asked for
    results: dict[str, Verdict] = {}
    restarts = 0
    server = _server()
    while len(results) < len(ids):
        while queue and len(sent) + len(running) - len(killed) < MAX_PARALLEL:
            key = queue.pop(0)
            t = ids[key]
            server.send({"id": key, "kind": t.kind, "spec": t.spec, "name": t.name, "report": str(tmp / key),
                         "options": t.options, "env": dict(os.environ), "cwd": os.getcwd(), "sys_path": list(sys.path)})
            sent[key] = time.monotonic()
        now = time.monotonic()
        deadlines = [d for k, (_, d) in running.items() if k not in killed]
        msgs = server.read(min([0.5] + [d - now for d in deadlines]))
        now = time.monotonic()
        stuck = [k for k, at in sent.items() if now - at > SERVER_START_S]
        if msgs is None or stuck:  # the server has gone (or hangs): restart it once for what it never started
            for k in running:
                results[k] = Verdict(False, "probe: the probe server died while probing it", final=False)
            lost = list(sent)
            running.clear()
            killed.clear()
            sent.clear()
            server.kill()
            restarts += 1
            if restarts > 1:
                for k in lost + queue:
                    results[k] = Verdict(False, "probe: the probe process could not run (KESTREL_PROBE=0 skips it)",
                                         final=False)
                break
            queue[:0] = lost
            server = _server()
            continue
        for msg in msgs:
            key = msg.get("id")
            if key not in ids or key in results:
                continue
            if "pid" in msg:
                sent.pop(key, None)
                running[key] = (now, now + timeout_for(ids[key].name))
            elif "status" in msg:
                start = running.pop(key, (now, now))[0]
                results[key] = _verdict(tmp / key, int(msg["status"]), key in killed, timeout_for(ids[key].name),
                                        now - start)
                killed.pop(key, None)
        for key, (start, deadline) in list(running.items()):
            if key not in killed and now >= deadline:
                killed[key] = now
                server.send({"kill": key})
            elif key in killed and now - killed[key] > KILL_GRACE_S:  # unkillable for now (a driver call)
                running.pop(key)
                killed.pop(key)
                results[key] = _verdict(tmp / key, signal.SIGKILL, True, timeout_for(ids[key].name), now - start)
    return {ids[k].key: v for k, v in results.items()}


def _phases(report: Path) -> list[dict[str, Any]]:
    try:
        lines = report.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            break  # a line cut short by the crash
    return out


def _verdict(report: Path, status: int, timed_out: bool, timeout: float, seconds: float) -> Verdict:
    phases = _phases(report)
    last = phases[-1]["phase"] if phases else "start"
    where = PHASES.get(last, last)
    name = next((p["name"] for p in phases if p.get("name")), "")
    done = next((p for p in phases if p["phase"] == "done"), None)
    note = str(done.get("stopped", "")) if done else ""
    try:
        tail = (report.parent / (report.name + ".err")).read_text(errors="replace").strip().splitlines()[-3:]
    except OSError:
        tail = []
    reason = ""
    if timed_out:
        reason = (f"the process did not exit within {timeout:g} s (a non-daemon thread or an atexit hook keeps it "
                  f"alive)" if last == "exit" else f"hangs in {where} (no answer in {timeout:g} s; "
                  f"{TIMEOUT_ENV} raises the limit)")
    elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            signame = signal.Signals(sig).name
        except ValueError:
            signame = f"signal {sig}"
        reason = (f"crashes the process ({signame}) at exit (an atexit hook)" if last == "exit"
                  else f"crashes the process ({signame}) in {where}")
    else:
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
        if last == "exit" and code != 0:
            reason = f"changes the process's exit code to {code} at exit (an atexit hook)"
        elif last != "exit" and done is None:
            reason = f"ends the process (exit code {code}) in {where}"
        elif done is not None and done.get("problems"):
            reason = "; ".join(str(p) for p in done["problems"])
    if reason:
        log.debug("kestrel probe: %s (stderr: %s)", reason, " | ".join(tail))
        return Verdict(False, "probe: " + reason, name, note, round(seconds, 3))
    return Verdict(True, "", name, note, round(seconds, 3))


# -- the server and the child ------------------------------------------------------------------------------


def _send(msg: dict[str, Any]) -> None:
    os.write(1, json.dumps(msg).encode() + b"\n")


def _serve() -> None:
    """The probe server: forks one child per request; reports each child's pid and wait status."""
    import kestrel_cpu  # what every probe needs, imported (and its small kernels loaded) once

    _warm(kestrel_cpu)
    children: dict[int, str] = {}
    pids: dict[str, int] = {}
    buf = b""
    idle_since = time.monotonic()
    while True:
        ready, _, _ = select.select([0], [], [], 0.02 if children else 1.0)
        if ready:
            data = os.read(0, 1 << 16)
            if not data:  # kestrel has gone: so do its probes
                for pid in children:
                    _kill(pid)
                os._exit(0)
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                msg = json.loads(line)
                if "kill" in msg:
                    pid = pids.get(msg["kill"], 0)
                    if pid in children:
                        _kill(pid)
                    continue
                pid = os.fork()
                if pid == 0:
                    _child(msg)  # never returns
                children[pid] = msg["id"]
                pids[msg["id"]] = pid
                _send({"id": msg["id"], "pid": pid})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            key = children.pop(pid, None)
            if key is not None:
                _send({"id": key, "status": status})
        if children or ready:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > SERVER_IDLE_S:
            os._exit(0)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _smoke_problem() -> tuple[Any, Any, Any, Any]:
    """A tiny GEMM (M=2, N=8, K=64): (a, a_codes, a_scales, weight), serial-sized everywhere."""
    import numpy as np

    from kestrel_core.contract import quantize_activations, quantize_weight_reference

    rng = np.random.default_rng(0)
    weight = quantize_weight_reference(rng.standard_normal((8, 64)).astype(np.float32))
    a = rng.standard_normal((2, 64)).astype(np.float32)
    a_codes, a_scales = quantize_activations(a, weight.group_size)
    return a, a_codes, a_scales, weight


def _warm(kestrel_cpu: Any) -> None:
    try:
        a, a_codes, a_scales, weight = _smoke_problem()
        device = kestrel_cpu.kestrel_open(options={})
        kestrel_cpu.kestrel_gemm_q8(device=device, a_codes=a_codes, a_scales=a_scales, weight=weight, wkey=0)
        kestrel_cpu.kestrel_gemm_f32(device=device, a=a, weight=weight, wkey=0)
    except Exception:  # only a speed-up
        pass


def _child(msg: dict[str, Any]) -> None:
    code = 0
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        err = os.open(msg["report"] + ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.dup2(err, 2)
        os.environ.clear()
        os.environ.update(msg["env"])
        os.environ[PROBE_ENV] = "0"
        os.environ[CHILD_ENV] = "1"
        os.chdir(msg["cwd"])
        sys.path[:] = msg["sys_path"]
        atexit._clear()  # the server's own: only the plugin's hooks run at this child's exit
        _probe_in_child(msg)
    except BaseException:
        code = 70
    os._exit(code)


class _Stop(Exception):
    pass


def _probe_in_child(msg: dict[str, Any]) -> None:
    from importlib.metadata import entry_points

    from kestrel_core.registry import ENTRY_POINT_GROUP, Backend, _module_from_path, _short, _validate

    report = open(msg["report"], "w", encoding="utf-8")  # noqa: SIM115  (written phase by phase)

    def mark(phase: str, **extra: Any) -> None:
        report.write(json.dumps({"phase": phase, **extra}) + "\n")
        report.flush()

    handlers = {sig: signal.getsignal(sig) for sig in WATCHED_SIGNALS}
    problems: list[str] = []

    def watch(phase: str) -> None:
        for sig, before in handlers.items():
            now = signal.getsignal(sig)
            if now is not before and now != before:
                problems.append(f"replaces the {signal.Signals(sig).name} handler in {PHASES[phase]} "
                                f"(kestrel must stay interruptible)")
                handlers[sig] = now

    if msg["kind"] == "path":
        def load() -> Any:
            return _module_from_path(Path(msg["spec"]))
    else:
        def load() -> Any:
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                if ep.name == msg["spec"]:
                    return ep.load()
            raise ImportError(f"no entry point {msg['spec']!r} in group {ENTRY_POINT_GROUP}")

    backend = Backend(name=msg["name"], source="probe", load=load)
    stopped = ""
    phase = "import"
    device = None
    try:
        mark("import")
        backend.plugin = load()
        watch("import")
        phase = "info"
        mark("info")
        bad = _validate(backend, check_name=False)
        watch("info")
        if bad:
            raise _Stop(bad)
        assert backend.info is not None
        phase = "open"
        mark("open", name=backend.info.name)
        device = backend.hook.kestrel_open(options=dict(msg["options"]))
        watch("open")
        if device is None:
            raise _Stop("kestrel_open returned no device handle")
        a, a_codes, a_scales, weight = _smoke_problem()
        for phase, call in (
                ("gemm_q8", lambda: backend.hook.kestrel_gemm_q8(device=device, a_codes=a_codes, a_scales=a_scales,
                                                                 weight=weight, wkey=0)),
                ("gemm_f32", lambda: backend.hook.kestrel_gemm_f32(device=device, a=a, weight=weight, wkey=0)),
                ("close", lambda: backend.hook.kestrel_close(device=device))):
            mark(phase)
            try:
                call()
            except BaseException as exc:  # caught in process too: only noted
                stopped = stopped or f"{PHASES[phase]}: {_short(exc)}"
            watch(phase)
    except _Stop as stop:
        stopped = str(stop)
    except BaseException as exc:
        stopped = f"{PHASES[phase]}: {_short(exc)}"
        watch(phase)
    lingering = _lingering_threads()
    if lingering:
        problems.append(f"leaves non-daemon thread {lingering[0]!r} running after {PHASES[phase]} "
                        f"(the process could never exit)")
    mark("done", problems=problems, stopped=stopped)
    if problems:
        report.close()
        os._exit(0)
    mark("exit")
    report.close()
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's exit: threads, then atexit
    except BaseException:
        pass
    try:
        atexit._run_exitfuncs()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _lingering_threads(grace: float = 0.5) -> list[str]:
    """Non-daemon threads still alive after ``grace`` s (each is joined briefly first)."""
    end = time.monotonic() + grace
    alive = []
    for t in threading.enumerate():
        if t is threading.main_thread() or t.daemon:
            continue
        t.join(max(end - time.monotonic(), 0.0))
        if t.is_alive():
            alive.append(t.name)
    return alive
