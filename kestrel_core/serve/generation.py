"""One request through the AsyncEngine, answered whole (JSON) or as server-sent events (embeddings: whole).

A request of several prompts and ``n`` choices each runs as an engine request per choice (ids ``<response
id>-<k>`` for choice k = p * n + i, prompt p's i-th; a single choice keeps the response id): answered whole
once all have finished, streamed with each chunk naming its choice's index as its tokens come, the usage
(each prompt counted once) after the last. A prompt whose choices generate nothing (an echo alone) gets one
finished output, "length", at once.

Errors the engine raises before the first output (a bad request, a full queue, a shutdown) become HTTP
statuses, so a stream waits for its first output before it sends its headers; later errors can only be an
``error`` event in the stream. A client that leaves frees its sequence at once: while we wait for tokens
a watcher reads the connection's ``http.disconnect``, and a stream that stops being read is aborted when
its response ends (the engine's generator is closed, then ``AsyncEngine.abort`` is called to be sure).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kestrel_core.errors import InvalidRequest, KestrelError, Overloaded, invalid_request
from kestrel_core.model.async_engine import Places
from kestrel_core.model.request import RequestOutput
from kestrel_core.model.sampling import SamplingParams, TokenLogprob
from kestrel_core.serve.access import CLIENT_CLOSED, RequestRecord, record_of
from kestrel_core.serve.errors import APIError, error_body, from_kestrel_error
from kestrel_core.serve.offload import json_answer, json_loads
from kestrel_core.serve.responses import ChoiceResult, Shape, cached_tokens, choice_params, usage

log = logging.getLogger("kestrel.serve")

T = TypeVar("T")

SHUTDOWN_MESSAGE = "the server shut down before the request finished"


@dataclass
class Prompt:
    """One prompt of a request: its tokens, how its choices sample (None: they generate nothing) and
    whether they report logprobs."""

    ids: list[int]
    params: SamplingParams | None
    logprobs: bool


class ClientGone(Exception):
    """The client disconnected while the server was still working on its answer."""


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(work: Awaitable[T], request: Request) -> T:
    """``work``'s result, or ClientGone (``work`` cancelled, which aborts its request) if the client left."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled: neither task may outlive it
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task  # lets the engine's generator run its abort before we answer
    if task.cancelled():
        raise ClientGone
    return task.result()


def engine_error(exc: KestrelError, accepting: bool, prompt_param: str) -> APIError:
    """An error from the engine: InvalidRequest -> 400, Overloaded -> 429 (503 shutting down), else 500."""
    if isinstance(exc, InvalidRequest):
        param = prompt_param if exc.param in ("prompt", "input") else exc.param  # the field the tokens came from
        return from_kestrel_error(invalid_request(exc, param))
    if isinstance(exc, Overloaded):
        return from_kestrel_error(exc, accepting=accepting)
    return APIError(500, str(exc), code="engine_error")


def check_sequences(async_engine: Any, n: int) -> None:
    """The 400 for a request of ``n`` sequences (prompts x n) that the server never holds at once."""
    if n > async_engine.capacity:
        raise APIError(400, f"the request asks for {n} sequences (prompts x n), more than this server holds "
                       f"at once ({async_engine.capacity}: --max-batch + --max-waiting)", param="n")


async def respond(async_engine: Any, request: Request, prompts: Sequence[Prompt], shape: Shape, *, stream: bool,
                  prompt_param: str = "prompt", choices: int = 1, places: Places | None = None,
                  priority: int = 0) -> Response:
    """Run ``choices`` sequences of each prompt, each at ``priority`` (the scheduler's); the answer, or the APIError
    to answer instead. ``prompt_param`` names the field that made the prompts, for errors about them ("messages" for
    chat); ``places``: those the request took already (``AsyncEngine.places``), which its sequences take. A request
    of several sequences takes its places all at once, or is refused before any of them starts."""
    jobs = [(p, i) for p in prompts for i in range(choices)]
    check_sequences(async_engine, len(jobs))
    running = sum(p.params is not None for p, _ in jobs)
    if places is None and running > 1:
        try:
            with async_engine.places(running) as taken:
                return await respond(async_engine, request, prompts, shape, stream=stream, prompt_param=prompt_param,
                                     choices=choices, places=taken, priority=priority)
        except KestrelError as exc:  # taking them: at capacity, or shutting down
            raise engine_error(exc, async_engine.accepting, prompt_param) from None
    record = record_of(request)
    ids = [shape.id] if len(jobs) == 1 else [f"{shape.id}-{k}" for k in range(len(jobs))]
    held: dict[str, Any] = {} if places is None else {"places": places}
    prompt_tokens = sum(len(p.ids) for p in prompts)

    def abort() -> None:  # every choice's sequence freed at the engine's next step (a no-op once finished)
        for rid in ids:
            async_engine.abort(rid)

    try:
        # each grammar compiled once, however many choices keep to it: each takes a copy (its own place in it)
        grammars = list(dict.fromkeys(p.params.grammar for p, _ in jobs if p.params and p.params.grammar))
        compiled = dict(zip(grammars, await unless_disconnected(_all([async_engine.compile(g) for g in grammars]),
                                                               request))) if grammars else {}
        gens = [async_engine.generate(p.ids, choice_params(p.params, i), request_id=rid, priority=priority,
                                      constraint=compiled[p.params.grammar].copy() if p.params.grammar else None,
                                      **held)
                if p.params is not None else _nothing(rid, p) for (p, i), rid in zip(jobs, ids)]
        if stream:
            firsts = await unless_disconnected(_all([_next(g) for g in gens]), request)
            if any(f.finish_reason == "abort" and not f.new_token_ids for f in firsts):  # a shutdown, before any
                abort()  # token: the status can still say so, as a whole answer's does
                raise APIError(503, SHUTDOWN_MESSAGE, code="server_shutting_down")
            record.prompt_tokens = prompt_tokens
            events = _events(gens, firsts, shape, record, prompt_tokens, [len(p.ids) for p, _ in jobs], choices)
            return EventStreamResponse(events, on_close=abort,
                                       cached_tokens=cached_tokens([f.cached_tokens for f in firsts], choices))
        results = await unless_disconnected(
            _all([_collect(g, record, p.logprobs, prompt_tokens) for g, (p, _) in zip(gens, jobs)]), request)
    except ClientGone:
        abort()
        return Response(status_code=CLIENT_CLOSED)
    except KestrelError as exc:
        abort()
        raise engine_error(exc, async_engine.accepting, prompt_param) from None
    if any(r.finish_reason == "abort" for r in results):
        raise APIError(503, SHUTDOWN_MESSAGE, code="server_shutting_down")
    cached = cached_tokens([r.cached_tokens for r in results], choices)
    return await json_answer(lambda: shape.response(results, prompt_tokens, cached))


async def embed(async_engine: Any, request: Request, inputs: list[list[int]],
                answer: Callable[[np.ndarray, int], dict[str, Any]], *, pooling: str | None,
                dimensions: int | None = None) -> Response:
    """The inputs' vectors [inputs, D], computed between the engine's generation steps, answered as
    ``answer(vectors, prompt tokens)``; a client that leaves gives the job's KV blocks back."""
    record = record_of(request)
    try:
        vectors = await unless_disconnected(async_engine.embed(inputs, pooling=pooling, dimensions=dimensions),
                                            request)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    except KestrelError as exc:
        raise engine_error(exc, async_engine.accepting, "input") from None
    record.prompt_tokens = sum(len(ids) for ids in inputs)
    return await json_answer(lambda: answer(vectors, record.prompt_tokens))


async def _nothing(request_id: str, prompt: Prompt) -> AsyncIterator[RequestOutput]:
    """The one output of a choice that generates nothing."""
    yield RequestOutput(request_id, [], "", [] if prompt.logprobs else None, True, "length", len(prompt.ids), 0)


async def _all(works: list[Awaitable[T]]) -> list[T]:
    """Every work's result, in order; on the first failure (or a cancellation) the others are cancelled
    before it is raised."""
    if len(works) == 1:
        return [await works[0]]
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _next(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await gen.__anext__()


async def _collect(gen: AsyncIterator[RequestOutput], record: RequestRecord, logprobs: bool,
                   prompt_tokens: int) -> ChoiceResult:
    result = ChoiceResult(logprobs=[] if logprobs else None)
    async for out in gen:
        if record.prompt_tokens == 0:
            record.prompt_tokens = prompt_tokens  # admitted: the prompt counts
        record.tokens(len(out.new_token_ids))
        result.completion_tokens += len(out.new_token_ids)
        result.text.append(out.new_text)
        result.tokens.add(out.new_text, len(out.new_token_ids), out.text_offsets, out.logprobs)
        if out.logprobs and result.logprobs is not None:
            result.logprobs.extend(out.logprobs)
        result.cached_tokens = max(result.cached_tokens, out.cached_tokens)
        if out.finished:
            result.finish_reason, result.stop_reason = out.finish_reason, out.stop_reason
    return result


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


DONE = sse("[DONE]")
_MARK = "\ue000kestrel\ue000"  # a text no token decodes to alone: where a template's text goes
_MARK_JSON = json.dumps(_MARK, ensure_ascii=False).encode()


class DeltaEvents:
    """A stream's delta chunks as server-sent events, ``sse(shape.delta_chunk(...))`` byte for byte: a chunk
    without logprobs is its choice's template around the text's JSON (and, with continuous usage, the choice's
    usage's), since everything else in it is the same at every token (encoding the whole chunk was a tenth of
    the server's event loop at 64 streams)."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self._parts: dict[int, list[bytes]] = {}

    def __call__(self, text: str, entries: list[TokenLogprob] | None, index: int) -> bytes:
        shape = self.shape
        if entries is not None:
            return sse(shape.delta_chunk(text, entries, index))
        parts = self._parts.get(index)
        if parts is None:
            parts = self._parts[index] = self._template(index)
        text_json = json.dumps(text, ensure_ascii=False).encode()
        if not shape.continuous_usage:
            return parts[0] + text_json + parts[1]
        running = json.dumps(usage(*shape.choice_counts(index)), separators=(",", ":")).encode()
        return parts[0] + text_json + parts[1] + running + parts[2]

    def _template(self, index: int) -> list[bytes]:
        """The chunk's bytes split where the text goes (and the usage, with continuous usage)."""
        body = self.shape.delta_chunk(_MARK, None, index)
        if self.shape.continuous_usage:
            body["usage"] = _MARK
        return sse(body).split(_MARK_JSON)


async def _arrivals(gens: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput]
                    ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) as they come, until every choice has finished: the first outputs, then
    whichever choice's next one is ready (ties in index order)."""
    if len(gens) == 1:
        yield 0, firsts[0]
        if not firsts[0].finished:
            async for out in gens[0]:
                yield 0, out
        return
    pending: dict[asyncio.Future[RequestOutput], int] = {}
    try:
        for i, out in enumerate(firsts):
            yield i, out
            if not out.finished:
                pending[asyncio.ensure_future(_next(gens[i]))] = i
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                out = task.result()
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(_next(gens[i]))] = i
    finally:  # left early: no read of a generator may outlive this one
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def _events(gens: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput], shape: Shape,
                  record: RequestRecord, prompt_tokens: int, choice_prompt_tokens: list[int], choices: int = 1
                  ) -> AsyncIterator[bytes]:
    """OpenAI's chunk sequence: the role (chat), the deltas and each choice's finish reason, the usage,
    ``[DONE]``. ``prompt_tokens``: the request's (each prompt once), for the usage; ``choice_prompt_tokens``:
    each choice's prompt's, which the shape counts with each choice's tokens sent, for continuous usage;
    ``choices``: each prompt's (``n``)."""
    shape.start_usage(choice_prompt_tokens)
    completion_tokens = 0
    cached = [0] * len(gens)  # each choice's prompt tokens the prefix cache held
    arrivals = _arrivals(gens, firsts)
    deltas = DeltaEvents(shape)
    try:
        for chunk in shape.first_chunks(len(gens)):
            yield sse(chunk)
        async for i, out in arrivals:
            record.tokens(len(out.new_token_ids))
            completion_tokens += len(out.new_token_ids)
            shape.add_sent(i, len(out.new_token_ids))
            cached[i] = max(cached[i], out.cached_tokens)
            if out.finish_reason == "abort":
                yield sse(error_body(SHUTDOWN_MESSAGE, "server_error", None, "server_shutting_down"))
                break
            if shape.by_parts:
                yield sse(shape.parts_chunk(i, out))
            else:
                reasoning, text = shape.stream_text(i, out)
                if reasoning:  # the step's logprobs go with its content where it has any
                    yield sse(shape.reasoning_chunk(reasoning, None if text else out.logprobs, i))
                    if text:
                        yield deltas(text, out.logprobs, i)
                elif out.new_token_ids or out.new_text or out.logprobs:  # a chunk per step that made tokens, as
                    yield deltas(text, out.logprobs, i)  # OpenAI's ("" while text is held)
            if out.finished:
                for chunk in shape.finish_chunks(out.finish_reason, i, out.stop_reason):
                    yield sse(chunk)
        else:
            if shape.include_usage:
                yield sse(shape.usage_chunk(prompt_tokens, completion_tokens, cached_tokens(cached, choices)))
    except KestrelError as exc:  # a failed step, after the headers went out: the stream says so
        yield sse(error_body(str(exc), "server_error", None, "engine_error"))
    except Exception as exc:  # a bug, not bad input: logged as AccessMiddleware logs it, and the stream still ends
        log.error("a stream failed: %s: %s", type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))
        yield sse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error"))
    finally:
        await arrivals.aclose()  # its reads of the generators first
        for gen in gens:  # a no-op for one that finished; otherwise the engine aborts its request
            await gen.aclose()  # type: ignore[attr-defined]
    yield DONE


async def answer_chunks(events: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a stream ``respond`` answered (its server-sent events), as dicts, up to ``[DONE]``."""
    async for event in events:
        data = event.decode()
        if not data.startswith("data: "):
            continue
        data = data[len("data: "):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def retold(response: Response, whole: Callable[[dict[str, Any]], dict[str, Any]],
                 events: Callable[[AsyncIterator[dict[str, Any]]], AsyncIterator[bytes]],
                 media_type: str = "text/event-stream", request: Request | None = None) -> Response:
    """An answer of ``respond`` retold in another API's shape: ``whole`` of a whole answer's body, ``events`` of a
    stream's chunks (the request aborted however the new stream ends); a client that left (499) is answered as
    it was. ``request``: json_answer's, where ``whole`` does work that grows with its body."""
    if response.status_code != 200:
        return response
    if isinstance(response, EventStreamResponse):
        return EventStreamResponse(events(answer_chunks(response.body_iterator)),  # type: ignore[arg-type]
                                   response.on_close, media_type, response.cached_tokens)
    return await json_answer(lambda: whole(json_loads(bytes(response.body))), request)


class EventStreamResponse(StreamingResponse):
    """A streamed response (``text/event-stream``, or Ollama's ``application/x-ndjson``) that aborts its request
    however it ends (client gone, cancelled). ``cached_tokens``: the request's prompt tokens the prefix cache held,
    known from its first outputs, for an API whose stream says them in its first event (Anthropic's
    ``message_start``); OpenAI's says them in its last chunk."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None],
                 media_type: str = "text/event-stream", cached_tokens: int = 0) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                         media_type=media_type)
        self.on_close = on_close
        self.cached_tokens = cached_tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()  # synchronous: the sequence is freed at the engine's next step, whatever follows
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
