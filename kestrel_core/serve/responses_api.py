"""OpenAI's Responses API (``POST /v1/responses``) over the same engine, for the clients built on it (the
``openai`` SDKs' ``client.responses``, agent frameworks, coding agents).

A request is translated into the chat request kestrel already answers: ``instructions`` and the ``input``
(a string, or items: messages with text content, ``function_call`` items as an assistant turn's tool calls,
``function_call_output`` items as tool messages; ``reasoning`` items are dropped, as templates drop past
reasoning), ``tools`` (functions), ``tool_choice``, ``parallel_tool_calls``, ``text.format`` (text, a JSON
object or a JSON Schema), ``max_output_tokens``, ``temperature``, ``top_p``; ``reasoning.effort`` as the chat
request's ``reasoning_effort``. The answer comes back as output items (``reasoning``,
``message`` with an ``output_text`` part, ``function_call`` a call), whole or as the API's event stream
(``response.created``, each item's ``output_item.added`` / deltas / ``done`` events, ``response.completed`` or
``response.incomplete`` when ``max_output_tokens`` cut it). Nothing is stored: ``store`` is accepted and ignored,
``previous_response_id`` and the retrieval routes are refused, so a client sends the whole conversation (as
``store: false`` clients do).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from kestrel_core.serve.errors import APIError, named_as, validated
from kestrel_core.serve.generation import retold
from kestrel_core.serve.protocol import ChatCompletionRequest, RequestBody

if TYPE_CHECKING:
    from kestrel_core.serve.app import Models, Served

# the chat request's fields a Responses request sets, by the names it sends them under (its errors name those)
CHAT_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format",
              "reasoning_effort": "reasoning.effort", "messages": "input"}

class Reasoning(RequestBody):
    effort: StrictStr | None = None
    summary: StrictStr | None = None


class TextFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


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

    def text_format(self) -> TextFormat:
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return TextFormat()
        if not isinstance(fmt, dict):
            raise APIError(400, "text.format must be an object", param="text.format")
        with named_as({name: f"text.format.{name}" for name in ("type", "name", "schema", "strict")}):
            return validated(TextFormat, fmt)

    def openai(self) -> dict[str, Any]:
        for name in ("previous_response_id", "conversation", "prompt"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name} is not supported: kestrel stores no responses, conversations or prompts; "
                               "send the whole conversation as input", param=name)
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
            "parallel_tool_calls": self.parallel_tool_calls}
        if "message.output_text.logprobs" in (self.include or ()) or self.top_logprobs:
            out.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        choice = self.tool_choice
        if isinstance(choice, dict):
            out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
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
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}: a {kind!r} part is not supported (text only)", param=where)
        parts.append({"type": "text", "text": str(part.get("text", ""))})
    return parts


def _text(content: Any, where: str) -> str:
    """A tool output's text: its parts joined by newlines."""
    parts = _content(content, where)
    return parts if isinstance(parts, str) else "\n".join(part["text"] for part in parts)


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    """One input item onto the chat messages (a function call joins the assistant turn before it)."""
    if not isinstance(item, dict):
        raise APIError(400, f"{where} must be an object", param=where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise APIError(400, f"{where}.role must be user, assistant, system or developer", param=where)
        messages.append({"role": role, "content": _content(item.get("content", ""), f"{where}.content")})
    elif kind == "function_call":
        call = {"id": str(item.get("call_id", "")), "type": "function",
                "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", "{}"))}}
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            messages.append(last)
        last.setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                         "content": _text(item.get("output", ""), f"{where}.output")})
    elif kind != "reasoning":
        raise APIError(400, f"{where}: a {kind!r} item is not supported", param=where)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Output:
    """The output items of one response as they are built: reasoning, a message, function calls."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def reasoning(self, text: str = "") -> dict[str, Any]:
        item = {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "completed",
                "content": [{"type": "reasoning_text", "text": text}]}
        self.items.append(item)
        return item

    def message(self, text: str = "", status: str = "completed") -> dict[str, Any]:
        item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}
        self.items.append(item)
        return item

    def call(self, call: dict[str, Any]) -> dict[str, Any]:
        fn = call.get("function") or {}
        item = {"type": "function_call", "id": _id("fc"), "call_id": call.get("id") or _id("call"),
                "name": fn.get("name", ""), "arguments": fn.get("arguments") or "{}", "status": "completed"}
        self.items.append(item)
        return item


class _Response:
    """The response object, in progress or whole."""

    def __init__(self, served: Served, body: ResponsesBody) -> None:
        self.id = _id("resp")
        self.created = int(time.time())
        self.model = served.model_name
        self.body = body
        self.output = _Output()

    def envelope(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        incomplete = status == "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions, "model": self.model, "output": self.output.items,
            "parallel_tool_calls": b.parallel_tool_calls is not False, "temperature": b.temperature,
            "top_p": b.top_p, "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
            "text": {"format": b.text_format().model_dump(exclude_none=True, by_alias=True)},
            "max_output_tokens": b.max_output_tokens, "previous_response_id": None,
            "reasoning": (b.reasoning or Reasoning()).model_dump(), "store": False, "metadata": b.metadata or {},
            "usage": None if usage is None else _usage(usage)}


def _usage(chat: dict[str, Any]) -> dict[str, Any]:
    """The chat answer's usage as the Responses API's (its reasoning tokens ChatShape's count)."""
    prompt, completion = chat.get("prompt_tokens", 0), chat.get("completion_tokens", 0)
    reasoning = (chat.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def _whole(response: _Response, answer: dict[str, Any]) -> dict[str, Any]:
    choice = answer["choices"][0]
    message, status = choice["message"], _status(choice.get("finish_reason"))
    if message.get("reasoning_content"):
        response.output.reasoning(message["reasoning_content"])
    if message.get("content") or not message.get("tool_calls"):
        item = response.output.message(message.get("content") or "", status)
        item["content"][0]["logprobs"] = (choice.get("logprobs") or {}).get("content") or []
    for call in message.get("tool_calls") or ():
        response.output.call(call)
    return response.envelope(status, answer.get("usage") or {})


class _Stream:
    """The API's event stream of one response: sequence numbers, and the item open now."""

    def __init__(self, response: _Response) -> None:
        self.response = response
        self.sequence = 0
        self.open: dict[str, Any] | None = None

    def event(self, kind: str, **body: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **body}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def _index(self) -> int:
        return len(self.response.output.items) - 1

    def to(self, kind: str) -> list[bytes]:
        """The events that open an item of ``kind`` (closing the one open before), unless it is open."""
        if self.open is not None and self.open["type"] == kind:
            return []
        events = self.close()
        output = self.response.output
        item = output.reasoning() if kind == "reasoning" else output.message(status="in_progress")
        self.open = item
        added = {**item, "status": "in_progress", "content": []} if kind == "reasoning" else {**item, "content": []}
        events.append(self.event("response.output_item.added", output_index=self._index(), item=added))
        if kind == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self._index(),
                                     content_index=0, part={**item["content"][0], "text": ""}))
        return events

    def delta(self, text: str, logprobs: list[dict[str, Any]]) -> bytes:
        """The open item's next text, with the logprobs of its tokens (the chat chunk's, where asked for)."""
        item = self.open
        assert item is not None
        item["content"][0]["text"] += text
        kind = "response.reasoning_text.delta" if item["type"] == "reasoning" else "response.output_text.delta"
        extra = {}
        if item["type"] == "message":
            item["content"][0]["logprobs"].extend(logprobs)
            extra["logprobs"] = logprobs
        return self.event(kind, item_id=item["id"], output_index=self._index(), content_index=0, delta=text, **extra)

    def close(self, status: str = "completed") -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.response.output.items.index(item)
        text = item["content"][0]["text"]
        if item["type"] == "reasoning":
            events = [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=text)]
        else:
            item["status"] = status
            events = [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=text, logprobs=item["content"][0]["logprobs"]),
                      self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=item["content"][0])]
        return [*events, self.event("response.output_item.done", output_index=index, item=item)]

    def call(self, call: dict[str, Any]) -> list[bytes]:
        events = self.close()
        item = self.response.output.call(call)
        index = self._index()
        events.append(self.event("response.output_item.added", output_index=index,
                                 item={**item, "arguments": "", "status": "in_progress"}))
        events.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                 delta=item["arguments"]))
        events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


async def _events(response: _Response, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """A chat stream's chunks as the Responses API's events."""
    stream = _Stream(response)
    yield stream.event("response.created", response=response.envelope("in_progress"))
    yield stream.event("response.in_progress", response=response.envelope("in_progress"))
    finish: str | None = None
    pending: list[dict[str, Any]] = []  # token logprobs not yet sent with text
    async for chunk in chunks:
        if "error" in chunk:
            error = chunk["error"]
            yield stream.event("error", code=error.get("code"), message=error.get("message", "error"), param=None)
            return
        if not chunk.get("choices"):  # the usage: the response is complete
            status = _status(finish)
            if not any(i["type"] in ("message", "function_call") for i in response.output.items):
                for e in stream.to("message"):  # an empty answer is an empty message, as the whole response's
                    yield e
            if pending and stream.open is not None and stream.open["type"] == "message":
                stream.open["content"][0]["logprobs"].extend(pending)
            for e in stream.close(status):
                yield e
            kind = "response.incomplete" if status == "incomplete" else "response.completed"
            yield stream.event(kind, response=response.envelope(status, chunk.get("usage") or {}))
            return
        choice = chunk["choices"][0]
        finish = choice.get("finish_reason") or finish
        delta = choice.get("delta") or {}
        pending += (choice.get("logprobs") or {}).get("content") or []  # a chunk may hold back its text
        for kind, text in (("reasoning", delta.get("reasoning_content")), ("message", delta.get("content"))):
            if text:
                for e in stream.to(kind):
                    yield e
                yield stream.delta(text, pending if kind == "message" else [])
                if kind == "message":
                    pending = []
        for call in delta.get("tool_calls") or ():
            for e in stream.call(call):
                yield e


def install(app: FastAPI, models: Models) -> None:
    """The Responses API's route on ``app``, answered by the named model's chat handler."""

    @app.post("/v1/responses")
    async def responses(body: ResponsesBody, request: Request) -> Response:
        served = models.get(body.model)
        with named_as(CHAT_NAMES):
            openai = validated(ChatCompletionRequest, body.openai())
            answer = await served.chat(openai, request)
        response = _Response(served, body)
        return retold(answer, lambda whole: _whole(response, whole), lambda chunks: _events(response, chunks))

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored(response_id: str) -> Response:
        raise APIError(404, f"No response with id '{response_id}': kestrel stores no responses", param="response_id",
                       code="not_found")
