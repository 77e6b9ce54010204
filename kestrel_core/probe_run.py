"""Running plugin probes from kestrel's side: the probe server process, the deadlines, the verdicts.

``run_probes`` sends each target to the probe server (``probe_child``, started on the first probe and
restarted once if it dies), kills a child that overruns its timeout, and reads each verdict from the report
the child wrote phase by phase and from its wait status.
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
from pathlib import Path
from typing import Any

from kestrel_core.probe import PHASES, PROBE_ENV, TIMEOUT_ENV, Target, Verdict, supported, timeout_for

log = logging.getLogger("kestrel")

MAX_PARALLEL = 8
SERVER_START_S = 60.0  # how long the server may take to import kestrel_core and answer
KILL_GRACE_S = 5.0  # a probe killed for its timeout that has not died after this long is given up on


class _Server:
    """The probe server process and the line-delimited JSON on its pipes."""

    BOOT = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
            "from kestrel_core.probe_child import serve; serve()")

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


def run_probes(targets: list[Target]) -> dict[str, Verdict]:
    """Probe every target now (in parallel); each verdict keyed by ``Target.key``."""
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
        return Verdict(False, "probe: " + reason, name, note, round(seconds, 3), timeout=timeout if timed_out else 0.0)
    return Verdict(True, "", name, note, round(seconds, 3))
