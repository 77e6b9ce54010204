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
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kestrel_core.model.detokenize import partial_suffix
from kestrel_core.model.grammar import lark_grammar, lark_json
from kestrel_core.model.parts import CALL, CONTENT, REASONING, Part, PartStream, Settled, joined

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


def finite_float(text: str) -> float:
    """A JSON number's value; a ValueError past a float's range (Python's reader makes it infinity)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is past a float's range")
    return value


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


# JSON as RFC 8259 has it, for a call's arguments: Python's reader also takes NaN and Infinity, which json.dumps
# writes back and JSON.parse (as most readers) refuses
STRICT_JSON = json.JSONDecoder(parse_constant=_not_json, parse_float=finite_float)


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
        return [Part(CONTENT, 0, len(text), 0, text)], []
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
        kind = _kind(header)
        if kind == CALL:
            arguments = _arguments(body) if complete or final else None
            if arguments is not None:
                recipient = _RECIPIENT.search(header)
                assert recipient is not None
                calls.append(ToolCall(recipient.group(1).removeprefix("functions."), arguments))
            elif final:  # one that does not parse (or that max_tokens cut) is text, as the other formats' are
                kind = CONTENT
        answer.append(Part(kind, start, start + len(body), start, body))
    return answer, calls


def _kind(header: str) -> str:
    """The kind of a message's part, by its header: a call to its recipient, the analysis channel's reasoning, or
    content."""
    if _RECIPIENT.search(header):
        return CALL
    channel = _CHANNEL.search(header)
    return REASONING if channel is not None and channel.group(1) == "analysis" else CONTENT


def _arguments(body: str) -> str | None:
    """A call's body as a JSON object's text; None where it is not one (nested past the JSON parser's depth too)."""
    try:
        value = STRICT_JSON.decode(body)
    except (ValueError, RecursionError):
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
    """One streamed answer, read into ``parse``'s parts (PartStream) as the text comes: a message's part is settled
    once the next ``<|start|>`` comes, and each feed looks only at the new text and what may still change before
    it; ``calls`` once it has ended."""

    def __init__(self) -> None:
        super().__init__()
        self.harmony = False  # a message has come
        self.lead: str | None = None  # the answer's first character past its whitespace
        self.done: list[Settled] = []  # the parts of the messages before the last <|start|>
        self.segment = 0  # where the last message starts (past its <|start|>)
        self.body: int | None = None  # where its body starts, once its header has ended
        self.end: int | None = None  # where its body ends, once its end token has come
        self.scanned = 0  # where a token may still start (less the longest one's length)
        self.kind = CONTENT  # its part's kind

    def settled(self) -> list[Settled]:
        while self._advance():
            pass
        self.scanned = self.length
        if not self.harmony:
            if self.lead is None:  # the text before what ``recent`` holds is whitespace
                self.lead = self.recent.lstrip()[:1] or None
            if self.lead in (None, "<"):
                return []  # the first message's header may still be coming
            return [Settled(CONTENT, 0, self.length, 0, self.length)]
        if self.body is None:
            return self.done
        return [*self.done, self._part(self.length)]

    def _advance(self) -> bool:
        """Reads the next token of the new text that ends a header, a body or a message; whether there was one."""
        since = self.segment if self.body is None else self.body if self.end is None else self.end
        seen = max(since, self.scanned - len(MESSAGE) + 1)
        new = self.slice(seen, self.length)
        tokens = (START,) if self.end is not None else (START, MESSAGE) if self.body is None else (START, *ENDS)
        found = [(i, token) for i, token in ((new.find(t), t) for t in tokens) if i >= 0]
        if not found:
            return False
        at, token = min(found)
        at += seen
        if token == START:
            if self.body is not None:
                self.done.append(self._part(at))
            self.segment, self.body, self.end = at + len(START), None, None
        elif token == MESSAGE:
            self.harmony, self.body = True, at + len(MESSAGE)
            self.kind = _kind(self.slice(self.segment, at))
        else:
            self.end = at
        self.scanned = at + len(token)
        return True

    def _part(self, upto: int) -> Settled:
        """The last message's part, its body up to ``upto`` (or its end token), less what may start an end token."""
        assert self.body is not None
        if self.end is not None:
            end = self.end
        else:
            tail = self.slice(max(self.body, upto - len(ENDS[-1])), upto)
            end = upto - partial_suffix(tail, ENDS)
        return Settled(self.kind, self.body, end, self.body, end)

    def whole(self) -> list[Part]:
        return _read(self.text, final=True)[0]

    def calls(self) -> tuple[ToolCall, ...]:
        return tuple(_read(self.text, final=True)[1])
