"""Tool calls through a real server and the official openai client: the tools reach the prompt through the model's
chat template, and the calls in an answer come back as OpenAI's ``tool_calls``, whole and streamed.

The answers are scripted (``Scripted``, an AsyncEngine whose ``generate`` yields a given text a few characters
at a time), since no model small enough for the tests writes a call on cue; the prompt, the chat template, the
server and the client are the real ones, over the default model's tokenizer with a Hermes-style template.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest

import kestrel_core
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.serve import protocol

from .helpers import Scripted, openai_client, running_server

pytestmark = pytest.mark.default_model

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
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}
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


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, tuple[Scripted, openai.OpenAI]]]:
    """Scripted servers with the Hermes-style template, its thinking variant (THINKING_TEMPLATE) and a harmony
    one (HARMONY_TEMPLATE, gpt-oss's format)."""
    with _served(HERMES_TEMPLATE) as hermes, _served(THINKING_TEMPLATE) as thinking, \
            _served(HARMONY_TEMPLATE) as harmony:
        yield {"hermes": hermes, "thinking": thinking, "harmony": harmony}


@pytest.fixture
def scripted(servers: dict[str, tuple[Scripted, openai.OpenAI]]) -> Scripted:
    return _fresh(servers["hermes"])


@pytest.fixture
def client(servers: dict[str, tuple[Scripted, openai.OpenAI]]) -> openai.OpenAI:
    return servers["hermes"][1]


def _answer(scripted: Scripted, client: openai.OpenAI, text: str, **kwargs: Any) -> Any:
    scripted.answers.append(text)
    args: dict[str, Any] = {"model": NAME, "messages": ASK, "tools": [WEATHER, TIME]}
    return client.chat.completions.create(**{**args, **kwargs})


def test_the_tools_reach_the_prompt(scripted: Scripted, client: openai.OpenAI) -> None:
    _answer(scripted, client, "Sunny.")
    prompt = scripted.prompts[-1]
    assert "<tools>" in prompt and json.dumps(WEATHER, ensure_ascii=False) in prompt
    assert json.dumps(TIME, ensure_ascii=False) in prompt


def test_a_named_tool_use_template_renders_and_reads_the_calls() -> None:
    """Hermes 3's and Command-R's shape: a default template that shows no tools and a tool_use one that does; a
    request with tools renders with the second and its calls are read in its format."""
    plain = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
    with kestrel_core.load(None, backend="cpu") as engine:
        engine.tokenizer.chat_template, engine.tokenizer.tool_template = plain, HERMES_TEMPLATE
        front = Scripted(engine)
        with running_server(front, NAME) as server:
            client = openai_client(server)
            front.answers += ["Hi.", PARIS]
            assert client.chat.completions.create(model=NAME, messages=ASK).choices[0].message.content == "Hi."
            assert front.prompts[-1].startswith("<|user|>")
            (call,) = _answer(front, client, PARIS).choices[0].message.tool_calls
            assert "<tools>" in front.prompts[-1] and call.function.name == "get_weather"


def test_a_call_comes_back_as_tool_calls(scripted: Scripted, client: openai.OpenAI) -> None:
    choice = _answer(scripted, client, PARIS).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_text_before_a_call_is_the_content(scripted: Scripted, client: openai.OpenAI) -> None:
    choice = _answer(scripted, client, "Let me look that up.\n\n" + PARIS).choices[0]
    assert choice.message.content == "Let me look that up."
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("answer", ["It is sunny in Paris.", "<tool_call>\n{not json}\n</tool_call>",
                                    '<tool_call>\n{"arguments": {}}\n</tool_call>'])
def test_an_answer_without_a_readable_call_is_text(scripted: Scripted, client: openai.OpenAI, answer: str) -> None:
    choice = _answer(scripted, client, answer).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == answer and not choice.message.tool_calls


@pytest.mark.parametrize(("parallel", "names"), [(None, ["get_weather", "get_time"]), (False, ["get_weather"])])
def test_several_calls_unless_parallel_calls_are_off(scripted: Scripted, client: openai.OpenAI,
                                                     parallel: bool | None, names: list[str]) -> None:
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    message = _answer(scripted, client, PARIS + "\n" + _call("get_time", {}), **extra).choices[0].message
    assert [c.function.name for c in message.tool_calls] == names
    assert len({c.id for c in message.tool_calls}) == len(names)


def _stream(scripted: Scripted, client: openai.OpenAI, texts: list[str], **kwargs: Any
            ) -> tuple[dict[int, str], dict[int, list[dict[str, Any]]], dict[int, str]]:
    """Each choice's streamed content, its tool calls (from their deltas) and its finish reason."""
    scripted.answers.extend(texts)
    content: dict[int, str] = {}
    calls: dict[int, list[dict[str, Any]]] = {}
    reasons: dict[int, str] = {}
    for chunk in _answer(scripted, client, texts[0], stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content[choice.index] = content.get(choice.index, "") + (delta.content or "")
        for call in delta.tool_calls or []:
            calls.setdefault(choice.index, []).append(
                {"index": call.index, "id": call.id, "name": call.function.name, "arguments": call.function.arguments})
        if choice.finish_reason:
            reasons[choice.index] = choice.finish_reason
    scripted.answers.clear()
    return content, calls, reasons


def test_a_streamed_call(scripted: Scripted, client: openai.OpenAI) -> None:
    content, calls, reasons = _stream(scripted, client, ["Let me look that up.\n\n" + PARIS])
    assert content == {0: "Let me look that up."} and reasons == {0: "tool_calls"}
    (call,) = calls[0]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("cut", [len("</tool_call>"), len("all>")], ids=["before the tag", "inside the tag"])
def test_a_call_cut_before_its_closing_tag_is_a_call(scripted: Scripted, client: openai.OpenAI, stream: bool,
                                                     cut: int) -> None:
    """A request that stops on "</tool_call>" (the scripted answer is cut there, as the engine cuts a stop
    string), or whose answer ends inside that tag (max_tokens), gets its call, whole and streamed."""
    assert PARIS.endswith("</tool_call>")
    scripted.answers.append("Let me look.\n" + PARIS[:-cut])
    reply = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], stop=["</tool_call>"],
                                           stream=stream)
    _, content, calls, reason = reply_parts(reply, stream)
    assert (content, reason) == ("Let me look.", "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_streamed_choices_each_have_their_calls(scripted: Scripted, client: openai.OpenAI) -> None:
    content, calls, reasons = _stream(scripted, client, [PARIS, "No call here <tool_"], n=2)
    assert reasons == {0: "tool_calls", 1: "stop"}
    assert content == {0: "", 1: "No call here <tool_"}
    assert [c["name"] for c in calls[0]] == ["get_weather"] and 1 not in calls


def test_a_conversation_with_calls_and_results(scripted: Scripted, client: openai.OpenAI) -> None:
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    reply = _answer(scripted, client, "It is 18 C and sunny.", messages=messages)
    assert reply.choices[0].message.content == "It is 18 C and sunny."
    prompt = scripted.prompts[-1]
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt  # an object, not a string
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt


def test_tool_choice_none_shows_no_tools_and_reads_no_calls(scripted: Scripted, client: openai.OpenAI) -> None:
    choice = _answer(scripted, client, PARIS, tool_choice="none").choices[0]
    assert choice.message.content == PARIS and not choice.message.tool_calls
    assert "<tools>" not in scripted.prompts[-1]


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),  # not offered
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools.[0].type"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"},
     "tools.[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": ["city"]}}}]},
     "tools.[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": "city"}}}]},
     "tools.[0].function.parameters"),
    # a schema the forced call's grammar cannot hold names its tool, not kestrel's grammar text
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
      "tool_choice": "required"}, "tools.[1].function.parameters"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools.[1].function.parameters"),
])
def test_what_kestrel_cannot_do_is_a_400(client: openai.OpenAI, kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{"model": NAME, "messages": ASK, "tools": [WEATHER], **kwargs})
    assert info.value.body["param"] == param, info.value.body
    assert "<tool_call>" not in info.value.body["message"]


# a template that shows the tools and teaches calls in a format of its own (written for this test)
UNREAD_TEMPLATE = (
    "{%- if tools %}<|system|>\nCall a tool as: Action: NAME(ARGS)\n{{ tools | tojson }}\n<|end|>\n{%- endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n<|end|>\n{%- endfor %}<|assistant|>\n")


def test_tools_in_a_format_kestrel_cannot_read_are_a_400() -> None:
    """A template that teaches calls in a format kestrel does not read is refused the tools; the same request
    without tools is answered."""
    with _served(UNREAD_TEMPLATE) as (scripted, client):
        with pytest.raises(openai.BadRequestError) as info:
            _answer(scripted, client, "x")
        assert info.value.body["param"] == "tools" and "none of the formats" in info.value.body["message"]
        scripted.answers.clear()  # the refused request's
        assert _answer(scripted, client, "Sunny.", tools=None).choices[0].message.content == "Sunny."


# -- a forced call, written by the model itself --------------------------------------------------------------


@pytest.fixture(scope="module")
def model_client() -> Iterator[openai.OpenAI]:
    """A server over the default model itself, with the Hermes-style template: its answers are its own."""
    with _served(HERMES_TEMPLATE, scripted=False) as (_, model_client):
        yield model_client


def _weather_args(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str), args


def test_a_forced_call_that_cannot_fit_is_refused_before_its_grammar_is_built(
        model_client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiling a client's schema may take seconds: not for a request whose prompt is over the context."""
    built: list[Any] = []
    real = protocol.forced_call_grammar
    monkeypatch.setattr(protocol, "forced_call_grammar", lambda *args: built.append(args) or real(*args))
    values = [f"value-{i}" for i in range(20_000)]
    huge = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"v": {"enum": values}}, "required": ["v"]}}}
    with pytest.raises(openai.BadRequestError, match="context"):
        model_client.chat.completions.create(model=NAME, messages=ASK, tools=[huge], tool_choice="required")
    assert built == []
    answer = model_client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], max_tokens=40,
                                                  tool_choice="required", temperature=0)
    assert answer.choices[0].message.tool_calls and len(built) == 1


@pytest.mark.parametrize(("temperature", "parallel"), [(0.0, None), (1.0, False), (1.0, None)])
def test_a_required_call_is_one_of_the_tools_with_its_arguments(model_client: openai.OpenAI, temperature: float,
                                                               parallel: bool | None) -> None:
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    choice = model_client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME], seed=3,
                                                  tool_choice="required", temperature=temperature,
                                                  max_tokens=250, **extra).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and (parallel is None or len(calls) == 1) and choice.message.content is None
    for call in calls:
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            _weather_args(call.function.arguments)
        else:
            assert json.loads(call.function.arguments) == {}


def test_a_named_call_streamed(model_client: openai.OpenAI) -> None:
    chunks = list(model_client.chat.completions.create(
        model=NAME, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    calls = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_weather"]
    _weather_args(calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == ""


@pytest.mark.parametrize("response_format", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER["function"]["parameters"]}},
])
def test_a_json_response_format(model_client: openai.OpenAI, response_format: dict[str, Any]) -> None:
    messages = [{"role": "system", "content": "You are a helpful AI assistant."},
                {"role": "user", "content": "Give me a JSON object with the name and country of the capital of "
                                            "France."}]
    choice = model_client.chat.completions.create(model=NAME, messages=messages, max_tokens=100, temperature=0,
                                                  response_format=response_format).choices[0]
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content)
    assert isinstance(value, dict)
    if response_format["type"] == "json_schema":
        _weather_args(json.dumps(value))


# -- reasoning ------------------------------------------------------------------------------------------------

# the Hermes-style template with Qwen3's reasoning switches (and one that opens the block itself, as
# DeepSeek-R1's distills do)
THINKING_TEMPLATE = HERMES_TEMPLATE.replace(
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}",
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- if open_block is defined and open_block %}<think>\n{%- endif %}{%- endif %}")
THOUGHT = "The user wants the weather; get_weather takes a city."


@pytest.fixture
def thinking(servers: dict[str, tuple[Scripted, openai.OpenAI]]) -> Scripted:
    return _fresh(servers["thinking"])


@pytest.fixture
def thinking_client(servers: dict[str, tuple[Scripted, openai.OpenAI]]) -> openai.OpenAI:
    return servers["thinking"][1]


def test_reasoning_is_its_own_field(thinking: Scripted, thinking_client: openai.OpenAI) -> None:
    assert THINKING_TEMPLATE != HERMES_TEMPLATE
    message = _answer(thinking, thinking_client, f"<think>\n{THOUGHT}\n</think>\n\n{PARIS}").choices[0].message
    assert message.reasoning_content == THOUGHT and message.content is None
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    message = _answer(thinking, thinking_client, "<think>\nEasy.\n</think>\n\nSunny.", tools=None).choices[0].message
    assert (message.reasoning_content, message.content) == ("Easy.", "Sunny.")
    message = _answer(thinking, thinking_client, "Sunny.").choices[0].message
    assert message.content == "Sunny." and getattr(message, "reasoning_content", None) is None


def test_streamed_reasoning_comes_before_the_content(thinking: Scripted, thinking_client: openai.OpenAI) -> None:
    thinking.answers.append(f"<think>\n{THOUGHT}\n</think>\n\nLet me look.\n{PARIS}")
    chunks = [c for c in thinking_client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER],
                                                                  stream=True) if c.choices]
    parts = [("reasoning", d.reasoning_content) if getattr(d, "reasoning_content", None) else ("content", d.content)
             for d in (c.choices[0].delta for c in chunks) if getattr(d, "reasoning_content", None) or d.content]
    kinds = [k for k, _ in parts]
    assert kinds == sorted(kinds, key=lambda k: k == "content") and len(kinds) > 3  # all reasoning first
    assert "".join(t for k, t in parts if k == "reasoning") == THOUGHT
    assert "".join(t for k, t in parts if k == "content") == "Let me look."
    calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_weather"] and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_reasoning_that_mentions_the_call_tag_keeps_the_call(thinking: Scripted,
                                                             thinking_client: openai.OpenAI) -> None:
    """A ``<tool_call>`` that the reasoning mentions before its ``</think>`` is reasoning; the call after it is a
    call, whole and streamed."""
    thought = "I should emit a <tool_call> block for get_weather."
    answer = f"<think>\n{thought}\n</think>\n\n{PARIS}"
    message = _answer(thinking, thinking_client, answer).choices[0].message
    assert (message.reasoning_content, message.content) == (thought, None)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    thinking.answers.append(answer)
    chunks = [c for c in thinking_client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER],
                                                                  stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == ""
    assert [c.function.name for d in deltas for c in d.tool_calls or []] == ["get_weather"]


def test_chat_template_kwargs_reach_the_template(thinking: Scripted, thinking_client: openai.OpenAI) -> None:
    reply = _answer(thinking, thinking_client, "Sunny.", tools=None,
                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert thinking.prompts[-1].endswith("<|im_start|>assistant<think>\n\n</think>")  # {%- eats the rest
    assert reply.choices[0].message.content == "Sunny."
    reply = _answer(thinking, thinking_client, "I know this.\n</think>\n\nSunny.", tools=None,
                    extra_body={"chat_template_kwargs": {"open_block": True}})  # the answer starts inside it
    assert thinking.prompts[-1].endswith("<|im_start|>assistant<think>")
    assert (reply.choices[0].message.reasoning_content, reply.choices[0].message.content) == \
        ("I know this.", "Sunny.")
    reply = _answer(thinking, thinking_client, '{"a": 1}', tools=None, response_format={"type": "json_object"},
                    extra_body={"chat_template_kwargs": {"open_block": True}})  # constrained: JSON from the start
    assert reply.choices[0].message.content == '{"a": 1}'
    assert getattr(reply.choices[0].message, "reasoning_content", None) is None
    with pytest.raises(openai.BadRequestError) as info:
        _answer(thinking, thinking_client, "x", extra_body={"chat_template_kwargs": {"tools": []}})
    assert info.value.body["param"] == "chat_template_kwargs"


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


@pytest.fixture
def harmony(servers: dict[str, tuple[Scripted, openai.OpenAI]]) -> tuple[Scripted, openai.OpenAI]:
    return _fresh(servers["harmony"]), servers["harmony"][1]


def test_harmony_channels_are_reasoning_content_and_calls(harmony: tuple[Scripted, openai.OpenAI]) -> None:
    """gpt-oss's analysis channel is the reasoning, its final channel the content, a message to functions.NAME a
    call; the channels are special tokens, so the server keeps their text in the answer it reads."""
    scripted, client = harmony
    message = _answer(scripted, client, HARMONY_CALL).choices[0].message
    assert scripted.params[-1].skip_special_tokens is False
    assert "namespace functions" in scripted.prompts[-1] and scripted.prompts[-1].endswith("<|start|>assistant")
    assert message.reasoning_content == "Need the weather in Paris." and not message.content
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    choice = _answer(scripted, client, "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>"
                     "final<|message|>Sunny.<|return|>", tools=None).choices[0]
    assert (choice.message.reasoning_content, choice.message.content, choice.finish_reason) == \
        ("Easy.", "Sunny.", "stop")
    assert _answer(scripted, client, "Sunny, no channels.", tools=None).choices[0].message.content == \
        "Sunny, no channels."


def test_a_harmony_answer_with_a_preamble_and_a_call_goes_back_as_it_came(
        harmony: tuple[Scripted, openai.OpenAI]) -> None:
    """gpt-oss's answer of reasoning, a preamble (content) and a call, sent back unchanged with the call's result
    (as agent loops send it), renders: the template takes one analysis message before a call, the reasoning."""
    scripted, client = harmony
    preamble = "<|start|>assistant<|channel|>commentary<|message|>Let me check the weather.<|end|>"
    answer = HARMONY_CALL.replace("<|start|>", preamble + "<|start|>", 1)
    first = _answer(scripted, client, answer).choices[0].message
    assert (first.reasoning_content, first.content) == ("Need the weather in Paris.", "Let me check the weather.")
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "22 C, sunny"}]
    reply = _answer(scripted, client, "<|channel|>final<|message|>Sunny.<|return|>", messages=history)
    assert reply.choices[0].message.content == "Sunny."
    rendered = "<|channel|>analysis<|message|>Need the weather in Paris.<|end|><|start|>assistant to=functions."
    assert rendered + "get_weather" in scripted.prompts[-1]


def test_harmony_streams_reasoning_then_content_then_calls(harmony: tuple[Scripted, openai.OpenAI]) -> None:
    scripted, client = harmony
    scripted.answers.append("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
                            "commentary<|message|>Let me look.<|end|>" + HARMONY_CALL.split("<|end|>", 1)[1])
    chunks = [c for c in client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], stream=True)
              if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == ("Need the weather.", "Let me look.") and "<|" not in reasoning + content
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_weather"] and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_harmony_forced_calls_and_json_keep_harmonys_shape(harmony: tuple[Scripted, openai.OpenAI]) -> None:
    """A forced call and a JSON response format constrain gpt-oss's answer in its own shape (the grammars are
    kestrel_core.model.harmony's, tested there): the answer is still read by its channels."""
    scripted, client = harmony
    choice = _answer(scripted, client, HARMONY_CALL, tool_choice="required").choices[0]
    assert scripted.params[-1].grammar is not None and scripted.params[-1].skip_special_tokens is False
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    reply = _answer(scripted, client, '<|channel|>final<|message|>{"a": 1}', tools=None,
                    response_format={"type": "json_object"})
    assert scripted.params[-1].grammar is not None and reply.choices[0].message.content == '{"a": 1}'


# -- Qwen3.5's calls ------------------------------------------------------------------------------------------

# Qwen3.5's (and Qwen3-Coder's) way, written for these tests: the tools as JSON, a call as <function=...> with a
# <parameter=...> block a value, and the answer opening inside a reasoning block the template starts
XML_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "Call a function as <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n"
    "</tool_call><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{%- else %}<think>\n{%- endif %}{%- endif %}")
DAYS = {"type": "function", "function": {"name": "get_forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 40}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
XML_CALL = ("<tool_call>\n<function=get_forecast>\n<parameter=city>\nSaint-Étienne\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def xml_servers() -> Iterator[dict[str, tuple[Any, openai.OpenAI]]]:
    with _both_served(XML_TEMPLATE) as both:
        yield both


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
    content; named, the call is DAYS's; a DAYS call's integer is an integer."""
    _, content, calls, reason = reply_parts(reply, stream)
    assert (content, reason) == ("", "tool_calls")
    (call,) = calls
    args = json.loads(call.function.arguments)
    if tool_choice != "required":
        assert call.function.name == "get_forecast"
    if call.function.name == "get_forecast":
        assert isinstance(args["city"], str) and isinstance(args["days"], int)


@pytest.mark.parametrize("closed", [True, False], ids=["after </think>", "inside the reasoning"])
def test_qwen3_5_calls_come_back_typed_with_the_reasoning_apart(xml_servers, closed: bool) -> None:  # type: ignore[no-untyped-def]
    """A call in Qwen3.5's format, after the reasoning or in place of its </think>, is a tool call whose values
    have their schema's types, whole and streamed; the reasoning is reasoning_content."""
    scripted, client = _fresh(xml_servers["scripted"]), xml_servers["scripted"][1]
    answer = "Three days of Paris weather.\n" + ("</think>\n\n" if closed else "") + XML_CALL
    for stream in (False, True):
        scripted.answers.append(answer)
        reply = client.chat.completions.create(model=NAME, messages=ASK, tools=[DAYS], stream=stream)
        reasoning, content, calls, reason = reply_parts(reply, stream)
        assert scripted.prompts[-1].endswith("<think>")  # the answer opens inside the block
        assert (reasoning, content, reason) == ("Three days of Paris weather.", "", "tool_calls")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_forecast", {"city": "Saint-Étienne", "days": 3})]


@pytest.mark.parametrize("call", [XML_CALL.removesuffix("</tool_call>"),
                                  XML_CALL.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")],
                         ids=["its </tool_call> cut", "no <tool_call> block"])
def test_a_qwen3_coder_call_without_its_block_end_or_block_is_a_call(xml_servers, call: str) -> None:  # type: ignore[no-untyped-def]
    """A call whose </tool_call> never comes, and Qwen3-Coder's bare <function=...>, are tool calls, whole and
    streamed, as vLLM's qwen3_coder parser reads them."""
    scripted, client = _fresh(xml_servers["scripted"]), xml_servers["scripted"][1]
    for stream in (False, True):
        scripted.answers.append("Paris.\n</think>\n\nLet me look.\n" + call)
        reply = client.chat.completions.create(model=NAME, messages=ASK, tools=[DAYS], stream=stream)
        _, content, calls, reason = reply_parts(reply, stream)
        assert (content, reason) == ("Let me look.", "tool_calls")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_forecast", {"city": "Saint-Étienne", "days": 3})]


def test_a_required_qwen3_5_call_keeps_to_its_schema(xml_servers) -> None:  # type: ignore[no-untyped-def]
    """tool_choice "required" in Qwen3.5's format: the model's own answer is a call of the offered function, its
    integer an integer."""
    client = xml_servers["model"][1]
    choice = client.chat.completions.create(model=NAME, messages=ASK, tools=[DAYS], tool_choice="required",
                                            temperature=0, max_tokens=200).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_forecast" and isinstance(args["city"], str) and isinstance(args["days"], int)
