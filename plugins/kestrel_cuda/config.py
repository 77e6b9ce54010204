"""The CUDA backend's settings: one frozen ``CudaConfig``, read once when the device opens.

``CudaConfig.from_env(options)`` reads the ``KESTREL_CUDA_*`` variables (through ``kestrel_core.env``) and
lets the options of ``kestrel_open`` (``--backend-option KEY=VALUE``, keys as the fields' names) override
them; ``binding.open_device`` hands the result to what needs it. No other module of the backend reads the
environment (KESTREL_CUDA_MIN_FLOPS is the core's). ``SETTINGS`` is the table docs/backends/cuda.md
"## Settings" shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kestrel_core.env import env_flag, env_int, env_str
from kestrel_core.errors import KestrelError

RENAMED = {"KESTREL_CUDA_STREAM": "KESTREL_CUDA_WINDOW"}
_ON, _OFF = ("1", "on", "yes", "true"), ("0", "off", "no", "false")  # kestrel_core.env's spellings


@dataclass(frozen=True)
class Setting:
    """One field of ``CudaConfig``: its variable, its minimum (None: an on/off flag) and what it means."""

    key: str
    env: str
    minimum: int | None
    what: str
    meaning: str


SETTINGS = (
    Setting("device", "KESTREL_CUDA_DEVICE", 0, "a device number", "CUDA device index"),
    Setting("cache_mb", "KESTREL_CUDA_CACHE_MB", 1, "a whole number of MiB",
            "weight cache budget (default: free device memory less max(a quarter, 2 GiB), at least 256 MiB)"),
    Setting("window", "KESTREL_CUDA_WINDOW", 0, "a number of layers",
            "residency window: layers of streamed weights kept resident (0: off; on: no decode graph)"),
    Setting("max_context", "KESTREL_CUDA_MAX_CONTEXT", 1, "a number of positions",
            "longest context the device forward holds (also capped by the model's)"),
    Setting("graph", "KESTREL_CUDA_GRAPH", None, "", "decode step captured once in a CUDA graph and replayed"),
    Setting("pdl", "KESTREL_CUDA_PDL", None, "",
            "programmatic dependent launch in the decode graph (sm_90: each kernel starts under its "
            "predecessor's tail)"),
    Setting("cluster", "KESTREL_CUDA_CLUSTER", None, "",
            "K splits run as thread block clusters (sm_90): the M=1 GEMVs the planner picks, the decode batches' "
            "GEMMs"),
    Setting("trace", "KESTREL_CUDA_TRACE", None, "",
            "diagnostic build of the forward's kernels: every block records when its PDL wait returned "
            "(benchmarks/cuda_step_trace.py; a little slower)"),
)


@dataclass(frozen=True)
class CudaConfig:
    """Every setting of the CUDA backend (defaults: the measured best; ``SETTINGS`` says what each means)."""

    device: int = 0
    cache_mb: int | None = None  # None: free memory less max(free/4, 2 GiB), >= 256 MiB (residency.cache_budget)
    window: int = 0
    max_context: int = 32768
    graph: bool = True
    pdl: bool = True
    cluster: bool = True
    trace: bool = False

    @classmethod
    def from_env(cls, options: Mapping[str, Any] | None = None) -> CudaConfig:
        """The environment's settings, each overridden by ``options[key]`` where given (other keys are other
        backends' and ignored). A bad value, or a variable that was renamed, raises a one-line KestrelError."""
        for old, new in RENAMED.items():
            if env_str(old):
                raise KestrelError(f"{old} was renamed {new}; set that instead")
        options = options or {}
        defaults = cls()
        values: dict[str, Any] = {}
        for s in SETTINGS:
            default = getattr(defaults, s.key)
            if s.key in options:
                values[s.key] = _option(s, str(options[s.key]))
            elif s.minimum is None:
                values[s.key] = env_flag(s.env, default)
            else:
                values[s.key] = env_int(s.env, 0 if default is None else default, minimum=s.minimum, what=s.what)
        if values["cache_mb"] == 0:
            values["cache_mb"] = None
        return cls(**values)


def _option(s: Setting, raw: str) -> int | bool:
    """A ``--backend-option`` value, read as the environment's (kestrel_core.env reads variables only)."""
    text = raw.strip().lower()
    if s.minimum is None:
        if text in _ON or text in _OFF:
            return text in _ON
        raise KestrelError(f"backend option {s.key} must be 1 or 0 (on/off), got {raw!r}")
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < s.minimum:
        raise KestrelError(f"backend option {s.key} must be {s.what} >= {s.minimum}, got {raw!r}")
    return value

