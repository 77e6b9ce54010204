"""Errors kestrel reports to its users as one line (``-v`` shows the traceback)."""

from __future__ import annotations


class KestrelError(Exception):
    """A user-facing error: the message is printed as one line and kestrel exits non-zero."""


class ContractError(KestrelError, ValueError):
    """A strip-cache tensor or artifact that breaks the contract."""


class BackendUnavailable(KestrelError):
    """Raised by a backend's ``kestrel_open`` to say why its device cannot be used."""
