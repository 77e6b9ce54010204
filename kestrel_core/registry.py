"""Backend discovery and binding: discover, probe, import, validate, open, commit.

Any failure leaves that backend not bound with a precise reason and no hooks registered anywhere; kestrel
itself always carries on, on the CPU backend. Discovery order: ``KESTREL_BACKEND_PATH`` (explicit files or
directories, for development), then the installed entry points of group ``kestrel.backends``.
``KESTREL_PLUGINS`` is a comma-separated allow-list (unset: all; empty: only cpu).

Plugin code never takes kestrel down: whatever it raises in process (``sys.exit`` and other
``BaseException``s included; only a real ``KeyboardInterrupt`` passes) ends as "not bound" or a decline
with the reason, and a plugin that replaces the SIGINT or SIGTERM handler at import or open is refused (the
handler is restored). What Python cannot catch (``os._exit``, a segfault, a hang, a thread or ``atexit``
hook that keeps the process alive) is found by the probe (``kestrel_core.probe``): each new or changed
plugin first runs in a child process, and only one that passes is imported here.

Names: the built-in reference is ``cpu`` (no plugin may take that name): the module ``kestrel_cpu``, imported
by name when it is first bound, never probed (its entry point, when installed, names the same module). An
entry point's backend is named by the entry point, and its ``BackendInfo.name`` must say the same; the names of
kestrel's own entry points (its distribution's) are theirs, whatever another package declares; a path
backend is named by its ``BackendInfo.name`` (learned by the probe, or by importing it when probing is off),
else by its file or package directory. A directory on ``KESTREL_BACKEND_PATH`` contributes only the ``.py``
files and packages whose source (the file, or the package's ``__init__.py``) mentions
``kestrel_backend_info``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy

from kestrel_core import hookspecs, probe
from kestrel_core.env import backend_var, env_flag, env_float, env_str
from kestrel_core.errors import BackendUnavailable, KestrelError, safe_repr, safe_text
from kestrel_core.guard import plugin_call, short, took_signals
from kestrel_core.hookspecs import KINDS as KINDS
from kestrel_core.hookspecs import BackendInfo as BackendInfo
from kestrel_core.model.validate import is_number

log = logging.getLogger("kestrel")

ENTRY_POINT_GROUP = "kestrel.backends"
OWN_DISTRIBUTION = "kestrel"  # the distribution that ships kestrel_core and kestrel's own backends
BOUND, NOT_BOUND, CANDIDATE = "bound", "not_bound", "candidate"
CPU = "cpu"  # the built-in reference's name, reserved
CPU_MODULE = "kestrel_cpu"  # the built-in reference's module, imported by name (never a static import here)
FORCE_CPU_ENV = "KESTREL_FORCE_CPU"
PLUGINS_ENV = "KESTREL_PLUGINS"
BACKEND_PATH_ENV = "KESTREL_BACKEND_PATH"
BACKEND_MARKER = b"kestrel_backend_info"  # a path entry's source must mention it to be imported
MARKER_SCAN_BYTES = 1 << 20
NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")
MAX_NAME = 64  # characters of a backend's name
MAX_API_PART = 10_000  # an API version's major and minor are below it
MAX_API_CHARS = 64  # of an API version string (spaces around it included)
OPTION_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


@dataclass
class Backend:
    """One candidate backend and how far it got."""

    name: str
    source: str  # "path /x/y.py" or "entry point pkg.mod"
    load: Callable[[], Any]
    status: str = CANDIDATE
    reason: str = ""
    info: BackendInfo | None = None
    plugin: Any = None
    pm: pluggy.PluginManager | None = None
    device: Any = None
    device_description: str = ""
    probe: str = "-"  # the probe's verdict, for `kestrel backends`
    target: probe.Target | None = None  # what the probe runs; None: nothing to probe (or probed already)
    probe_name: str = ""  # BackendInfo.name as the probe saw it
    declared_name: str = ""  # a valid BackendInfo.name, once kestrel_backend_info has returned one
    named_by: str = "entry point"  # "entry point", "BackendInfo.name", "file name", "built in"

    @property
    def bound(self) -> bool:
        return self.status == BOUND

    @property
    def kind(self) -> str:
        return self.info.kind if self.info else ""

    @property
    def version(self) -> str:
        return self.info.version if self.info else ""

    @property
    def hook(self) -> Any:
        assert self.pm is not None, f"backend {self.name} is not bound"
        return self.pm.hook

    def implements(self, hook_name: str) -> bool:
        return self.pm is not None and bool(getattr(self.pm.hook, hook_name).get_hookimpls())

    @property
    def min_flops(self) -> int:
        """``KESTREL_<NAME>_MIN_FLOPS`` (a finite number >= 0, ``1e7`` allowed), else BackendInfo's."""
        default = self.info.min_flops if self.info else 0
        return int(env_float(backend_var(self.name, "MIN_FLOPS"), default, what="a finite number"))

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "status": self.status, "reason": self.reason, "version": self.version,
            "source": self.source, "kind": self.kind, "device": self.device_description,
            "api_version": ".".join(map(str, self.info.api_version)) if self.info else "",
            "offload": offload_state(self), "probe": self.probe,
        }


def force_cpu() -> bool:
    return env_flag(FORCE_CPU_ENV)


def offload_state(backend: Backend) -> str:
    if not backend.bound:
        return "-"
    if backend.name == CPU:
        return "reference"
    return f"forced to CPU ({FORCE_CPU_ENV})" if force_cpu() else "enabled"


# -- options for kestrel_open -------------------------------------------------------------------------------

_default_options: dict[str, str] = {}


def parse_backend_options(items: Sequence[str] | None) -> dict[str, str]:
    """``KEY=VALUE`` strings (``--backend-option``) -> {KEY: VALUE}; a bad one is a one-line KestrelError."""
    options: dict[str, str] = {}
    for item in items or ():
        key, sep, value = str(item).partition("=")
        if not sep or not OPTION_KEY_RE.fullmatch(key):
            raise KestrelError(f"--backend-option takes KEY=VALUE (KEY: a letter or _, then letters, digits, "
                               f"_ . -), got {item!r}")
        options[key] = value
    return options


def check_options(options: Mapping[str, Any] | None) -> dict[str, str]:
    """Options for ``kestrel_open``: string keys of the KEY syntax, string values."""
    out: dict[str, str] = {}
    for key, value in (options or {}).items():
        if not isinstance(key, str) or not OPTION_KEY_RE.fullmatch(key):
            raise KestrelError(f"backend option key {key!r} is not a valid KEY (a letter or _, then letters, "
                               f"digits, _ . -)")
        if not isinstance(value, str):
            raise KestrelError(f"backend option {key!r} must be a string, got {type(value).__name__}")
        out[key] = value
    return out


@contextlib.contextmanager
def default_options(options: Mapping[str, str] | None) -> Iterator[None]:
    """Within the block, every ``Registry()`` opens its backends with ``options`` (merged under its own):
    how the CLI's ``--backend-option`` reaches ``kestrel_open`` whatever command builds the registry."""
    global _default_options
    saved = _default_options
    _default_options = check_options(options)
    try:
        yield
    finally:
        _default_options = saved


# -- discovery ----------------------------------------------------------------------------------------------


def _allow_list() -> set[str] | None:
    if PLUGINS_ENV not in os.environ:  # unset: every backend; set but empty: only cpu
        return None
    return {CPU} | {name.strip() for name in env_str(PLUGINS_ENV).split(",") if name.strip()}


_PATH_MODULES: set[str] = set()  # sys.modules names this module created for path backends
_IMPORTING: set[Path] = set()  # path backends being imported now (a plugin may build a Registry at import)


def _module_from_path(path: Path) -> ModuleType:
    """Import a backend from a ``.py`` file or a package directory, under its file or directory name."""
    if path.is_dir():
        init = path / "__init__.py"
        if not init.exists():
            raise ImportError(f"{path} is not a package (no __init__.py)")
        spec = importlib.util.spec_from_file_location(path.name, init, submodule_search_locations=[str(path)])
    else:
        spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    existing = sys.modules.get(spec.name)
    if existing is not None and spec.name not in _PATH_MODULES:
        raise ImportError(f"its module name {spec.name!r} is already taken by {getattr(existing, '__file__', None)}"
                          f" (rename the file)")
    if existing is None:  # not yet imported, but installed: it would stand in for that module from then on
        other = importlib.util.find_spec(spec.name)
        if other is not None and other.origin != spec.origin:
            raise ImportError(f"its module name {spec.name!r} is the name of the installed module {other.origin}"
                              f" (rename the file)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    _PATH_MODULES.add(spec.name)
    _IMPORTING.add(path)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    finally:
        _IMPORTING.discard(path)
    return module


def looks_like_backend(path: Path) -> bool:
    """The static test for path entries: the source (a file, or a package's ``__init__.py``) mentions
    ``kestrel_backend_info`` in its first MiB. Nothing is imported."""
    source = path / "__init__.py" if path.is_dir() else path
    try:
        with open(source, "rb") as f:
            return BACKEND_MARKER in f.read(MARKER_SCAN_BYTES)
    except OSError:
        return False


def _path_name(path: Path) -> str:
    return path.stem if path.suffix == ".py" else path.name


def _path_candidates(options: Mapping[str, str]) -> list[Backend]:
    found = []
    for entry in filter(None, env_str(BACKEND_PATH_ENV).split(os.pathsep)):
        path = Path(entry).expanduser()
        if path.name == "__init__.py":  # a package named by its __init__.py: the package
            path = path.parent
        if path.is_dir() and not (path / "__init__.py").exists():
            children = []
            for p in sorted(path.iterdir()):
                is_module = p.suffix == ".py" and p.stem != "__init__" and p.is_file()
                if (is_module or (p / "__init__.py").is_file()) and looks_like_backend(p):
                    children.append(p)
                elif is_module or p.is_dir():
                    log.debug("KESTREL_BACKEND_PATH: skipping %s (no kestrel_backend_info in its source)", p)
            explicit = False
        else:
            children, explicit = [path], True
        for child in children:
            backend = Backend(name=_path_name(child), source=f"path {child}",
                              load=lambda c=child: _module_from_path(c), named_by="file name")
            if explicit and not child.exists():
                _fail(backend, "no such file or directory")
            elif explicit and not looks_like_backend(child):
                _fail(backend, "does not look like a backend: its source never mentions kestrel_backend_info")
            else:
                backend.target = probe.Target(backend.source, backend.name, "path", str(child),
                                              probe.path_identity(child, options), dict(options))
            found.append(backend)
    return found


def _is_own(ep: EntryPoint) -> bool:
    """Whether ``ep`` is one of kestrel's own backends: declared by the distribution that ships kestrel."""
    dist = getattr(ep, "dist", None)
    return dist is not None and re.sub(r"[-_.]+", "-", str(dist.name)).lower() == OWN_DISTRIBUTION


def _entry_point_candidates(options: Mapping[str, str]) -> tuple[list[Backend], list[Backend], Backend | None]:
    """(the plugins' entry points; those another package registered under the name of one of kestrel's own
    backends, never imported; the built-in cpu's own entry point if installed). Which package's entry point is
    found first depends on how kestrel was started (the order of sys.path): kestrel's own keep their names."""
    eps = list(entry_points(group=ENTRY_POINT_GROUP))
    own = {ep.name for ep in eps if _is_own(ep)}
    found, clashing, builtin = [], [], None
    for ep in eps:
        backend = Backend(name=ep.name, source=f"entry point {ep.value}", load=ep.load)
        if ep.name == CPU and ep.value.strip() == CPU_MODULE:
            builtin = backend
        elif ep.name in own and not _is_own(ep):
            clashing.append(_fail(backend, f"the name {ep.name} is kestrel's own"))
        else:
            backend.target = probe.Target(f"entry point {ep.name} = {ep.value}", ep.name, "entry point", ep.value,
                                          probe.entry_point_identity(ep, options), dict(options))
            found.append(backend)
    return found, clashing, builtin


def _load_cpu() -> ModuleType:
    """The built-in reference backend, imported by its module name (never probed: it is kestrel's own)."""
    return importlib.import_module(CPU_MODULE)


def _api_version(raw: Any) -> tuple[int, int] | None:
    """(major, minor) from a tuple/list of two ints or a "1.1" string, each in [0, MAX_API_PART); None if it is
    neither (a string longer than MAX_API_CHARS is not parsed: a plugin's value may be megabytes)."""
    if isinstance(raw, str):
        parts = raw.strip().split(".") if len(raw) <= MAX_API_CHARS else []
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            return None
        api = int(parts[0]), int(parts[1])
    elif isinstance(raw, (tuple, list)) and len(raw) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in raw):
        api = int(raw[0]), int(raw[1])
    else:
        return None
    return api if all(0 <= v < MAX_API_PART for v in api) else None


def _api_compatible(theirs: tuple[int, int]) -> bool:
    ours = hookspecs.API_VERSION
    return len(theirs) == 2 and theirs[0] == ours[0] and theirs[1] <= ours[1]


def _fail(backend: Backend, reason: str) -> Backend:
    if backend.pm is not None and backend.plugin is not None and backend.pm.is_registered(backend.plugin):
        backend.pm.unregister(backend.plugin)
    backend.pm = backend.plugin = backend.device = None
    backend.status, backend.reason = NOT_BOUND, reason
    log.debug("backend %s not bound: %s", backend.name, reason)
    return backend


def _validate(backend: Backend, check_name: bool = True) -> str | None:
    """Register into a private plugin manager and check it; returns a reason on failure."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    backend.pm = pm
    try:
        pm.register(backend.plugin, name=backend.name)
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        return "invalid hook: " + "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    unpassed = _unpassed_arguments(pm)
    if unpassed:
        return f"invalid hook: {unpassed}"
    missing = [h for h in hookspecs.REQUIRED_HOOKS if not backend.implements(h)]
    if missing:
        return f"missing required hook(s): {', '.join(missing)}"
    info = pm.hook.kestrel_backend_info()
    if not isinstance(info, BackendInfo):
        return f"kestrel_backend_info returned {type(info).__name__}, not BackendInfo"
    if type(info.name) is not str or len(info.name) > MAX_NAME or not NAME_RE.fullmatch(info.name) \
            or info.name == "auto":  # exact strings: a subclass's __str__ would run wherever they are shown
        return (f"BackendInfo.name {safe_repr(info.name)} is not a valid name (letters, digits, _ and -, at most "
                f"{MAX_NAME}; not 'auto')")
    backend.declared_name = info.name  # a path backend is listed under it whatever the checks below say
    ours = ".".join(map(str, hookspecs.API_VERSION))
    api = _api_version(info.api_version)
    if api is None:
        return (f"api_version must be (major, minor) such as kestrel_core.API_VERSION or a string like "
                f"{ours!r}, got {safe_repr(info.api_version)}")
    if not _api_compatible(api):
        return f"incompatible API version {api[0]}.{api[1]} (kestrel has {ours})"
    if type(info.version) is not str or type(info.description) is not str:
        return "BackendInfo.version and .description must be strings"
    if not is_number(info.min_flops) or not math.isfinite(info.min_flops) or info.min_flops < 0:
        return f"BackendInfo.min_flops must be a finite number >= 0, got {safe_repr(info.min_flops)}"
    if type(info.kind) is not str or info.kind not in KINDS:
        return f"unknown kind {safe_repr(info.kind)} (expected one of {', '.join(KINDS)})"
    if check_name and info.name != backend.name:
        by = {"entry point": "its entry point", "file name": "its file name"}.get(backend.named_by, "the probe")
        return f"BackendInfo.name {info.name!r} differs from the name {backend.name!r} given by {by}"
    backend.info = dataclasses.replace(info, api_version=api)
    return None


def _unpassed_arguments(pm: pluggy.PluginManager) -> str | None:
    """A hook's argument that no call passes: a keyword-only one without a default (pluggy checks only the
    positional ones against the spec; the calls would all fail), or ``*args`` / ``**kwargs`` (a call passes only
    the arguments the hook's parameters name: a decorator's ``wrapper(*args, **kwargs)`` without
    ``functools.wraps`` would get none)."""
    for caller in pm.hook.__dict__.values():
        for impl in getattr(caller, "get_hookimpls", list)():
            try:
                params = inspect.signature(impl.function).parameters.values()
            except (TypeError, ValueError):
                continue
            bare = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
            if bare:
                return f"{caller.name} takes the keyword-only argument {bare[0]!r}, which no call passes"
            rest = [p for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            if rest:
                star = "*" if rest[0].kind is rest[0].VAR_POSITIONAL else "**"
                return (f"{caller.name} takes {star}{rest[0].name}, which no call fills: a hook gets the arguments "
                        "its parameters name (a decorator's wrapper needs functools.wraps)")
    return None


class Registry:
    """Every candidate backend, bound or not, by name. ``options`` reach every backend's ``kestrel_open``
    (merged over those of an enclosing ``default_options`` block)."""

    def __init__(self, options: Mapping[str, str] | None = None) -> None:
        self.options: dict[str, str] = {**_default_options, **check_options(options)}
        self.backends: dict[str, Backend] = {}
        allow = _allow_list()
        probing = probe.mode()
        paths = _path_candidates(self.options)
        plugins, clashing, builtin = _entry_point_candidates(self.options)
        self.shadowed: list[Backend] = clashing  # candidates never imported: shadowed, or with a reserved name
        cpu = builtin or Backend(CPU, f"built in {CPU_MODULE}", load=_load_cpu)
        cpu.load, cpu.probe, cpu.named_by, cpu.target = _load_cpu, "built in", "built in", None
        self.backends[CPU] = cpu
        self._name_path_backends([p for p in paths if p.status == CANDIDATE], probing)
        for cand in paths + plugins:
            if probing == "off" and cand.target is not None:
                cand.probe, cand.target = "off (KESTREL_PROBE=0)", None
            if cand.name == CPU:
                self.shadowed.append(_fail(cand, "the name 'cpu' is reserved for the built-in reference backend"))
            elif cand.name in self.backends:
                winner = self.backends[cand.name]
                self.shadowed.append(_fail(cand, f"shadowed by the backend of the same name from {winner.source}"))
            else:
                if allow is not None and cand.name not in allow:
                    _fail(cand, "not in KESTREL_PLUGINS")
                self.backends[cand.name] = cand

    def _name_path_backends(self, paths: list[Backend], probing: str) -> None:
        """A path backend is named by its BackendInfo.name: the probe reports it (cached), or, with probing
        off, it is imported and described here."""
        if probing == "off":
            if probe.in_child():  # a Registry built by the plugin a probe is running: import nothing more
                return
            for backend in paths:
                if backend.target is not None and Path(backend.target.spec) in _IMPORTING:
                    continue  # built while this very plugin is being imported: it keeps its file name here
                self._import(backend, check_name=False)
                if backend.declared_name:
                    backend.name, backend.named_by = backend.declared_name, "BackendInfo.name"
            return
        self._probe(paths)
        for backend in paths:  # refused ones too: `--backend NAME` then gives the probe's reason
            if backend.probe_name and NAME_RE.fullmatch(backend.probe_name):
                backend.name, backend.named_by = backend.probe_name, "BackendInfo.name"

    def _probe(self, backends: Sequence[Backend]) -> None:
        """Probe (or read the cached verdict of) every candidate that still needs it, in parallel."""
        todo = [b for b in backends if b.status == CANDIDATE and b.target is not None]
        if not todo:
            return
        verdicts = probe.check([b.target for b in todo if b.target is not None])
        for backend in todo:
            assert backend.target is not None
            verdict = verdicts[backend.target.key]
            backend.target = None
            backend.probe = verdict.summary
            backend.probe_name = verdict.name
            if verdict.note:
                log.debug("backend %s: the probe stopped at %s", backend.name, verdict.note)
            if not verdict.ok:
                _fail(backend, verdict.reason)

    def candidates(self) -> list[Backend]:
        return list(self.backends.values()) + self.shadowed

    def _get(self, name: str) -> Backend:
        backend = self.backends.get(name)
        if backend is None:
            known = ", ".join(sorted(self.backends))
            raise KestrelError(f"unknown backend {name!r} (known: {known})")
        return backend

    def _import(self, backend: Backend, check_name: bool = True) -> Backend:
        """Phases 1-3 in process: import, register and validate, describe."""
        plugin, error, took = plugin_call("import", backend.load)
        if error is not None:
            return _fail(backend, f"import failed: {short(error)}")
        if took:
            return _fail(backend, took_signals("its import", took))
        backend.plugin = plugin
        reason, error, took = plugin_call("kestrel_backend_info", lambda: _validate(backend, check_name))
        if error is not None:
            reason = f"validation failed: {short(error)}"
        elif took:
            reason = took_signals("kestrel_backend_info", took)
        return _fail(backend, reason) if reason else backend

    def describe(self, name: str) -> Backend:
        """Probe, import and validate a backend without opening its device (phases 1-3)."""
        backend = self._get(name)
        if backend.status != CANDIDATE or backend.info is not None:
            return backend
        self._probe([backend])
        if backend.status != CANDIDATE:
            return backend
        return self._import(backend)

    def bind(self, name: str, options: Mapping[str, str] | None = None) -> Backend:
        """Bind one backend (idempotent); never raises for a backend's own failure. ``options`` (default: the
        registry's) are what its ``kestrel_open`` receives."""
        backend = self.describe(name)
        if backend.status != CANDIDATE:
            return backend
        opts = dict(self.options) if options is None else {**self.options, **check_options(options)}
        device, error, took = plugin_call("kestrel_open", lambda: backend.hook.kestrel_open(options=opts))
        if isinstance(error, BackendUnavailable):
            return _fail(backend, safe_text(error))
        if error is not None:
            return _fail(backend, f"device open failed: {short(error)}")
        if took:
            backend.device = device
            self._close(backend)
            return _fail(backend, took_signals("kestrel_open", took))
        if device is None:
            return _fail(backend, "kestrel_open returned no device handle")
        backend.device = device
        description, error, _ = plugin_call("the device's description",
                                            lambda: str(getattr(device, "description", "") or ""))
        # a handle whose description raises (even sys.exit) is still a handle
        backend.device_description = safe_text(description) if error is None and description else backend.kind
        backend.status, backend.reason = BOUND, ""
        return backend

    def bind_all(self, options: Mapping[str, str] | None = None) -> list[Backend]:
        self._probe(list(self.backends.values()))  # every probe at once
        for name in list(self.backends):
            self.bind(name, options)
        return self.candidates()

    def cpu(self) -> Backend:
        cpu = self.bind(CPU)
        if not cpu.bound:
            raise KestrelError(f"the CPU reference backend did not bind: {cpu.reason}")
        return cpu

    def select(self, name: str = "auto", options: Mapping[str, str] | None = None) -> Backend:
        """The backend to run on: ``auto`` = best bound real accelerator (gpu, then npu), else cpu."""
        if name != "auto":
            backend = self.bind(name, options)
            if not backend.bound:
                raise KestrelError(f"backend {name!r} is not bound: {backend.reason}")
            return backend
        self._probe(list(self.backends.values()))
        for kind in ("gpu", "npu"):  # never a simulator
            for backend in list(self.backends.values()):
                if backend.name != CPU and self.describe(backend.name).kind == kind:
                    if self.bind(backend.name, options).bound:
                        return backend
        return self.cpu()

    def _close(self, backend: Backend) -> None:
        _, error, took = plugin_call("kestrel_close", lambda: backend.hook.kestrel_close(device=backend.device))
        if error is not None:
            log.warning("backend %s failed to close: %s", backend.name, short(error))
        if took:
            log.warning("backend %s: %s", backend.name, took_signals("kestrel_close", took))

    def close(self) -> None:
        for backend in self.backends.values():
            if backend.bound:
                self._close(backend)
                _fail(backend, "closed")
