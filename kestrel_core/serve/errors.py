"""OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, for every failure the server reports
(Ollama's, Anthropic's and llama.cpp's shapes under their routes).

Clients (the ``openai`` package among them) map the HTTP status to an exception class and read ``param`` to
say which field was wrong, so every error path, validation included, goes through ``APIError``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kestrel_core.errors import ContextExceeded, InvalidRequest, KestrelError, Overloaded

# Anthropic's status for a server that cannot take a request now; its 429 is an account's rate limit, which
# kestrel has none of, so every 429 (the server at capacity) is this under its routes
ANTHROPIC_OVERLOADED = 529

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 503: "overloaded_error",
                    ANTHROPIC_OVERLOADED: "overloaded_error"}
_LLAMA_CPP_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "invalid_request_error", 429: "unavailable_error",
                    501: "not_supported_error", 503: "unavailable_error"}
LLAMA_CPP_PATHS = ("/infill",)


class APIError(Exception):
    """An error answered as ``status`` with OpenAI's body (``type`` defaults from the status)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None,
                 exceeded: ContextExceeded | None = None) -> None:
        message = _quoted(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else _quoted(param)
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers
        self.exceeded = exceeded  # a prompt past the context: each API words it its own way

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def renamed(self, names: Mapping[str, str]) -> APIError:
        """This error naming its field as ``names`` maps the start of ``param`` (and of the message): the longest
        key whose dotted parts begin it (a ``*`` part matches any one, and the part at its place in the new name is
        kept)."""
        parts = (self.param or "").split(".")
        for key in sorted(names, key=lambda k: -k.count(".")):
            pattern = key.split(".")
            if len(pattern) <= len(parts) and all(p in ("*", q) for p, q in zip(pattern, parts)):
                head = ".".join(parts[:len(pattern)])
                new_head = ".".join(parts[i] if p == "*" else p for i, p in enumerate(names[key].split(".")))
                message = new_head + self.message[len(head):] if self.message.startswith(head) else self.message
                return APIError(self.status, message, param=new_head + (self.param or "")[len(head):],
                                code=self.code, type=self.type, headers=self.headers, exceeded=self.exceeded)
        return self

    def response(self, path: str = "") -> JSONResponse:
        """The answer, in the shape the clients of the API ``path`` belongs to read: Ollama's
        ``{"error": message}`` under ``/api/``, Anthropic's ``{"type": "error", "error": {"type", "message"}}``
        under ``/v1/messages`` (a 429 as Anthropic's 529, a prompt past the context in Anthropic's words),
        llama.cpp's (``llama_cpp_error``) under its routes, else OpenAI's."""
        status = self.status
        if path.startswith("/api/"):
            body: dict[str, Any] = {"error": self.message}
        elif path in LLAMA_CPP_PATHS:  # its body has no param: the message names the field
            named = self.param is None or self.param in self.message
            body = llama_cpp_error(self.status, self.message if named else f"{self.param}: {self.message}")
        elif path == "/v1/messages" or path.startswith("/v1/messages/"):
            status = ANTHROPIC_OVERLOADED if status == 429 else status
            kind = _ANTHROPIC_TYPES.get(status, "api_error")
            message = self.message if self.exceeded is None else _prompt_too_long(self.exceeded)
            body = {"type": "error", "error": {"type": kind, "message": message}}
        else:
            body = self.body()
        return JSONResponse(body, status_code=status, headers=self.headers)


def _prompt_too_long(exc: ContextExceeded) -> str:
    """Anthropic's words for a prompt past the context, which its clients match to compact the conversation (Claude
    Code reads the two counts). A prompt that fills the context leaves no room for an answer: its maximum is a token
    less, so that the numbers say it."""
    maximum = exc.context if exc.tokens > exc.context else exc.context - 1
    return f"prompt is too long: {exc.tokens} tokens > {maximum} maximum"


def _quoted(text: str) -> str:
    """``text`` with a client's lone surrogates written as escapes (``\\ud800``): UTF-8, and so JSON, has none."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def llama_cpp_error(status: int, message: str) -> dict[str, Any]:
    """llama.cpp's error body: ``{"error": {"code": status, "message", "type"}}``."""
    return {"error": {"code": status, "message": message, "type": _LLAMA_CPP_TYPES.get(status, "server_error")}}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_kestrel_error(exc: KestrelError, *, accepting: bool = True, param: str | None = None) -> APIError:
    """The HTTP answer to an engine error: 400 for a bad request, 429 when full, 503 while shutting down."""
    if isinstance(exc, Overloaded):
        if not accepting:
            return APIError(503, str(exc), code="server_shutting_down")
        return APIError(429, str(exc), code="rate_limit_exceeded", headers={"Retry-After": "1"})
    if isinstance(exc, ContextExceeded):  # OpenAI's code and words, which clients match to shorten a conversation
        room = ", which leaves no room for an answer" if exc.tokens <= exc.context else ""
        return APIError(400, f"This model's maximum context length is {exc.context} tokens. However, the {exc.what} "
                        f"has {exc.tokens} tokens{room}.", param=exc.param or param, code="context_length_exceeded",
                        exceeded=exc)
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), param=exc.param or param, code="invalid_value")
    return APIError(400, str(exc), param=param)  # e.g. a chat template that failed on these messages


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_type_tag(part: int | str) -> bool:
    """pydantic names the member of a union it tried in the location: ("stop", "list[str]", 0); a model member by
    its class's name ("NamedToolChoice"), which no field of the APIs' (all lower case) is spelled as."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper())


def param_path(loc: Sequence[int | str]) -> str | None:
    """A pydantic error location as OpenAI writes a param: ("body", "messages", 0, "content") ->
    "messages.[0].content"; a union member's tag ends the path."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    out = ""
    for part in parts:
        if _is_type_tag(part):
            break
        piece = f"[{part}]" if isinstance(part, int) else str(part)
        out = f"{out}.{piece}" if out else piece
    return out or None


# pydantic's type errors, and the types its union members are tagged with, as JSON names the values they want
_JSON_TYPES = {"int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
               "float_type": "a number", "float_parsing": "a number", "string_type": "a string",
               "bool_type": "a boolean", "bool_parsing": "a boolean", "list_type": "an array", "dict_type": "an object",
               "model_type": "an object", "model_attributes_type": "an object"}
_TAG_TYPES = {"str": ("a string", "strings"), "int": ("an integer", "integers"), "float": ("a number", "numbers"),
              "bool": ("a boolean", "booleans"), "none": ("null", "nulls")}


def _json_type(tag: str, plural: bool = False) -> str:
    """A union member's tag as JSON names its values: "list[int]" -> "an array of integers", "literal['a','b']" ->
    "one of 'a', 'b'", a model's class or a dict -> "an object"."""
    if tag in _TAG_TYPES:
        return _TAG_TYPES[tag][plural]
    if tag.startswith("list[") and tag.endswith("]"):
        return ("arrays of " if plural else "an array of ") + _json_type(tag[len("list["):-1], True)
    if tag.startswith("literal[") and tag.endswith("]"):
        return "one of " + tag[len("literal["):-1].replace("','", "', '")
    return "objects" if plural else "an object"


def _one_of(types: list[str]) -> str:
    """``types`` as a phrase: "a string or an array of strings" (an integer is a number too)."""
    kinds = [t for t in dict.fromkeys(types) if not (t == "an integer" and "a number" in types)]
    return kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"


def _message(param: str | None, errors: list[dict[str, Any]]) -> str:
    """The message of a field's pydantic errors, in JSON's terms where they are about the value's type."""
    first = errors[0]
    kind = first.get("type", "")
    if kind == "missing":
        return f"{param} is required" if param else "the request body is missing"
    if kind in ("model_attributes_type", "model_type") and not param:
        return "the request body must be a JSON object"
    tags = [next((p for p in e.get("loc", ()) if _is_type_tag(p)), None) for e in errors]
    if all(tags):  # every member of a union refused the value
        return f"{param} must be {_one_of([_json_type(str(t)) for t in tags])}"
    if param and kind in _JSON_TYPES:
        return f"{param} must be {_JSON_TYPES[kind]}"
    if param and kind == "literal_error" and (first.get("ctx") or {}).get("expected"):
        return f"{param} must be {first['ctx']['expected']}"
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{param}: {msg}" if param else msg


def validation_error(exc: RequestValidationError) -> APIError:
    """The first bad field's pydantic errors as one 400 naming it (a body that is not JSON names none)."""
    groups: dict[str | None, list[dict[str, Any]]] = {}
    for error in exc.errors():
        groups.setdefault(param_path(error.get("loc", ())), []).append(error)
    if not groups:
        return APIError(400, "invalid request body")
    param, errors = next(iter(groups.items()))
    if errors[0].get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    message = _message(param, errors)
    if len(groups) > 1:
        message += f" (and {len(groups) - 1} more bad field{'s' if len(groups) > 2 else ''})"
    code = "missing_required_parameter" if errors[0].get("type") == "missing" else "invalid_value"
    return APIError(400, message, param=param, code=code)


def validated(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """``data`` as the request ``model`` (a request another API's was translated into); a field it refuses is
    a 400 naming it."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(RequestValidationError(exc.errors())) from None


@contextmanager
def named_as(names: Mapping[str, str]) -> Iterator[None]:
    """A request translated from another API's: its errors name the fields the client sent, ``names`` mapping the
    translation's (max_tokens) to the client's (max_output_tokens)."""
    try:
        yield
    except APIError as exc:
        raise exc.renamed(names) from None


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the app in OpenAI's shape (an unexpected one: ``AccessMiddleware`` answers 500)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return APIError(exc.status_code, message, code=code).response(request.url.path)
