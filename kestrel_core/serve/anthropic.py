"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) over the same engine, for the
clients and agents written against it (the ``anthropic`` SDKs, Claude Code pointed at a local server).

A request is translated into the OpenAI chat request kestrel already answers: ``system`` first, each user
turn's ``tool_result`` blocks as tool messages, an assistant turn's ``tool_use`` and ``thinking`` blocks as its
tool calls and reasoning, ``tools`` as functions, ``tool_choice`` auto / any / tool / none as auto / required /
a named function / none, ``thinking`` enabled or disabled as the template's ``enable_thinking`` (adaptive: the
template's default), ``output_config.format`` (a JSON Schema) as a JSON response format; ``temperature``, ``top_p``
and ``top_k``, which the current SDKs no longer send, are read where a client sends them. What Anthropic's API
refuses is refused with its words, though the chat request would take it: a ``temperature`` or ``top_p`` outside
[0, 1], enabled thinking without a ``budget_tokens`` of at least 1024, a block without the fields its kind needs, a
``tool_use`` whose ``tool_result`` is not in the next turn or a ``tool_result`` whose ``tool_use`` is not in the turn
before, an empty message but the last assistant one. The answer comes back as Anthropic's content blocks
(``thinking``, ``text``, ``tool_use``), whole or as Anthropic's event stream (``message_start``, a
``content_block_start`` / ``_delta`` / ``_stop`` run a block, ``message_delta`` with the stop reason and the
answer's usage, ``message_stop``). The usage's ``input_tokens`` leave out the prompt tokens the prefix cache held,
which are its ``cache_read_input_tokens``, as Anthropic's leave out its cache's reads. Stop reasons: ``end_turn``,
``max_tokens``, ``tool_use``, ``stop_sequence`` with the sequence that ended the answer, and
``model_context_window_exceeded``. Thinking blocks carry an empty signature: nothing here signs them. Errors are
Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (a server at capacity: its 529 overloaded_error; a
prompt past the context: its "prompt is too long"); the model is one the server serves, by its name.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from kestrel_core.serve.bodies import RequestBody
from kestrel_core.serve.errors import APIError, named_as, validated
from kestrel_core.serve.generation import EventStreamResponse, retold
from kestrel_core.serve.offload import json_body, off_loop
from kestrel_core.serve.protocol import ChatCompletionRequest
from kestrel_core.serve.responses import usage as chat_usage
from kestrel_core.serve.tools import arguments_object

if TYPE_CHECKING:
    from kestrel_core.serve.app import Models, Served

# the chat request's fields an Anthropic request sets, by the names it sends them under (its errors name those)
ANTHROPIC_NAMES = {"stop": "stop_sequences", "response_format": "output_config.format",
                   "chat_template_kwargs": "thinking", "tools.*.function.parameters": "tools.*.input_schema",
                   "tools.*.function": "tools.*"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
MIN_THINKING_BUDGET = 1024  # Anthropic's least thinking.budget_tokens


class Block(RequestBody):
    """A content block of a message (the kinds kestrel reads; an image is refused)."""

    type: StrictStr
    text: StrictStr | None = None
    id: StrictStr | None = None  # tool_use
    name: StrictStr | None = None
    input: dict[str, Any] | None = None
    tool_use_id: StrictStr | None = None  # tool_result
    content: StrictStr | list[Block] | None = None
    is_error: StrictBool | None = None
    thinking: StrictStr | None = None  # thinking


class Message(RequestBody):
    role: Literal["user", "assistant"]
    content: StrictStr | list[Block]


class Tool(RequestBody):
    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any]


class ToolChoice(RequestBody):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Thinking(RequestBody):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: StrictInt | None = None


class OutputFormat(RequestBody):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestBody):
    format: OutputFormat | None = None
    effort: StrictStr | None = None  # how hard a model reasons: the template decides here


class MessagesBody(RequestBody):
    model: StrictStr
    messages: list[Message]
    max_tokens: StrictInt | None = None  # required by Anthropic; count_tokens has none
    system: StrictStr | list[Block] | None = None
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    top_k: StrictInt | None = None
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None

    def openai(self, stream: bool) -> dict[str, Any]:
        self._check_sampling()
        messages: list[dict[str, Any]] = []
        if isinstance(self.system, list):
            _check_blocks(self.system, "system")
        if self.system:
            messages.append({"role": "system", "content": _text(self.system, "system")})
        turns: list[tuple[int, Message]] = []  # consecutive messages of one role are one turn, as Anthropic has it
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list) and not m.content:
                raise APIError(400, f"messages.[{i}].content must hold at least one block",
                               param=f"messages.[{i}].content")
            if m.content == "" and not (i == len(self.messages) - 1 and m.role == "assistant"):
                raise APIError(400, f"messages.[{i}]: all messages must have non-empty content except for the "
                               "optional final assistant message", param=f"messages.[{i}]")
            if isinstance(m.content, list):
                _check_blocks(m.content, f"messages.[{i}].content")
            if turns and turns[-1][1].role == m.role:
                first, turn = turns[-1]
                turns[-1] = first, Message(role=m.role, content=_as_blocks(turn.content) + _as_blocks(m.content))
            else:
                turns.append((i, m))
        _check_tool_results(self.messages)
        for i, m in turns:
            messages.extend(_openai_messages(m, f"messages.[{i}].content"))
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and not choice.name:
            raise APIError(400, "tool_choice.name is required for a tool_choice of type tool", param="tool_choice")
        last = messages[-1] if messages else {}
        if last.get("role") == "assistant" and "tool_calls" not in last and "reasoning_content" not in last:
            text = "".join(_texts(last.get("content") or ""))
            if not text:  # Anthropic's optional empty final assistant message: no prefill
                messages.pop()
                last = messages[-1] if messages else {}
            elif not text.strip():
                raise APIError(400, "final assistant content cannot end with trailing whitespace",
                               param=f"messages.[{turns[-1][0]}].content")
        out: dict[str, Any] = {
            # a last assistant turn of text is a prefill: the answer continues it
            "continue_final_message": last.get("role") == "assistant" and "tool_calls" not in last
            and any(part.strip() for part in _texts(last.get("content") or "")),
            "messages": messages, "max_tokens": self.max_tokens, "stop": self.stop_sequences, "top_k": self.top_k,
            # unset: the model's recommendation, else 1 (Anthropic's default, and the chat route's)
            "temperature": None if self.temperature is None else float(self.temperature),
            "top_p": None if self.top_p is None else float(self.top_p),
            "stream": stream, "stream_options": {"include_usage": True, "continuous_usage_stats": True}
            if stream else None,
            "tools": [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                        "parameters": t.input_schema}} for t in self.tools or ()]
            or None}
        if choice is not None:
            out["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                  else {"any": "required"}.get(choice.type, choice.type))
            if choice.disable_parallel_tool_use:
                out["parallel_tool_calls"] = False
        if self.thinking is not None and self.thinking.type in ("enabled", "disabled"):
            out["chat_template_kwargs"] = {"enable_thinking": self.thinking.type == "enabled"}
        if self.output_config is not None and self.output_config.format is not None:
            out["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": "output", "schema": self.output_config.format.schema_}}
        return out

    def _check_sampling(self) -> None:
        """Anthropic's ranges, narrower than the chat request's: ``temperature`` and ``top_p`` in [0, 1], ``top_k``
        from 0 (the chat request's -1 is vLLM's), stop sequences of more than blanks."""
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                raise APIError(400, f"{name}: range: 0..1", param=name)
        if self.top_k is not None and self.top_k < 0:
            raise APIError(400, f"top_k: must be at least 0, got {self.top_k}", param="top_k")
        if any(not s.strip() for s in self.stop_sequences or ()):
            raise APIError(400, "stop_sequences: each stop sequence must contain non-whitespace",
                           param="stop_sequences")
        if self.thinking is not None and self.thinking.type == "enabled":  # the budget is no limit here, but given
            budget = self.thinking.budget_tokens
            if budget is None or budget < MIN_THINKING_BUDGET:
                why = "Field required" if budget is None else \
                    f"Input should be greater than or equal to {MIN_THINKING_BUDGET}"
                raise APIError(400, f"thinking.enabled.budget_tokens: {why}", param="thinking.budget_tokens")


# the fields each kind of block needs, as Anthropic's API requires them
REQUIRED_FIELDS = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",),
                   "thinking": ("thinking",)}


def _check_blocks(blocks: list[Block], where: str) -> None:
    """Each block has the fields its kind needs (a tool result's blocks too); ``where``: the list's field."""
    for k, block in enumerate(blocks):
        for name in REQUIRED_FIELDS.get(block.type, ()):
            if getattr(block, name) is None:
                raise APIError(400, f"{where}.[{k}].{name}: Field required", param=f"{where}.[{k}].{name}")
        if isinstance(block.content, list):
            _check_blocks(block.content, f"{where}.[{k}].content")


def _check_tool_results(messages: list[Message]) -> None:
    """Anthropic's pairing of calls and results: each ``tool_use`` of an assistant turn has its ``tool_result`` in
    the next turn, a user's, and each ``tool_result`` answers a ``tool_use`` of the turn before (a turn: consecutive
    messages of one role). A conversation may not end with calls: their results are what would come next."""
    turns: list[list[tuple[int, int, Block]]] = []  # each turn's blocks: (message index, block index, block)
    for i, m in enumerate(messages):
        blocks = [(i, k, b) for k, b in enumerate(m.content)] if isinstance(m.content, list) else []
        if i and messages[i - 1].role == m.role:
            turns[-1].extend(blocks)
        else:
            turns.append(blocks)
    for t, turn in enumerate(turns):
        role = messages[turn[0][0]].role if turn else None
        if role == "user":
            asked = {b.id for _, _, b in turns[t - 1] if b.type == "tool_use"} if t else set()
            for i, k, b in turn:
                if b.type == "tool_result" and b.tool_use_id not in asked:
                    raise APIError(400, f"messages.[{i}].content.[{k}]: unexpected `tool_use_id` found in "
                                   f"`tool_result` blocks: {b.tool_use_id}. Each `tool_result` block must have a "
                                   "corresponding `tool_use` block in the previous message.",
                                   param=f"messages.[{i}].content.[{k}]")
        elif role == "assistant":
            after = turns[t + 1] if t + 1 < len(turns) else []
            answered = {b.tool_use_id for _, _, b in after if b.type == "tool_result"}
            missing = [(i, b.id) for i, _, b in turn if b.type == "tool_use" and b.id not in answered]
            if missing:
                raise APIError(400, f"messages.[{missing[0][0]}]: `tool_use` ids were found without `tool_result` "
                               f"blocks immediately after: {', '.join(str(id_) for _, id_ in missing)}. Each "
                               "`tool_use` block must have a corresponding `tool_result` block in the next message.",
                               param=f"messages.[{missing[0][0]}]")


def _text(content: str | list[Block], where: str) -> str:
    """The text of a string or of text blocks (any other block is refused, naming where)."""
    if isinstance(content, str):
        return content
    for block in content:
        if block.type != "text":
            raise APIError(400, f"{where}: a {block.type!r} block is not supported here", param=where)
    return "\n".join(block.text or "" for block in content)


def _as_blocks(content: str | list[Block]) -> list[Block]:
    return [Block(type="text", text=content)] if isinstance(content, str) else list(content)


def _texts(content: str | list[dict[str, str]]) -> list[str]:
    return [content] if isinstance(content, str) else [part["text"] for part in content]


def _parts(texts: list[str]) -> str | list[dict[str, str]]:
    """A turn's text blocks as chat content: one is its text, several are text parts (the chat template joins
    them or loops over them)."""
    return texts[0] if len(texts) == 1 else [{"type": "text", "text": text} for text in texts]


def _openai_messages(m: Message, where: str) -> list[dict[str, Any]]:
    """One Anthropic turn as OpenAI messages: a user turn's tool results first (a tool message each), then its
    text; an assistant turn's text, reasoning and tool calls as one message."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict[str, Any]] = []
    texts, calls, thinking = [], [], []
    for block in m.content:
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "tool_result" and m.role == "user":
            result = _text(block.content or "", where)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": f"Error: {result}" if block.is_error else result})
        elif block.type == "tool_use" and m.role == "assistant":
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input)}})
        elif block.type == "thinking" and m.role == "assistant":
            thinking.append(block.thinking or "")
        elif block.type != "redacted_thinking":
            raise APIError(400, f"{where}: a {block.type!r} block is not supported in a {m.role} turn", param=where)
    if m.role == "user":
        return out + ([{"role": "user", "content": _parts(texts)}] if texts else [])
    message: dict[str, Any] = {"role": "assistant", "content": _parts(texts)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    return [message]


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An OpenAI answer's message as Anthropic's content blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": arguments_object(call["function"]["arguments"])})
    return blocks


def _stop(choice: dict[str, Any], max_tokens: int, output_tokens: int, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an OpenAI choice that finished (vLLM's ``stop_reason``: the string), which
    made tool calls where ``called``; a length stop short of ``max_tokens`` is the context's end, which asking again
    would not get past. An answer that ends in calls is "tool_use", a forced tool's too (whose OpenAI answer, a
    named function's, finishes with "stop")."""
    by = choice.get("stop_reason")
    if isinstance(by, str):
        return "stop_sequence", by
    finish = choice.get("finish_reason") or "stop"
    reason = "tool_use" if called and finish == "stop" else STOP_REASONS.get(finish, "end_turn")
    if reason == "max_tokens" and output_tokens < max_tokens:
        return "model_context_window_exceeded", None
    return reason, None


def _usage(chat: dict[str, Any]) -> dict[str, int]:
    """A chat answer's usage as Anthropic's, whose ``input_tokens`` are the prompt's tokens read neither from the
    cache (``cache_read_input_tokens``: those the prefix cache held) nor into it (``cache_creation_input_tokens``:
    none, since every prompt is cached as it is read, with no ``cache_control`` to ask for it), the three adding up
    to the prompt's tokens."""
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat.get("prompt_tokens", 0) - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": chat.get("completion_tokens", 0)}


def _envelope(message_id: str, model: str, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
              usage: dict[str, int]) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def _event(kind: str, body: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n".encode()


class _Blocks:
    """The stream's content blocks: which one is open, and the events that open, fill and close them."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def to(self, kind: str, start: dict[str, Any]) -> list[bytes]:
        """The events that make a block of ``kind`` the open one (closing the one open before)."""
        if self.open == kind and kind != "tool_use":
            return []
        events = self.close()
        self.index += 1
        self.open = kind
        return [*events, _event("content_block_start", {"index": self.index, "content_block": start})]

    def delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        events = [self.delta({"type": "signature_delta", "signature": ""})] if self.open == "thinking" else []
        self.open = None
        return [*events, _event("content_block_stop", {"index": self.index})]


async def _events(message_id: str, model: str, max_tokens: int, cached: int,
                  chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """An OpenAI chat stream's chunks as Anthropic's event stream (``cached``: the prompt's tokens the prefix cache
    held, which ``message_start`` says before the chat stream's last chunk does); ``message_delta``'s usage is the
    whole answer's, as Anthropic's."""
    blocks = _Blocks()
    started = False
    finish: dict[str, Any] = {}  # the choice that finished
    called = False  # whether it made tool calls
    output = 0
    async for chunk in chunks:
        if "error" in chunk:
            error = {"type": "api_error", "message": chunk["error"].get("message", "error")}
            yield _event("error", {"error": error})
            return
        usage = chunk.get("usage") or {}
        output = usage.get("completion_tokens", output)
        if not started:
            started = True
            read = _usage(chat_usage(usage.get("prompt_tokens", 0), 0, cached))
            start = _envelope(message_id, model, [], (None, None), read)
            yield _event("message_start", {"message": start})
        if not chunk.get("choices"):  # the final usage: the message is complete
            for e in blocks.close():
                yield e
            reason, sequence = _stop(finish, max_tokens, output, called)
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            yield _event("message_delta", {"delta": delta, "usage": _usage(usage)})
            yield _event("message_stop", {})
            return
        choice = chunk["choices"][0]
        finish = choice if choice.get("finish_reason") else finish
        delta = choice.get("delta") or {}
        if delta.get("reasoning_content"):
            for e in blocks.to("thinking", {"type": "thinking", "thinking": ""}):
                yield e
            yield blocks.delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            for e in blocks.to("text", {"type": "text", "text": ""}):
                yield e
            yield blocks.delta({"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or ():
            called = True
            fn = call.get("function") or {}
            for e in blocks.to("tool_use", {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
                                            "input": {}}):
                yield e
            yield blocks.delta({"type": "input_json_delta", "partial_json": fn.get("arguments") or "{}"})


async def _prompt_only(served: Served, body: MessagesBody, request: Request, message_id: str) -> Response:
    """The answer to ``max_tokens`` 0, Anthropic's way to warm the prompt cache: the prompt is read into the prefix
    cache (``Served.read_prompt``), and the message is empty."""
    with named_as(ANTHROPIC_NAMES):
        read = await served.read_prompt(lambda: body.openai(False), request)
    if isinstance(read, Response):
        return read
    message = _envelope(message_id, body.model, [], ("max_tokens", None), _usage(read))
    if not body.stream:
        return JSONResponse(message)
    events = [_event("message_start", {"message": {**message, "stop_reason": None}}),
              _event("message_delta", {"delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                                       "usage": message["usage"]}),
              _event("message_stop", {})]
    return Response(b"".join(events), media_type="text/event-stream")


def install(app: FastAPI, models: Models) -> None:
    """Anthropic's routes on ``app``, answered by the named model's chat handler."""

    @app.post("/v1/messages")
    async def messages(body: Annotated[MessagesBody, json_body(MessagesBody)], request: Request) -> Response:
        if body.max_tokens is None:
            raise APIError(400, "max_tokens: Field required", param="max_tokens")
        served = models.get(body.model)
        message_id = f"msg_{uuid.uuid4().hex}"

        def whole(answer: dict[str, Any]) -> dict[str, Any]:
            choice, usage = answer["choices"][0], answer.get("usage") or {}
            stop = _stop(choice, max_tokens, usage.get("completion_tokens", 0),
                         bool(choice["message"].get("tool_calls")))
            return _envelope(message_id, body.model, _blocks(choice["message"]), stop, _usage(usage))

        max_tokens = body.max_tokens
        if max_tokens == 0:  # Anthropic's way to warm the prompt cache: the prompt is read, nothing generated
            return await _prompt_only(served, body, request, message_id)
        with named_as(ANTHROPIC_NAMES):
            chat = await off_loop(request, lambda: validated(ChatCompletionRequest, body.openai(body.stream)))
            response = await served.chat(chat, request)
        cached = response.cached_tokens if isinstance(response, EventStreamResponse) else 0
        return await retold(response, whole,
                            lambda chunks: _events(message_id, body.model, max_tokens, cached, chunks))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: Annotated[MessagesBody, json_body(MessagesBody)], request: Request) -> dict[str, int]:
        def prompt_ids() -> list[int]:
            chat = validated(ChatCompletionRequest, body.openai(False))
            return models.get(body.model).chat_prompt(chat)[1]

        with named_as(ANTHROPIC_NAMES):
            return {"input_tokens": len(await off_loop(request, prompt_ids, inline=False))}

