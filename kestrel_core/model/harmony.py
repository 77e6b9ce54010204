"""OpenAI's harmony format, what gpt-oss answers in: messages of a channel, split by special tokens.

An answer (after the template's ``<|start|>assistant``) is a run of messages ``[<|start|>ROLE] HEADER
<|message|>BODY END``: the header names the channel (``<|channel|>analysis``, ``commentary`` or ``final``) and,
for a tool call, its recipient (``to=functions.NAME``, before or after the channel, with ``<|constrain|>json``);
END is ``<|end|>``, ``<|call|>`` or ``<|return|>``. The analysis channel is the reasoning, the final channel (and
commentary to no one: a preamble the user sees) the content, and a message to ``functions.NAME`` a call whose
arguments are its body. Reading it needs the special tokens in the text (``SamplingParams.skip_special_tokens``
False). ``parse`` reads a whole answer, ``HarmonyStream`` a streamed one; an answer with no harmony message at
all is content, as it came. ``json_grammar`` and ``call_grammar`` keep an answer to JSON or to a call (a JSON
response format, a forced tool call) in harmony's own shape: the analysis may come first, the final message or
the call is constrained.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kestrel_core.model.detokenize import partial_suffix
from kestrel_core.model.grammar import lark_grammar, lark_json

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
    content: str  # the final (and preamble) messages' bodies
    calls: tuple[ToolCall, ...]


def parse(text: str) -> HarmonyAnswer:
    """A whole answer's reasoning, content and calls."""
    reasoning, content, calls, _ = _read(text, final=True)
    return HarmonyAnswer("\n".join(reasoning) if reasoning else None, "".join(content), tuple(calls))


def _read(text: str, final: bool) -> tuple[list[str], list[str], list[ToolCall], bool]:
    """The messages' bodies by kind, and whether the text is harmony at all. A body still streaming (``final``
    False) stops short of what may be the start of its end token; its message is not a call yet."""
    if MESSAGE not in text:
        return [], [text], [], False  # not harmony (or, streaming, not yet: HarmonyStream holds a header back)
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[ToolCall] = []
    for segment in text.split(START):
        header, sep, body = segment.partition(MESSAGE)
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
        if recipient is not None:
            arguments = _arguments(body) if complete or final else None
            if arguments is not None:
                calls.append(ToolCall(recipient.group(1).removeprefix("functions."), arguments))
            elif final:  # a call that does not parse (or that max_tokens cut) is text, as the other formats' are
                content.append(body)
        elif channel is not None and channel.group(1) == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
    return reasoning, content, calls, True


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


class HarmonyStream:
    """One streamed answer: ``feed`` gives the (reasoning, content) that can go out now, ``finish`` the rest and
    the calls. What goes out always starts ``parse``'s parts, so it adds up to them."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = [0, 0]  # characters of the reasoning and of the content sent

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        if MESSAGE not in self.text and self.text.lstrip()[:1] in ("", "<"):
            return "", ""  # the first message's header may still be coming
        reasoning, content, _, _ = _read(self.text, final=False)
        return self._send("\n".join(reasoning), "".join(content))

    def finish(self) -> tuple[str, str, tuple[ToolCall, ...]]:
        answer = parse(self.text)
        reasoning, content = self._send(answer.reasoning or "", answer.content)
        return reasoning, content, answer.calls

    def _send(self, reasoning: str, content: str) -> tuple[str, str]:
        out = reasoning[self.sent[0]:], content[self.sent[1]:]
        self.sent = [max(self.sent[0], len(reasoning)), max(self.sent[1], len(content))]
        return out
