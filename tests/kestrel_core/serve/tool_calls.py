"""What the tool-call tests share: the tools, a request for them, a Hermes-style template (Qwen2.5's), its
thinking variant and gpt-oss's harmony format, and servers over the default model whose answers are scripted
(``Scripted``, an AsyncEngine whose ``generate`` yields a given text a few characters at a time: no model small
enough for the tests writes a call on cue) or the model's own; the prompt, the chat template, the server and the
client are the real ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai

import kestrel_core
from kestrel_core.model.async_engine import AsyncEngine

from .helpers import Scripted, openai_client, running_server

NAME = "tools-test"
# Qwen2.5's way of offering tools and writing calls, written for these tests
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    'Answer a call as <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n{%- endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for call in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
# the Hermes-style template with Qwen3's reasoning switches (and one that opens the block itself, as
# DeepSeek-R1's distills do)
THINKING_TEMPLATE = HERMES_TEMPLATE.replace(
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}",
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- if open_block is defined and open_block %}<think>\n{%- endif %}{%- endif %}")
# gpt-oss's harmony format as its template writes it (written for these tests): channels, a developer message
# with the tools as a namespace, calls as messages to functions.NAME
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n\nnamespace functions {\n"
    "{%- for tool in tools %}\ntype {{ tool.function.name }} = (_: any) => any;{%- endfor %}\n"
    "} // namespace functions<|end|>{%- endif %}"
    "{%- for message in messages %}"
    # gpt-oss's for an earlier call (trimmed): one analysis message before it, from the content or the thinking
    "{%- if message.role == 'assistant' and message.tool_calls %}{%- if message.content and message.thinking %}"
    "{{- raise_exception('Cannot pass both content and thinking in an assistant message with tool calls!') }}"
    "{%- elif message.content %}<|start|>assistant<|channel|>analysis<|message|>{{ message.content }}<|end|>"
    "{%- elif message.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>"
    "{%- endif %}<|start|>assistant to=functions.{{ message.tool_calls[0].function.name }}<|channel|>commentary "
    "json<|message|>{{ message.tool_calls[0].function.arguments | tojson }}<|call|>"
    "{%- elif message.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather in Paris.<|end|><|start|>assistant<|channel|>commentary"
                ' to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}
DAYS = {"type": "function", "function": {"name": "get_forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 40}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _call(name: str, arguments: dict[str, Any]) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


PARIS = _call("get_weather", {"city": "Paris"})


@contextmanager
def _served(template: str, scripted: bool = True) -> Iterator[tuple[Any, openai.OpenAI]]:
    """A server over the default model with ``template``, its answers scripted (``Scripted``) or the model's own,
    and a client of it."""
    with kestrel_core.load(None, backend="cpu") as engine:
        engine.tokenizer.chat_template = template
        front = Scripted(engine) if scripted else AsyncEngine(engine, max_batch=4)
        with running_server(front, NAME) as s:
            yield front, openai_client(s)


@contextmanager
def _both_served(template: str) -> Iterator[dict[str, tuple[Any, openai.OpenAI]]]:
    """Two servers with ``template``: one whose answers are scripted ("scripted"), one whose are the model's own
    ("model")."""
    with _served(template) as scripted, _served(template, scripted=False) as model:
        yield {"scripted": scripted, "model": model}


def _fresh(pair: tuple[Scripted, openai.OpenAI]) -> Scripted:
    pair[0].answers.clear()
    pair[0].prompts.clear()
    return pair[0]


def _answer(scripted: Scripted, client: openai.OpenAI, text: str, **kwargs: Any) -> Any:
    scripted.answers.append(text)
    args: dict[str, Any] = {"model": NAME, "messages": ASK, "tools": [WEATHER, TIME]}
    return client.chat.completions.create(**{**args, **kwargs})


def reply_parts(reply: Any, stream: bool) -> tuple[str | None, str, list[Any], str | None]:
    """(reasoning, content, tool calls, finish reason) of a chat reply, whole or streamed."""
    if stream:
        chunks = [c for c in reply if c.choices]
        reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
        return reasoning, content, calls, chunks[-1].choices[0].finish_reason
    message = reply.choices[0].message
    reasoning = getattr(message, "reasoning_content", None)
    return reasoning, message.content or "", message.tool_calls, reply.choices[0].finish_reason


def assert_one_forced_forecast(reply: Any, stream: bool, tool_choice: Any) -> None:
    """A reply to a forced call of DAYS (``tool_choice`` "required" or DAYS named, beside TIME): one call and no
    content; named, the call is DAYS's, finished with "stop" (OpenAI's finish reason for a named function); a
    DAYS call's integer is an integer."""
    _, content, calls, reason = reply_parts(reply, stream)
    assert (content, reason) == ("", "tool_calls" if tool_choice == "required" else "stop")
    (call,) = calls
    args = json.loads(call.function.arguments)
    if tool_choice != "required":
        assert call.function.name == "get_forecast"
    if call.function.name == "get_forecast":
        assert isinstance(args["city"], str) and isinstance(args["days"], int)
