"""OpenAI's Responses API (``POST /v1/responses``) over the same engine, for the clients built on it (the
``openai`` SDKs' ``client.responses``, agent frameworks, coding agents).

A request is translated into the chat request kestrel already answers: ``instructions`` and the ``input`` (a string,
or items: messages with text content, ``function_call_output`` items as tool messages; an answer's items in a row,
its ``reasoning``, assistant messages and ``function_call`` items, one assistant turn with its reasoning, text and
tool calls, as the chat route's message of that answer, which the template renders as it renders that one),
``tools`` (functions), ``tool_choice``, ``parallel_tool_calls``, ``text.format`` (text, a JSON object or a JSON
Schema), ``max_output_tokens``, ``temperature``, ``top_p``; ``reasoning.effort`` as the chat request's
``reasoning_effort``. The answer comes back as output items, one of each of its parts (ChatShape's ``by_parts``: a
``reasoning`` item, a ``message`` with an ``output_text`` part) and a ``function_call`` of each call, whole or as
the API's event stream (``response.created``, each item's ``output_item.added``, ``content_part.added`` / deltas /
``done`` events, ``response.completed`` or ``response.incomplete`` when ``max_output_tokens`` cut it);
``truncation: "auto"`` drops the oldest input items that leave no room for an answer (the chat route's ``truncate``,
as Ollama's); ``prompt_cache_options.prewarm`` reads the input into the prefix cache and answers a completed
response without output (``Served.read_prompt``). Nothing is stored: ``store`` is accepted and ignored,
``previous_response_id``, ``conversation``, ``prompt``, ``background: true`` and the retrieval routes are refused, so
a client sends the whole conversation (as ``store: false`` clients do). As on the chat route, a field that asks for
what kestrel does not do is refused (``context_management``'s compaction, ``moderation``, a tool choice other than a
function), fields that only tune what OpenAI's own service does (``service_tier``, ``prompt_cache_key``,
``prompt_cache_options``' other options, ``safety_identifier``, ``user``, ``max_tool_calls`` of built-in tools,
``reasoning.summary``, ``text.verbosity``, the API's other ``include`` values) are accepted and ignored, and so are
unknown fields; an ``include`` value the API does not define is refused. ``priority`` (vLLM's extension) is the
chat request's.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from kestrel_core.model.parts import SEPARATOR
from kestrel_core.serve.bodies import RequestBody
from kestrel_core.serve.errors import APIError, named_as, validated
from kestrel_core.serve.generation import retold
from kestrel_core.serve.offload import json_body, off_loop
from kestrel_core.serve.protocol import ChatCompletionRequest, unset_sampling

if TYPE_CHECKING:
    from kestrel_core.serve.app import Models, Served

# the chat request's fields a Responses request sets, by the names it sends them under (its errors name those; the
# prompt the input makes is the input)
CHAT_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format",
              "reasoning_effort": "reasoning.effort", "messages": "input", "prompt": "input",
              "tools.*.function": "tools.*"}
# ``include``'s values the API defines (the openai package's ResponseIncludable); kestrel answers the logprobs one
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs")

class Reasoning(RequestBody):
    effort: StrictStr | None = None
    summary: StrictStr | None = None


class TextFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class PromptCacheOptions(RequestBody):
    """``prompt_cache_options``: ``prewarm`` is honoured (the input read into the prefix cache, nothing generated);
    ``mode``, ``ttl`` and ``comparison_response_id`` tune or diagnose OpenAI's own cache, and are ignored."""

    prewarm: StrictBool = False


class ResponsesBody(RequestBody):
    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    reasoning: Reasoning | None = None
    stream: StrictBool = False
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    include: list[StrictStr] | None = None
    top_logprobs: StrictInt | None = None
    conversation: Any = None  # refused: kestrel stores no conversations, nor prompts
    prompt: Any = None
    background: StrictBool | None = None  # refused when true: kestrel stores no response to fetch later
    truncation: Literal["auto", "disabled"] | None = None
    context_management: list[Any] | None = None  # refused where it asks for compaction: kestrel compacts nothing
    moderation: Any = None  # refused: kestrel moderates nothing
    prompt_cache_options: PromptCacheOptions | None = None
    priority: StrictInt | None = None  # vLLM's extension, as the chat request's

    def text_format(self) -> TextFormat:
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return TextFormat()
        if not isinstance(fmt, dict):
            raise APIError(400, "text.format must be an object", param="text.format")
        with named_as({name: f"text.format.{name}" for name in ("type", "name", "schema", "strict")}):
            got = validated(TextFormat, fmt)
        if got.type == "json_schema" and got.schema_ is None:
            raise APIError(400, "text.format.schema is required for a json_schema format",
                           param="text.format.schema", code="missing_required_parameter")
        return got

    def openai(self) -> dict[str, Any]:
        for name in ("previous_response_id", "conversation", "prompt"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name} is not supported: kestrel stores no responses, conversations or prompts; "
                               "send the whole conversation as input", param=name)
        if self.background:
            raise APIError(400, "background is not supported: kestrel stores no responses, so none can be fetched "
                           "later; send the request without it (answered at once, or streamed)", param="background")
        if self.context_management:
            raise APIError(400, "context_management is not supported: kestrel compacts no conversation; send the "
                           'request without it (truncation "auto" drops the oldest input items instead)',
                           param="context_management")
        if self.moderation is not None:
            raise APIError(400, "moderation is not supported: kestrel moderates neither the input nor the output; "
                           "send the request without it", param="moderation")
        for i, value in enumerate(self.include or ()):
            if value not in INCLUDABLE:
                raise APIError(400, f"include.[{i}]: {value!r} is not one of {', '.join(INCLUDABLE)}",
                               param=f"include.[{i}]", code="invalid_value")
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            _add_item(messages, item, f"input.[{i}]")
        out: dict[str, Any] = {
            "messages": messages, "max_tokens": self.max_output_tokens, "stream": self.stream,
            "stream_options": {"include_usage": True} if self.stream else None,
            "temperature": None if self.temperature is None else float(self.temperature),  # as the chat route
            "top_p": None if self.top_p is None else float(self.top_p),
            "tools": [_function(t, f"tools.[{i}]") for i, t in enumerate(self.tools or ())] or None,
            "parallel_tool_calls": self.parallel_tool_calls, "priority": self.priority}
        if "message.output_text.logprobs" in (self.include or ()) or self.top_logprobs:
            out.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function":
                raise APIError(400, f"tool_choice: a {choice.get('type')!r} choice is not supported (none, auto, "
                               "required or a function)", param="tool_choice")
            out["tool_choice"] = {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}
        elif choice is not None:
            out["tool_choice"] = choice
        fmt = self.text_format()
        if fmt.type == "json_object":
            out["response_format"] = {"type": "json_object"}
        elif fmt.type == "json_schema":
            out["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_ or {}}}
        if self.reasoning is not None and self.reasoning.effort is not None:
            out["reasoning_effort"] = self.reasoning.effort
        return out


def _function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise APIError(400, f"{where}: only function tools (type, name, parameters) are supported", param=where)
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                             if tool.get(k) is not None}}


def _content(content: Any, where: str) -> str | list[dict[str, str]]:
    """A message's content: a string, or its text parts as chat text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of parts", param=where)
    parts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}: a {kind!r} part is not supported (text only)", param=where)
        parts.append({"type": "text", "text": _string(part, "text", f"{where}.[{k}]")})
    return parts


def _string(item: dict[str, Any], key: str, where: str) -> str:
    """Field ``key`` of the input's ``item`` (at ``where``), which the API requires to be a string."""
    value = item.get(key)
    if isinstance(value, str):
        return value
    param = f"{where}.{key}"
    if value is None:
        raise APIError(400, f"{param} is required", param=param, code="missing_required_parameter")
    raise APIError(400, f"{param} must be a string, not {type(value).__name__}", param=param, code="invalid_value")


def _text(content: Any, where: str) -> str:
    """A tool output's text: its parts joined by newlines."""
    parts = _content(content, where)
    return parts if isinstance(parts, str) else "\n".join(part["text"] for part in parts)


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    """One input item onto the chat messages. The items of one answer in a row (its reasoning, its messages and its
    function calls) are one assistant turn, as the chat route's message of that answer: its reasoning and its text
    each the items' a line apart, then its calls."""
    if not isinstance(item, dict):
        raise APIError(400, f"{where} must be an object", param=where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise APIError(400, f"{where}.role must be user, assistant, system or developer", param=f"{where}.role")
        if "content" not in item:
            raise APIError(400, f"{where}.content is required", param=f"{where}.content",
                           code="missing_required_parameter")
        content = _content(item["content"], f"{where}.content")
        if role != "assistant":
            messages.append({"role": role, "content": content})
            return
        turn = _assistant_turn(messages)
        turn["content"] = _more_text(turn["content"], content)
    elif kind == "reasoning":
        thought = _reasoning(item, where)
        if thought:
            turn = _assistant_turn(messages)
            said = turn.get("reasoning_content")
            turn["reasoning_content"] = thought if said is None else said + SEPARATOR + thought
    elif kind == "function_call":
        call = {"id": _string(item, "call_id", where), "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
        _assistant_turn(messages).setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        if "output" not in item:
            raise APIError(400, f"{where}.output is required", param=f"{where}.output",
                           code="missing_required_parameter")
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                         "content": _text(item["output"], f"{where}.output")})
    else:
        raise APIError(400, f"{where}: a {kind!r} item is not supported", param=where)


def _assistant_turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant turn an answer's next item joins: the last message where it is one, else a new one."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    return messages[-1]


def _more_text(content: str | list[dict[str, str]], more: str | list[dict[str, str]]) -> str | list[dict[str, str]]:
    """A turn's content with more after it: as text parts, which a template that reads a string gets a line apart."""
    if not content:
        return more
    return [part for text in (content, more)
            for part in ([{"type": "text", "text": text}] if isinstance(text, str) else text)]


def _reasoning(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its ``reasoning_text`` parts a line apart (a summary is not the reasoning)."""
    parts = item.get("content") or []
    if not isinstance(parts, list):
        raise APIError(400, f"{where}.content must be a list of reasoning_text parts", param=f"{where}.content")
    texts = []
    for k, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "reasoning_text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}.content.[{k}]: a {kind!r} part is not supported (reasoning_text only)",
                           param=f"{where}.content.[{k}]")
        texts.append(_string(part, "text", f"{where}.content.[{k}]"))
    return SEPARATOR.join(texts)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Response:
    """The response object, in progress or whole."""

    def __init__(self, served: Served, body: ResponsesBody) -> None:
        self.id = _id("resp")
        self.created = int(time.time())
        self.model = served.model_name
        self.body = body
        self.output: list[dict[str, Any]] = []
        # the sampling the answer runs with, as OpenAI's response says it, what the request left out included
        unset = unset_sampling(served.engine.sampling_defaults)
        self.temperature = unset["temperature"] if body.temperature is None else float(body.temperature)
        self.top_p = unset["top_p"] if body.top_p is None else float(body.top_p)

    def envelope(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        incomplete = status == "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions, "model": self.model, "output": self.output,
            "parallel_tool_calls": b.parallel_tool_calls is not False, "temperature": self.temperature,
            "top_p": self.top_p, "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
            "text": {"format": b.text_format().model_dump(exclude_none=True, by_alias=True)},
            "max_output_tokens": b.max_output_tokens, "previous_response_id": None, "background": False,
            "truncation": b.truncation or "disabled",
            "reasoning": (b.reasoning or Reasoning()).model_dump(), "store": False, "metadata": b.metadata or {},
            "usage": None if usage is None else _usage(usage)}


def _usage(chat: dict[str, Any]) -> dict[str, Any]:
    """The chat answer's usage as the Responses API's (its reasoning tokens ChatShape's count)."""
    prompt, completion = chat.get("prompt_tokens", 0), chat.get("completion_tokens", 0)
    reasoning = (chat.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


class _Items:
    """The response's output items as its answer's parts come, and the API's events that build them: an item of
    each part that says something (its reasoning a ``reasoning`` item, its content a ``message`` with one
    ``output_text`` part), then a ``function_call`` item of each call. A whole answer's items are built by the
    same events, one part at a time, so they are the stream's."""

    def __init__(self, response: _Response) -> None:
        self.response = response
        self.sequence = 0
        self.open: dict[str, Any] | None = None
        self.open_part: int | None = None  # the index of the answer's part the open item says
        self.pending: dict[int, list[dict[str, Any]]] = {}  # by part: logprobs of tokens before its first text

    def event(self, kind: str, **body: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **body}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def part(self, index: int, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[bytes]:
        """Part ``index``'s next ``text`` (``kind``: reasoning or content), an item of its own from its first,
        and the logprobs of its tokens (where asked for), which a message's text carries (those that come before
        its first text wait for it)."""
        if logprobs:
            self.pending.setdefault(index, []).extend(logprobs)
        if self.open_part != index and not text:
            return []
        events = [] if self.open_part == index else self._start(index, kind)
        item = self.open
        assert item is not None
        at = len(self.response.output) - 1
        taken = self.pending.pop(index, [])
        item["content"][0]["text"] += text
        if item["type"] == "reasoning":
            return [*events, self.event("response.reasoning_text.delta", item_id=item["id"], output_index=at,
                                        content_index=0, delta=text)] if text else events
        if not (text or taken):
            return events
        item["content"][0]["logprobs"] += taken
        return [*events, self.event("response.output_text.delta", item_id=item["id"], output_index=at,
                                    content_index=0, delta=text, logprobs=taken)]

    def _start(self, index: int | None, kind: str) -> list[bytes]:
        events = self.close()
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.response.output.append(item)
        self.open, self.open_part = item, index
        at = len(self.response.output) - 1
        events.append(self.event("response.output_item.added", output_index=at, item={**item, "content": []}))
        events.append(self.event("response.content_part.added", item_id=item["id"], output_index=at,
                                 content_index=0, part=item["content"][0]))
        return events

    def close(self, status: str = "completed") -> list[bytes]:
        item, self.open, self.open_part = self.open, None, None
        if item is None:
            return []
        index = self.response.output.index(item)
        text = item["content"][0]["text"]
        if item["type"] == "reasoning":
            item["status"] = "completed"
            done = self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=text)
        else:
            item["status"] = status
            done = self.event("response.output_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=text, logprobs=item["content"][0]["logprobs"])
        return [done, self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=item["content"][0]),
                self.event("response.output_item.done", output_index=index, item=item)]

    def call(self, call: dict[str, Any]) -> list[bytes]:
        events = self.close()
        fn = call.get("function") or {}
        item = {"type": "function_call", "id": _id("fc"), "call_id": call.get("id") or _id("call"),
                "name": fn.get("name", ""), "arguments": fn.get("arguments") or "{}", "status": "completed"}
        self.response.output.append(item)
        index = len(self.response.output) - 1
        events.append(self.event("response.output_item.added", output_index=index,
                                 item={**item, "arguments": "", "status": "in_progress"}))
        events.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                 delta=item["arguments"]))
        events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def end(self, status: str) -> list[bytes]:
        """The events that close the last item; an answer with neither text nor calls is an empty message."""
        events = []
        if not any(i["type"] in ("message", "function_call") for i in self.response.output):
            events = self._start(None, "content")
        return [*events, *self.close(status)]

    def said(self, choice: dict[str, Any]) -> list[bytes]:
        """A chat choice's (or stream chunk's) parts and calls."""
        said = choice.get("delta") or choice.get("message") or {}
        events = []
        for part in said.get("parts") or choice.get("parts") or ():
            events += self.part(part["index"], part["type"], part["text"], part.get("logprobs"))
        for call in said.get("tool_calls") or ():
            events += self.call(call)
        return events


def _whole(response: _Response, answer: dict[str, Any]) -> dict[str, Any]:
    choice = answer["choices"][0]
    status = _status(choice.get("finish_reason"))
    items = _Items(response)
    items.said(choice)
    items.end(status)
    return response.envelope(status, answer.get("usage") or {})


async def _events(response: _Response, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """A chat stream's chunks (ChatShape's ``by_parts``) as the Responses API's events."""
    items = _Items(response)
    yield items.event("response.created", response=response.envelope("in_progress"))
    yield items.event("response.in_progress", response=response.envelope("in_progress"))
    finish: str | None = None
    async for chunk in chunks:
        if "error" in chunk:
            error = chunk["error"]
            yield items.event("error", code=error.get("code"), message=error.get("message", "error"), param=None)
            return
        if not chunk.get("choices"):  # the usage: the response is complete
            status = _status(finish)
            for e in items.end(status):
                yield e
            kind = "response.incomplete" if status == "incomplete" else "response.completed"
            yield items.event(kind, response=response.envelope(status, chunk.get("usage") or {}))
            return
        choice = chunk["choices"][0]
        finish = choice.get("finish_reason") or finish
        for e in items.said(choice):
            yield e


def _prewarmed(response: _Response, usage: dict[str, Any]) -> Response:
    """The answer to a ``prompt_cache_options.prewarm`` (``usage``: the chat usage of reading its prompt): a
    completed response without output, whole or as its stream's events."""
    if not response.body.stream:
        return JSONResponse(response.envelope("completed", usage))
    items = _Items(response)
    events = [items.event("response.created", response=response.envelope("in_progress")),
              items.event("response.in_progress", response=response.envelope("in_progress")),
              items.event("response.completed", response=response.envelope("completed", usage))]
    return Response(b"".join(events), media_type="text/event-stream")


def install(app: FastAPI, models: Models) -> None:
    """The Responses API's route on ``app``, answered by the named model's chat handler."""

    @app.post("/v1/responses")
    async def responses(body: Annotated[ResponsesBody, json_body(ResponsesBody)], request: Request) -> Response:
        served = models.get(body.model)
        if body.prompt_cache_options is not None and body.prompt_cache_options.prewarm:
            translated = await off_loop(request, body.openai)
            with named_as(CHAT_NAMES):
                read = await served.read_prompt(lambda: translated, request, truncate=body.truncation == "auto")
            return read if isinstance(read, Response) else _prewarmed(_Response(served, body), read)

        def chat() -> ChatCompletionRequest:
            translated = body.openai()  # its errors name the Responses API's own fields (its refused prompt too)
            with named_as(CHAT_NAMES):
                return validated(ChatCompletionRequest, translated)

        openai = await off_loop(request, chat)
        with named_as(CHAT_NAMES):
            answer = await served.chat(openai, request, truncate=body.truncation == "auto", by_parts=True)
        response = _Response(served, body)
        return await retold(answer, lambda whole: _whole(response, whole),
                            lambda chunks: _events(response, chunks))

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"], include_in_schema=False)  # nothing stored
    async def stored(response_id: str) -> Response:
        raise APIError(404, f"No response with id '{response_id}': kestrel stores no responses", param="response_id",
                       code="not_found")
