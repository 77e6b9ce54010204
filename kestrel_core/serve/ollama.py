"""Ollama's API (``/api/*``) over the same engine, for the clients and tools written against Ollama.

Each generation route translates its request into the OpenAI request kestrel already answers (``/api/chat`` into
a chat completion, cut to its latest messages where the conversation is past the context unless ``truncate`` is
false, as Ollama cuts it; ``/api/generate`` into a chat completion of one user turn, or a plain completion when
``raw``, when the model has no chat template or with a ``suffix``; ``/api/embed`` into embeddings, of unit length
as Ollama's) and that answer back into Ollama's shape: one JSON object, or newline-delimited JSON objects when
streamed (Ollama streams unless ``stream`` is false), the last with ``done: true``, the reason and the counts and
durations (nanoseconds); a plain completion is answered in a chat completion's shape, whose logprobs
(``logprobs``, ``top_logprobs``) are Ollama's. Errors are ``{"error": message}`` with the same statuses. A model
is named as served, with or without the ``:latest`` tag, in any case where that names one model only; a field
sent as null is one not sent, as Go reads it; options Ollama has and kestrel does not (``num_ctx``,
``repeat_last_n``...) are ignored, as Ollama ignores options a model does not use. An option not given takes the
sampling the model recommends (as a Modelfile's parameters; ``/api/show`` lists them), else Ollama's default:
temperature 0.8, top-k 40, top-p 0.9, the context's length for ``num_predict``; one past its sampler's range is
read as Ollama's sampler reads it (a ``top_p`` of 0: the most likely token alone). ``repeat_penalty`` covers the
prompt and the answer (Hugging Face's and vLLM's repetition penalty), not Ollama's last ``repeat_last_n`` tokens.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BeforeValidator, Field, StrictBool, StrictFloat, StrictInt, StrictStr

import kestrel_core
from kestrel_core.model.embed import finish_vector
from kestrel_core.model.fim import fim_format
from kestrel_core.model.quantize import model_quant
from kestrel_core.model.reasoning import think_kwargs
from kestrel_core.model.sampling import MAX_TOP_LOGPROBS
from kestrel_core.serve.access import record_of
from kestrel_core.serve.bodies import NullsAbsentBody
from kestrel_core.serve.errors import APIError, named_as, validated
from kestrel_core.serve.generation import retold
from kestrel_core.serve.offload import json_answer, json_body, json_loads, off_loop
from kestrel_core.serve.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from kestrel_core.serve.tools import MISTRAL_FORMATS, arguments_object

if TYPE_CHECKING:
    from kestrel_core.serve.app import Models, Served

OLLAMA_VERSION = "0.12.11"  # the Ollama API these routes follow (logprobs came in it): clients require a minimum
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}  # Ollama's, where a Modelfile sets none
OLLAMA_NAMES = {"repetition_penalty": "repeat_penalty"}  # its options' names where they differ from kestrel's
# the chat or completions request's fields an Ollama request sets, by the names it sends them under (its errors
# name those)
REQUEST_NAMES = {**{name: f"options.{OLLAMA_NAMES.get(name, name)}" for name in (
    "temperature", "top_p", "top_k", "seed", "stop", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty")}, "max_tokens": "options.num_predict", "response_format": "format"}
DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop"}


class OllamaBody(NullsAbsentBody):
    """An Ollama request's object: a field sent as null is one not sent, as Go reads null (``"content": null`` is
    no content, ``"stream": null`` the default)."""


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _whole_number(value: Any) -> Any:
    """An integral float as the integer it is: Ollama reads its options from a JSON object, where 3.0 is 3."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


OptionInt = Annotated[StrictInt, BeforeValidator(_whole_number)]


class Options(OllamaBody):
    """The options kestrel honours; the rest of Ollama's are ignored."""

    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    top_k: OptionInt | None = None
    min_p: StrictFloat | StrictInt | None = None
    repeat_penalty: StrictFloat | StrictInt | None = None  # over the prompt and the answer (Hugging Face's)
    seed: OptionInt | None = None
    num_predict: OptionInt | None = None  # 0 or less (-1, -2): until the context ends
    stop: list[StrictStr] | None = None
    presence_penalty: StrictFloat | StrictInt | None = None
    frequency_penalty: StrictFloat | StrictInt | None = None


class ToolFunction(OllamaBody):
    name: StrictStr
    arguments: dict[str, Any]


class ToolCall(OllamaBody):
    function: ToolFunction


class Message(OllamaBody):
    role: Annotated[Literal["system", "user", "assistant", "tool"], BeforeValidator(_lower)]  # Ollama lowers it
    content: StrictStr = ""
    images: list[StrictStr] | None = None
    thinking: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: StrictStr | None = None


class _Generation(OllamaBody):
    model: StrictStr
    format: Literal["json", ""] | dict[str, Any] | None = None  # "": none, as Ollama reads it
    options: Options | None = None
    stream: StrictBool = True
    think: StrictBool | Literal["low", "medium", "high", "max"] | None = None  # a level: the reasoning effort
    keep_alive: Any = None  # a model stays loaded while the server runs
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0  # each token's alternatives

    def chat_logprobs(self) -> dict[str, Any]:
        """The chat request's logprobs fields (Ollama's top_logprobs count only with logprobs)."""
        return {"logprobs": True, "top_logprobs": self.top_logprobs} if self.logprobs else {}

    def sampling(self, stream: bool, recommended: Mapping[str, float]) -> dict[str, Any]:
        """The OpenAI request's sampling fields: an option not given takes the model's ``recommended`` value,
        else Ollama's default (as a Modelfile's parameters override Ollama's)."""
        o = self.options or Options()
        default = {**DEFAULTS, **recommended}
        top_p = float(default["top_p"] if o.top_p is None else o.top_p)
        top_k = int(default["top_k"] if o.top_k is None else o.top_k)
        # values past a sampler's range are read as Ollama's sampler reads them: a temperature below 0 is greedy,
        # a top_p of 0 or less keeps the most likely token alone (top-k 1), and one above 1 or a top_k below 0
        # filters nothing
        fields: dict[str, Any] = {
            "temperature": max(0.0, float(default["temperature"] if o.temperature is None else o.temperature)),
            "top_p": min(top_p, 1.0) if top_p > 0 else 1.0, "top_k": max(top_k, 0) if top_p > 0 else 1,
            "seed": None if o.seed is not None and o.seed < 0 else o.seed, "stop": o.stop,  # -1: random, Ollama's
            "min_p": None if o.min_p is None else min(max(float(o.min_p), 0.0), 1.0),
            "repetition_penalty": o.repeat_penalty,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None}
        if o.presence_penalty is not None:
            fields["presence_penalty"] = float(o.presence_penalty)
        if o.frequency_penalty is not None:
            fields["frequency_penalty"] = float(o.frequency_penalty)
        if o.num_predict is not None and o.num_predict > 0:  # 0 and below: no limit but the context, as Ollama's
            fields["max_tokens"] = o.num_predict
        return fields

    def response_format(self) -> dict[str, Any] | None:
        if self.format == "json":
            return {"type": "json_object"}
        if isinstance(self.format, dict):
            return {"type": "json_schema", "json_schema": {"name": "format", "schema": self.format}}
        return None

    def template_kwargs(self, harmony: bool) -> dict[str, Any] | None:
        """The template's variables for ``think`` (``harmony``: the template is gpt-oss's)."""
        return think_kwargs(self.think, harmony)


class ChatBody(_Generation):
    messages: list[Message] = []
    tools: list[dict[str, Any]] | None = None
    truncate: StrictBool = True  # a conversation past the context loses its oldest messages, as Ollama's

    def openai(self, served: Served) -> dict[str, Any]:
        """The OpenAI chat request to ``served``: its recommended sampling, the tool format its template takes
        (which the ids of earlier calls must suit) and whether the template is gpt-oss's."""
        messages = _openai_messages(self.messages, served.tool_format)
        recommended = served.engine.sampling_defaults
        return {"messages": messages, "tools": self.tools, "response_format": self.response_format(),
                "chat_template_kwargs": self.template_kwargs(served.harmony), **self.chat_logprobs(),
                **self.sampling(self.stream, recommended)}


class GenerateBody(_Generation):
    prompt: StrictStr = ""
    suffix: StrictStr | None = None
    system: StrictStr | None = None
    raw: StrictBool = False
    images: list[StrictStr] | None = None
    template: StrictStr | None = None
    context: list[StrictInt] | None = None


class EmbedBody(OllamaBody):
    model: StrictStr
    input: StrictStr | list[StrictStr] = ""  # none: what clients send to load the model
    truncate: StrictBool = True
    dimensions: StrictInt | None = None  # 0 or past the model's size: none, as Ollama ignores it


class LegacyEmbeddingsBody(OllamaBody):
    model: StrictStr
    prompt: StrictStr = ""


class ShowBody(OllamaBody):
    model: StrictStr | None = None
    name: StrictStr | None = None  # the older field


def _openai_messages(messages: list[Message], tool_format: str | None) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's. Ollama's calls have no ids, so each gets one made from where it stands (the
    same prompt each time a conversation is sent again), in the shape ``tool_format``'s template takes; a tool
    result answers the earliest unanswered call of its ``tool_name``, or the earliest unanswered one."""
    out: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (id, name) of the calls no result has answered yet
    for i, m in enumerate(messages):
        if m.images:
            raise APIError(400, "images are not supported (kestrel serves text models)", param="messages")
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.thinking:
            message["reasoning_content"] = m.thinking
        if m.tool_calls:
            ids = [_call_id(tool_format, i, k) for k in range(len(m.tool_calls))]
            message["tool_calls"] = [{"id": id_, "type": "function", "function": {
                "name": c.function.name, "arguments": json.dumps(c.function.arguments)}}
                for id_, c in zip(ids, m.tool_calls)]
            unanswered = [(id_, c.function.name) for id_, c in zip(ids, m.tool_calls)]
        if m.role == "tool":
            match = next((c for c in unanswered if c[1] == m.tool_name), unanswered[0] if unanswered else None)
            if match is not None:
                unanswered.remove(match)
            message["tool_call_id"] = match[0] if match else _call_id(tool_format, i, 0)
            if m.tool_name:
                message["name"] = m.tool_name
        out.append(message)
    return out


def _call_id(tool_format: str | None, message: int, call: int) -> str:
    """The id of call ``call`` of message ``message``: nine letters and digits for Mistral's templates."""
    return f"c{message % 10**5:05d}{call % 10**3:03d}" if tool_format in MISTRAL_FORMATS else f"call_{message}_{call}"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class _Answer:
    """One answer's Ollama objects: the model and creation time, and the counts and durations of the last."""

    def __init__(self, served: Served, request: Request, key: str) -> None:
        self.model = ollama_name(served)
        self.key = key  # "message" (chat) or "response" (generate)
        self.record = record_of(request)  # its start and its first token's time

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

    def last(self, finish_reason: str | None, usage: dict[str, int], **fields: Any) -> dict[str, Any]:
        end = time.perf_counter()
        start, first = self.record.start, self.record.first_token_at or end
        body = self.part(**fields, done=True)
        body.update(done_reason=DONE_REASONS.get(finish_reason or "stop", "stop"),
                    total_duration=_ns(end - start), load_duration=0,
                    prompt_eval_count=usage.get("prompt_tokens", 0), prompt_eval_duration=_ns(first - start),
                    eval_count=usage.get("completion_tokens", 0), eval_duration=_ns(end - first))
        return body


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _ollama_calls(calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI's tool calls as Ollama's: the arguments as an object."""
    if not calls:
        return None
    out = []
    for call in calls:
        fn = call.get("function") or {}
        out.append({"function": {"name": fn.get("name", ""), "arguments": arguments_object(fn.get("arguments"))}})
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
    return answer.last(choice.get("finish_reason"), body.get("usage") or {}, content=message.get("content") or "",
                       thinking=message.get("reasoning_content") or "",
                       tool_calls=_ollama_calls(message.get("tool_calls")),
                       logprobs=_ollama_logprobs(choice.get("logprobs")))


async def _lines(answer: _Answer, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """An OpenAI chat stream's chunks as Ollama's lines: a line a delta (its text or its tokens' logprobs), the
    last with the counts."""
    finish: str | None = None
    calls: list[dict[str, Any]] = []
    async for chunk in chunks:
        if "error" in chunk:
            yield _line({"error": chunk["error"].get("message", "error")})
            return
        if not chunk.get("choices"):  # the usage: the answer is complete
            yield _line(answer.last(finish, chunk.get("usage") or {}, tool_calls=_ollama_calls(calls)))
            return
        choice = chunk["choices"][0]
        finish = choice.get("finish_reason") or finish
        delta = choice.get("delta") or {}
        calls.extend(delta.get("tool_calls") or ())
        text, thinking = delta.get("content") or "", delta.get("reasoning_content") or ""
        logprobs = _ollama_logprobs(choice.get("logprobs"))
        if text or thinking or logprobs:
            yield _line(answer.part(text, thinking, logprobs=logprobs))


def _line(body: dict[str, Any]) -> bytes:
    return (json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


async def _translate(answer: _Answer, response: Response) -> Response:
    """kestrel's OpenAI chat answer as Ollama's: its stream's chunks as lines, or its one object."""
    return await retold(response, lambda body: _whole(answer, body), lambda chunks: _lines(answer, chunks),
                        "application/x-ndjson")


def _loaded(answer: _Answer, keep_alive: Any) -> JSONResponse:
    """The answer to a request with nothing to generate, which clients send to load a model (or, with a
    ``keep_alive`` of zero, to unload it): the model is loaded for as long as the server runs."""
    reason = "unload" if _is_zero_duration(keep_alive) else "load"
    return JSONResponse({**answer.part(done=True), "done_reason": reason})


GO_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
GO_DURATION = re.compile(rf"[-+]?(?:{GO_DURATION_PART.pattern})+")
NANOSECONDS = {"ns": 1, "us": 10**3, "µs": 10**3, "μs": 10**3, "ms": 10**6, "s": 10**9, "m": 60 * 10**9,
               "h": 3600 * 10**9}


def _is_zero_duration(keep_alive: Any) -> bool:
    """Whether ``keep_alive`` is a duration of zero as Ollama reads one: seconds as a number, or Go's duration
    text ("0", "0s", "0m"...)."""
    if isinstance(keep_alive, (int, float)) and not isinstance(keep_alive, bool):
        return 0 <= keep_alive < 1e-9
    if not isinstance(keep_alive, str):
        return False
    if keep_alive == "0":
        return True
    if not GO_DURATION.fullmatch(keep_alive):
        return False
    return all(int(float(number) * NANOSECONDS[unit]) == 0 for number, unit in
               GO_DURATION_PART.findall(keep_alive))


def _unit_vector(vector: list[float], dimensions: int | None) -> list[float]:
    """A vector as Ollama's ``/api/embed`` answers it, whatever the model's own normalization: of unit length, cut
    to ``dimensions`` where that is between 0 and its size (Ollama scales it, cuts it and scales it again: the
    same vector)."""
    cut = dimensions if dimensions is not None and 0 < dimensions < len(vector) else None
    return finish_vector(np.asarray(vector), cut, normalize=True).tolist()


def _check_think(body: _Generation, served: Served) -> None:
    """``think`` asked of a model whose template has no reasoning is a 400, as Ollama answers it (false is
    fine)."""
    if body.think not in (None, False) and not (served.thinks or served.harmony):
        raise APIError(400, f'"{body.model}" does not support thinking', param="think")


def install(app: FastAPI, models: Models) -> None:
    """Ollama's routes on ``app``, answered by the named model's handlers."""

    @app.post("/api/chat")
    async def chat(body: Annotated[ChatBody, json_body(ChatBody)], request: Request) -> Response:
        served = model_of(models, body.model)
        _check_think(body, served)
        if not body.messages:  # a client loading (or unloading) the model: it stays loaded while serving
            return _loaded(_Answer(served, request, "message"), body.keep_alive)
        with named_as(REQUEST_NAMES):
            openai = await off_loop(request, lambda: validated(ChatCompletionRequest, body.openai(served)))
            response = await served.chat(openai, request, truncate=body.truncate)
        return await _translate(_Answer(served, request, "message"), response)

    @app.post("/api/generate")
    async def generate(body: Annotated[GenerateBody, json_body(GenerateBody)], request: Request) -> Response:
        served = model_of(models, body.model)
        _check_think(body, served)
        answer = _Answer(served, request, "response")
        if body.images:
            raise APIError(400, "images are not supported (kestrel serves text models)", param="images")
        suffix = body.suffix or None  # "": none, as Ollama reads it
        if not body.prompt and suffix is None:
            return _loaded(answer, body.keep_alive)
        sampling = body.sampling(body.stream, served.engine.sampling_defaults)
        templated = not body.raw and suffix is None and served.engine.tokenizer.chat_template
        if not templated and body.response_format() is not None:
            raise APIError(400, "format needs the model's chat template (not raw, no suffix)", param="format")
        with named_as(REQUEST_NAMES):
            if templated:
                messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
                    {"role": "user", "content": body.prompt}]
                openai = await off_loop(request, lambda: validated(ChatCompletionRequest, {
                    "messages": messages, "response_format": body.response_format(),
                    "chat_template_kwargs": body.template_kwargs(served.harmony), **body.chat_logprobs(), **sampling}))
                response = await served.chat(openai, request)
            else:
                completion = await off_loop(request, lambda: validated(CompletionRequest, {
                    "prompt": body.prompt, "suffix": suffix, "logprobs": body.top_logprobs if body.logprobs else None,
                    **sampling}))
                response = await served.complete(completion, request, chat_shaped=True)
        return await _translate(answer, response)

    @app.post("/api/embed")
    async def embed(body: Annotated[EmbedBody, json_body(EmbedBody)], request: Request) -> Response:
        served = model_of(models, body.model)
        start = record_of(request).start
        if not body.input:
            return JSONResponse({"model": ollama_name(served), "embeddings": []})
        openai = await off_loop(request, lambda: validated(EmbeddingRequest, {"input": body.input}))
        response = await served.embed(openai, request, truncate=body.truncate)
        if response.status_code != 200:
            return response

        def answer() -> dict[str, Any]:
            data = json_loads(bytes(response.body))
            vectors = [_unit_vector(d["embedding"], body.dimensions) for d in data["data"]]
            return {"model": ollama_name(served), "embeddings": vectors,
                    "total_duration": _ns(time.perf_counter() - start), "load_duration": 0,
                    "prompt_eval_count": data["usage"]["prompt_tokens"]}

        return await json_answer(answer)

    @app.post("/api/embeddings")
    async def embeddings(body: Annotated[LegacyEmbeddingsBody, json_body(LegacyEmbeddingsBody)],
                         request: Request) -> Response:
        served = model_of(models, body.model)
        if not body.prompt:  # what clients send to load the model
            return JSONResponse({"embedding": []})
        openai = await off_loop(request, lambda: validated(EmbeddingRequest, {"input": body.prompt}))
        response = await served.embed(openai, request, truncate=True)
        if response.status_code != 200:
            return response
        return JSONResponse({"embedding": json.loads(bytes(response.body))["data"][0]["embedding"]})

    @app.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [card(served) for served in models]}

    @app.get("/api/ps")
    async def ps() -> dict[str, Any]:
        return {"models": [{**card(served), "expires_at": "2100-01-01T00:00:00Z", "size_vram": 0,
                            "context_length": served.engine.config.max_position} for served in models]}

    @app.post("/api/show")
    async def show(body: Annotated[ShowBody, json_body(ShowBody)]) -> dict[str, Any]:
        return show_model(model_of(models, body.model or body.name or ""))

    @app.get("/api/version")
    async def version() -> dict[str, str]:
        return {"version": OLLAMA_VERSION, "kestrel_version": kestrel_core.__version__}

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # a heartbeat, no API
    async def running() -> PlainTextResponse:
        """Ollama's heartbeat: its CLI and clients check the server with ``HEAD /`` before anything else."""
        return PlainTextResponse("kestrel is running")


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
    params = sum(w.n * w.k for w in _tensors(served))
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
    """The model as ``/api/tags`` lists it."""
    size = sum(w.nbytes for w in _tensors(served))
    created = datetime.fromtimestamp(served.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"name": ollama_name(served), "model": ollama_name(served), "modified_at": created, "size": size,
            "digest": "", "details": details(served)}


def show_model(served: Served) -> dict[str, Any]:
    """``/api/show``: the details, the chat template, the architecture's figures and the capabilities."""
    c = served.engine.config
    info = {"general.architecture": c.arch, "general.basename": served.model_name,
            f"{c.arch}.context_length": c.max_position,
            f"{c.arch}.embedding_length": c.hidden_size, f"{c.arch}.block_count": c.num_layers,
            f"{c.arch}.attention.head_count": c.num_heads, f"{c.arch}.attention.head_count_kv": c.num_kv_heads}
    parameters = "\n".join(f"{OLLAMA_NAMES.get(k, k)} {v:g}" for k, v in served.engine.sampling_defaults.items())
    return {"modelfile": "", "parameters": parameters, "template": served.engine.tokenizer.chat_template or "",
            "details": details(served), "model_info": info, "capabilities": capabilities(served)}


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
