"""Ollama's API (``/api/*``) over the same engine, for the clients and tools written against Ollama.

Each generation route translates its request into the OpenAI request kestrel already answers (``/api/chat`` into
a chat completion, cut to its latest messages where the conversation is past the context unless ``truncate`` is
false, as Ollama cuts it; ``/api/generate`` into a chat completion of one user turn, or a plain completion when
``raw``, when the model has no chat template or with a ``suffix``, after the ids of an earlier answer's
``context``; ``/api/embed`` into embeddings, of unit length as Ollama's) and that answer back into Ollama's shape:
one JSON object, or newline-delimited JSON objects when streamed (Ollama streams unless ``stream`` is false), the
last with ``done: true``, the reason and the counts and durations (nanoseconds); a plain completion is answered in
a chat completion's shape, whose logprobs (``logprobs``, ``top_logprobs``) are Ollama's. Errors are
``{"error": message}`` with the same statuses. A model is named as served, with or without the ``:latest`` tag, in
any case where that names one model only, and answers name it as the request does; the
requests are read as Ollama's Go server reads them (serve/ollama_requests.py); options Ollama has and kestrel does
not (``num_ctx``, ``repeat_last_n``...) are ignored, as Ollama ignores options a model does not use. An option not
given takes the sampling the model recommends (as a Modelfile's parameters; ``/api/show`` lists them), else Ollama's
default: temperature 0.8, top-k 40, top-p 0.9, the context's length for ``num_predict``; one past its sampler's
range is read as Ollama's sampler reads it (a ``top_p`` of 0: the most likely token alone). ``repeat_penalty``
covers the prompt and the answer (Hugging Face's and vLLM's repetition penalty), not Ollama's last
``repeat_last_n`` tokens.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import kestrel_core
from kestrel_core.errors import KestrelError
from kestrel_core.model.embed import finish_vector
from kestrel_core.model.fim import fim_format
from kestrel_core.model.quantize import model_quant
from kestrel_core.serve.access import record_of
from kestrel_core.serve.errors import APIError, from_kestrel_error, named_as, validated
from kestrel_core.serve.generation import retold
from kestrel_core.serve.offload import json_answer, json_body, json_loads, off_loop
from kestrel_core.serve.ollama_requests import (
    OLLAMA_NAMES,
    ChatBody,
    EmbedBody,
    GenerateBody,
    GenerationBody,
    LegacyEmbeddingsBody,
    ShowBody,
    model_required,
)
from kestrel_core.serve.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from kestrel_core.serve.tools import arguments_object

if TYPE_CHECKING:
    from kestrel_core.serve.app import Models, Served

OLLAMA_VERSION = "0.12.11"  # the Ollama API these routes follow (logprobs came in it): clients require a minimum
# the chat or completions request's fields an Ollama request sets, by the names it sends them under (its errors
# name those)
REQUEST_NAMES = {**{name: f"options.{OLLAMA_NAMES.get(name, name)}" for name in (
    "temperature", "top_p", "top_k", "seed", "stop", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty")}, "max_tokens": "options.num_predict", "response_format": "format"}
DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop"}


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class _Answer:
    """One answer's Ollama objects: the model as the request names it (Ollama's answers repeat the request's name)
    and the creation time, and the counts and durations of the last, with ``context`` where ``context`` is given
    (``/api/generate``'s: the token ids of the prompt and of the answer's text, which it is given; called off the
    event loop, as the request's body's work is: ``off_loop``)."""

    def __init__(self, model: str, request: Request, key: str,
                 context: Callable[[str], list[int]] | None = None) -> None:
        self.model = model
        self.key = key  # "message" (chat) or "response" (generate)
        self.request = request
        self.record = record_of(request)  # its start and its first token's time
        self.context = context

    def part(self, content: str = "", thinking: str = "", tool_calls: list[dict[str, Any]] | None = None,
             logprobs: list[dict[str, Any]] | None = None, done: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "created_at": _now()}
        if self.key == "message":
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            body["message"] = message
        else:
            body["response"] = content
            if thinking:
                body["thinking"] = thinking
        body["done"] = done
        if logprobs:
            body["logprobs"] = logprobs
        return body

    def last(self, finish_reason: str | None, usage: dict[str, int], context: list[int] | None = None,
             **fields: Any) -> dict[str, Any]:
        end = time.perf_counter()
        start, first = self.record.start, self.record.first_token_at or end
        body = self.part(**fields, done=True)
        body["done_reason"] = DONE_REASONS.get(finish_reason or "stop", "stop")
        if context is not None:
            body["context"] = context
        body.update(total_duration=_ns(end - start), load_duration=0,
                    prompt_eval_count=usage.get("prompt_tokens", 0), prompt_eval_duration=_ns(first - start),
                    eval_count=usage.get("completion_tokens", 0), eval_duration=_ns(end - first))
        return body


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _ollama_calls(calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI's tool calls as Ollama's: each with its id (which the result's ``tool_call_id`` may name) and its
    place among the answer's calls as ``function.index``, the arguments as an object."""
    if not calls:
        return None
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") or {}
        out.append({"id": call.get("id", ""), "function": {
            "index": call.get("index", k), "name": fn.get("name", ""),
            "arguments": arguments_object(fn.get("arguments"))}})
    return out


def _ollama_logprobs(logprobs: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """A chat answer's logprobs as Ollama's: its entries (token, logprob, bytes, top_logprobs), the alternatives
    left out where none were asked for, as Ollama's omitempty leaves them."""
    if not logprobs:
        return None
    return [{k: v for k, v in entry.items() if k != "top_logprobs" or v} for entry in logprobs["content"]]


def _whole(answer: _Answer, body: dict[str, Any]) -> dict[str, Any]:
    """A whole OpenAI chat answer as Ollama's one object."""
    choice = body["choices"][0]
    message = choice["message"]
    content = message.get("content") or ""
    context = answer.context(content) if answer.context is not None else None  # on a worker thread: json_answer's
    return answer.last(choice.get("finish_reason"), body.get("usage") or {}, context, content=content,
                       thinking=message.get("reasoning_content") or "",
                       tool_calls=_ollama_calls(message.get("tool_calls")),
                       logprobs=_ollama_logprobs(choice.get("logprobs")))


async def _lines(answer: _Answer, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """An OpenAI chat stream's chunks as Ollama's lines: a line a delta (its text or its tokens' logprobs), the
    last with the counts."""
    finish: str | None = None
    calls: list[dict[str, Any]] = []
    said: list[str] = []
    async for chunk in chunks:
        if "error" in chunk:
            yield _line({"error": chunk["error"].get("message", "error")})
            return
        if not chunk.get("choices"):  # the usage: the answer is complete
            context = None
            if answer.context is not None:
                context = await off_loop(answer.request, partial(answer.context, "".join(said)), inline=False)
            yield _line(answer.last(finish, chunk.get("usage") or {}, context, tool_calls=_ollama_calls(calls)))
            return
        choice = chunk["choices"][0]
        finish = choice.get("finish_reason") or finish
        delta = choice.get("delta") or {}
        calls.extend(delta.get("tool_calls") or ())
        text, thinking = delta.get("content") or "", delta.get("reasoning_content") or ""
        said.append(text)
        logprobs = _ollama_logprobs(choice.get("logprobs"))
        if text or thinking or logprobs:
            yield _line(answer.part(text, thinking, logprobs=logprobs))


def _line(body: dict[str, Any]) -> bytes:
    return (json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


async def _translate(answer: _Answer, response: Response) -> Response:
    """kestrel's OpenAI chat answer as Ollama's: its stream's chunks as lines, or its one object."""
    return await retold(response, lambda body: _whole(answer, body), lambda chunks: _lines(answer, chunks),
                        "application/x-ndjson", answer.request)


def _loaded(answer: _Answer, keep_alive: int | None) -> JSONResponse:
    """The answer to a request with nothing to generate, which clients send to load a model (or, with a
    ``keep_alive`` of zero nanoseconds, to unload it): the model is loaded for as long as the server runs."""
    reason = "unload" if keep_alive == 0 else "load"
    return JSONResponse({**answer.part(done=True), "done_reason": reason})


def _context_ids(served: Served, context: list[int] | None) -> list[int]:
    """``/api/generate``'s ``context``: token ids of the model's vocabulary (none: empty)."""
    if not context:
        return []
    try:
        return served.engine.check_ids(context, "context")
    except KestrelError as exc:
        raise from_kestrel_error(exc, param="context") from None


def _structured(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chat request's ``response_format`` as a plain completion's ``structured_outputs`` (vLLM's)."""
    if response_format is None:
        return None
    if response_format["type"] == "json_object":
        return {"json_object": True}
    return {"json": response_format["json_schema"]["schema"]}


def _unit_vector(vector: list[float], dimensions: int | None) -> list[float]:
    """A vector as Ollama's ``/api/embed`` answers it, whatever the model's own normalization: of unit length, cut
    to ``dimensions`` where that is between 0 and its size (Ollama scales it, cuts it and scales it again: the
    same vector)."""
    cut = dimensions if dimensions is not None and 0 < dimensions < len(vector) else None
    return finish_vector(np.asarray(vector), cut, normalize=True).tolist()


def _check_think(body: GenerationBody, served: Served) -> None:
    """``think`` asked of a model whose template has no reasoning is a 400, as Ollama answers it (false is
    fine)."""
    if body.think not in (None, False) and not (served.thinks or served.harmony):
        raise APIError(400, f'"{body.model}" does not support thinking', param="think")


def install(app: FastAPI, models: Models) -> None:
    """Ollama's routes on ``app``, answered by the named model's handlers."""

    @app.post("/api/chat")
    async def chat(body: Annotated[ChatBody, json_body(ChatBody)], request: Request) -> Response:
        served = model_of(models, model_required(body.model))
        _check_think(body, served)
        if not body.messages:  # a client loading (or unloading) the model: it stays loaded while serving
            return _loaded(_Answer(body.model, request, "message"), body.keep_alive)
        with named_as(REQUEST_NAMES):
            openai = await off_loop(request, lambda: validated(ChatCompletionRequest, body.openai(served)))
            response = await served.chat(openai, request, truncate=body.truncate)
        return await _translate(_Answer(body.model, request, "message"), response)

    @app.post("/api/generate")
    async def generate(body: Annotated[GenerateBody, json_body(GenerateBody)], request: Request) -> Response:
        served = model_of(models, body.model)
        _check_think(body, served)
        tokenizer = served.engine.tokenizer
        if body.images:
            raise APIError(400, "images are not supported (kestrel serves text models)", param="images")
        if body.raw and (body.template or body.system or body.context):
            raise APIError(400, "raw mode does not support template, system, or context", param="raw")
        suffix = body.suffix or None  # "": none, as Ollama reads it
        if not body.prompt and suffix is None:
            return _loaded(_Answer(body.model, request, "response"), body.keep_alive)
        if body.template and body.template != tokenizer.chat_template:  # the one /api/show gives is the model's
            raise APIError(400, "template is not supported: kestrel renders the model's own chat template (the one "
                           "/api/show gives); send the prompt in another template's format with raw", param="template")
        context = _context_ids(served, body.context)
        sampling = body.sampling(body.stream, served.engine.sampling_defaults)
        templated = not body.raw and suffix is None and tokenizer.chat_template
        with named_as(REQUEST_NAMES):
            if templated:
                messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
                    {"role": "user", "content": body.prompt}]
                openai = await off_loop(request, lambda: validated(ChatCompletionRequest, {
                    "messages": messages, "response_format": body.response_format(),
                    "chat_template_kwargs": body.template_kwargs(served.harmony), **body.chat_logprobs(), **sampling}))
                response = await served.chat(openai, request, prefix=context)

                def prompt_ids() -> list[int]:
                    return served.chat_prompt(openai, prefix=context)[1]
            else:  # Ollama's runner reads the context's text before the prompt
                def prompt() -> str:
                    return (tokenizer.decode(context, skip_special_tokens=False) if context else "") + body.prompt

                completion = await off_loop(request, lambda: validated(CompletionRequest, {
                    "prompt": prompt(), "suffix": suffix, "logprobs": body.top_logprobs if body.logprobs else None,
                    "structured_outputs": _structured(body.response_format()), **sampling}))
                response = await served.complete(completion, request, chat_shaped=True)

                def prompt_ids() -> list[int]:
                    return completion.prompt_ids(tokenizer, served.engine.eos_token_ids)[0][0]

        def answered(text: str) -> list[int]:
            """Ollama's ``context``: the prompt's ids and the answer's, which a next request's ``context`` follows
            (the answer's reasoning left out, as chat templates leave an earlier turn's out)."""
            return prompt_ids() + list(tokenizer.encode(text, add_special_tokens=False))

        return await _translate(_Answer(body.model, request, "response", None if body.raw else answered), response)

    @app.post("/api/embed")
    async def embed(body: Annotated[EmbedBody, json_body(EmbedBody)], request: Request) -> Response:
        served = model_of(models, body.model)
        start = record_of(request).start
        if not body.input:
            return JSONResponse({"model": body.model, "embeddings": []})
        openai = await off_loop(request, lambda: validated(EmbeddingRequest, {"input": body.input}))
        response = await served.embed(openai, request, truncate=body.truncate)
        if response.status_code != 200:
            return response

        def answer() -> dict[str, Any]:
            data = json_loads(bytes(response.body))
            vectors = [_unit_vector(d["embedding"], body.dimensions) for d in data["data"]]
            return {"model": body.model, "embeddings": vectors,
                    "total_duration": _ns(time.perf_counter() - start), "load_duration": 0,
                    "prompt_eval_count": data["usage"]["prompt_tokens"]}

        return await json_answer(answer)

    @app.post("/api/embeddings")
    async def embeddings(body: Annotated[LegacyEmbeddingsBody, json_body(LegacyEmbeddingsBody)],
                         request: Request) -> Response:
        served = model_of(models, model_required(body.model))
        if not body.prompt:  # what clients send to load the model
            return JSONResponse({"embedding": []})
        openai = await off_loop(request, lambda: validated(EmbeddingRequest, {"input": body.prompt}))
        response = await served.embed(openai, request, truncate=True)
        if response.status_code != 200:
            return response
        return JSONResponse({"embedding": json.loads(bytes(response.body))["data"][0]["embedding"]})

    @app.get("/api/tags")
    @app.head("/api/tags", include_in_schema=False)  # Ollama answers HEAD too: a health check's
    async def tags() -> dict[str, Any]:
        return {"models": [card(served) for served in models]}

    @app.get("/api/ps")
    async def ps() -> dict[str, Any]:
        def running(served: Served) -> dict[str, Any]:
            listed = card(served)  # a GPU holds the weights whole: Ollama's CLI shows "100% GPU"
            vram = listed["size"] if served.engine.backend.kind == "gpu" else 0
            return {**listed, "expires_at": "2100-01-01T00:00:00Z", "size_vram": vram,
                    "context_length": served.engine.config.max_position}

        return {"models": [running(served) for served in models]}

    @app.post("/api/show")
    async def show(body: Annotated[ShowBody, json_body(ShowBody)]) -> dict[str, Any]:
        return show_model(model_of(models, model_required(body.model or body.name)))

    @app.get("/api/version")
    @app.head("/api/version", include_in_schema=False)  # one operation (and id) a path in the OpenAPI document
    async def version() -> dict[str, str]:
        return {"version": OLLAMA_VERSION, "kestrel_version": kestrel_core.__version__}

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # a heartbeat, no API
    async def running() -> PlainTextResponse:
        """Ollama's heartbeat: its CLI checks the server with ``HEAD /`` before anything else, and clients that
        detect an Ollama server compare ``GET /``'s text with Ollama's."""
        return PlainTextResponse("Ollama is running")


def ollama_name(served: Served) -> str:
    """The served name as Ollama spells model names: with a tag (``:latest`` where it has none)."""
    return served.model_name if ":" in served.model_name else f"{served.model_name}:latest"


def model_of(models: Models, name: str) -> Served:
    """The model Ollama's ``name`` names: a served name, with or without its ``:latest`` tag, in any case where
    that names one model only (Ollama's names are matched so)."""
    for served in models:
        if name in (served.model_name, ollama_name(served)):
            return served
    folded = [served for served in models
              if name.casefold() in (served.model_name.casefold(), ollama_name(served).casefold())]
    if len(folded) == 1:
        return folded[0]
    names = ", ".join(f"'{ollama_name(served)}'" for served in models)
    raise APIError(404, f"model '{name}' not found; this server serves {names}", param="model")


def details(served: Served) -> dict[str, Any]:
    c = served.engine.config
    path = str(served.engine.source).removesuffix(")")  # a path, or "NAME (path)"
    fmt = "gguf" if path.endswith(".gguf") else "kst" if path.endswith(".kst") else "safetensors"
    params = served.parameter_count
    return {"parent_model": "", "format": fmt, "family": c.arch, "families": [c.arch],
            "parameter_size": f"{params / 1e9:.1f}B" if params >= 1e8 else f"{params / 1e6:.1f}M",
            "quantization_level": model_quant(served.engine.model).upper()}


def _tensors(served: Served) -> list[Any]:
    """The model's strip-caches, each once (a tied lm_head is the embedding)."""
    model = served.engine.model
    tensors = {id(w): w for _, w in model.weights()}
    tensors[id(model.embedding)] = model.embedding
    return list(tensors.values())


def card(served: Served) -> dict[str, Any]:
    """The model as ``/api/tags`` lists it; its digest (Ollama's is its manifest's SHA-256, which clients shorten to
    an id and key models by) is that of its name and source."""
    size = sum(w.nbytes for w in _tensors(served))
    digest = hashlib.sha256(f"{served.model_name}\n{served.engine.source}".encode()).hexdigest()
    return {"name": ollama_name(served), "model": ollama_name(served), "modified_at": _modified(served), "size": size,
            "digest": digest, "details": details(served)}


def _modified(served: Served) -> str:
    """When the model was loaded, as Ollama's ``modified_at``."""
    return datetime.fromtimestamp(served.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def show_model(served: Served) -> dict[str, Any]:
    """``/api/show``: the details, the chat template, the architecture's figures and the capabilities."""
    c = served.engine.config
    info = {"general.architecture": c.arch, "general.basename": served.model_name,
            "general.parameter_count": served.parameter_count, f"{c.arch}.context_length": c.max_position,
            f"{c.arch}.embedding_length": c.hidden_size, f"{c.arch}.block_count": c.num_layers,
            f"{c.arch}.attention.head_count": c.num_heads, f"{c.arch}.attention.head_count_kv": c.num_kv_heads}
    parameters = "\n".join(f"{OLLAMA_NAMES.get(k, k)} {v:g}" for k, v in served.engine.sampling_defaults.items())
    return {"modelfile": "", "parameters": parameters, "template": served.engine.tokenizer.chat_template or "",
            "details": details(served), "model_info": info, "capabilities": capabilities(served),
            "modified_at": _modified(served)}


def capabilities(served: Served) -> list[str]:
    """What Ollama's ``/api/show`` says the model does."""
    engine = served.engine
    if engine.config.pooling is not None:
        return ["embedding"]
    caps = ["completion"]
    if served.tool_format is not None:
        caps.append("tools")
    if served.thinks or served.harmony:
        caps.append("thinking")
    if fim_format(engine.tokenizer) is not None:
        caps.append("insert")
    return caps
