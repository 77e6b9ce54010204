"""Reasoning in chat answers: a model whose chat template teaches a reasoning block answers with its reasoning
first, in ``<think>...</think>`` (Qwen3, QwQ, DeepSeek-R1's distills), Mistral's ``[THINK]...[/THINK]``
control tokens (Magistral, Ministral 3 Reasoning: MISTRAL_THINK) or Cohere's ``<|START_THINKING|>...<|END_THINKING|>``
special tokens (Command R7B, Command A: COHERE_THINK, whose content is a ``<|START_RESPONSE|>...<|END_RESPONSE|>``
block, its tags no text of it, as llama.cpp's command_r7b parser reads it). The server returns that block's text as the
message's ``reasoning_content`` (DeepSeek's and vLLM's field) and what follows as its ``content``, where tool calls
are read (serve/tools.py); ``kestrel run`` and ``chat`` show it apart from the answer (model/commands.py).
gpt-oss's channels are kestrel_core.model.harmony's.

``reasoning_markers(template)`` says which block a template teaches (the one whose end it writes: ``</think>``,
``[/THINK]``), ``thinks(template)`` whether it teaches one; ``without_reasoning`` turns thinking off in a prompt
whose template has no ``enable_thinking`` of its own (Cohere's), as llama.cpp does. An answer that starts with the
block's open tag reasons until its close tag, as does one whose prompt ended with the open tag (a template that
opens the block itself, as Qwen3.5's). Where no ``</think>`` comes, its first ``<tool_call>`` ends the reasoning
(Qwen3.5 may call a tool without closing its block: the call is content, where serve/tools.py reads it, as vLLM's
qwen3 reasoning parser reads it); a ``<tool_call>`` that reasoning mentions before its ``</think>`` is reasoning.
Mistral's block ends at its ``[/THINK]`` only, as vLLM's mistral reasoning parser reads it. An answer cut before
either is all reasoning. ``split_parts`` does this for a whole answer (its parts, kestrel_core.model.parts;
``split`` their two texts), ``ReasoningStream`` for a stream, holding back what may be the start of a tag, the
whitespace that the whole answer's parts leave out at their edges, and the reasoning from a ``<tool_call>`` on until
its ``</think>`` comes (or the answer ends, which makes the call content).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kestrel_core.model.detokenize import partial_suffix
from kestrel_core.model.parts import CONTENT, REASONING, Part, PartStream, Settled, joined, trimmed


@dataclass(frozen=True)
class Markers:
    """How a reasoning block is spelled: its ``open`` and ``close`` tags; ``call``: a tool call's tag that ends the
    block where no close tag comes (None: only the close tag ends it); ``control``: the tags are special tokens
    (Mistral's control tokens, Cohere's), whose text an answer keeps only where its special tokens' text is kept;
    ``thinking_block``: an earlier answer's reasoning goes back to the template as a ``thinking`` content block
    (Mistral's templates read it there, not from ``reasoning_content``); ``response``: the open and close tags of the
    block the content is in (Cohere's), which are no text of the content (the prompt may have opened it); ``turn``:
    the tag that opens the answer's turn in a template without a thinking switch of its own (Cohere's), where
    ``without_reasoning`` turns it off."""

    open: str
    close: str
    call: str | None = None
    control: bool = False
    thinking_block: bool = False
    response: tuple[str, str] | None = None
    turn: str | None = None

    @property
    def longest(self) -> int:
        """The length of the longest tag that ends a block."""
        return max(len(self.close), len(self.call or ""))


THINK = Markers("<think>", "</think>", call="<tool_call>")
MISTRAL_THINK = Markers("[THINK]", "[/THINK]", control=True, thinking_block=True)
COHERE_THINK = Markers(
    "<|START_THINKING|>",
    "<|END_THINKING|>",
    control=True,
    response=("<|START_RESPONSE|>", "<|END_RESPONSE|>"),
    turn="<|CHATBOT_TOKEN|>",
)


@dataclass(frozen=True)
class Reasoning:
    """A request's answers carry a reasoning block spelled by ``markers``; ``open_in_prompt``: they start inside
    it."""

    open_in_prompt: bool = False
    markers: Markers = THINK


THINK_LEVELS = ("low", "medium", "high", "max")  # Ollama's think levels: gpt-oss's reasoning efforts, and max


def think_kwargs(think: bool | str | None, harmony: bool = False) -> dict[str, Any] | None:
    """The chat template's variables for Ollama's ``think``: Qwen3's switch ``enable_thinking``, and for a level
    (THINK_LEVELS) also its ``reasoning_effort``; None: neither. ``harmony``: the template is gpt-oss's, whose
    efforts end at high, which max becomes (as Ollama maps it)."""
    if think is None:
        return None
    if isinstance(think, str):
        return {"enable_thinking": True, "reasoning_effort": "high" if harmony and think == "max" else think}
    return {"enable_thinking": think}


def reasoning_markers(template: str | None) -> Markers | None:
    """The reasoning block the chat template teaches (it writes the block's close tag); None: it teaches none."""
    if not template:
        return None
    return next((m for m in (THINK, MISTRAL_THINK, COHERE_THINK) if m.close in template), None)


def without_reasoning(prompt: str, markers: Markers | None) -> str:
    """The rendered ``prompt`` with thinking turned off where its template has no switch of its own
    (``markers.turn``): a prompt that ends opening the block gets it closed, one that ends opening the answer's turn
    gets an empty block, as llama.cpp's command_r7b handler writes them; any other prompt is as it came."""
    if markers is None or markers.turn is None:
        return prompt
    if prompt.endswith(markers.open):
        return prompt + markers.close
    if prompt.endswith(markers.turn):
        return prompt + markers.open + markers.close
    return prompt


def thinks(template: str | None) -> bool:
    """Whether the chat template teaches a reasoning block."""
    return reasoning_markers(template) is not None


def opens_in_prompt(prompt: str, markers: Markers = THINK) -> bool:
    """Whether the rendered prompt leaves the answer inside a reasoning block (the template wrote its open tag)."""
    return prompt.rstrip().endswith(markers.open)


def split_parts(text: str, open_in_prompt: bool = False, markers: Markers = THINK) -> list[Part]:
    """A whole answer's parts: its reasoning block's (its text stripped), then what follows (its start's whitespace
    left out); an answer without a block is all content, as it came. Where the content is in a response block
    (``markers.response``), its tags are left out, and what follows the block too."""
    head = text.lstrip()
    if head.startswith(markers.open):  # where the prompt opened the block too: the tag may come again
        start = len(text) - len(head) + len(markers.open)
    elif open_in_prompt:
        start = 0
    else:
        return [_content(text, 0, markers, follows_block=False)]
    end, after = _end(text[start:], markers)
    if end < 0:
        return [trimmed(REASONING, text, start, len(text))]
    return [trimmed(REASONING, text, start, start + end), _content(text, start + after, markers, follows_block=True)]


def _content(text: str, start: int, markers: Markers, follows_block: bool) -> Part:
    """The content from ``start`` on: past its start's whitespace where it ``follows_block`` (else as it came), and
    past a response block's open tag that comes first after that whitespace; up to the response block's close tag."""
    rest = text[start:].lstrip()
    lead = len(text) - len(rest)
    first, end = lead if follows_block else start, len(text)
    if markers.response is not None:
        opener, closer = markers.response
        if rest.startswith(opener):
            first = lead + len(opener)
        close = text.find(closer, first)
        end = close if close >= 0 else end
    return Part(CONTENT, start, end, first, text[first:end])


def split(text: str, open_in_prompt: bool = False, markers: Markers = THINK) -> tuple[str | None, str]:
    """(the reasoning, None where the answer has none; the content) of a whole answer."""
    answer = split_parts(text, open_in_prompt, markers)
    return joined(answer, REASONING) or None, joined(answer, CONTENT) or ""


def _end(body: str, markers: Markers) -> tuple[int, int]:
    """Where the reasoning in the whole answer's ``body`` ends and its content starts: at its close tag (past it),
    else at the first call tag (the call is content); (-1, -1) where neither has come."""
    close = body.find(markers.close)
    if close >= 0:
        return close, close + len(markers.close)
    call = body.find(markers.call) if markers.call else -1
    return (call, call) if call >= 0 else (-1, -1)


class ReasoningStream(PartStream):
    """One streamed choice's answer, read into ``split_parts``' parts (PartStream) as the text comes: once its start
    says whether it has a block, each feed looks only at the new text and what may still change before it."""

    def __init__(self, open_in_prompt: bool = False, markers: Markers = THINK) -> None:
        super().__init__()
        self.open_in_prompt = open_in_prompt
        self.markers = markers
        self.all_content = False  # the answer has no block
        self.body: int | None = None  # where the block's text starts
        self.scanned = 0  # where a marker may still start (less the longest one's length)
        self.lead: int | None = None  # where the block's text starts past its whitespace
        self.known = 0  # where the open block's settled text ends (past its last non-whitespace character)
        self.block: Settled | None = None  # the block, once it has ended
        self.held: Settled | None = None  # the open block up to its first <tool_call>: the rest waits for </think>
        self.after = 0  # where the content after the block starts
        self.content_scan = 0  # where the content's leading whitespace may go on from
        self.content_lead: int | None = None  # where the content's text starts past that whitespace (and a tag)
        self.end_scan = 0  # where the response block's close tag may still start (less its length)
        self.content_end: int | None = None  # where the content ends, once that tag has come

    def whole(self) -> list[Part]:
        return split_parts(self.text, self.open_in_prompt, self.markers)

    def settled(self) -> list[Settled]:
        """The parts as far as the text so far settles them."""
        if self.body is None and not self.all_content and not self._decide():
            return []
        if self.all_content:
            if self.markers.response is None:
                return [Settled(CONTENT, 0, self.length, 0, self.length)]
            return [self._content(follows_block=False)]
        if self.block is None:
            block = self._read_block()
            if self.block is None:
                return [block]
        return [self.block, self._content(follows_block=True)]

    def _content(self, follows_block: bool) -> Settled:
        """The content from ``after`` on as far as the text so far settles it (``split_parts``' content): its text
        starts once what comes first past the whitespace says whether it opens a response block, and it ends at that
        block's close tag, short of what may be its start meanwhile."""
        opener = self.markers.response[0] if self.markers.response else None
        if self.content_lead is None:
            stripped = self.slice(self.content_scan, self.length).lstrip()
            self.content_scan = self.length - len(stripped)  # whitespace is read once
            if stripped and not (opener and len(stripped) < len(opener) and opener.startswith(stripped)):
                lead = self.content_scan if follows_block else self.after
                self.content_lead = self.content_scan + len(opener) if opener and stripped.startswith(opener) else lead
        if self.content_lead is None:
            return Settled(CONTENT, self.after, self.length, self.length, self.length)
        end = self._content_end(self.content_lead)
        return Settled(CONTENT, self.after, end, self.content_lead, end)

    def _content_end(self, first: int) -> int:
        """Where the content from ``first`` ends as far as the text so far says: at the response block's close tag,
        else short of what may start it (a tag starts where no earlier feed could have seen all of it)."""
        if self.markers.response is None:
            return self.length
        if self.content_end is None:
            closer = self.markers.response[1]
            seen = max(first, self.end_scan - len(closer) + 1)
            new = self.slice(seen, self.length)
            at = new.find(closer)
            if at < 0:
                self.end_scan = self.length
                return self.length - partial_suffix(new, (closer,))
            self.content_end = seen + at
        return self.content_end

    def _decide(self) -> bool:
        """Whether the answer's start says if it has a block (where its text starts, or that it has none), as
        ``split_parts`` reads it; its start is whitespace and at most a tag's length, so it is read whole."""
        text, tag = self.text, self.markers.open
        head = text.lstrip()
        if not head.startswith(tag) and tag.startswith(head):  # whitespace, or the tag's start
            return False
        if head.startswith(tag):
            self.body = len(text) - len(head) + len(tag)
        elif self.open_in_prompt:
            self.body = 0
        else:
            self.all_content = True
            return True
        self.scanned = self.known = self.body
        return True

    def _read_block(self) -> Settled:
        """The open block as far as the text so far settles it; ``block`` and where the content starts, once it
        ends at its close tag (a marker starts where no earlier feed could have seen all of it). From its first
        call tag on, the block is ``held``: that call ends it only where no close tag ever comes."""
        assert self.body is not None
        markers = self.markers
        seen = max(self.body, self.scanned - markers.longest + 1)
        new = self.slice(seen, self.length)
        close = new.find(markers.close)
        if self.held is None and markers.call:
            call = new.find(markers.call)
            if call >= 0 and (close < 0 or call < close):
                self.held = self._settle(seen + call, None)
        if close >= 0:
            self.after = self.content_scan = seen + close + len(markers.close)
            self.block = self._settle(seen + close, seen + close)
            return self.block
        self.scanned = self.length
        if self.held is not None:
            return self.held
        ends = (markers.close, markers.call) if markers.call else (markers.close,)
        return self._settle(self.length - partial_suffix(new, ends), None)

    def kept_from(self) -> int:
        # held text goes out once, when the close tag comes: keeping it in ``recent`` would cost each feed its length
        if self.held is not None and self.block is None:
            return self.length
        return super().kept_from()

    def _settle(self, upto: int, end: int | None) -> Settled:
        """The block's part with its text up to ``upto`` (less its edges' whitespace); ``end``: where it ends, None
        while it is open (then at its settled text's end)."""
        assert self.body is not None
        rest = self.slice(self.known, upto)
        solid = rest.rstrip()
        if solid:
            if self.lead is None:
                self.lead = self.known + len(rest) - len(rest.lstrip())
            self.known += len(solid)
        first = self.known if self.lead is None else self.lead
        return Settled(REASONING, self.body, self.known if end is None else end, first, self.known)
