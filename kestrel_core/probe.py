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
options. A later run with the same identity reads the verdict and starts nothing, but for a probe that timed
out, which runs again under a longer timeout than the one it ran out of.

Children are forked from a probe server (one per kestrel process, started on the first probe, exiting when
idle or when kestrel exits) that has kestrel_core and the CPU backend imported, so a probe costs the plugin's
own work, not an interpreter's start; several plugins are probed in parallel. POSIX only: where ``os.fork``
is missing, plugins are not probed (the in-process guards still apply).

This module decides (settings, identities, the cache, ``check``); ``probe_run`` runs the probes from kestrel's
side (the server process, the deadlines, the verdicts from the children's reports), imported only when a
plugin has to be probed; ``probe_child`` is the server and the forked child.

Environment: ``KESTREL_PROBE`` (``1``/unset: probe new or changed plugins; ``0``: never probe; ``always``:
ignore the cache), ``KESTREL_PROBE_TIMEOUT`` (seconds per plugin, default 20),
``KESTREL_<NAME>_PROBE_TIMEOUT`` (one plugin's: NAME its entry point's name, or a path backend's file or directory
name, since the probe learns its ``BackendInfo.name``), ``KESTREL_PROBE_CACHE`` (the cache file).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kestrel_core.env import backend_var, env_flag, env_float, env_str
from kestrel_core.errors import KestrelError

log = logging.getLogger("kestrel")

PROBE_ENV = "KESTREL_PROBE"
TIMEOUT_ENV = "KESTREL_PROBE_TIMEOUT"
CACHE_ENV = "KESTREL_PROBE_CACHE"
MAX_CACHE_BYTES = 1 << 24  # a probe cache holds a few entries a backend: a larger file is not one
CHILD_ENV = "KESTREL_PROBE_CHILD"  # set in the probe's children (internal)
DEFAULT_TIMEOUT = 20.0
MIN_TIMEOUT = 0.001  # seconds; nothing a probe runs (an import, an open) can finish in less
CACHE_FORMAT = 2  # 2: a verdict holds the timeout a probe ran out of
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
    (``spec`` the entry point's value, ``module:attr``); ``key`` names it in the cache."""

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
    timeout: float = 0.0  # the seconds a probe that timed out ran out of (0: it did not time out)

    @property
    def summary(self) -> str:
        """For the ``probe`` column of ``kestrel backends``."""
        if not self.ok:
            return "failed" + (" (cached)" if self.cached else "")
        return "ok (cached)" if self.cached else f"ok ({self.seconds:.1f} s)"


# -- settings ----------------------------------------------------------------------------------------------


def mode() -> str:
    """``on`` (probe new or changed plugins), ``off`` or ``always``."""
    if env_str(PROBE_ENV).lower() == "always":
        return "always"
    try:
        return "on" if env_flag(PROBE_ENV, default=True) else "off"
    except KestrelError:
        raise KestrelError(f"{PROBE_ENV} must be 1, 0 or always, got {os.environ[PROBE_ENV]!r}") from None


def in_child() -> bool:
    """Whether this process is a probe's child (a Registry built there by the plugin must not import or probe
    the other plugins on the path)."""
    return env_flag(CHILD_ENV)


def supported() -> bool:
    return hasattr(os, "fork") and sys.platform != "win32"


def timeout_for(name: str) -> float:
    """Seconds the probe of backend ``name`` may take: its own variable, else the general one, else 20."""
    own = backend_var(name, "PROBE_TIMEOUT")
    return env_float(own if env_str(own) else TIMEOUT_ENV, DEFAULT_TIMEOUT, minimum=MIN_TIMEOUT,
                     what="a number of seconds")


def cache_path() -> Path:
    env = env_str(CACHE_ENV)
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


def _is_replaceable(path: Path) -> bool:
    """Whether the cache may be written at ``path``: nothing there, an empty file, or a probe cache (of any
    format); any other file, link or directory the setting names is the user's and stays as it is."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return True
    if not stat.S_ISREG(st.st_mode):
        return False
    if st.st_size == 0:
        return True
    if st.st_size > MAX_CACHE_BYTES:
        return False
    try:
        data = json.loads(path.read_bytes())
    except ValueError:
        return False
    return isinstance(data, dict) and set(data) == {"format", "plugins"}


def _write_cache(path: Path, updates: Mapping[str, dict[str, Any]]) -> None:
    """Merge ``updates`` into the cache file (atomically: another kestrel may be writing it too)."""
    try:
        if not _is_replaceable(path):
            log.warning("%s is not a probe cache, so it is left as it is and probe verdicts are not "
                        "cached (%s names the cache file)", path, CACHE_ENV)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        plugins = _read_cache(path)
        plugins.update(updates)
        fd, tmp = tempfile.mkstemp(prefix=".probes-", suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"format": CACHE_FORMAT, "plugins": plugins}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:  # a full disk: no temp file left behind
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:  # a read-only home: probes are then repeated, nothing else changes
        log.debug("kestrel: cannot write the probe cache %s: %s", path, exc)


def cached(targets: Iterable[Target]) -> dict[str, Verdict]:
    """The cached verdicts of ``targets`` whose identity has not changed; a probe that timed out stands only while
    the timeout is no longer than the one it ran out of (a slow first import gets its chance under a longer one,
    and a plugin that hangs is not waited for at every start)."""
    plugins = _read_cache(cache_path())
    found = {}
    for t in targets:
        entry = plugins.get(t.key)
        if isinstance(entry, dict) and entry.get("identity") == t.identity and isinstance(entry.get("verdict"), dict):
            try:
                verdict = Verdict(**{**entry["verdict"], "cached": True})
            except TypeError:
                continue
            if not verdict.timeout or timeout_for(t.name) <= verdict.timeout:
                found[t.key] = verdict
    return found


def check(targets: list[Target]) -> dict[str, Verdict]:
    """The verdict for every target: cached where its identity is unchanged (unless KESTREL_PROBE=always),
    else probed now (in parallel) and cached."""
    if not targets:
        return {}
    verdicts = {} if mode() == "always" else cached(targets)
    todo = [t for t in targets if t.key not in verdicts]
    if todo:
        from kestrel_core.probe_run import run_probes  # subprocess, select...: only when something is probed

        fresh = run_probes(todo)
        _write_cache(cache_path(), {
            t.key: {"identity": t.identity, "verdict": {**asdict(fresh[t.key]), "cached": False},
                    "name": t.name, "probed_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
            for t in todo if fresh[t.key].final})
        verdicts.update(fresh)
    return verdicts
