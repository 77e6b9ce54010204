"""Errors kestrel reports to its users as one line (``-v`` shows the traceback)."""

from __future__ import annotations


class KestrelError(Exception):
    """A user-facing error: the message is printed as one line and kestrel exits non-zero."""


class ContractError(KestrelError, ValueError):
    """A strip-cache tensor or artifact that breaks the contract."""


class BackendUnavailable(KestrelError):
    """Raised by a backend's ``kestrel_open`` to say why its device cannot be used."""


class InvalidRequest(KestrelError):
    """A request with a bad field; ``param`` names it (the server answers HTTP 400 with it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Overloaded(KestrelError):
    """No room for another request now (the server answers HTTP 429); retrying later may succeed."""


class ShuttingDown(Overloaded):
    """The server stopped accepting requests (HTTP 503)."""


class NonFiniteLogits(KestrelError):
    """The model's own (CPU) computation produced NaN or infinite logits: a clear error, never an empty answer."""
