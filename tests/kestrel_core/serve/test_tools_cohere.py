"""serve/tools.py and serve/tool_grammar.py for Cohere's formats: Command R7B's and Command A's
``<|START_ACTION|>[...]<|END_ACTION|>`` block of calls (as llama.cpp's command_r7b parser reads it) and the older
Command R's ``Action: ```json [...]``` `` list (as Ollama reads it), whole, streamed and forced."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kestrel_core.model.chat_template import compile_chat_template, render_chat
from kestrel_core.serve.tool_grammar import call_grammar
from kestrel_core.serve.tools import COHERE, COMMAND_R, Parsed, ToolCall, ToolStream, parse, tool_format

from .test_tools import FUNCTIONS, _admits

TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "templates"
R7B = "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja"
R_PLUS = "CohereForAI-c4ai-command-r-plus-tool_use.jinja"


def _calls(*calls: tuple[str, dict[str, Any]]) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(name, json.dumps(args)) for name, args in calls)


def _action(*calls: tuple[str, dict[str, Any]]) -> str:
    """A block of calls as Command R7B writes one."""
    items = ",\n".join(
        f'    {{"tool_call_id": "{i}", "tool_name": "{name}", "parameters": {json.dumps(args)}}}'
        for i, (name, args) in enumerate(calls)
    )
    return f"<|START_ACTION|>[\n{items}\n]<|END_ACTION|>"


def _command_r(*calls: tuple[str, dict[str, Any]]) -> str:
    """A list of calls as Command R writes one."""
    return "Action: ```json\n" + json.dumps([{"tool_name": n, "parameters": a} for n, a in calls], indent=4) + "\n```"


def _as_text(fmt: str, text: str) -> tuple[str, str, Parsed]:
    """A case read as it came: all content, no calls."""
    return fmt, text, Parsed(text, ())


CASES = [
    (COHERE, _action(("f", {"x": 1})), Parsed(None, _calls(("f", {"x": 1})))),
    (COHERE, _action(("f", {"x": 1}), ("g", {})), Parsed(None, _calls(("f", {"x": 1}), ("g", {})))),
    (COHERE, "Let me look.\n" + _action(("g", {})), Parsed("Let me look.", _calls(("g", {})))),
    (COHERE, _action(("f", {})).removesuffix("<|END_ACTION|>"), Parsed(None, _calls(("f", {})))),  # cut before its end
    (COHERE, '<|START_ACTION|>[{"tool_name": "f"}]<|END_ACTION|>', Parsed(None, _calls(("f", {})))),
    # malformed: as it came
    _as_text(COHERE, '<|START_ACTION|>[{"tool_name": "f", "parameters": {"x": 1}<|END_ACTION|>'),
    _as_text(COHERE, '<|START_ACTION|>{"tool_name": "f", "parameters": {}}<|END_ACTION|>'),  # not a list
    _as_text(COHERE, '<|START_ACTION|>[{"name": "f", "arguments": {}}]<|END_ACTION|>'),  # not Cohere's keys
    _as_text(COHERE, '<|START_ACTION|>[{"tool_name": "f", "parameters": []}]<|END_ACTION|>'),
    _as_text(COHERE, "<|START_ACTION|>[]<|END_ACTION|>"),
    _as_text(COHERE, "Sunny in Paris."),
    (COMMAND_R, _command_r(("f", {"x": 1}), ("g", {})), Parsed(None, _calls(("f", {"x": 1}), ("g", {})))),
    (COMMAND_R, "I will look it up.\n" + _command_r(("f", {})), Parsed("I will look it up.", _calls(("f", {})))),
    (COMMAND_R, 'Action:\n```json\n[{"tool_name": "f", "parameters": {}}]```', Parsed(None, _calls(("f", {})))),
    (COMMAND_R, _command_r(("f", {})).removesuffix("```"), Parsed(None, _calls(("f", {})))),
    _as_text(COMMAND_R, 'Action: ```json\n[{"tool_name": "f", "parameters": {}}\n```'),
    _as_text(COMMAND_R, 'Action: ```json\n[{"tool_name": "f", "parameters": {}}] and then text'),
    _as_text(COMMAND_R, "Action: none needed."),
]


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES)
def test_cohere_calls_whole_and_streamed(fmt: str, text: str, expected: Parsed) -> None:
    """Each call's name and parameters (Cohere's keys; its tool_call_id is the model's count, not an id: the
    server gives each call its own); an answer whose calls do not parse is content, as it came; a stream sends
    that content and nothing of a call, however it is cut."""
    assert parse(fmt, text) == expected
    for size in (1, 2, 3, 7, len(text)):
        stream = ToolStream(fmt)
        sent = "".join(stream.feed(text[i : i + size]) for i in range(0, len(text), size))
        rest, calls = stream.finish()
        assert (sent + rest, calls) == (expected.content or "", expected.calls)
        assert not expected.calls or "Action" not in sent


def test_parallel_calls_off_keeps_the_first() -> None:
    assert parse(COHERE, _action(("f", {}), ("g", {})), parallel=False).calls == _calls(("f", {}))


@pytest.mark.parametrize(("name", "fmt"), [(R7B, COHERE), (R_PLUS, COMMAND_R)])
def test_the_calls_a_real_cohere_template_writes_parse_back(name: str, fmt: str) -> None:
    """Command R7B's and Command R+'s tool_use templates teach their formats; an earlier turn's calls, as each
    writes them, parse back to those calls."""
    source = (TEMPLATES / name).read_text()
    assert tool_format(source) == fmt
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": c["function"]["name"],
                "description": "",
                "parameters": {"type": "object", "properties": {}},
            },
        }
        for c in calls
    ]
    messages = [
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": "", "tool_calls": calls, "tool_plan": "I will look."},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    ]
    prompt = render_chat(compile_chat_template(source), messages, True, tools=tools, bos_token="", eos_token="")
    opener, closer = ("<|START_ACTION|>", "<|END_ACTION|>") if fmt == COHERE else ("Action:", "```\n")
    start = prompt.index(opener, prompt.index("Weather and time?"))
    turn = prompt[start : prompt.index(closer, start) + len(closer)]
    assert parse(fmt, turn) == Parsed(None, _calls(("get_weather", {"city": "Paris"}), ("get_time", {})))


@pytest.mark.parametrize("fmt", [COHERE, COMMAND_R])
def test_a_cohere_grammar_admits_the_calls_parse_reads_and_no_others(fmt: str) -> None:
    """tool_choice "required" in Cohere's formats: one block of a list of calls, each of an offered function with
    arguments its schema accepts; what it admits parses back."""
    grammar = call_grammar(fmt, FUNCTIONS, many=True)

    def block(*calls: dict[str, Any]) -> str:
        if fmt == COHERE:
            items = [{"tool_call_id": str(i), **c} for i, c in enumerate(calls)]
            return f"<|START_ACTION|>{json.dumps(items)}<|END_ACTION|>"
        return f"Action: ```json\n{json.dumps(list(calls))}\n```"

    f = {"tool_name": "f", "parameters": {"s": "x", "i": 3, "e": "y"}}
    g = {"tool_name": "g", "parameters": {}}
    for text in (block(f), block(f, g)):
        assert _admits(grammar, text) and parse(fmt, text).calls, text
    for bad in (
        block({"tool_name": "f", "parameters": {"i": 3}}),
        block({"tool_name": "h", "parameters": {}}),
        block(g) + " and text",
        block({"name": "g", "arguments": {}}),
    ):
        assert not _admits(grammar, bad), bad
    assert not _admits(call_grammar(fmt, FUNCTIONS, many=False), block(f, g))
    if fmt == COHERE:
        assert not _admits(grammar, block(g).replace('"0"', '"zero"'))  # the count, as llama.cpp's grammar has it
        tokens = call_grammar(COHERE, FUNCTIONS, many=False, control_ids={"<|START_ACTION|>": 7, "<|END_ACTION|>": 8})
        assert '<[7]> "[" call' in tokens and '"]" <[8]>' in tokens  # the special tokens the vocabulary has
