"""kestrel's settings from the environment: one reader per kind of value, every bad value one line (exit 2).

An unset or empty variable gives the default. Backends read theirs through these too, so every
``KESTREL_*`` variable accepts the same spellings and fails the same way.
"""

from __future__ import annotations

import math
import os

from kestrel_core.errors import KestrelError

_TRUE = ("1", "on", "yes", "true")
_FALSE = ("0", "off", "no", "false")


def backend_var(backend: str, setting: str) -> str:
    """A backend's own variable, ``KESTREL_<NAME>_<SETTING>``, its name's other characters (``-``) as ``_``, as
    a shell can set it."""
    return f"KESTREL_{''.join(c if c.isalnum() else '_' for c in backend.upper())}_{setting}"


def env_str(name: str, default: str = "") -> str:
    """The variable's value, stripped; ``default`` when unset or empty."""
    return os.environ.get(name, "").strip() or default


def env_flag(name: str, default: bool = False) -> bool:
    """``1/on/yes/true`` or ``0/off/no/false`` (any case)."""
    raw = env_str(name).lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise KestrelError(f"{name} must be 1 or 0 (on/off), got {os.environ[name]!r}")


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """One of ``choices`` (any case, returned as spelled in ``choices``)."""
    raw = env_str(name).lower()
    if not raw:
        return default
    for choice in choices:
        if raw == choice.lower():
            return choice
    raise KestrelError(f"{name} must be {' or '.join(choices)}, got {os.environ[name]!r}")


def env_int(name: str, default: int, *, minimum: int = 0, what: str = "a whole number") -> int:
    """A whole number >= ``minimum``; ``what`` names it in the error ("a number of MiB")."""
    raw = env_str(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise KestrelError(f"{name} must be {what} >= {minimum}, got {raw!r}")
    return value


def env_float(name: str, default: float, *, minimum: float = 0.0, what: str = "a number") -> float:
    """A finite number >= ``minimum`` (``1e7`` allowed)."""
    raw = env_str(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < minimum:
        raise KestrelError(f"{name} must be {what} >= {minimum:g}, got {raw!r}")
    return value
