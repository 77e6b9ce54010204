"""Work that grows with a request, kept off the event loop: one client's large body must not hold up every other
request (``/health`` included) while the loop's thread parses it.

Every route takes its JSON body as ``json_body(Model)``: the bytes are read on the loop, then parsed and
validated in a worker thread where they are large (``INLINE_BODY_BYTES`` or more; a smaller body costs less than
a thread's hand-off), with FastAPI's own steps and errors (stdlib JSON, then the model, validated as FastAPI
validates a body), so a bad body is answered as before. ``off_loop`` runs a route's other work on the body the
same way (prompts rendered and tokenized, embeddings' and scores' inputs tokenized, /infill's prompt built);
``json_answer`` builds and writes an answer in a worker thread.

Large bodies take turns on ``BODY_THREADS`` threads of their own: their work holds the GIL, so more threads would
not finish it sooner, but would hold more parsed bodies (several times their bytes) at once, take more of the
GIL from the loop, and, on the loop's default executor, queue the other requests' prompt rendering behind them.
While one runs, the interpreter's switch interval is ``BODY_SWITCH_S`` instead of 5 ms: a thread that lets go of
the GIL and wants it back (the engine's steps' thread, around each kernel or numba call; the loop, around each
poll) otherwise waits up to the whole interval each time behind a thread that never lets go of it.

A thread frees the loop only where the GIL changes hands: C code such as the JSON decoder and encoder holds it for
a whole call, so a large document is read with a Python hook for each object and number and written in calls of
about ``JSON_STEP`` values, and the loop's thread takes the GIL between them. What no thread avoids: CPython's full
garbage collections, which pause every thread, last longer the more objects a body or an answer is made of (those
of the server's startup are frozen out of them: server.frozen_heap).
"""

from __future__ import annotations

import asyncio
import contextvars
import email.message
import json
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.models import Schema
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException

T = TypeVar("T")
Model = TypeVar("Model", bound=BaseModel)

# below this a body's work runs on the loop: at most ~2 ms (16 KiB of one-letter messages), where a thread's
# hand-off costs ~0.06 ms, a quarter of a small request's time
INLINE_BODY_BYTES = 16 * 1024
JSON_STEP = 4096  # values one JSON encoder call writes: ~1 ms
BODY_THREADS = 2
# the longest gap between tokens of 2 streams beside bodies of a million prompts: 0.35-0.36 s against 1.9-2.1 s
# at 5 ms and one call of pydantic's a body (docs/performance.md)
BODY_SWITCH_S = 0.0005
_BODIES = ThreadPoolExecutor(BODY_THREADS, thread_name_prefix="kestrel-body")
_switching = threading.Lock()
_running = [0, 0.0]  # bodies being worked on, the switch interval before the first
_ENCODE = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode  # JSONResponse's


def json_body(model: type[Model]) -> Any:
    """A route parameter's dependency (``body: Annotated[Model, json_body(Model)]``): the request's JSON body as
    ``model``, parsed and validated off the loop when large; a bad body is FastAPI's RequestValidationError (its
    ``loc`` starting with "body"), or FastAPI's 400 for a body it cannot read; /openapi.json documents ``model`` as
    the route's body (``document_bodies``)."""

    async def parsed(request: Request) -> Model:
        try:
            raw = await request.body()
        except HTTPException:  # the body over the server's limit
            raise
        except Exception as exc:  # the client left mid-body
            raise HTTPException(400, "There was an error parsing the body") from exc
        return await off_loop(request, lambda: _validated(model, raw, request.headers.get("content-type", "")))

    parsed.body_model = model  # type: ignore[attr-defined]
    return Depends(parsed)


async def off_loop(request: Request, work: Callable[[], T], inline: bool = True) -> T:
    """``work()``, work that grows with the request's body: on a thread of the large bodies' where that body is
    large, else at once (``inline`` False: on the loop's default executor, for work that may take long whatever
    the body's size, such as a chat template's rendering)."""
    if len(await request.body()) < INLINE_BODY_BYTES:
        return work() if inline else await asyncio.to_thread(work)
    return await asyncio.get_running_loop().run_in_executor(_BODIES, contextvars.copy_context().run,
                                                            _short_switches, work)


def _short_switches(work: Callable[[], T]) -> T:
    """``work()`` with the switch interval at most BODY_SWITCH_S, until the last body being worked on is done."""
    with _switching:
        if not _running[0]:
            _running[1] = sys.getswitchinterval()
            sys.setswitchinterval(min(_running[1], BODY_SWITCH_S))
        _running[0] += 1
    try:
        return work()
    finally:
        with _switching:
            _running[0] -= 1
            if not _running[0]:
                sys.setswitchinterval(_running[1])


def _validated(model: type[Model], raw: bytes, content_type: str) -> Model:
    """``raw`` as ``model``, read as FastAPI reads a body: JSON where the content type says so (JsonBodyMiddleware
    has set it where the client's means JSON too), the bytes themselves otherwise; an empty body is missing."""
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    data: Any = raw
    if _is_json(content_type):
        try:
            data = json_loads(raw)
        except json.JSONDecodeError as exc:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                           "input": {}, "ctx": {"error": exc.msg}}]) from None
        except Exception as exc:  # not UTF-8 (or UTF-16/32), nested past the recursion limit
            raise HTTPException(400, "There was an error parsing the body") from exc
    try:
        return model.model_validate(data, from_attributes=True)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]) \
            from None


def _is_json(content_type: str) -> bool:
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _dict(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


def _int(text: str) -> int:
    return int(text)


def _float(text: str) -> float:
    return float(text)


def json_loads(raw: bytes) -> Any:
    """``json.loads(raw)``; a large document read with Python hooks for its objects and numbers (the same
    values), which let the loop's thread take the GIL from the decoder between them."""
    if len(raw) < INLINE_BODY_BYTES:
        return json.loads(raw)
    return json.loads(raw, object_pairs_hook=_dict, parse_int=_int, parse_float=_float)


def _size(value: Any) -> int:
    """About how many values ``value``'s JSON holds, each list's counted from its first item (an answer's lists
    hold items of one shape)."""
    if isinstance(value, dict):
        return 1 + sum(_size(v) for v in value.values())
    if isinstance(value, (list, tuple)) and value:
        return 1 + len(value) * _size(value[0])
    return 1


def _write(value: Any, parts: list[str]) -> None:
    """``value``'s JSON as JSONResponse writes it, appended to ``parts`` in encoder calls of about JSON_STEP
    values each."""
    size = _size(value)
    if size <= JSON_STEP or not isinstance(value, (dict, list, tuple)) \
            or isinstance(value, dict) and not all(isinstance(k, str) for k in value):
        parts.append(_ENCODE(value))
    elif isinstance(value, dict):
        for i, (key, item) in enumerate(value.items()):
            parts.append(("," if i else "{") + _ENCODE(key) + ":")
            _write(item, parts)
        parts.append("}")
    else:
        per_call = max(1, JSON_STEP * len(value) // size)
        for start in range(0, len(value), per_call):
            parts.append("," if start else "[")
            if per_call == 1:
                _write(value[start], parts)
            else:
                parts.append(_ENCODE(value[start:start + per_call])[1:-1])
        parts.append("]")


def _written(content: Any) -> bytes:
    parts: list[str] = []
    _write(content, parts)
    return "".join(parts).encode("utf-8")


async def json_answer(build: Callable[[], Any], request: Request | None = None) -> Response:
    """``JSONResponse(build())``, byte for byte, built and written in a worker thread: an answer of any request
    can be megabytes (a logprob for each of thousands of tokens, thousands of embeddings), and the hand-off
    (~0.06 ms) is small beside the generation or the embedding it answers. ``request``: the request whose body
    ``build`` grows with (Ollama's ``context`` renders its prompt again), built as ``off_loop`` does its work."""
    def written() -> bytes:
        return _written(build())

    content = await asyncio.to_thread(written) if request is None else await off_loop(request, written, inline=False)
    return Response(content, media_type="application/json")


def document_bodies(app: FastAPI) -> None:
    """/openapi.json with each route's ``json_body`` model as its request body: FastAPI documents only the bodies
    it parses itself."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        routes = [(route, dep.call.body_model) for route in app.routes if isinstance(route, APIRoute)
                  for dep in route.dependant.dependencies if hasattr(dep.call, "body_model")]
        refs, schemas = models_json_schema([(m, "validation") for m in dict.fromkeys(m for _, m in routes)],
                                           ref_template="#/components/schemas/{model}")
        for route, model in routes:
            body = {"content": {"application/json": {"schema": refs[(model, "validation")]}}, "required": True}
            route.openapi_extra = {**(route.openapi_extra or {}), "requestBody": body}
        schema = generate()
        components = schema.setdefault("components", {})
        # written as FastAPI writes its own (through its OpenAPI model: no null defaults)
        written = {name: jsonable_encoder(Schema(**s), by_alias=True, exclude_none=True)
                   for name, s in schemas.get("$defs", {}).items()}
        components["schemas"] = dict(sorted({**components.get("schemas", {}), **written}.items()))
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
