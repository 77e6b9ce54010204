"""Tool calls through a real server and the official openai client: the tools reach the prompt through the model's
chat template, and the calls in an answer come back as OpenAI's ``tool_calls``, whole and streamed.

The answers are scripted over the default model's tokenizer with a Hermes-style template (tool_calls.py has the
setup); a forced call the model writes itself, reasoning, gpt-oss's harmony format and Qwen3.5's calls have
test_tool_calls modules of their own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

import kestrel_core

from .helpers import Scripted, openai_client, running_server
from .tool_calls import ASK, HERMES_TEMPLATE, NAME, PARIS, TIME, WEATHER, _answer, _call, _fresh, _served, reply_parts

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def hermes() -> Iterator[tuple[Scripted, openai.OpenAI]]:
    """A scripted server with the Hermes-style template."""
    with _served(HERMES_TEMPLATE) as pair:
        yield pair


@pytest.fixture
def scripted(hermes: tuple[Scripted, openai.OpenAI]) -> Scripted:
    return _fresh(hermes)


@pytest.fixture
def client(hermes: tuple[Scripted, openai.OpenAI]) -> openai.OpenAI:
    return hermes[1]


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


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("tool_choice", "reason"), [
    ("auto", "tool_calls"), ("required", "tool_calls"),
    # a named function's call finishes with "stop", as OpenAI's and vLLM's (its PR 25054) do
    ({"type": "function", "function": {"name": "get_weather"}}, "stop")])
def test_the_finish_reason_of_a_call_is_openais_for_its_tool_choice(scripted: Scripted, client: openai.OpenAI,
                                                                   tool_choice: Any, reason: str,
                                                                   stream: bool) -> None:
    reply = _answer(scripted, client, PARIS, tool_choice=tool_choice, stream=stream)
    _, content, calls, finish = reply_parts(reply, stream)
    assert (content, [c.function.name for c in calls], finish) == ("", ["get_weather"], reason)


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
