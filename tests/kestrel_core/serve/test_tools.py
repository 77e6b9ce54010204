"""serve/tools.py: the tool-call format a chat template teaches, calls read out of whole answers, and a stream's
content held back exactly where a call may begin."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kestrel_core.model.chat_template import compile_chat_template, render_chat
from kestrel_core.serve.tools import (
    APRIEL,
    GLM,
    GLM_COMPACT,
    HERMES,
    LLAMA3,
    MINIMAX,
    MISTRAL,
    MISTRAL_ARGS,
    UNKNOWN,
    XML,
    Parsed,
    ToolCall,
    ToolCalls,
    ToolStream,
    call_id,
    parse,
    tool_format,
)


@pytest.mark.parametrize(("template", "fmt"), [
    ("{% for t in tools %}{{ t | tojson }}{% endfor %}Calls go in <tool_call></tool_call>.", HERMES),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", MISTRAL),
    # Ministral-3's, Devstral's (Mistral-Small-3.2's writes [CALL_ID]{{ tc.id }} before the [ARGS])
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{% for tc in m.tool_calls %}"
     "{{- '[TOOL_CALLS]' + tc.function.name + '[ARGS]' + tc.function.arguments }}{% endfor %}", MISTRAL_ARGS),
    ("<|start_header_id|>system<|end_header_id|>{% if tools is not none %}{{ tools | tojson }}{% endif %}", LLAMA3),
    ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}{{ tools }}<tool_call>",
     HERMES),  # the loop controls the sandbox allows
    ("{% for t in tools %}{{ t.function.name }}{% endfor %}", UNKNOWN),
    ("{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>\n<function=NAME>\n<parameter=KEY>\nvalue\n"
     "</parameter>\n</function>\n</tool_call>", XML),  # Qwen3.5's, Qwen3-Coder's
    ("{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>{{ tc.name }}\n<arg_key>{{ k }}</arg_key>\n"
     "<arg_value>{{ v }}</arg_value>\n</tool_call>", GLM),  # GLM-4.5's, GLM-4.6's
    ("{% for t in tools %}{{ t | tojson }}{% endfor %}{{- '<tool_call>' + tc.name -}}<arg_key>{{ k }}</arg_key>"
     "<arg_value>{{ v }}</arg_value></tool_call>", GLM_COMPACT),  # GLM-4.7's
    ("{% for t in tools %}<tool>{{ t.function | tojson }}</tool>{% endfor %}<minimax:tool_call>\n"
     '<invoke name="tool-name-1">\n<parameter name="param-key-1">param-value-1</parameter>\n</invoke>\n'
     "</minimax:tool_call>", MINIMAX),  # MiniMax-M2's
    ("{% if tools %}Return all function calls as a list of json objects within <tool_call></tool_call> XML tags:\n"
     '<tool_calls>[{"name": <function-name-1>, "arguments": <args-dict-1>}]</tool_calls>{% endif %}',
     APRIEL),  # Apriel-1.5's: one block of a list, not hermes' blocks
    ("{% for m in messages %}{{ m.content }}{% endfor %} tools <tool_call>", None),  # "tools" only as text
    ("{% set tools = [] %}{{ tools }}<tool_call>", None),  # its own variable, not the request's
    ("", None),
    (None, None),
])
def test_the_format_a_template_teaches(template: str | None, fmt: str | None) -> None:
    assert tool_format(template) == fmt


def test_a_template_that_does_not_parse_has_no_format() -> None:
    assert tool_format("{% for t in tools %}<tool_call>") is None  # the chat template's own error says why
    nested = "{{ tools" + " + (1" * 5000 + ")" * 5000 + " }}"  # past the parser's recursion depth
    assert tool_format(nested) is None  # a server still starts: its chat requests say the template is invalid


def _calls(*pairs: tuple[str, dict[str, object]]) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(name, json.dumps(args)) for name, args in pairs)


CASES = [
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', Parsed(None, _calls(("f", {"x": 1})))),
    (HERMES, 'Sure.\n\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", '
             '"arguments": "{\\"y\\": [1, 2]}"}</tool_call>\n',
     Parsed("Sure.", _calls(("f", {}), ("g", {"y": [1, 2]})))),
    (HERMES, '<tool_call>{"name": "f", "arguments": {"s": "\u00e9\u4e2d"}}</tool_call>',
     Parsed(None, (ToolCall("f", '{"s": "\u00e9\u4e2d"}'),))),
    (HERMES, '<tool_call>{"name": "f"}</tool_call>', Parsed(None, _calls(("f", {})))),  # no arguments: none
    (HERMES, "Just text, no call.", Parsed("Just text, no call.", ())),
    (HERMES, "<tool_call>{bad json}</tool_call>", Parsed("<tool_call>{bad json}</tool_call>", ())),
    (HERMES, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     Parsed('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', ())),
    (HERMES, '<tool_call>{"name": "", "arguments": {}}</tool_call>',
     Parsed('<tool_call>{"name": "", "arguments": {}}</tool_call>', ())),
    # a call whose </tool_call> never comes (a stop string or the answer's end cut it), as vLLM's hermes parser
    (HERMES, '<tool_call>{"name": "f", "arguments": {}}', Parsed(None, _calls(("f", {})))),
    (HERMES, 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n', Parsed("Sure.", _calls(("f", {"x": 1})))),
    (HERMES, '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}',
     Parsed(None, _calls(("f", {}), ("g", {})))),
    (HERMES, '<tool_call>{"name": "f", "arguments": {}} and more',
     Parsed('<tool_call>{"name": "f", "arguments": {}} and more', ())),
    (HERMES, '<tool_call>{"name": "f", "arguments": {', Parsed('<tool_call>{"name": "f", "arguments": {', ())),
    (MISTRAL, ' [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]',
     Parsed(None, _calls(("f", {"x": 1}), ("g", {})))),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {}}]', Parsed(None, _calls(("f", {})))),
    (MISTRAL, '[{"name": "f", "arguments": {}}] and then text',
     Parsed('[{"name": "f", "arguments": {}}] and then text', ())),
    (MISTRAL, "[a link](http://x)", Parsed("[a link](http://x)", ())),
    (MISTRAL, '{"name": "f", "arguments": {}}', Parsed('{"name": "f", "arguments": {}}', ())),
    (MISTRAL_ARGS, '[TOOL_CALLS]f[ARGS]{"x": 1}', Parsed(None, _calls(("f", {"x": 1})))),
    (MISTRAL_ARGS, 'Sure.\n[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}\n',
     Parsed("Sure.", _calls(("f", {"x": 1}), ("g", {})))),
    (MISTRAL_ARGS, '[TOOL_CALLS]f{"x": 1}', Parsed(None, _calls(("f", {"x": 1})))),  # as vLLM reads it
    (MISTRAL_ARGS, '[TOOL_CALLS]f[ARGS]{"x": 1} and then text',
     Parsed('[TOOL_CALLS]f[ARGS]{"x": 1} and then text', ())),
    (MISTRAL_ARGS, "[TOOL_CALLS]f[ARGS][1]", Parsed("[TOOL_CALLS]f[ARGS][1]", ())),
    (MISTRAL_ARGS, "[TOOL_CALLS][ARGS]{}", Parsed("[TOOL_CALLS][ARGS]{}", ())),
    (MISTRAL_ARGS, '[TOOL_CALLS]f[ARGS]{"x": ', Parsed('[TOOL_CALLS]f[ARGS]{"x": ', ())),
    (MISTRAL_ARGS, "[a link](http://x) {}", Parsed("[a link](http://x) {}", ())),
    (APRIEL, '<tool_calls>[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]</tool_calls>',
     Parsed(None, _calls(("f", {"x": 1}), ("g", {})))),
    (APRIEL, 'I need the weather.\n[BEGIN FINAL RESPONSE]\n<tool_calls>[{"name": "f", "arguments": {}, "id": "c1"}]'
             '</tool_calls>\n[END FINAL RESPONSE]',  # reasoning and its markers are content
     Parsed("I need the weather.\n[BEGIN FINAL RESPONSE]\n\n[END FINAL RESPONSE]", _calls(("f", {})))),
    (APRIEL, '<tool_calls>[{"name": "f", "arguments": {"s": "]</tool_calls>"}}]',  # its end cut; the tag in a string
     Parsed(None, _calls(("f", {"s": "]</tool_calls>"})))),
    (APRIEL, '<tool_calls>{"name": "f", "arguments": {}}</tool_calls>',
     Parsed('<tool_calls>{"name": "f", "arguments": {}}</tool_calls>', ())),  # not a list
    (APRIEL, "<tool_calls>[]</tool_calls>", Parsed("<tool_calls>[]</tool_calls>", ())),
    (APRIEL, '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
     Parsed('<tool_call>{"name": "f", "arguments": {}}</tool_call>', ())),  # hermes' spelling, which its prose names
    (APRIEL, "I will write <tool_calls> then a list.", Parsed("I will write <tool_calls> then a list.", ())),
    (LLAMA3, '{"name": "f", "parameters": {"x": 1}}', Parsed(None, _calls(("f", {"x": 1})))),
    (LLAMA3, '{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"y": 2}}',
     Parsed(None, _calls(("f", {}), ("g", {"y": 2})))),
    (LLAMA3, '{"name": "f", "parameters": {}} is what I would call',
     Parsed('{"name": "f", "parameters": {}} is what I would call', ())),
    (LLAMA3, '{"x": 1}', Parsed('{"x": 1}', ())),
    (LLAMA3, "Hello {name}", Parsed("Hello {name}", ())),
    # NaN, Infinity and numbers past a float's range are not JSON (JSON.parse refuses them): not calls
    (HERMES, '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
     Parsed('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', ())),
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"x\\": -Infinity}"}</tool_call>',
     Parsed('<tool_call>{"name": "f", "arguments": "{\\"x\\": -Infinity}"}</tool_call>', ())),
    (MISTRAL_ARGS, '[TOOL_CALLS]f[ARGS]{"x": 1e400}', Parsed('[TOOL_CALLS]f[ARGS]{"x": 1e400}', ())),
    (LLAMA3, '{"name": "f", "parameters": {"x": Infinity}}',
     Parsed('{"name": "f", "parameters": {"x": Infinity}}', ())),
]


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES)
def test_parse(fmt: str, text: str, expected: Parsed) -> None:
    assert parse(fmt, text) == expected


def _xml(name: str, **values: str) -> str:
    """A call as Qwen3.5's template writes one."""
    return f"<tool_call>\n{_bare(name, **values)}\n</tool_call>"


def _bare(name: str, **values: str) -> str:
    """A call as Qwen3.5's template writes one, without its <tool_call> block."""
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<function={name}>\n{params}</function>"


SCHEMAS = {"f": {"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
    "o": {"type": "object"}, "a": {"type": ["array", "null"]}, "e": {"type": "string", "enum": ["x", "y"]},
    # pydantic's Optional[int] and Optional[str], and an enum of numbers: JSON values but for the string's
    "oi": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "os": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "en": {"enum": [1, 2]}}}}
XML_CASES = [
    (_xml("f", oi="3", os="3", en="2"), Parsed(None, _calls(("f", {"oi": 3, "os": "3", "en": 2})))),
    (_xml("f", s="12", i="12", n="1.5", b="True", o='{"k": [1]}', a="[1, 2]"),
     Parsed(None, _calls(("f", {"s": "12", "i": 12, "n": 1.5, "b": True, "o": {"k": [1]}, "a": [1, 2]})))),
    (_xml("f", s="two\nlines <b>", n="2", a="null"), Parsed(None, _calls(("f", {"s": "two\nlines <b>", "n": 2,
                                                                               "a": None})))),
    (_xml("f", i="twelve", o="{not json"), Parsed(None, _calls(("f", {"i": "twelve", "o": "{not json"})))),
    # no NaN or infinity, which JSON has not: the text
    (_xml("f", n="inf", o='{"k": NaN}', a="[1e400]"),
     Parsed(None, _calls(("f", {"n": "inf", "o": '{"k": NaN}', "a": "[1e400]"})))),
    (_xml("g", i="12") + "\n" + _xml("f"), Parsed(None, _calls(("g", {"i": "12"}), ("f", {})))),  # g: no schema
    ("Let me look.\n\n" + _xml("f", e="x"), Parsed("Let me look.", _calls(("f", {"e": "x"})))),
    ("<tool_call>\n<function=f>\nloose text\n</function>\n</tool_call>",
     Parsed("<tool_call>\n<function=f>\nloose text\n</function>\n</tool_call>", ())),
    ("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
     Parsed("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", ())),  # Hermes' JSON: not this format
    # a block whose </tool_call> never comes, and Qwen3-Coder's functions without their blocks (vLLM's qwen3_coder)
    (_xml("f", i="3").removesuffix("</tool_call>"), Parsed(None, _calls(("f", {"i": 3})))),
    (_xml("f", i="3").removesuffix("ll>"), Parsed(None, _calls(("f", {"i": 3})))),  # cut inside it (max_tokens)
    ("Let me look.\n" + _bare("f", i="3") + "\n" + _bare("g"),
     Parsed("Let me look.", _calls(("f", {"i": 3}), ("g", {})))),
    (_bare("f", i="3") + " and more", Parsed(_bare("f", i="3") + " and more", ())),
    ("Write <function=NAME> to call one.", Parsed("Write <function=NAME> to call one.", ())),
    (_xml("f") + "\n" + _bare("g"), Parsed("\n" + _bare("g"), _calls(("f", {})))),  # bare only where no block is
]


@pytest.mark.parametrize(("text", "expected"), XML_CASES)
def test_parse_xml_types_each_value_by_its_schema(text: str, expected: Parsed) -> None:
    """Qwen3.5's calls: a value is text, read as its parameter's JSON Schema type (a string where the schema says
    string or nothing; the text itself where it does not convert), as vLLM's qwen3_coder parser reads them."""
    assert parse(XML, text, schemas=SCHEMAS) == expected
    stream = ToolStream(XML, schemas=SCHEMAS)
    sent = "".join(stream.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, calls = stream.finish()
    assert (sent + rest, calls) == (expected.content or "", expected.calls)


def _glm(name: str, compact: bool = False, **values: str) -> str:
    """A call as GLM-4.5's template writes one (``compact``: GLM-4.7's, without the newlines)."""
    nl = "" if compact else "\n"
    params = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}" for k, v in values.items())
    return f"<tool_call>{name}{nl}{params}</tool_call>"


GLM_CASES = [
    (_glm("f", s="12", i="12", n="1.5", b="true", o='{"k": [1]}', a="[1, 2]"),
     Parsed(None, _calls(("f", {"s": "12", "i": 12, "n": 1.5, "b": True, "o": {"k": [1]}, "a": [1, 2]})))),
    (_glm("f", True, s="two\nlines <b>", e="y"), Parsed(None, _calls(("f", {"s": "two\nlines <b>", "e": "y"})))),
    ("<think>Let me check.</think>" + _glm("get_weather", location="Paris"),  # Ollama's GLM-4.6 ground truth
     Parsed("<think>Let me check.</think>", _calls(("get_weather", {"location": "Paris"})))),
    ("Two calls:\n" + _glm("f", i="1") + "\n" + _glm("g"), Parsed("Two calls:", _calls(("f", {"i": 1}), ("g", {})))),
    ("<tool_call>f\nloose text\n</tool_call>", Parsed("<tool_call>f\nloose text\n</tool_call>", ())),
    (_glm("f", i="1").removesuffix("</tool_call>"), Parsed(None, _calls(("f", {"i": 1})))),  # its end never came
    (_glm("f", i="1").removesuffix("call>"), Parsed(None, _calls(("f", {"i": 1})))),  # or only its start
    ("<tool_call>\n<arg_key>s</arg_key><arg_value>x</arg_value></tool_call>",  # no name
     Parsed("<tool_call>\n<arg_key>s</arg_key><arg_value>x</arg_value></tool_call>", ())),
    # a key ends at its first </arg_key>: text after it is not more of the key
    ("<tool_call>f<arg_key>s</arg_key>junk</arg_key><arg_value>x</arg_value></tool_call>",
     Parsed("<tool_call>f<arg_key>s</arg_key>junk</arg_key><arg_value>x</arg_value></tool_call>", ())),
]


@pytest.mark.parametrize("fmt", [GLM, GLM_COMPACT])
@pytest.mark.parametrize(("text", "expected"), GLM_CASES)
def test_parse_glm_types_each_value_by_its_schema(fmt: str, text: str, expected: Parsed) -> None:
    """GLM's calls, with or without the newlines, read as the xml format's: each value typed by its schema."""
    assert parse(fmt, text, schemas=SCHEMAS) == expected
    stream = ToolStream(fmt, schemas=SCHEMAS)
    sent = "".join(stream.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, calls = stream.finish()
    assert (sent + rest, calls) == (expected.content or "", expected.calls)


def _minimax(*invokes: tuple[str, dict[str, str]]) -> str:
    """One block of calls as MiniMax-M2's template writes them."""
    calls = "".join(f'<invoke name="{name}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n'
                                                           for k, v in values.items()) + "</invoke>\n"
                    for name, values in invokes)
    return f"<minimax:tool_call>\n{calls}</minimax:tool_call>"


MINIMAX_CASES = [
    (_minimax(("f", {"s": "12", "i": "12", "n": "1.5", "b": "true", "o": '{"k": [1]}', "a": "[1, 2]"})),
     Parsed(None, _calls(("f", {"s": "12", "i": 12, "n": 1.5, "b": True, "o": {"k": [1]}, "a": [1, 2]})))),
    ("<think>Two lookups.</think>\nLet me look.\n" + _minimax(("f", {"s": "two\nlines <b>"}), ("g", {"i": "3"})),
     Parsed("<think>Two lookups.</think>\nLet me look.", _calls(("f", {"s": "two\nlines <b>"}), ("g", {"i": "3"})))),
    (_minimax(("f", {"e": "x"})) + "\n" + _minimax(("g", {})), Parsed(None, _calls(("f", {"e": "x"}), ("g", {})))),
    ('<minimax:tool_call><invoke name="f"><parameter name="i">7</parameter></invoke></minimax:tool_call>',
     Parsed(None, _calls(("f", {"i": 7})))),  # written without the newlines
    ('<minimax:tool_call>\n<invoke name="f">\nloose text\n</invoke>\n</minimax:tool_call>',
     Parsed('<minimax:tool_call>\n<invoke name="f">\nloose text\n</invoke>\n</minimax:tool_call>', ())),
    ('<minimax:tool_call>\ntext beside <invoke name="f">\n</invoke>\n</minimax:tool_call>',
     Parsed('<minimax:tool_call>\ntext beside <invoke name="f">\n</invoke>\n</minimax:tool_call>', ())),
    (_minimax(("f", {})).replace("</minimax:tool_call>", ""),  # never closed
     Parsed(_minimax(("f", {})).replace("</minimax:tool_call>", ""), ())),
]


@pytest.mark.parametrize(("text", "expected"), MINIMAX_CASES)
def test_parse_minimax_types_each_value_by_its_schema(text: str, expected: Parsed) -> None:
    """MiniMax-M2's calls, several invokes to a block, each value typed by its schema as the xml format's; a stream
    of them sends the same content and nothing of a call."""
    assert parse(MINIMAX, text, schemas=SCHEMAS) == expected
    for pieces in _chunkings(text):
        stream = ToolStream(MINIMAX, schemas=SCHEMAS)
        sent = "".join(stream.feed(piece) for piece in pieces)
        rest, calls = stream.finish()
        assert (sent + rest, calls) == (expected.content or "", expected.calls)
        assert not expected.calls or "<minimax" not in sent


# the functions the call grammars are tried with: one with a required string, an integer and an enum, one bare
FUNCTIONS = [{"name": "f", "parameters": {"type": "object", "properties": {"s": {"type": "string"},
                                                                          "i": {"type": "integer"},
                                                                          "e": {"type": "string", "enum": ["x", "y"]}},
                                          "required": ["s"]}}, {"name": "g"}]


def _admits(grammar: str, text: str) -> bool:
    """Whether tiny-qwen3's tokens of ``text`` pass ``grammar`` to its end."""
    from pathlib import Path

    import kestrel_core

    model = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-qwen3"
    with kestrel_core.load(str(model), backend="cpu") as engine:
        constraint = engine.constraint(grammar)
        for token in engine.tokenizer.encode(text, add_special_tokens=False):
            if not constraint.allowed()[token]:
                return False
            constraint.accept(token)
        return bool(constraint.allowed()[constraint.eos])


@pytest.mark.parametrize("fmt", [GLM, GLM_COMPACT])
def test_a_glm_grammar_admits_the_calls_parse_reads_and_no_others(fmt: str) -> None:
    """tool_choice "required" in GLM's format, spelled as the template writes it: a string value up to
    </arg_value>, JSON of the other types, the required parameters always, the functions offered only."""
    from kestrel_core.serve.tool_grammar import call_grammar

    compact = fmt == GLM_COMPACT
    schemas = {f["name"]: f.get("parameters") or {} for f in FUNCTIONS}
    grammar = call_grammar(fmt, FUNCTIONS, many=True)
    between = "" if compact else "\n"
    good = [_glm("f", compact, s="New York <b>", i="3", e="y"),
            _glm("f", compact, s="x") + between + _glm("g", compact)]
    for text in good:
        assert _admits(grammar, text) and parse(fmt, text, schemas=schemas).calls, text
    other = _glm("f", not compact, s="x")  # the other spelling
    for bad in (_glm("f", compact, i="3"), _glm("f", compact, s="x", i="three"), _glm("h", compact),
                _glm("f", compact, s="x") + " and text", _glm("f", compact, s="x", e="z"), other):
        assert not _admits(grammar, bad), bad


def test_an_xml_grammar_admits_the_calls_parse_reads_and_no_others() -> None:
    """tool_choice "required" in Qwen3.5's format: the grammar takes any string value up to </parameter>, JSON of
    the other types, the required parameters always, the functions offered only; what it admits parses back."""
    from kestrel_core.serve.tool_grammar import call_grammar

    schemas = {f["name"]: f.get("parameters") or {} for f in FUNCTIONS}
    grammar = call_grammar(XML, FUNCTIONS, many=True)
    for text in (_xml("f", s="New York <b>", i="3", e="y"), _xml("f", s="x") + "\n" + _xml("g")):
        assert _admits(grammar, text) and parse(XML, text, schemas=schemas).calls, text
    for bad in (_xml("f", i="3"), _xml("f", s="x", i="three"), _xml("h"), _xml("f", s="x") + " and text",
                _xml("f", s="x", e="z")):
        assert not _admits(grammar, bad), bad


def test_a_minimax_grammar_admits_the_calls_parse_reads_and_no_others() -> None:
    """tool_choice "required" in MiniMax-M2's format: a string value up to </parameter>, JSON of the other types, the
    required parameters always, the functions offered only; what it admits parses back."""
    from kestrel_core.serve.tool_grammar import call_grammar

    schemas = {f["name"]: f.get("parameters") or {} for f in FUNCTIONS}
    grammar = call_grammar(MINIMAX, FUNCTIONS, many=True)
    for text in (_minimax(("f", {"s": "New York <b>", "i": "3", "e": "y"})),
                 _minimax(("f", {"s": "x"})) + "\n" + _minimax(("g", {}))):
        assert _admits(grammar, text) and parse(MINIMAX, text, schemas=schemas).calls, text
    for bad in (_minimax(("f", {"i": "3"})), _minimax(("f", {"s": "x", "i": "three"})), _minimax(("h", {})),
                _minimax(("f", {"s": "x"})) + " and text", _minimax(("f", {"s": "x", "e": "z"}))):
        assert not _admits(grammar, bad), bad


def test_a_mistral_args_grammar_admits_the_calls_parse_reads_and_no_others() -> None:
    """tool_choice "required" in the newer Mistral templates' spelling: each call its own [TOOL_CALLS], a name,
    [ARGS] and JSON its schema accepts; what it admits parses back."""
    from kestrel_core.serve.tool_grammar import call_grammar

    grammar = call_grammar(MISTRAL_ARGS, FUNCTIONS, many=True)
    good = ['[TOOL_CALLS]f[ARGS]{"s": "x", "i": 3, "e": "y"}', '[TOOL_CALLS]f[ARGS]{"s": "x"}[TOOL_CALLS]g[ARGS]{}']
    for text in good:
        assert _admits(grammar, text) and parse(MISTRAL_ARGS, text).calls, text
    for bad in ('[TOOL_CALLS][{"name": "g", "arguments": {}}]', '[TOOL_CALLS]f[ARGS]{"i": 3}', "[TOOL_CALLS]h[ARGS]{}",
                '[TOOL_CALLS]g[ARGS]{} and text', 'g[ARGS]{}'):
        assert not _admits(grammar, bad), bad
    assert not _admits(call_grammar(MISTRAL_ARGS, FUNCTIONS, many=False), good[1])
    tokens = call_grammar(MISTRAL_ARGS, FUNCTIONS, many=False, control_ids={"[TOOL_CALLS]": 9, "[ARGS]": 32})
    assert '<[9]> "g" <[32]> args1' in tokens  # the control tokens the vocabulary has


@pytest.mark.parametrize("name", ["ns.get_weather", "get weather", "météo"])
def test_a_forced_mistral_args_call_of_a_name_beyond_letters_and_digits_parses_back(name: str) -> None:
    """The grammar spells any function's name; parse reads it back whole (as vLLM's parser: up to its [ARGS])."""
    from kestrel_core.serve.tool_grammar import call_grammar

    text = f'[TOOL_CALLS]{name}[ARGS]{{"x": 1}}'
    assert _admits(call_grammar(MISTRAL_ARGS, [{"name": name, "parameters": {"type": "object"}}], many=True), text)
    assert parse(MISTRAL_ARGS, text) == Parsed(None, _calls((name, {"x": 1})))


def test_an_apriel_grammar_admits_the_calls_parse_reads_and_no_others() -> None:
    """tool_choice "required" in Apriel's format: one <tool_calls> block of a list of calls, as its template writes
    an earlier turn's, each of an offered function with arguments its schema accepts; what it admits parses back."""
    from kestrel_core.serve.tool_grammar import call_grammar

    grammar = call_grammar(APRIEL, FUNCTIONS, many=True)
    good = ['<tool_calls>[{"name": "f", "arguments": {"s": "x", "i": 3, "e": "y"}}]</tool_calls>',
            '<tool_calls>[{"name": "f", "arguments": {"s": "x"}}, {"name": "g", "arguments": {}}]</tool_calls>']
    for text in good:
        assert _admits(grammar, text) and parse(APRIEL, text).calls, text
    for bad in ('<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
                '<tool_calls>{"name": "g", "arguments": {}}</tool_calls>',
                '<tool_calls>[{"name": "f", "arguments": {"i": 3}}]</tool_calls>',
                '<tool_calls>[{"name": "h", "arguments": {}}]</tool_calls>',
                '<tool_calls>[{"name": "g", "arguments": {}}]</tool_calls> and text'):
        assert not _admits(grammar, bad), bad
    assert not _admits(call_grammar(APRIEL, FUNCTIONS, many=False), good[1])


TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "templates"


@pytest.mark.parametrize("name", ["unsloth-Apriel-1.5.jinja", "Apriel-1.6-15b-Thinker-fixed.jinja"])
def test_apriels_calls_are_read_as_its_real_template_writes_them(name: str) -> None:
    """Apriel 1.5's and 1.6's templates teach the apriel format; an earlier turn's calls, as each writes them (with
    their ids), parse back to those calls, its text before them the content."""
    source = (TEMPLATES / name).read_text()
    assert tool_format(source) == APRIEL
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
             {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]
    messages = [{"role": "user", "content": "Weather and time?"},
                {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
                {"role": "tool", "content": "22 C"}, {"role": "tool", "content": "noon"}]
    tools = [{"type": "function", "function": {"name": c["function"]["name"], "parameters": {"type": "object"}}}
             for c in calls]
    prompt = render_chat(compile_chat_template(source), messages, True, tools=tools, bos_token="", eos_token="")
    start = prompt.index("Let me look.")
    turn = prompt[start:prompt.index("</tool_calls>", start) + len("</tool_calls>")]
    assert '"id": "call_1"' in turn  # an earlier turn's calls carry their ids
    assert parse(APRIEL, turn) == Parsed("Let me look.", _calls(("get_weather", {"city": "Paris"}), ("get_time", {})))


def test_a_hermes_string_argument_may_hold_the_closing_tag() -> None:
    """The call grammar admits any JSON string, "</tool_call>" included (a sampled answer wrote one): the block
    ends where its JSON does."""
    from kestrel_core.serve.tool_grammar import call_grammar

    args = {"city": "+s1}}</tool_call>-<tool_call>get_weather"}
    text = "<tool_call>\n" + json.dumps({"name": "f", "arguments": args}, ensure_ascii=False) + "\n</tool_call>"
    assert _admits(call_grammar(HERMES, [{"name": "f"}], many=False), text)
    assert parse(HERMES, "Sure. " + text + " Done.") == Parsed("Sure.  Done.", _calls(("f", args)))
    for bad in (text.replace("}\n</tool_call>", "\n</tool_call>"), text + "<tool_call>{}"):
        assert parse(HERMES, bad) == Parsed(bad, ()), bad
    assert parse(HERMES, text.replace("\n</tool_call>", "")) == Parsed(None, _calls(("f", args)))  # cut before it


def test_parallel_off_keeps_the_first_call() -> None:
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert parse(HERMES, text, parallel=False) == Parsed(None, _calls(("f", {})))


def _chunkings(text: str) -> list[list[str]]:
    sizes = [1, 2, 3, 7, len(text) or 1]
    return [[text[i:i + n] for i in range(0, len(text), n)] for n in sizes]


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES + [
    (HERMES, "Ends in a half marker <tool_ca", Parsed("Ends in a half marker <tool_ca", ())),
    (XML, "Sure: " + _xml("f", x="1"), Parsed("Sure:", _calls(("f", {"x": "1"})))),
    (XML, "Sure: " + _bare("f", x="1"), Parsed("Sure:", _calls(("f", {"x": "1"})))),
    (XML, "Sure: " + _xml("f", x="1").removesuffix("</tool_call>"), Parsed("Sure:", _calls(("f", {"x": "1"})))),
    (HERMES, "Spaces at the end   \n", Parsed("Spaces at the end   \n", ())),
    (LLAMA3, "   \n  ", Parsed("   \n  ", ())),
])
def test_a_stream_sends_what_the_whole_answer_has(fmt: str, text: str, expected: Parsed) -> None:
    """However the text arrives, the content sent as it comes plus the rest at the end is the whole answer's
    content, the calls are its calls, and nothing of a call is ever sent as content."""
    for pieces in _chunkings(text):
        stream = ToolStream(fmt)
        sent = ""
        for piece in pieces:
            sent += stream.feed(piece)
            assert (expected.content or "").startswith(sent)
            if expected.calls:
                assert "<tool_call" not in sent and "[{" not in sent and not sent.lstrip().startswith("{")
                assert "[TOOL_CALLS]" not in sent and "<function=" not in sent
        rest, calls = stream.finish()
        assert (sent + rest, calls) == (expected.content or "", expected.calls)


def test_a_stream_sends_text_as_soon_as_it_cannot_begin_a_call() -> None:
    stream = ToolStream(HERMES)
    assert stream.feed("Hello <to") == "Hello"
    assert stream.feed("ken> there ") == " <token> there"
    assert stream.feed("<tool_call>{") == ""
    llama = ToolStream(LLAMA3)
    assert llama.feed("  ") == "" and llama.feed("Hi") == "  Hi"


def test_call_ids() -> None:
    for fmt in (MISTRAL, MISTRAL_ARGS):
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call_id(fmt))  # Mistral's templates check for nine
    ids = {call_id(HERMES) for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    calls = ToolCalls(LLAMA3).message_calls(_calls(("f", {"x": 1})))
    assert calls[0]["type"] == "function" and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}


@pytest.mark.parametrize("fmt", [LLAMA3, MISTRAL])
def test_plain_json_is_a_call_only_of_an_offered_function_with_its_arguments(fmt: str) -> None:
    """An answer of JSON content (a response_format's object) that has a "name" is not a call of a function
    nobody offered, nor an object without the arguments' key."""
    key = "arguments" if fmt == MISTRAL else "parameters"
    wrap = (lambda t: f"[{t}]") if fmt == MISTRAL else (lambda t: t)
    offered = {"get_weather": {"type": "object"}}
    for text in (wrap('{"name": "Bob", "age": 42}'), wrap('{"name": "get_weather"}'),
                 wrap(f'{{"name": "Bob", "{key}": {{}}}}')):
        assert parse(fmt, text, schemas=offered) == Parsed(text, ())
        stream = ToolStream(fmt, schemas=offered)
        assert "".join(stream.feed(text[i:i + 4]) for i in range(0, len(text), 4)) + stream.finish()[0] == text
    call = wrap(f'{{"name": "get_weather", "{key}": {{"city": "Paris"}}}}')
    assert parse(fmt, call, schemas=offered) == Parsed(None, (ToolCall("get_weather", '{"city": "Paris"}'),))


def _pydantic_tools() -> list[dict]:
    """openai's pydantic_function_tool of a model with an enum and a nested model: its parameters name both
    through $ref and $defs, as every such model's do."""
    import enum

    import openai
    import pydantic

    class Unit(str, enum.Enum):
        kg = "kg"
        lb = "lb"

    class Address(pydantic.BaseModel):
        city: str

    class Ship(pydantic.BaseModel):
        to: Address
        unit: Unit
        n: int

    return [openai.pydantic_function_tool(Ship)["function"], {"name": "g"}]


@pytest.mark.parametrize("fmt", [HERMES, APRIEL, LLAMA3, MISTRAL, XML, GLM, MINIMAX])
def test_a_forced_call_of_a_pydantic_model_with_refs_takes_its_definitions(fmt: str) -> None:
    """The definitions stay reachable from the grammar's root, which is not the function's schema; the markup
    formats type a model's value as the object it is."""
    from kestrel_core.serve.tool_grammar import call_grammar

    functions = _pydantic_tools()
    assert "$defs" in functions[0]["parameters"]
    grammar = call_grammar(fmt, functions, many=False)
    args, wrong = {"to": {"city": "Paris"}, "unit": "kg", "n": 3}, {"to": {"city": "Paris"}, "unit": "oz", "n": 3}
    if fmt in (XML, GLM, MINIMAX):
        write = {XML: lambda a: _xml("Ship", **a), GLM: lambda a: _glm("Ship", **a),
                 MINIMAX: lambda a: _minimax(("Ship", a))}[fmt]
        good, bad = (write({k: json.dumps(v) if isinstance(v, dict) else str(v) for k, v in a.items()})
                     for a in (args, wrong))
    else:
        key = "parameters" if fmt == LLAMA3 else "arguments"
        good, bad = (json.dumps({"name": "Ship", key: a}) for a in (args, wrong))
        if fmt == HERMES:
            good, bad = (f"<tool_call>\n{t}\n</tool_call>" for t in (good, bad))
        elif fmt == MISTRAL:
            good, bad = (f"[TOOL_CALLS][{t}]" for t in (good, bad))
        elif fmt == APRIEL:
            good, bad = (f"<tool_calls>[{t}]</tool_calls>" for t in (good, bad))
    assert _admits(grammar, good) and not _admits(grammar, bad)
    call = parse(fmt, good, schemas={f["name"]: f.get("parameters") or {} for f in functions}).calls[0]
    assert (call.name, json.loads(call.arguments)) == ("Ship", args)


@pytest.mark.parametrize("fmt", [HERMES, APRIEL, LLAMA3, MISTRAL, XML])
def test_a_call_nested_past_the_json_parsers_depth_is_text(fmt: str) -> None:
    """A model that writes thousands of "[" is answered with that text, not a 500 (RecursionError)."""
    deep = "[" * 100_000
    text = {HERMES: f"<tool_call>\n{{\"name\": \"f\", \"arguments\": {{\"a\": {deep}}}}}\n</tool_call>",
            APRIEL: f"<tool_calls>[{{\"name\": \"f\", \"arguments\": {{\"a\": {deep}}}}}]</tool_calls>",
            LLAMA3: f"{{\"name\": \"f\", \"parameters\": {{\"a\": {deep}}}}}",
            MISTRAL: f"[TOOL_CALLS][{{\"name\": \"f\", \"arguments\": {deep}}}]",
            XML: _xml("f", i=deep)}[fmt]
    schemas = {"f": {"type": "object", "properties": {"i": {"type": "array"}}}}
    assert parse(fmt, text, schemas=schemas) == Parsed(text, ())
