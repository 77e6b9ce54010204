"""Cohere's tool calls through a real server and the official openai client, with Command R7B's real tool_use
template (Command A's writes the same): the ``<|START_THINKING|>`` plan is the answer's reasoning, a
``<|START_ACTION|>[...]<|END_ACTION|>`` block comes back as OpenAI's ``tool_calls`` and a ``<|START_RESPONSE|>`` block
as the content without its tags, whole and streamed, as llama.cpp's command_r7b parser reads them; a block that
does not parse is text; ``tool_choice`` required or named forces the block. The older Command R's ``Action:`` list
is read from its tool_use template's format.

The answers are spoken in the default model's tokens (``Spoken``), its tokenizer given Cohere's tags as special
tokens, as Cohere's vocabularies have them: a token's text is decoded as the engine decodes it, so the tags are in
the answer only where the server keeps special tokens' text. A forced call is the default model's own answer, as in
test_tool_calls.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

import kestrel_core
from kestrel_core.serve.server import KestrelServer

from .helpers import Scripted, Spoken, answering, openai_client, running_server
from .tool_calls import ASK, DAYS, NAME, TIME, WEATHER, _both_served, assert_one_forced_forecast, reply_parts

pytestmark = pytest.mark.default_model

TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "templates"
TEMPLATE = (TEMPLATES / "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja").read_text()
TAGS = [
    "<|START_THINKING|>",
    "<|END_THINKING|>",
    "<|START_ACTION|>",
    "<|END_ACTION|>",
    "<|START_RESPONSE|>",
    "<|END_RESPONSE|>",
]
PLAN = "I will look up the weather and the time."
LIST = (
    '[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}},\n'
    '    {"tool_call_id": "1", "tool_name": "get_time", "parameters": {}}\n]'
)
# answers as the texts their tokens come from: each tag one token
CALLED = ["<|START_THINKING|>", PLAN, "<|END_THINKING|>", "<|START_ACTION|>", LIST, "<|END_ACTION|>"]
ANSWERED = ["<|START_RESPONSE|>", "It is sunny in Paris.", "<|END_RESPONSE|>"]
BROKEN = [
    "<|START_ACTION|>",
    '[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Par',
    "<|END_ACTION|>",
]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Spoken, KestrelServer]]:
    """The default model with Command R7B's template and Cohere's tags, its answers spoken two tokens an output,
    and its server."""
    with kestrel_core.load(None, backend="cpu") as engine:
        engine.tokenizer.chat_template = TEMPLATE
        engine.tokenizer.backend.add_special_tokens(TAGS)
        front = Spoken(engine, per_step=2)
        with running_server(front, NAME) as server:
            yield front, server



@pytest.mark.parametrize("stream", [False, True])
def test_the_plan_is_reasoning_and_the_action_block_is_the_calls(
    served: tuple[Spoken, KestrelServer], stream: bool
) -> None:
    front, client = answering(served, CALLED)
    reply = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME], stream=stream)
    reasoning, content, calls, reason = reply_parts(reply, stream)
    prompt = front.prompts[-1]
    assert '"name": "get_weather"' in prompt and "## Available Tools" in prompt
    assert prompt.endswith("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
    assert (reasoning, content, reason) == (PLAN, "", "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == 2
    if stream:
        assert [c.index for c in calls] == [0, 1]


@pytest.mark.parametrize(
    "off", [{"reasoning_effort": "none"}, {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}]
)
def test_thinking_off_gives_the_answer_an_empty_plan(served: tuple[Spoken, KestrelServer], off: dict[str, Any]) -> None:
    """Thinking turned off (reasoning_effort none, or the template's enable_thinking false, which Cohere's templates do
    not read): the prompt ends with an empty thinking block, as llama.cpp writes it, and the calls come back without
    reasoning."""
    front, client = answering(served, CALLED[3:])
    reply = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME], **off)
    reasoning, content, calls, reason = reply_parts(reply, False)
    assert front.prompts[-1].endswith("<|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>")
    assert (reasoning, content, reason, len(calls)) == (None, "", "tool_calls", 2)


@pytest.mark.parametrize("stream", [False, True])
def test_the_response_block_is_the_content_without_its_tags(served: tuple[Spoken, KestrelServer], stream: bool) -> None:
    _, client = answering(served, ANSWERED, ["<|START_THINKING|>", PLAN, "<|END_THINKING|>", *ANSWERED])
    for tools in (None, [WEATHER]):
        reply = client.chat.completions.create(
            model=NAME, messages=ASK, stream=stream, **({"tools": tools} if tools else {})
        )
        reasoning, content, calls, reason = reply_parts(reply, stream)
        assert (reasoning or None, content, calls or None, reason) == (
            PLAN if tools else None,
            "It is sunny in Paris.",
            None,
            "stop",
        )


@pytest.mark.parametrize("stream", [False, True])
def test_an_action_block_that_does_not_parse_is_text(served: tuple[Spoken, KestrelServer], stream: bool) -> None:
    _, client = answering(served, BROKEN)
    reply = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], stream=stream)
    _, content, calls, reason = reply_parts(reply, stream)
    assert (content, calls or None, reason) == ("".join(BROKEN), None, "stop")


def test_a_conversation_goes_back_with_its_plan_and_calls_as_the_template_writes_them(
    served: tuple[Spoken, KestrelServer],
) -> None:
    """The answer's reasoning and calls, sent back with the calls' results as agent loops send them, render as
    Command R7B writes a turn of its own: the plan in its thinking block (the template's tool_plan), the calls
    numbered in its action block, each result by its call's number."""
    front, client = answering(served, CALLED, ANSWERED)
    first = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME]).choices[0].message
    history: list[Any] = [
        *ASK,
        first.model_dump(exclude_none=True),
        *(
            {"role": "tool", "tool_call_id": c.id, "content": f"result {k}"}
            for k, c in enumerate(first.tool_calls or [])
        ),
    ]
    client.chat.completions.create(model=NAME, messages=history, tools=[WEATHER, TIME])
    prompt = front.prompts[-1]
    turn = (
        f'<|START_THINKING|>{PLAN}<|END_THINKING|><|START_ACTION|>[\n    {{"tool_call_id": "0", '
        '"tool_name": "get_weather", "parameters": {"city": "Paris"}},'
    )
    assert turn in prompt, prompt[-800:]
    assert '"tool_call_id": "1",\n        "results": {\n            "0": "result 1"' in prompt


@pytest.fixture(scope="module")
def cohere() -> Iterator[dict[str, tuple[Any, openai.OpenAI]]]:
    with _both_served(TEMPLATE) as both:
        yield both


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_forecast"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_cohere_call_is_an_action_block(
    cohere: dict[str, tuple[Any, openai.OpenAI]], tool_choice: Any, stream: bool
) -> None:
    """tool_choice "required" or named: the model's own answer is one action block of a call of the offered
    function, read back as the call, its integer an integer."""
    client = cohere["model"][1]
    reply = client.chat.completions.create(
        model=NAME,
        messages=ASK,
        tools=[DAYS, TIME],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
        stream=stream,
    )
    assert_one_forced_forecast(reply, stream, tool_choice)


@pytest.mark.parametrize("stream", [False, True])
def test_the_older_command_rs_action_list_comes_back_as_tool_calls(stream: bool) -> None:
    """Command R's and R+'s default template shows no tools; its tool_use template renders them (each parameter with
    its description, which it requires) and teaches the ``Action: ```json`` list, whose calls come back as
    tool_calls, the text before them the content."""
    described = {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city"}},
        "required": ["city"],
    }
    weather = {"type": "function", "function": {**WEATHER["function"], "parameters": described}}
    tool_use = (TEMPLATES / "CohereForAI-c4ai-command-r-plus-tool_use.jinja").read_text()
    plain = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
    answer = (
        'Plan: I will look it up.\nAction: ```json\n[\n    {\n        "tool_name": "get_weather",\n'
        '        "parameters": {\n            "city": "Paris"\n        }\n    }\n]\n```'
    )
    with kestrel_core.load(None, backend="cpu") as engine:
        engine.tokenizer.chat_template, engine.tokenizer.tool_template = plain, tool_use
        front = Scripted(engine)
        with running_server(front, NAME) as server:
            front.answers.append(answer)
            reply = openai_client(server).chat.completions.create(
                model=NAME, messages=ASK, tools=[weather], stream=stream
            )
            reasoning, content, calls, reason = reply_parts(reply, stream)
            assert "def get_weather(city: str) -> List[Dict]" in front.prompts[-1]
    assert (reasoning or None, content, reason) == (None, "Plan: I will look it up.", "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
