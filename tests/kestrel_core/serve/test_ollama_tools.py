"""Ollama's tool calls and reasoning through a real server and the official ``ollama`` client: scripted answers
(``Scripted``) over the real templates, prompt and server, the calls and the reasoning in Ollama's shape, the calls
and their results sent back as the templates take them, ``think`` and its levels."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ollama
import pytest

from .helpers import Scripted, running_server, scripted_ollama
from .tool_calls import HARMONY_CALL, HARMONY_TEMPLATE, PARIS, THINKING_TEMPLATE, WEATHER

NAME = "tiny"


@pytest.fixture(scope="module")
def scripted(engine: Any) -> Iterator[tuple[Scripted, ollama.Client]]:
    """A server whose answers are scripted, over tiny-qwen3 with the thinking Hermes template."""
    template = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = THINKING_TEMPLATE
    try:
        front = Scripted(engine)
        with running_server(front, NAME) as s:
            yield front, ollama.Client(host=s.url)
    finally:
        engine.tokenizer.chat_template = template


def test_tool_calls_and_thinking_come_back_in_ollamas_shape(scripted: tuple[Scripted, ollama.Client]) -> None:
    front, ol = scripted
    assert ol.show("tiny").capabilities == ["completion", "tools", "thinking"]
    front.answers.append(f"<think>Paris is a city.</think>\n{PARIS}")
    got = ol.chat(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER])
    assert got.message.thinking == "Paris is a city." and got.done_reason == "stop"
    (call,) = got.message.tool_calls
    assert (call.function.name, dict(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    front.answers.append(f"<think>Again.</think>\n{PARIS}")
    parts = list(ol.chat(model="tiny", messages=[{"role": "user", "content": "And now?"}], tools=[WEATHER],
                         stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == "Again."
    assert [c.function.name for p in parts for c in p.message.tool_calls or ()] == ["get_weather"]
    # the call and its result go back into the conversation as the template writes them
    front.answers.append("Sunny.")
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                                 "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "22 C, sunny", "tool_name": "get_weather"}]
    assert ol.chat(model="tiny", messages=history, tools=[WEATHER], think=False).message.content == "Sunny."
    prompt = front.prompts[-1]
    assert '"arguments": {"city": "Paris"}' in prompt and "<tool_response>\n22 C, sunny" in prompt
    assert prompt.rstrip().endswith("<think>\n\n</think>")  # think=False: the template's enable_thinking


# Mistral's way with call ids (written for this test): each call's id and each result's must be nine characters
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{% for m in messages %}"
    "{% if m.tool_calls %}[TOOL_CALLS]{% for c in m.tool_calls %}{% if c.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{{ c.function.name }}={{ c.id }};{% endfor %}{% elif m.role == 'tool' %}{% if m.tool_call_id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "[TOOL_RESULTS]{{ m.tool_call_id }}:{{ m.content }}[/TOOL_RESULTS]{% else %}[INST]{{ m.content }}[/INST]"
    "{% endif %}{% endfor %}")


@pytest.mark.parametrize("template", [MISTRAL_TEMPLATE, MISTRAL_TEMPLATE.replace(";{% endfor %}",
                                                                                ";{% endfor %}[ARGS]")],
                         ids=["[TOOL_CALLS] list", "[TOOL_CALLS] and [ARGS]"])
def test_results_answer_their_calls_with_ids_the_template_takes(engine: Any, template: str) -> None:
    """Ollama's calls carry no ids: each gets one in the template's shape, the same each time the conversation
    is sent, and a result the id of the call of its ``tool_name`` (else the next unanswered one)."""
    with scripted_ollama(engine, NAME, template) as (front, ol, _):
        calls = [{"function": {"name": name, "arguments": {"city": "Paris"}}} for name in ("weather", "time")]
        history = [{"role": "user", "content": "Weather and time in Paris?"},
                   {"role": "assistant", "content": "", "tool_calls": calls},
                   {"role": "tool", "content": "12:00", "tool_name": "time"},
                   {"role": "tool", "content": "sunny"}]
        for _ in range(2):
            front.answers.append("Sunny at noon.")
            assert ol.chat(model="tiny", messages=history, tools=[WEATHER]).message.content == "Sunny at noon."
        first, again = front.prompts[-2:]
    assert first == again
    ids = dict(pair.split("=") for pair in first.split("[TOOL_CALLS]")[1].split("[")[0].split(";") if pair)
    assert all(len(i) == 9 and i.isalnum() for i in ids.values()) and len(set(ids.values())) == 2
    assert f"[TOOL_RESULTS]{ids['time']}:12:00" in first and f"[TOOL_RESULTS]{ids['weather']}:sunny" in first


def test_think_levels_reach_the_template_as_its_reasoning_effort(engine: Any) -> None:
    """Every level Ollama takes, max among them, turns thinking on and reaches the template as reasoning_effort,
    on /api/chat and /api/generate; another level is a 400, as Ollama answers it."""
    template = THINKING_TEMPLATE + "{%- if reasoning_effort is defined %}[effort {{ reasoning_effort }}]{%- endif %}"
    with scripted_ollama(engine, NAME, template) as (front, ol, _):
        for level in ("low", "medium", "high", "max"):
            front.answers += ["Paris.", "Paris."]
            ol.chat(model="tiny", messages=[{"role": "user", "content": "Capital of France?"}], think=level)
            ol.generate(model="tiny", prompt="Capital of France?", think=level)
            for prompt in front.prompts[-2:]:
                assert prompt.endswith(f"[effort {level}]") and "<think>" not in prompt
        with pytest.raises(ollama.ResponseError) as info:
            ol.chat(model="tiny", messages=[{"role": "user", "content": "Capital of France?"}], think="extreme")
        assert info.value.status_code == 400 and "think" in info.value.error


def test_gpt_oss_thinks_at_the_level_asked_and_answers_in_ollamas_shape(engine: Any) -> None:
    """A harmony model (gpt-oss): ``think`` as a level is its reasoning effort; its analysis channel comes back as
    ``thinking``, its final channel as the content, a message to functions.NAME as a call."""
    with scripted_ollama(engine, NAME, HARMONY_TEMPLATE) as (front, ol, _):
        assert ol.show("tiny").capabilities == ["completion", "tools", "thinking"]
        front.answers.append("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
                             "<|message|>Paris.<|return|>")
        got = ol.chat(model="tiny", messages=[{"role": "user", "content": "Capital of France?"}], think="high")
        assert (got.message.thinking, got.message.content) == ("Easy.", "Paris.")
        assert "Reasoning: high" in front.prompts[-1]
        front.answers.append("<|channel|>final<|message|>Paris.<|return|>")
        ol.chat(model="tiny", messages=[{"role": "user", "content": "Capital of France?"}], think="max")
        assert "Reasoning: high" in front.prompts[-1]  # harmony's efforts end at high, as Ollama maps max
        front.answers.append(HARMONY_CALL)
        got = ol.chat(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER])
        (call,) = got.message.tool_calls
        assert (call.function.name, dict(call.function.arguments)) == ("get_weather", {"city": "Paris"})


def test_a_cut_conversation_keeps_a_tool_result_with_its_call(scripted: tuple[Scripted, ollama.Client],
                                                              engine: Any) -> None:
    """Where the cut would leave a tool's result without the call it answers, the call's message and its results
    go together."""
    front, ol = scripted
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris " * 150}}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "22 C, sunny", "tool_name": "get_weather"},
                {"role": "user", "content": "And now?"}]
    orphan = [messages[0], {"role": "tool", "content": "22 C, sunny"}, messages[-1]]
    assert len(engine.tokenizer.encode_chat(orphan)) < engine.config.max_position  # the result alone would fit
    front.answers.append("Sunny.")
    assert ol.chat(model="tiny", messages=messages, think=False).message.content == "Sunny."
    prompt = front.prompts[-1]
    assert "Be brief." in prompt and "And now?" in prompt
    assert "22 C, sunny" not in prompt and "Paris" not in prompt
