"""Tool calls in chat completions: the model's chat template renders the tools a request offers, and the calls
the model writes are read back out of its text in the format that template teaches it.

``tool_format(template)`` names the format from the template's source: ``hermes`` (Qwen2.5, Qwen3, Hermes:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, anywhere in the answer), ``xml`` (Qwen3.5,
Qwen3-Coder: ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`` blocks, each
value read as its parameter's JSON Schema type says), ``glm`` (GLM-4.5: ``<tool_call>NAME`` then
``<arg_key>KEY</arg_key><arg_value>value</arg_value>`` pairs, typed the same way, each on a line of its own;
``glm-compact``: GLM-4.7's, the same without the newlines), ``minimax`` (MiniMax-M2: ``<minimax:tool_call>``
blocks of ``<invoke name="NAME"><parameter name="KEY">value</parameter>...</invoke>`` calls, typed the same way),
``apriel`` (ServiceNow's Apriel 1.5 and 1.6: ``<tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>``
blocks of a JSON list, anywhere in the answer), ``mistral`` (``[TOOL_CALLS]`` then a JSON list of ``{"name",
"arguments"}``: the control token is not text, so the answer starts with the list), ``mistral-args`` (Mistral's
newer templates, which write ``[ARGS]``: each call ``[TOOL_CALLS]NAME[ARGS]{...}``, anywhere in the answer, the
request keeping the control tokens' text),
``cohere`` (Command R7B, Command A: ``<|START_ACTION|>[{"tool_call_id": "0", "tool_name": ..., "parameters":
{...}}, ...]<|END_ACTION|>`` blocks of a JSON list, their tags special tokens, as llama.cpp's command_r7b parser reads
them), ``command-r`` (the older Command R and R+: ``Action: ```json [{"tool_name": ..., "parameters": {...}}, ...]```
``, as Ollama reads it), ``llama3`` (Llama 3.1+: the answer is ``{"name": ..., "parameters": {...}}``, several
separated by ``;``) or ``harmony`` (gpt-oss: a message to ``functions.NAME``, read with the answer's channels by
kestrel_core.model.harmony); None where the template never reads ``tools``. ``parse`` splits a whole answer into its
content and its calls; ``ToolStream`` does the same for a stream, sending content as soon as it cannot be the start
of a call. An answer whose calls do not parse (bad JSON, a missing name) is content, as it came. The grammars that
force calls in these formats are serve/tool_grammar.py's.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Container, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jinja2
import jinja2.meta

from kestrel_core.model.chat_template import TEMPLATE_EXTENSIONS
from kestrel_core.model.detokenize import partial_suffix
from kestrel_core.model.harmony import STRICT_JSON, ToolCall, finite_float, is_harmony

HERMES, XML, GLM, GLM_COMPACT, MINIMAX, APRIEL, MISTRAL, MISTRAL_ARGS, COHERE, COMMAND_R, LLAMA3, HARMONY = (
    "hermes", "xml", "glm", "glm-compact", "minimax", "apriel", "mistral", "mistral-args", "cohere", "command-r",
    "llama3", "harmony")
UNKNOWN = "unknown"
MISTRAL_FORMATS = (MISTRAL, MISTRAL_ARGS)  # their templates take nine-character call ids
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"  # Mistral's control tokens
START_ACTION, END_ACTION = "<|START_ACTION|>", "<|END_ACTION|>"  # Cohere's special tokens
# the special tokens each format spells its calls with, which a forced call's grammar names by id where the vocabulary
# has them; the formats whose answers must keep special tokens' text for their calls to be read
CONTROL_TOKENS = {MISTRAL: (TOOL_CALLS, ARGS), MISTRAL_ARGS: (TOOL_CALLS, ARGS), COHERE: (START_ACTION, END_ACTION)}
SPECIAL_TEXT_FORMATS = (MISTRAL_ARGS, COHERE)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
APRIEL_OPEN, APRIEL_CLOSE = "<tool_calls>", "</tool_calls>"
# a block's tags, by format; those whose block holds a list of calls, and the keys of a call's name and arguments
_JSON_BLOCK = {HERMES: (HERMES_OPEN, HERMES_CLOSE), APRIEL: (APRIEL_OPEN, APRIEL_CLOSE),
               COHERE: (START_ACTION, END_ACTION)}
_LIST_BLOCKS = (APRIEL, COHERE)
COHERE_NAME, COHERE_ARGUMENTS = "tool_name", "parameters"  # Cohere's formats' keys of a call's name and arguments
# the older Command R's list of calls: its opening, and the code fence after the list
COMMAND_R_OPEN, _COMMAND_R_ACTION, FENCE = "Action:", re.compile(r"Action:\s*```(?:json)?\s*"), "```"
MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
_SPACE = re.compile(r"\s*")
# a block, or the last one where its end never comes or is cut short (as vLLM's qwen3_coder parser reads it)
_CLOSE_START = "|".join(re.escape(HERMES_CLOSE[:k]) for k in range(len(HERMES_CLOSE) - 1, 0, -1))
_HERMES_BLOCK = re.compile(f"{re.escape(HERMES_OPEN)}(.*?)(?:{re.escape(HERMES_CLOSE)}|(?:{_CLOSE_START})?\\Z)",
                           re.DOTALL)
# an invoke's and a parameter's opening (the name or key its group), each running to its closing tag
_MINIMAX_INVOKE = re.compile(r'<invoke name="([^">\n]+)">')
_MINIMAX_PARAMETER = re.compile(r'<parameter name="([^">\n]+)">')
# a mistral-args call's head after its [TOOL_CALLS]: the name (up to the next "[" or "{", as vLLM's mistral parser
# reads it: a forced call spells any name), the id some templates write, [ARGS] (vLLM reads a call without it too)
_MISTRAL_HEAD = re.compile(r"([^\[{]*)(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?\s*")
XML_FUNCTION, GLM_KEY, GLM_COMPACT_PAIR = "<function=", "<arg_key>", "</arg_key><arg_value>"
# a block's (function name, its parameters' text) and each parameter's (key, value), by format
_GLM_CALL = re.compile(r"\s*([^<\n]+)(.*)", re.DOTALL)
_CALL = {XML: re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL), GLM: _GLM_CALL,
         GLM_COMPACT: _GLM_CALL}


@dataclass(frozen=True)
class _Tagged:
    """How a format spells a tagged value: its opening (its group the key: a parameter's, an invoke's name), the
    tag that closes it (its first after the opening), and whether one newline is trimmed from each end of it."""

    opening: re.Pattern[str]
    closing: str
    trimmed: bool = True


_GLM_PARAMETER = _Tagged(re.compile(r"<arg_key>((?:(?!</arg_key>).)*)</arg_key>\s*<arg_value>", re.DOTALL),
                         "</arg_value>", trimmed=False)
_PARAMETER = {XML: _Tagged(re.compile(r"<parameter=([^>\n]+)>"), "</parameter>"), GLM: _GLM_PARAMETER,
              GLM_COMPACT: _GLM_PARAMETER}
_MINIMAX_INVOKES = _Tagged(_MINIMAX_INVOKE, "</invoke>", trimmed=False)
_MINIMAX_PARAMETERS = _Tagged(_MINIMAX_PARAMETER, "</parameter>")
# calls in blocks anywhere in the answer, by how a block opens
_BLOCK_OPEN = {HERMES: (HERMES_OPEN,), **{fmt: (HERMES_OPEN,) for fmt in _CALL}, XML: (HERMES_OPEN, XML_FUNCTION),
               MINIMAX: (MINIMAX_OPEN,), APRIEL: (APRIEL_OPEN,), MISTRAL_ARGS: (TOOL_CALLS,), COHERE: (START_ACTION,),
               COMMAND_R: (COMMAND_R_OPEN,)}
_OPENERS = {MISTRAL: "[", LLAMA3: "{"}  # formats whose answer is the calls alone, and how the calls start
_ID_CHARS = string.ascii_letters + string.digits


def tool_format(template: str | None) -> str | None:
    """The tool-call format the chat template ``template`` teaches: None if it does not render ``tools``,
    UNKNOWN if it does in a format kestrel cannot read."""
    if not template:
        return None
    try:
        env = jinja2.Environment(extensions=list(TEMPLATE_EXTENSIONS))
        reads = jinja2.meta.find_undeclared_variables(env.parse(template))
    except (jinja2.TemplateError, RecursionError, MemoryError):  # nested past the parser's depth too
        return None  # the sandbox compiles it again and says what is wrong
    if "tools" not in reads:
        return None
    if is_harmony(template):  # gpt-oss: a call is a message to functions.NAME (kestrel_core.model.harmony)
        return HARMONY
    if MINIMAX_OPEN in template:
        return MINIMAX
    if START_ACTION in template:  # Command R7B's and Command A's, whose prose says "Action:" too
        return COHERE
    if APRIEL_OPEN in template:  # Apriel's list of calls in one block, which its prose may call <tool_call>
        return APRIEL
    if HERMES_OPEN in template:
        if GLM_KEY in template:
            return GLM_COMPACT if GLM_COMPACT_PAIR in template else GLM
        return XML if XML_FUNCTION in template else HERMES
    if TOOL_CALLS in template:
        return MISTRAL_ARGS if ARGS in template else MISTRAL
    if "<|start_header_id|>" in template:
        return LLAMA3
    if COMMAND_R_OPEN in template and f'"{COHERE_NAME}"' in template:
        return COMMAND_R
    return UNKNOWN


def call_id(fmt: str) -> str:
    """A new tool call's id: Mistral's templates take nine letters and digits, the others OpenAI's shape."""
    if fmt in MISTRAL_FORMATS:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class Parsed:
    """An answer split: its content (None when only calls remain) and its calls (none: it is all content);
    ``spans``: where the content's text is in the answer, in order."""

    content: str | None
    calls: tuple[ToolCall, ...]
    spans: tuple[tuple[int, int], ...] = field(default=(), compare=False)


def _around(text: str, cuts: Sequence[tuple[int, int]], calls: tuple[ToolCall, ...]) -> Parsed:
    """The answer ``text`` whose ``calls`` take the stretches ``cuts`` (in order): its content is the rest, less the
    whitespace at its end."""
    spans, at = [], 0
    for start, end in (*cuts, (len(text), len(text))):
        if start > at:
            spans.append((at, start))
        at = end
    while spans:
        start, end = spans.pop()
        end = start + len(text[start:end].rstrip())
        if end > start:
            spans.append((start, end))
            break
    content = "".join(text[start:end] for start, end in spans)
    return Parsed(content or None, calls, tuple(spans))


def _call(obj: Any, keys: tuple[str, ...], name: str = "name") -> ToolCall | None:
    """``{name: str, <one of keys>: {...}}`` (the arguments may also be a JSON object's text) as a ToolCall."""
    if not isinstance(obj, dict) or not isinstance(obj.get(name), str) or not obj[name]:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = STRICT_JSON.decode(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj[name], json.dumps(args, ensure_ascii=False))


def _calls(values: list[Any], keys: tuple[str, ...], name: str = "name") -> tuple[ToolCall, ...] | None:
    calls = [_call(v, keys, name) for v in values]
    return None if not calls or None in calls else tuple(c for c in calls if c is not None)


def _cohere_calls(values: list[Any]) -> tuple[ToolCall, ...] | None:
    return _calls(values, (COHERE_ARGUMENTS,), COHERE_NAME)


def _json_blocks(text: str, fmt: str) -> Parsed | None:
    """The calls in hermes' blocks (a call each) or Apriel's and Cohere's (a list of calls each, Cohere's with its
    own keys): each block's JSON read by the JSON decoder, not up to the first closing tag, which a string in the
    arguments may hold (the call grammar admits it); the last block's closing tag may never come, or only its start
    (a stop string or the answer's end cut it: vLLM's hermes parser reads such a call too)."""
    opener, closer = _JSON_BLOCK[fmt]
    listed = fmt in _LIST_BLOCKS
    values, cuts, at = [], [], 0
    while (start := text.find(opener, at)) >= 0:
        try:
            value, end = STRICT_JSON.raw_decode(text, _SPACE.match(text, start + len(opener)).end())
        except ValueError:
            return None
        close = _SPACE.match(text, end).end()
        if not closer.startswith(text[close:close + len(closer)]) or listed and not isinstance(value, list):
            return None
        values.extend(value if listed else [value])
        at = min(close + len(closer), len(text))
        cuts.append((start, at))
    calls = _cohere_calls(values) if fmt == COHERE else _calls(values, ("arguments",))
    return None if calls is None else _around(text, cuts, calls)


def _command_r(text: str) -> Parsed | None:
    """The older Command R's calls: ``Action:``, a json code fence and a JSON list of calls, the fence's end (which
    may never come, where the answer was cut); the text before and after it is the content."""
    action = _COMMAND_R_ACTION.search(text)
    if action is None:
        return None
    try:
        values, end = STRICT_JSON.raw_decode(text, action.end())
    except ValueError:
        return None
    close = _SPACE.match(text, end).end()
    if text.startswith(FENCE, close):
        close += len(FENCE)
    elif close < len(text):
        return None
    calls = _cohere_calls(values) if isinstance(values, list) else None
    return None if calls is None else _around(text, [(action.start(), close)], calls)


def _mistral_args(text: str) -> Parsed | None:
    """The calls from the first ``[TOOL_CALLS]`` to the answer's end, each its own ``[TOOL_CALLS]``, a name and
    its arguments' JSON; the text before them is the content."""
    start = text.find(TOOL_CALLS)
    if start < 0:
        return None
    values, at = [], start
    while text.startswith(TOOL_CALLS, at):
        head = _MISTRAL_HEAD.match(text, at + len(TOOL_CALLS))
        name = head.group(1).strip() if head is not None else ""
        if head is None or not name:
            return None
        try:
            arguments, end = STRICT_JSON.raw_decode(text, head.end())
        except ValueError:
            return None
        values.append({"name": name, "arguments": arguments})
        at = _SPACE.match(text, end).end()
    calls = _calls(values, ("arguments",))
    if at < len(text) or calls is None:
        return None  # text after the calls
    return _around(text, [(start, len(text))], calls)


def _typed_blocks(text: str, fmt: str, schemas: dict[str, Any]) -> Parsed | None:
    """The blocks of the xml or glm format: each a function and its parameters, the values typed by ``schemas``
    (function name -> its parameters' JSON Schema). An xml answer without blocks may hold its functions bare, from
    the first ``<function=`` to its end (Qwen3-Coder may leave out ``<tool_call>``, as vLLM's qwen3_coder parser
    reads it)."""
    blocks = list(_HERMES_BLOCK.finditer(text))
    bodies, cuts = [block.group(1) for block in blocks], [block.span() for block in blocks]
    if not bodies and fmt == XML and (start := text.find(XML_FUNCTION)) >= 0:
        bodies, cuts = re.split(f"(?={XML_FUNCTION})", text[start:])[1:], [(start, len(text))]
    calls = []
    for body in bodies:
        call = _CALL[fmt].fullmatch(body)
        if call is None:
            return None
        typed = _typed_call(call.group(1).strip(), call.group(2), _PARAMETER[fmt], schemas)
        if typed is None:
            return None
        calls.append(typed)
    return _around(text, cuts, tuple(calls)) if calls else None


def _tagged(body: str, tagged: _Tagged) -> list[tuple[str, str]] | None:
    """The (key, value) of each value spelled as ``tagged`` that ``body`` is made of, whitespace around them; None
    where other text stands beside them or a value never closes. One pass: a regular expression's search for them
    takes time quadratic (or worse) in an answer of openings that never close."""
    pairs, at = [], _SPACE.match(body).end()
    while at < len(body):
        opening = tagged.opening.match(body, at)
        end = body.find(tagged.closing, opening.end()) if opening is not None else -1
        if opening is None or end < 0:
            return None
        value = body[opening.end():end]
        if tagged.trimmed:
            value = value.removeprefix("\n").removesuffix("\n")
        pairs.append((opening.group(1), value))
        at = _SPACE.match(body, end + len(tagged.closing)).end()
    return pairs


def _typed_call(name: str, body: str, parameter: _Tagged, schemas: dict[str, Any]) -> ToolCall | None:
    """A call of function ``name`` whose ``body`` is its parameters alone (spelled as ``parameter``), its values
    typed by ``schemas``; None where the name is empty or text stands beside the parameters."""
    pairs = _tagged(body, parameter)
    if not name or pairs is None:
        return None  # text beside the parameters: not a call kestrel can read whole
    schema = schemas.get(name) or {}
    properties, defs = schema.get("properties") or {}, schema_defs(schema)
    arguments = {key.strip(): _typed(value, dereferenced(properties.get(key.strip()), defs), defs)
                 for key, value in pairs}
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _minimax_blocks(text: str, schemas: dict[str, Any]) -> Parsed | None:
    """MiniMax-M2's blocks: each one or more invokes of a function with its parameters, typed as the xml format's;
    a block runs to its first closing tag (where there is none, neither is there one for any later block)."""
    calls, cuts, at = [], [], 0
    while (start := text.find(MINIMAX_OPEN, at)) >= 0:
        end = text.find(MINIMAX_CLOSE, start + len(MINIMAX_OPEN))
        if end < 0:
            break
        invokes = _tagged(text[start + len(MINIMAX_OPEN):end], _MINIMAX_INVOKES)
        if invokes is None:
            return None  # text beside the calls
        for name, body in invokes:
            typed = _typed_call(name.strip(), body, _MINIMAX_PARAMETERS, schemas)
            if typed is None:
                return None
            calls.append(typed)
        at = end + len(MINIMAX_CLOSE)
        cuts.append((start, at))
    return _around(text, cuts, tuple(calls)) if calls else None


def _typed(value: str, schema: Any, defs: dict[str, Any]) -> Any:
    """A parameter's text as the type its JSON Schema gives (as vLLM's qwen3_coder parser reads it): a string where
    it says string or nothing, a number, a bool, JSON for the rest; the text itself where it does not convert.
    ``defs``: the definitions its ``$ref``s name."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string" or kind is None and not is_composite(schema, defs):
        return value
    text = value.strip()
    if text == "null":
        return None
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            number = finite_float(text)
            return int(number) if number.is_integer() and not any(c in text for c in ".eE") else number
        if kind == "boolean":
            return {"true": True, "false": False}[text.lower()]
        return STRICT_JSON.decode(text)
    except (ValueError, KeyError):
        return value


def is_composite(schema: Any, defs: dict[str, Any]) -> bool:
    """A schema without a top-level ``type`` whose values are JSON, not text: pydantic's Optional[int] (an
    ``anyOf`` of integer and null), an enum of numbers. One that admits a string (Optional[str]) is text, as
    a model writes a string's value."""
    if not isinstance(schema, dict):
        return False
    members = [dereferenced(m, defs) for k in ("anyOf", "oneOf", "allOf") for m in schema.get(k) or ()
               if isinstance(m, dict)]
    if members:
        kinds = [m.get("type") for m in members]
        return not any(k == "string" or isinstance(k, list) and "string" in k for k in kinds)
    values = schema.get("enum", [schema["const"]] if "const" in schema else [])
    return bool(values) and not all(isinstance(v, str) for v in values)


DEF_PREFIXES = ("#/$defs/", "#/definitions/")


def schema_defs(schema: Any) -> dict[str, Any]:
    """The definitions a function's parameters schema names with ``$ref`` (pydantic's ``$defs``; ``definitions``)."""
    if not isinstance(schema, dict):
        return {}
    return {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}


def dereferenced(schema: Any, defs: dict[str, Any]) -> Any:
    """``schema`` with a local ``$ref`` (a chain of them) replaced by the definition it names, its other keys kept:
    what a property of a pydantic model's type or enum says it is."""
    for _ in range(len(defs) + 1):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        name = next((ref[len(p):] for p in DEF_PREFIXES if isinstance(ref, str) and ref.startswith(p)), None)
        if name is None or not isinstance(defs.get(name), dict):
            return schema
        schema = {**defs[name], **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _leading_json(text: str, fmt: str, offered: Container[str] | None) -> Parsed | None:
    """The whole answer as calls: Mistral's list, or Llama 3's objects separated by ';'. An answer that is plain
    JSON is a call only where each object holds its arguments' key and names an ``offered`` function (None: any),
    so that JSON content that happens to have a "name" stays content."""
    rest = text.lstrip().removeprefix("[TOOL_CALLS]") if fmt == MISTRAL else text.lstrip()
    if not rest.startswith(_OPENERS[fmt]):
        return None
    values = []
    while rest:
        try:
            value, end = STRICT_JSON.raw_decode(rest)
        except ValueError:
            return None
        values.extend(value if fmt == MISTRAL and isinstance(value, list) else [value])
        rest = rest[end:].lstrip()
        if rest and (fmt == MISTRAL or not rest.startswith(";")):
            return None  # Mistral's list is the whole answer; Llama 3's calls are separated by ';'
        rest = rest.removeprefix(";").lstrip()
    keys = ("arguments",) if fmt == MISTRAL else ("parameters", "arguments")
    if not all(isinstance(v, dict) and any(k in v for k in keys) and (offered is None or v.get("name") in offered)
               for v in values):
        return None
    calls = _calls(values, keys)
    return None if calls is None else Parsed(None, calls)


def parse(fmt: str, text: str, parallel: bool = True, schemas: dict[str, Any] | None = None) -> Parsed:
    """``text`` (a whole answer) split into content and the calls in format ``fmt``; with ``parallel`` False
    only the first call is kept (OpenAI's ``parallel_tool_calls``); ``schemas``: each offered function's
    parameters' JSON Schema (the xml, glm and minimax formats type their values by them)."""
    try:
        parsed = (_json_blocks(text, fmt) if fmt in _JSON_BLOCK
                  else _typed_blocks(text, fmt, schemas or {}) if fmt in _CALL
                  else _minimax_blocks(text, schemas or {}) if fmt == MINIMAX
                  else _command_r(text) if fmt == COMMAND_R
                  else _mistral_args(text) if fmt == MISTRAL_ARGS else _leading_json(text, fmt, schemas))
    except RecursionError:  # JSON nested past the parser's depth: not a call kestrel reads
        parsed = None
    if parsed is None:
        return Parsed(text, (), ((0, len(text)),))
    return parsed if parallel else replace(parsed, calls=parsed.calls[:1])


class ToolStream:
    """One streamed choice's text in format ``fmt``: ``feed`` gives the content that can go out now, ``finish``
    the rest of the content and the calls. Content is held from where a call may begin; so is whitespace at its
    end, which a call's answer leaves out. Sent content is always the start of ``parse``'s content."""

    def __init__(self, fmt: str, parallel: bool = True, schemas: dict[str, Any] | None = None) -> None:
        self.fmt, self.parallel, self.schemas = fmt, parallel, schemas
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.holding = False  # a call may have begun: the rest is held to the end
        self.content: tuple[tuple[int, int], ...] | None = None  # once finished: where the content is in the text

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        if self.fmt in _BLOCK_OPEN:
            openers = _BLOCK_OPEN[self.fmt]
            start = min((i for i in (self.text.find(o, self.sent) for o in openers) if i >= 0), default=-1)
            self.holding = start >= 0
            end = start if self.holding else len(self.text) - partial_suffix(self.text, openers)
            end = len(self.text[:end].rstrip())
        else:
            head = self.text.lstrip()
            if self.sent == 0 and not head:
                return ""
            if self.sent == 0 and head.startswith(_OPENERS[self.fmt]):
                self.holding = True
                return ""
            end = len(self.text)
        out, self.sent = self.text[self.sent:max(end, self.sent)], max(end, self.sent)
        return out

    def spans(self) -> tuple[tuple[int, int], ...]:
        """Where the content is in the text: as far as it has gone out, or (finished) all of it."""
        return ((0, self.sent),) if self.content is None else self.content

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """(the content not yet sent, the calls) once the answer is whole."""
        parsed = parse(self.fmt, self.text, self.parallel, self.schemas)
        self.content = parsed.spans
        if not parsed.calls:
            return self.text[self.sent:], ()
        return (parsed.content or "")[self.sent:], parsed.calls


@dataclass(frozen=True)
class ToolCalls:
    """A request's tool calls: the format its answers write them in, whether several may come at once, each
    offered function's parameters' JSON Schema (by name: the xml and glm formats type their values by them), and
    whether ``tool_choice`` names the function (``named``)."""

    fmt: str
    parallel: bool = True
    schemas: dict[str, Any] = field(default_factory=dict)
    named: bool = False

    def finish_reason(self, reason: str | None) -> str | None:
        """The finish reason of an answer that made calls: "tool_calls" where the model stopped by itself, as
        OpenAI's and vLLM's answers say, except a named function's call, which they finish with "stop"."""
        return "tool_calls" if reason == "stop" and not self.named else reason

    def message_calls(self, calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
        """OpenAI's ``tool_calls`` of a message, each with a new id."""
        return [{"id": call_id(self.fmt), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def arguments_object(text: str) -> dict[str, Any]:
    """An OpenAI tool call's ``arguments`` (JSON text) as the object Ollama's and Anthropic's calls carry; {}
    where the text is not a JSON object."""
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
