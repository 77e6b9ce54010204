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


class ContextExceeded(InvalidRequest):
    """A prompt (or input) of ``tokens`` tokens past the model's ``context``, or one that fills it and so leaves no
    room for an answer; ``what`` names it in messages ("prompt", "input", "the prompt of document 1"...)."""

    def __init__(self, message: str, tokens: int, context: int, what: str = "prompt",
                 param: str | None = None) -> None:
        super().__init__(message, param)
        self.tokens, self.context, self.what = tokens, context, what


def invalid_request(exc: KestrelError, param: str | None) -> InvalidRequest:
    """``exc`` as the InvalidRequest naming ``param`` (a ContextExceeded stays one, for the server's answer)."""
    if isinstance(exc, ContextExceeded):
        return ContextExceeded(str(exc), exc.tokens, exc.context, exc.what, param)
    return InvalidRequest(str(exc), param)


class Overloaded(KestrelError):
    """No room for another request now (the server answers HTTP 429); retrying later may succeed."""


class ShuttingDown(Overloaded):
    """The server stopped accepting requests (HTTP 503)."""


class NonFiniteLogits(KestrelError):
    """The model's own (CPU) computation produced NaN or infinite logits: a clear error, never an empty answer."""


MAX_REPORTED_CHARS = 300  # of a plugin's message in a reason or a log line (rich wraps a long one slowly)


def safe_text(value: object, quoted: bool = False) -> str:
    """``str(value)`` (``repr`` where ``quoted``) as one line of at most MAX_REPORTED_CHARS, whatever the object
    does: a plugin's exception or object may raise from ``__str__``, even SystemExit, or be megabytes long."""
    try:
        text = repr(value) if quoted else str(value)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 (plugin code: anything, sys.exit included)
        return f"<a {type(value).__name__} that cannot be printed>"
    text = " ".join(text.split())
    return text if len(text) <= MAX_REPORTED_CHARS else text[:MAX_REPORTED_CHARS] + "..."


def safe_repr(value: object) -> str:
    return safe_text(value, quoted=True)


def os_reason(exc: OSError) -> str:
    """The OS's reason for ``exc`` in words ("not a directory"): its strerror, without Python's "[Errno N]" and
    quoted path; the text of an OSError raised with a message of its own."""
    reason = exc.strerror or safe_text(exc)
    return reason[:1].lower() + reason[1:] if reason[1:2].islower() else reason  # "ENOSPC..." stays as it is


def os_error(exc: OSError, doing: str = "", path: object = None) -> KestrelError:
    """``exc``, raised on a path the user gave, as the one line kestrel prints: what it was doing, the path
    (default: the error's own), the OS's reason; "KESTREL_HOME /some/file: not a directory", "cannot write
    out.kst: file name too long"."""
    where = " ".join(str(part) for part in (doing, exc.filename if path is None else path) if part not in ("", None))
    return KestrelError(f"{where}: {os_reason(exc)}" if where else os_reason(exc))
