"""OpenAI's harmony format, what gpt-oss answers in: messages of a channel, split by special tokens.

An answer (after the template's ``<|start|>assistant``) is a run of messages ``[<|start|>ROLE] HEADER
<|message|>BODY END``: the header names the channel (``<|channel|>analysis``, ``commentary`` or ``final``) and,
for a tool call, its recipient (``to=functions.NAME``, before or after the channel, with ``<|constrain|>json``);
END is ``<|end|>``, ``<|call|>`` or ``<|return|>``. The analysis channel is the reasoning, the final channel (and
commentary to no one: a preamble the user sees) the content, and a message to ``functions.NAME`` a call whose
arguments are its body; each message is a part of the answer (kestrel_core.model.parts: a chat message's reasoning
and its content are their parts' bodies a line apart, as vLLM joins them). Reading it needs the special tokens in
the text (``SamplingParams.skip_special_tokens`` False). ``parse`` reads a whole answer, ``HarmonyStream`` a
streamed one; an answer with no harmony message at all is content, as it came. ``json_grammar`` and
``call_grammar`` keep an answer to JSON or to a call (a JSON response format, a forced tool call) in harmony's own
shape: the analysis may come first, the final message or the call is constrained.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kestrel_core.model.detokenize import partial_suffix
from kestrel_core.model.grammar import lark_grammar, lark_json
from kestrel_core.model.parts import CALL, CONTENT, REASONING, Part, PartStream, joined

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


def is_harmony(template: str | None) -> bool:
    """Whether a chat template writes harmony (gpt-oss's)."""
    return bool(template) and CHANNEL in template and MESSAGE in template


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the function's name and its arguments as a JSON object's text (harmony's: a
    message to ``functions.NAME``, its body; the chat templates' formats, serve/tools.py)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class HarmonyAnswer:
    reasoning: str | None  # the analysis messages' bodies, a line apart; None: there were none
    content: str  # the final (and preamble) messages' bodies, a line apart
    calls: tuple[ToolCall, ...]
    parts: tuple[Part, ...]  # a part per message, in order (a call's: CALL)


def parse(text: str) -> HarmonyAnswer:
    """A whole answer's reasoning, content and calls."""
    answer, calls = _read(text, final=True)
    return HarmonyAnswer(joined(answer, REASONING), joined(answer, CONTENT) or "", tuple(calls), tuple(answer))


def _read(text: str, final: bool) -> tuple[list[Part], list[ToolCall]]:
    """The messages as parts, and the calls. A body still streaming (``final`` False) stops short of what may be
    the start of its end token; its message is not a call yet."""
    if MESSAGE not in text:  # not harmony (or, streaming, not yet: HarmonyStream holds a header back)
        return [Part(CONTENT, 0, len(text), text)], []
    answer: list[Part] = []
    calls: list[ToolCall] = []
    at = 0
    for segment in text.split(START):
        header, sep, body = segment.partition(MESSAGE)
        start = at + len(header) + len(sep)
        at += len(segment) + len(START)
        if not sep:
            continue  # a header still coming, or nothing
        ends = [i for i in (body.find(end) for end in ENDS) if i >= 0]
        complete = bool(ends)
        if complete:
            body = body[:min(ends)]
        elif not final:
            body = body[:len(body) - partial_suffix(body, ENDS)]
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        kind = CONTENT
        if recipient is not None:
            arguments = _arguments(body) if complete or final else None
            if arguments is not None:
                calls.append(ToolCall(recipient.group(1).removeprefix("functions."), arguments))
            if arguments is not None or not final:  # one that does not parse (or that max_tokens cut) is text,
                kind = CALL  # as the other formats' are
        elif channel is not None and channel.group(1) == "analysis":
            kind = REASONING
        answer.append(Part(kind, start, start + len(body), body))
    return answer, calls


def _arguments(body: str) -> str | None:
    """A call's body as a JSON object's text; None where it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


# an analysis message before the answer a grammar keeps to (llguidance's Lark: <|name|> is that special token)
_ANALYSIS = ('analysis: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"\n'
             "THOUGHT: /(.|\\n)*/\n")


def json_grammar(schema: dict[str, Any], param: str = "response_format") -> str:
    """The grammar of harmony answers whose final message is JSON ``schema`` accepts, reasoning first or not."""
    return lark_grammar(f'start: analysis? <|channel|> "final" <|message|> json\njson: {lark_json(schema)}\n'
                        + _ANALYSIS, param=param)


def call_grammar(functions: Sequence[dict[str, Any]], param: str = "tool_choice") -> str:
    """The grammar of harmony answers that call one of ``functions`` (OpenAI's: a name and a JSON Schema of its
    arguments as ``parameters``), reasoning first or not: ``<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>ARGUMENTS``, as gpt-oss writes a call."""
    calls = [f'call{i}: {json.dumps(f["name"] + " ")} <|constrain|> "json" <|message|> '
             f'{lark_json(f.get("parameters") or {"type": "object"})}' for i, f in enumerate(functions)]
    names = " | ".join(f"call{i}" for i in range(len(functions)))
    return lark_grammar(f'start: analysis? <|channel|> "commentary to=functions." ({names})\n' + "\n".join(calls)
                        + "\n" + _ANALYSIS, param=param)


class HarmonyStream(PartStream):
    """One streamed answer, read into ``parse``'s parts (PartStream); ``calls`` once it has ended."""

    def settled(self) -> list[Part]:
        if MESSAGE not in self.text and self.text.lstrip()[:1] in ("", "<"):
            return []  # the first message's header may still be coming
        return _read(self.text, final=False)[0]

    def whole(self) -> list[Part]:
        return _read(self.text, final=True)[0]

    def calls(self) -> tuple[ToolCall, ...]:
        return tuple(_read(self.text, final=True)[1])
