"""Backend discovery and binding: discover, import, validate, open, commit.

Any failure leaves that backend not bound with a precise reason and no hooks registered anywhere; kestrel
itself always carries on, on the CPU backend. Discovery order: ``KESTREL_BACKEND_PATH`` (explicit files or
directories, for development), then the installed entry points of group ``kestrel.backends``.
``KESTREL_PLUGINS`` is an allow-list (unset: all; empty: only cpu).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy

from kestrel_core import hookspecs
from kestrel_core.errors import BackendUnavailable, KestrelError

log = logging.getLogger("kestrel")

ENTRY_POINT_GROUP = "kestrel.backends"
KINDS = ("cpu", "gpu", "npu", "simulator")
BOUND, NOT_BOUND, CANDIDATE = "bound", "not_bound", "candidate"


@dataclass(frozen=True)
class BackendInfo:
    """What ``kestrel_backend_info`` returns."""

    name: str
    version: str
    api_version: tuple[int, int]
    kind: str  # one of KINDS
    min_flops: int = 0  # offloads below this many FLOPs are declined (env KESTREL_<NAME>_MIN_FLOPS wins)
    description: str = ""


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
        env = os.environ.get(f"KESTREL_{self.name.upper()}_MIN_FLOPS")
        if env is not None:
            try:
                return int(float(env))
            except ValueError:
                raise KestrelError(f"KESTREL_{self.name.upper()}_MIN_FLOPS must be a number, got {env!r}") \
                    from None
        return self.info.min_flops if self.info else 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "status": self.status, "reason": self.reason, "version": self.version,
            "source": self.source, "kind": self.kind, "device": self.device_description,
            "api_version": ".".join(map(str, self.info.api_version)) if self.info else "",
            "offload": offload_state(self),
        }


def force_cpu() -> bool:
    return os.environ.get("KESTREL_FORCE_CPU", "") not in ("", "0")


def offload_state(backend: Backend) -> str:
    if not backend.bound:
        return "-"
    if backend.name == "cpu":
        return "reference"
    return "forced to CPU (KESTREL_FORCE_CPU)" if force_cpu() else "enabled"


def _allow_list() -> set[str] | None:
    raw = os.environ.get("KESTREL_PLUGINS")
    if raw is None:
        return None
    return {"cpu"} | {name.strip() for name in raw.split(",") if name.strip()}


def _module_from_path(path: Path) -> ModuleType:
    """Import a backend from a ``.py`` file or a package directory, under a private module name."""
    if path.is_dir():
        init = path / "__init__.py"
        if not init.exists():
            raise ImportError(f"{path} is not a package (no __init__.py)")
        spec = importlib.util.spec_from_file_location(path.name, init, submodule_search_locations=[str(path)])
    else:
        spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    return module


def _path_candidates() -> list[Backend]:
    found = []
    for entry in filter(None, os.environ.get("KESTREL_BACKEND_PATH", "").split(os.pathsep)):
        path = Path(entry).expanduser()
        if path.is_dir() and not (path / "__init__.py").exists():
            children = sorted(p for p in path.iterdir()
                              if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists())
        else:
            children = [path]
        for child in children:
            name = child.stem if child.suffix == ".py" else child.name
            found.append(Backend(name=name, source=f"path {child}", load=lambda c=child: _module_from_path(c)))
    return found


def _entry_point_candidates() -> list[Backend]:
    return [Backend(name=ep.name, source=f"entry point {ep.value}", load=ep.load)
            for ep in entry_points(group=ENTRY_POINT_GROUP)]


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


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _validate(backend: Backend) -> str | None:
    """Register into a private plugin manager and check it; returns a reason on failure."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    backend.pm = pm
    try:
        pm.register(backend.plugin, name=backend.name)
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        return "invalid hook: " + "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    missing = [h for h in hookspecs.REQUIRED_HOOKS if not backend.implements(h)]
    if missing:
        return f"missing required hook(s): {', '.join(missing)}"
    info = pm.hook.kestrel_backend_info()
    if not isinstance(info, BackendInfo):
        return f"kestrel_backend_info returned {type(info).__name__}, not BackendInfo"
    if info.kind not in KINDS:
        return f"unknown kind {info.kind!r} (expected one of {', '.join(KINDS)})"
    if not _api_compatible(tuple(info.api_version)):
        ours = ".".join(map(str, hookspecs.API_VERSION))
        return f"incompatible API version {'.'.join(map(str, info.api_version))} (kestrel has {ours})"
    backend.info = info
    return None


class Registry:
    """Every candidate backend, bound or not, by name."""

    def __init__(self) -> None:
        self.backends: dict[str, Backend] = {}
        self.shadowed: list[Backend] = []
        allow = _allow_list()
        for cand in _path_candidates() + _entry_point_candidates():
            if cand.name in self.backends:
                winner = self.backends[cand.name]
                self.shadowed.append(_fail(cand, f"shadowed by the backend of the same name from {winner.source}"))
                continue
            if allow is not None and cand.name not in allow:
                _fail(cand, "not in KESTREL_PLUGINS")
            self.backends[cand.name] = cand
        if "cpu" not in self.backends:
            import kestrel_cpu

            self.backends["cpu"] = Backend("cpu", "built in kestrel_cpu", load=lambda: kestrel_cpu)

    def candidates(self) -> list[Backend]:
        return list(self.backends.values()) + self.shadowed

    def _get(self, name: str) -> Backend:
        backend = self.backends.get(name)
        if backend is None:
            known = ", ".join(sorted(self.backends))
            raise KestrelError(f"unknown backend {name!r} (known: {known})")
        return backend

    def describe(self, name: str) -> Backend:
        """Import and validate a backend without opening its device (phases 1-3)."""
        backend = self._get(name)
        if backend.status != CANDIDATE or backend.info is not None:
            return backend
        try:
            backend.plugin = backend.load()
        except Exception as exc:  # a broken plugin must never take kestrel down
            return _fail(backend, f"import failed: {_short(exc)}")
        try:
            reason = _validate(backend)
        except Exception as exc:
            reason = f"validation failed: {_short(exc)}"
        return _fail(backend, reason) if reason else backend

    def bind(self, name: str, options: dict[str, Any] | None = None) -> Backend:
        """Bind one backend (idempotent); never raises for a backend's own failure."""
        backend = self.describe(name)
        if backend.status != CANDIDATE:
            return backend
        try:
            device = backend.hook.kestrel_open(options=dict(options or {}))
        except BackendUnavailable as exc:
            return _fail(backend, str(exc))
        except Exception as exc:
            return _fail(backend, f"device open failed: {_short(exc)}")
        if device is None:
            return _fail(backend, "kestrel_open returned no device handle")
        backend.device = device
        backend.device_description = str(getattr(device, "description", "") or backend.kind)
        backend.status, backend.reason = BOUND, ""
        return backend

    def bind_all(self, options: dict[str, Any] | None = None) -> list[Backend]:
        for name in list(self.backends):
            self.bind(name, options)
        return self.candidates()

    def cpu(self) -> Backend:
        cpu = self.bind("cpu")
        if not cpu.bound:
            raise KestrelError(f"the CPU reference backend did not bind: {cpu.reason}")
        return cpu

    def select(self, name: str = "auto") -> Backend:
        """The backend to run on: ``auto`` = best bound real accelerator (gpu, then npu), else cpu."""
        if name != "auto":
            backend = self.bind(name)
            if not backend.bound:
                raise KestrelError(f"backend {name!r} is not bound: {backend.reason}")
            return backend
        for kind in ("gpu", "npu"):  # never a simulator
            for backend in list(self.backends.values()):
                if backend.name != "cpu" and self.describe(backend.name).kind == kind:
                    if self.bind(backend.name).bound:
                        return backend
        return self.cpu()

    def close(self) -> None:
        for backend in self.backends.values():
            if backend.bound:
                try:
                    backend.hook.kestrel_close(device=backend.device)
                except Exception as exc:
                    log.warning("backend %s failed to close: %s", backend.name, _short(exc))
                _fail(backend, "closed")
