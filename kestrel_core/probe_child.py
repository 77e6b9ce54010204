"""The probe server and its forked children: where a plugin's first import, open and GEMMs run.

The server (``serve``, started by ``probe_run``) imports the CPU backend once, then forks one child per request
read from its stdin and reports on its stdout each child's pid and, later, its wait status. A child
(``_child``) runs one plugin phase by phase, writing each phase's name to its report file before starting it,
so that whatever ends the process, the report says where.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kestrel_core.probe import CHILD_ENV, PHASES, PROBE_ENV, WATCHED_SIGNALS

SERVER_IDLE_S = 60.0  # the probe server exits after this long without work


def _send(msg: dict[str, Any]) -> None:
    os.write(1, json.dumps(msg).encode() + b"\n")


def serve() -> None:
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
    from importlib.metadata import EntryPoint

    from kestrel_core.guard import short
    from kestrel_core.registry import ENTRY_POINT_GROUP, Backend, _module_from_path, _validate

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
        def load() -> Any:  # the very entry point kestrel chose, not the first of its name
            return EntryPoint(msg["name"], msg["spec"], ENTRY_POINT_GROUP).load()

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
                stopped = stopped or f"{PHASES[phase]}: {short(exc)}"
            watch(phase)
    except _Stop as stop:
        stopped = str(stop)
    except BaseException as exc:
        stopped = f"{PHASES[phase]}: {short(exc)}"
        watch(phase)
    lingering = _lingering_threads()
    if lingering:
        problems.append(f"leaves non-daemon thread {lingering[0]!r} running after {PHASES[phase]} "
                        f"(the process could never exit)")
    mark("done", problems=problems, stopped=stopped, name=backend.declared_name)  # learned even where refused
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
