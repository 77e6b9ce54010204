"""The FastAPI app: OpenAI's chat and text completions and embeddings, the model list, a health probe and the
metrics; OpenAI's Responses API (serve/responses_api.py), Ollama's API (serve/ollama.py), Anthropic's Messages
API (serve/anthropic.py), llama.cpp's ``/infill`` (serve/llamacpp.py) and relevance scores (serve/scores.py)
beside them, answered by the same handlers.

``create_app`` takes a running-or-not ``AsyncEngine`` (its lifespan starts the scheduler thread and stops it
on shutdown), so one process can hold several apps (the tests do). Requests become prompt token ids here
(the chat template, or the tokenizer, or the ids as given), then ``generation.respond`` runs them; an echoed
completions prompt is scored here first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, asynccontextmanager, contextmanager
from dataclasses import replace
from functools import cached_property
from typing import Annotated, Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import kestrel_core
from kestrel_core.errors import KestrelError, invalid_request
from kestrel_core.model.async_engine import Places
from kestrel_core.model.chat_template import continue_final_message
from kestrel_core.model.embed import check_input
from kestrel_core.model.grammar import compiling
from kestrel_core.model.harmony import is_harmony
from kestrel_core.model.reasoning import Reasoning, opens_in_prompt, reasoning_markers
from kestrel_core.model.request_queue import checked_priority
from kestrel_core.model.rerank import is_reranker
from kestrel_core.model.sampling import TokenLogprob
from kestrel_core.model.weights import parameter_count
from kestrel_core.serve import anthropic, generation, llamacpp, ollama, responses_api, scores, tokenize
from kestrel_core.serve.access import (
    CLIENT_CLOSED,
    DEFAULT_MAX_REQUEST_BYTES,
    AccessMiddleware,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    BrowserGuardMiddleware,
    JsonBodyMiddleware,
    checked_api_key,
)
from kestrel_core.serve.errors import APIError, from_kestrel_error, install_error_handlers, validated
from kestrel_core.serve.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from kestrel_core.serve.offload import document_bodies, json_body, json_loads, off_loop
from kestrel_core.serve.protocol import (
    COMPLETIONS_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from kestrel_core.serve.responses import (
    ChatShape,
    CompletionShape,
    Echo,
    TokenStrings,
    embedding_list,
    new_id,
    usage,
)
from kestrel_core.serve.tools import CONTROL_TOKENS, SPECIAL_TEXT_FORMATS, ToolCalls, tool_format


class Served:
    """What the routes share: the engine, the model's public name, its token strings."""

    def __init__(self, async_engine: Any, model_name: str, pooling: str | None = None) -> None:
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.model_name = model_name
        self.pooling = pooling  # the embeddings' (None: the model's)
        self.tokens = TokenStrings(self.engine.tokenizer, self.engine.token_bytes)
        self.created = int(time.time())
        template = getattr(self.engine.tokenizer, "chat_template", None)
        tool_template = getattr(self.engine.tokenizer, "tool_template", None)
        # a request with tools renders with the model's tool_use template where it names one (transformers' pick)
        self.tool_format = tool_format(tool_template or template)
        # the reasoning block its answers start with (kestrel_core.model.reasoning; None: they have none), which
        # the tool_use template may teach alone
        self.reasoning_markers = reasoning_markers(template) or reasoning_markers(tool_template)
        self.thinks = self.reasoning_markers is not None
        self.harmony = is_harmony(template)  # its answers are harmony's channels (kestrel_core.model.harmony)
        backend = getattr(self.engine.tokenizer, "backend", None)  # Mistral's and Cohere's calls: special tokens
        ids = {token: backend.token_to_id(token) for token in CONTROL_TOKENS.get(self.tool_format or "", ())} \
            if backend else {}
        self.control_ids = {token: i for token, i in ids.items() if i is not None}

    @cached_property
    def parameter_count(self) -> int:
        """The model's parameters (``weights.parameter_count``), counted at the first ask: it visits every tensor."""
        return parameter_count(self.engine.model)

    def check_request(self, priority: int | None = None) -> None:
        """A generation request: for a model that generates, at a ``priority`` its scheduling policy takes."""
        try:
            self.engine.check_generates()
            checked_priority(self.async_engine.scheduler.policy, priority or 0)
        except KestrelError as exc:
            raise from_kestrel_error(exc) from None

    def context_left(self, prompt_tokens: int) -> int:
        """The default max_tokens: what the model's context has room for after the prompt."""
        return self.engine.config.max_position - prompt_tokens

    async def echoes(self, prompts: list[str | list[int]], ids: list[list[int]], logprobs: int | None,
                     request: Request, places: Places | None = None, priority: int = 0) -> list[Echo]:
        """Completions prompts echoed: their text and, with ``logprobs`` (the alternatives a token), the scores
        of their tokens after the first, each prompt a request of the engine's (``AsyncEngine.score``, one of
        ``places`` each in turn, at ``priority``). ClientGone where the client leaves meanwhile: its scoring stops
        at once."""
        def texts() -> list[str]:
            for one in ids:
                try:
                    self.engine.check_ids(one, "prompt")
                except KestrelError as exc:  # a bad prompt, as a generation's (checked_prompt)
                    raise invalid_request(exc, "prompt") from None
            return [p if isinstance(p, str) else self.engine.tokenizer.decode(one) for p, one in zip(prompts, ids)]

        async def scores(top: int) -> list[list[TokenLogprob] | None]:  # each prompt a request of the engine's
            return [await self.async_engine.score(one, top, places, priority) for one in ids]

        try:
            echoed = await off_loop(request, texts)
            scored: list[list[TokenLogprob] | None] = [None] * len(ids)
            if logprobs is not None:
                scored = await generation.unless_disconnected(scores(logprobs), request)
        except KestrelError as exc:  # a shutdown is a 503, as a generation's
            raise from_kestrel_error(exc, accepting=self.async_engine.accepting, param="prompt") from None
        return [Echo(text, one[0], s) for text, one, s in zip(echoed, ids, scored)]

    def chat_prompt(self, body: ChatCompletionRequest, truncate: bool = False,
                    prefix: Sequence[int] = ()) -> tuple[str, list[int], ToolCalls | None]:
        """A chat request's prompt: its text and token ids, and how its answers carry tool calls; with
        ``truncate``, a conversation that leaves no room for an answer is cut to its latest messages that do
        (``_latest_that_fit``); the ids follow ``prefix`` (Ollama's ``context``: the ids of an earlier prompt and
        its answer), the rendered prompt's own BOS left out after it."""
        self.check_request(body.priority)
        try:  # each of these names its field
            tools = body.tool_calls(self.tool_format)
            context = body.template_context()
        except KestrelError as exc:
            raise from_kestrel_error(exc) from None
        continuing = body.continue_final_message is True
        if continuing and body.add_generation_prompt is True:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true: the answer "
                           "either continues the last message or opens a turn", param="continue_final_message")
        tokenizer = self.engine.tokenizer

        def render(messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
            if continuing:
                prompt = continue_final_message(lambda ms: tokenizer.apply_chat_template(ms, False, **context),
                                                messages)
            else:
                prompt = tokenizer.apply_chat_template(messages, body.add_generation_prompt is not False, **context)
            return prompt, list(tokenizer.encode(prompt, add_special_tokens=False))  # the template wrote any BOS

        try:
            thinking_blocks = self.reasoning_markers is not None and self.reasoning_markers.thinking_block
            messages = body.template_messages(self.harmony, thinking_blocks)
            prompt, prompt_ids = render(messages)
            if truncate and self.context_left(len(prompt_ids)) < 1:
                prompt, prompt_ids = _latest_that_fit(messages, render, lambda ids: self.context_left(len(ids)) > 0)
        except KestrelError as exc:  # no messages, no template, or a template that failed on these
            raise from_kestrel_error(exc, param="messages") from None
        if prefix:
            bos = self.engine.config.bos_token_id
            prompt_ids = [*prefix, *prompt_ids[1 if bos is not None and prompt_ids[:1] == [bos] else 0:]]
        return prompt, prompt_ids, tools

    def chat_params(self, body: ChatCompletionRequest, prompt_ids: list[int]) -> Any:
        """A chat request's SamplingParams, checked against its prompt; its grammar (``chat_grammar``) comes
        after: a client's schema may take seconds to compile, so only for a request that can run."""
        params = _params(body, self.context_left(len(prompt_ids)), self)
        try:
            self.async_engine.check(prompt_ids, params)
        except KestrelError as exc:  # a prompt's error is the messages'
            named = invalid_request(exc, "messages") if getattr(exc, "param", None) == "prompt" else exc
            raise from_kestrel_error(named) from None
        return params

    def chat_grammar(self, body: ChatCompletionRequest, tools: ToolCalls | None) -> str | None:
        """The grammar a chat request's answer keeps to (ChatCompletionRequest.grammar), None for none."""
        try:
            return body.grammar(tools, self.control_ids, self.harmony)
        except KestrelError as exc:
            raise from_kestrel_error(exc) from None

    def guided(self, body: CompletionRequest, prompts: list[generation.Prompt]) -> str | None:
        """A completions request's grammar (vLLM's structured outputs), built once its prompts are known to fit."""
        try:
            for prompt in prompts:
                if prompt.params is not None:
                    self.async_engine.check(prompt.ids, prompt.params)
            return body.guided()
        except KestrelError as exc:
            raise from_kestrel_error(exc) from None

    async def chat(self, body: ChatCompletionRequest, request: Request, truncate: bool = False,
                   by_parts: bool = False, prefix: Sequence[int] = ()) -> Response:
        """``/v1/chat/completions``' answer (whole, or the stream's response); ``truncate`` and ``prefix``:
        ``chat_prompt``'s; ``by_parts``: ChatShape's (the answer's parts, for the Responses API)."""
        def prepare() -> tuple[str, list[int], ToolCalls | None, Any]:
            prompt, prompt_ids, tools = self.chat_prompt(body, truncate, prefix)
            return prompt, prompt_ids, tools, self.chat_params(body, prompt_ids)

        # a large conversation is rendered as a large body is read (offload): its thread gives the GIL back soon
        prompt, prompt_ids, tools, params = await off_loop(request, prepare, inline=False)
        if body.sets_grammar:
            try:
                grammar = await generation.unless_disconnected(compiling(lambda: self.chat_grammar(body, tools)),
                                                               request)
            except generation.ClientGone:
                return Response(status_code=CLIENT_CLOSED)
            params = replace(params, grammar=grammar)
        # a constrained answer is what it is constrained to from its first token, even where the prompt opened a
        # reasoning block
        markers = self.reasoning_markers
        reasoning = None if markers is None else \
            Reasoning(opens_in_prompt(prompt, markers) and params.grammar is None, markers)
        # harmony's channels, mistral-args' and Cohere's calls and Mistral's and Cohere's reasoning tags are special
        # tokens: their text must stay (as vLLM keeps a Mistral model's [THINK] tags, and its calls when the request
        # offers tools, and a Cohere model's)
        special = tools is not None and tools.fmt in SPECIAL_TEXT_FORMATS
        if self.harmony or special or markers is not None and markers.control:
            params = replace(params, skip_special_tokens=False)
        if params.logprobs:
            await asyncio.to_thread(self.tokens.ready)
        shape = ChatShape(new_id("chatcmpl"), self.model_name, self.tokens, body.include_usage,
                          body.continuous_usage, tools, reasoning, harmony=self.harmony, by_parts=by_parts)
        one = generation.Prompt(prompt_ids, params, params.logprobs)
        return await generation.respond(self.async_engine, request, [one], shape, stream=bool(body.stream),
                                        prompt_param="messages", choices=body.choices, priority=body.priority or 0)

    async def read_prompt(self, chat: Callable[[], dict[str, Any]], request: Request,
                          truncate: bool = False) -> Response | dict[str, Any]:
        """A chat request's prompt (``chat()``: the request's fields, made off the loop as a large body's are) read
        into the prefix cache with nothing answered, what Anthropic's ``max_tokens`` 0 and the Responses API's
        ``prompt_cache_options.prewarm`` ask for: one token is generated and dropped, so that the prompt's blocks
        stay in the prefix cache for the next request. The chat answer's usage of no completion tokens (the prompt's
        tokens, and those of them the prefix cache held), or the response to answer instead (an error, a client
        gone)."""
        def fields() -> dict[str, Any]:
            return {**chat(), "max_tokens": 1, "max_completion_tokens": None, "n": None, "stream": False,
                    "stream_options": None}

        body = await off_loop(request, lambda: validated(ChatCompletionRequest, fields()))
        response = await self.chat(body, request, truncate)
        if response.status_code != 200:
            return response
        read = json_loads(bytes(response.body)).get("usage") or {}
        cached = (read.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return usage(read.get("prompt_tokens", 0), 0, cached)

    async def complete(self, body: CompletionRequest, request: Request, chat_shaped: bool = False) -> Response:
        """``/v1/completions``' answer; ``chat_shaped``: in a chat completion's shape (each token's logprob with
        its bytes and alternatives), for an API that retells it."""
        self.check_request(body.priority)
        try:
            texts = await off_loop(request, body.prompts)
            token_ids, stops = await off_loop(
                request, lambda: body.prompt_ids(self.engine.tokenizer, self.engine.eos_token_ids), inline=False)
        except KestrelError as exc:
            raise from_kestrel_error(exc, param="prompt") from None
        prompts = []
        for ids in token_ids:
            params = _params(body, self.context_left(len(ids)), self)
            if params is not None and stops and not params.ignore_eos:
                # a fill-in-the-middle answer ends at its format's stop tokens too: ends of text, as llama.cpp's
                # ignore_eos takes them
                params = replace(params, stop_token_ids=tuple(dict.fromkeys(params.stop_token_ids + stops)))
            prompts.append(generation.Prompt(ids, params, body.logprobs is not None))
        grammar = None
        if body.sets_guided:
            try:
                grammar = await generation.unless_disconnected(compiling(lambda: self.guided(body, prompts)), request)
            except generation.ClientGone:
                return Response(status_code=CLIENT_CLOSED)
        if grammar is not None:
            prompts = [replace(p, params=replace(p.params, grammar=grammar)) if p.params else p for p in prompts]
        if body.logprobs is not None:
            await asyncio.to_thread(self.tokens.ready)
        with ExitStack() as held:
            places = None
            if body.echo and body.logprobs is not None:  # its scorings, then its choices: none loses its place
                places = held.enter_context(self.places(max(1, body.choices * sum(p.params is not None
                                                                                   for p in prompts))))
            echoes: list[Echo | None] = []
            if body.echo:  # each prompt's, once for each of its choices
                try:
                    echoed = await self.echoes(texts, token_ids, body.logprobs, request, places, body.priority or 0)
                except generation.ClientGone:
                    return Response(status_code=CLIENT_CLOSED)
                for echo in echoed:
                    echoes.extend([echo] * body.choices)
            shape: ChatShape | CompletionShape
            if chat_shaped:
                shape = ChatShape(new_id("cmpl"), self.model_name, self.tokens, body.include_usage,
                                  body.continuous_usage)
            else:
                shape = CompletionShape(new_id("cmpl"), self.model_name, self.tokens, body.include_usage, echoes,
                                        body.continuous_usage)
            return await generation.respond(self.async_engine, request, prompts, shape, stream=bool(body.stream),
                                            choices=body.choices, places=places, priority=body.priority or 0)

    @contextmanager
    def places(self, n: int) -> Iterator[Places]:
        """``n`` places of the capacity for a request of several parts (``AsyncEngine.places``), taken at once: a
        400 where the server never holds so many, a 429 (503 shutting down) where it has fewer free now."""
        generation.check_sequences(self.async_engine, n)
        with ExitStack() as taken:
            try:
                places = taken.enter_context(self.async_engine.places(n))
            except KestrelError as exc:
                raise from_kestrel_error(exc, accepting=self.async_engine.accepting) from None
            yield places

    async def embed(self, body: EmbeddingRequest, request: Request, truncate: bool = False) -> Response:
        """``/v1/embeddings``' answer; ``truncate``: inputs longer than the context keep their first tokens."""
        if is_reranker(self.engine.config):
            raise APIError(400, f"`{self.model_name}` is a reranker: it gives relevance scores of query-document pairs "
                           "(/v1/rerank, /v1/score), not embeddings", param="model")
        inputs = await self.tokenized(request, body.inputs, "input", truncate)

        def answer(vectors: np.ndarray, prompt_tokens: int) -> dict[str, Any]:
            return embedding_list(vectors, body.encoding_format, self.model_name, prompt_tokens)

        return await generation.embed(self.async_engine, request, inputs, answer, pooling=self.pooling,
                                      dimensions=body.dimensions)

    async def tokenized(self, request: Request, texts: Callable[[], list[str | list[int]]], param: str,
                        truncate: bool = False, what: str | None = None) -> list[list[int]]:
        """The token ids of ``texts()`` (texts, or token ids as given), made and checked for the embedding job
        off the event loop (a request may hold thousands; ``off_loop``): a 400 naming ``param``, its message the text as
        ``what`` (default ``param``). ``truncate``: each keeps a context's worth, a text its first tokens and
        the special tokens the tokenizer adds (the end token a last-token pooling reads), token ids their first."""
        tokenizer, context = self.engine.tokenizer, self.engine.config.max_position
        limit = context if truncate else None

        def tokenize() -> list[list[int]]:
            ids = [list(tokenizer.encode(t, max_length=limit)) if isinstance(t, str) else t[:limit] for t in texts()]
            return [check_input(self.engine, one, what or param, param) for one in ids]

        try:
            return await off_loop(request, tokenize, inline=False)
        except KestrelError as exc:
            raise from_kestrel_error(exc, param=param) from None

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kestrel",
                "max_model_len": self.engine.config.max_position}  # vLLM's field: clients size prompts by it


class Models:
    """The models a server serves, by their public names; the first answers requests that name none."""

    def __init__(self, engines: Mapping[str, Any], pooling: str | None = None) -> None:
        if not engines:
            raise KestrelError("a server needs at least one model")
        self.served = {name: Served(ae, name, pooling) for name, ae in engines.items()}
        self.default = next(iter(self.served.values()))

    def __iter__(self) -> Iterator[Served]:
        return iter(self.served.values())

    def get(self, name: str | None) -> Served:
        """The model ``name`` names (None: the first); OpenAI's 404 model_not_found for another."""
        if name is None:
            return self.default
        served = self.served.get(name)
        if served is None:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                           f"{', '.join(f'`{n}`' for n in self.served)}.", param="model", code="model_not_found")
        return served


def create_app(engines: Mapping[str, Any], api_key: str | None = None, pooling: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, loopback: bool = True,
               allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """The OpenAI-compatible app over ``engines`` (public name -> AsyncEngine; the first answers requests that
    name no model); with ``api_key``, /v1/* and /api/* need it; ``pooling``: the embeddings' (None: each
    model's); a request body over ``max_request_bytes`` is a 413; ``loopback`` (it listens on a loopback address)
    and ``allowed_origins``: BrowserGuardMiddleware's."""
    api_key = checked_api_key(api_key)
    models = Models(engines, pooling)
    metrics = ServerMetrics(engines)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for ae in engines.values():
            ae.start()
        yield
        # the server has already waited for (or cancelled) its requests: whatever is left is aborted
        await asyncio.gather(*(ae.shutdown(grace_s=0.0) for ae in engines.values()))

    app = FastAPI(title="kestrel", version=kestrel_core.__version__, lifespan=lifespan,
                  summary="An OpenAI-compatible API over kestrel's continuous-batching engine.")
    install_error_handlers(app)
    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    # outside the API key: a page's preflight carries none
    app.add_middleware(BrowserGuardMiddleware, loopback=loopback, allowed_origins=allowed_origins)
    app.add_middleware(AccessMiddleware, metrics=metrics)  # outermost: it also sees the 401s and 403s

    @app.post("/v1/chat/completions")
    async def chat_completions(body: Annotated[ChatCompletionRequest, json_body(ChatCompletionRequest)],
                               request: Request) -> Response:
        return await models.get(body.model).chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: Annotated[CompletionRequest, json_body(CompletionRequest)],
                          request: Request) -> Response:
        if "max_tokens" not in body.model_fields_set:  # left out, not null: OpenAI's and vLLM's 16 on this route
            body.max_tokens = COMPLETIONS_MAX_TOKENS
        return await models.get(body.model).complete(body, request)

    @app.post("/v1/embeddings")
    async def embeddings(body: Annotated[EmbeddingRequest, json_body(EmbeddingRequest)], request: Request) -> Response:
        return await models.get(body.model).embed(body, request)

    ollama.install(app, models)
    anthropic.install(app, models)
    llamacpp.install(app, models)
    responses_api.install(app, models)
    scores.install(app, models)
    tokenize.install(app, models)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [served.model_card() for served in models]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        return models.get(model_id).model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        if all(ae.accepting for ae in engines.values()):
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "shutting down"}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    document_bodies(app)
    return app


def _latest_that_fit(messages: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], tuple[str, list[int]]],
                     fits: Callable[[list[int]], bool]) -> tuple[str, list[int]]:
    """The prompt (text, token ids: ``render``'s) of a conversation cut to its latest messages that ``fits``, as
    Ollama's ``/api/chat`` cuts one: the oldest messages go, but the system ones and the latest message stay, and
    a tool's result keeps the assistant message whose call it answers. A cut the template refuses (one whose
    messages must open with a user turn) counts as not fitting. The cut is found by bisection, since fewer
    messages never make a longer prompt; where none fits, the shortest cut's prompt (the request then fails as
    too long), or its template's error."""
    starts = sorted({_turn_start(messages, i) for i in range(1, len(messages))} - {0})
    if not starts:
        return render(messages)
    rendered: dict[int, tuple[str, list[int]] | KestrelError] = {}

    def cut(k: int) -> tuple[str, list[int]] | KestrelError:
        """The prompt from ``starts[k]`` on, or the template's error."""
        if k not in rendered:
            kept = [m for m in messages[:starts[k]] if m["role"] == "system"] + messages[starts[k]:]
            try:
                rendered[k] = render(kept)
            except KestrelError as exc:
                rendered[k] = exc
        return rendered[k]

    low, high = 0, len(starts) - 1
    while low < high:
        middle = (low + high) // 2
        prompt = cut(middle)
        if isinstance(prompt, KestrelError) or not fits(prompt[1]):
            low = middle + 1
        else:
            high = middle
    prompt = cut(low)
    if isinstance(prompt, KestrelError):
        raise prompt
    return prompt


def _turn_start(messages: list[dict[str, Any]], index: int) -> int:
    """Where a cut before message ``index`` starts: the assistant message whose calls a tool result there answers
    (the results after its calls stay together with it), else ``index``."""
    start = index
    while start > 0 and messages[start]["role"] == "tool" and messages[start - 1]["role"] == "tool":
        start -= 1
    if messages[start]["role"] == "tool" and start > 0 and messages[start - 1]["role"] == "assistant" \
            and messages[start - 1].get("tool_calls"):
        return start - 1
    return index


def _params(body: ChatCompletionRequest | CompletionRequest, context_left: int, served: Served) -> Any:
    try:
        return body.sampling_params(context_left, served.engine.sampling_defaults)
    except KestrelError as exc:
        raise from_kestrel_error(exc) from None
