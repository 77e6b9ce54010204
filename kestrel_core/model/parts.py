"""An answer as its parts: the stretches of its text that are reasoning or content, in order (a ``<think>`` block
and what follows it, kestrel_core.model.reasoning; each of harmony's messages, kestrel_core.model.harmony), and the
tokens each part holds.

A part's tokens are those whose text starts within its stretch of the answer (``start``..``end``: between the
markers around it, as vLLM's reasoning parsers count a block's tokens: the whitespace that a part's text leaves
out at its edges is its too, a marker is no part's); a token whose text is still held back (the first bytes of a
character) starts where its text will. The logprobs a part carries are those of the tokens of its text alone
(``shown``: where it is, less that whitespace, and less a tool call a content part holds): a token whose text starts
in it, or runs into it from before. ``PartStream`` is what the streamed readers share: each part's text sent as far
as the text so far settles it; ``TokenParts`` which tokens are each part's, and their logprobs by part.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from kestrel_core.model.sampling import TokenLogprob

REASONING, CONTENT, CALL = "reasoning", "content", "call"  # a call (harmony's) is no text the answer says
SEPARATOR = "\n"  # between two parts of a kind, where the answer is one text of each kind (chat's message)


@dataclass(frozen=True)
class Stretch:
    """``kind``: REASONING, CONTENT or CALL; ``start``..``end``: its stretch of the answer's text (streamed: up to
    where the text so far settles it)."""

    kind: str
    start: int
    end: int


@dataclass(frozen=True)
class Part(Stretch):
    """A part of a whole answer; ``text``: what it says, the answer's ``text[first:last]``."""

    first: int
    text: str

    @property
    def last(self) -> int:
        return self.first + len(self.text)


@dataclass(frozen=True)
class Settled(Stretch):
    """A part of a streamed answer as the text so far settles it: what it says is the answer's
    ``text[first:last]`` (a stream keeps no copy of each part's text, so a feed costs only what it adds)."""

    first: int
    last: int


@dataclass(frozen=True)
class Shown:
    """Where part ``index``'s text, or a stretch of it, is in the answer: ``first``..``last``."""

    index: int
    first: int
    last: int


def shown(parts: Sequence[Part | Settled], content: Sequence[tuple[int, int]] | None = None) -> list[Shown]:
    """Where the text of each of ``parts`` is in the answer (a call's is no text); ``content``: where, in the
    content part's text, what a tool format's calls leave of it is (None: all of it)."""
    out = []
    for i, part in enumerate(parts):
        if part.kind == CONTENT and content is not None:
            out += [Shown(i, part.first + a, part.first + b) for a, b in content]
        elif part.kind != CALL:
            out.append(Shown(i, part.first, part.last))
    return out


def trimmed(kind: str, answer: str, start: int, end: int, trail: bool = True) -> Part:
    """The part of ``kind`` over ``answer[start:end]``, its text less the whitespace at its start (``trail``: and at
    its end)."""
    text = answer[start:end].lstrip()
    return Part(kind, start, end, end - len(text), text.rstrip() if trail else text)


@dataclass(frozen=True)
class PartDelta:
    """Part ``index``'s next ``text``; ``joins``: it opens a part after another of its kind (SEPARATOR goes
    between them)."""

    index: int
    kind: str
    text: str
    joins: bool = False


def joined(parts: Sequence[Part], kind: str) -> str | None:
    """The text of an answer's parts of ``kind`` as one (SEPARATOR between two); None: it has none."""
    texts = [p.text for p in parts if p.kind == kind]
    return SEPARATOR.join(texts) if texts else None


def joined_deltas(deltas: Sequence[PartDelta]) -> tuple[str, str]:
    """Deltas as what they add to the answer's (reasoning, content) texts (``joined``'s)."""
    out = {REASONING: "", CONTENT: ""}
    for d in deltas:
        if d.kind in out:
            out[d.kind] += (SEPARATOR if d.joins else "") + d.text
    return out[REASONING], out[CONTENT]


class PartStream:
    """One streamed answer read into parts: ``feed_parts`` gives each part's text that can go out now,
    ``finish_parts`` the rest (``feed`` and ``finish``: as the (reasoning, content) they add, ``joined_deltas``).
    A reader says which parts the text so far settles (``settled``) and which the whole answer has (``whole``):
    what goes out always starts the whole answer's parts, so it adds up to them. A reader that reads as the text
    comes looks only at its end (``recent``), which keeps the text from where the last part's settled text ends,
    or from MARGIN characters back (where a marker may start)."""

    MARGIN = 32  # more than any marker's length (Cohere's are 18 characters)

    def __init__(self) -> None:
        self.pieces: list[str] = []  # the answer's text as it came
        self.length = 0
        self.recent = ""  # the answer's text from recent_at on
        self.recent_at = 0
        self.parts: list[Stretch] = []  # as the text so far settles them
        self.sent: list[int] = []  # characters of each part's text sent

    @property
    def text(self) -> str:
        """The answer's text so far."""
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""

    def slice(self, start: int, end: int) -> str:
        """``text[start:end]``, at the cost of its length where it starts within ``recent``."""
        if end <= start:
            return ""
        if start >= self.recent_at:
            return self.recent[start - self.recent_at:end - self.recent_at]
        return self.text[start:end]

    def settled(self) -> Sequence[Part | Settled]:
        raise NotImplementedError

    def whole(self) -> list[Part]:
        raise NotImplementedError

    def feed_parts(self, delta: str) -> list[PartDelta]:
        self.pieces.append(delta)
        self.length += len(delta)
        self.recent += delta
        out = self._send(self.settled())
        keep = min(self.length - self.MARGIN, self.kept_from())
        if keep > self.recent_at:
            self.recent = self.recent[keep - self.recent_at:]
            self.recent_at = keep
        return out

    def kept_from(self) -> int:
        """Where the text that goes out next starts (the last part's settled text's end): ``recent`` keeps it."""
        last = self.parts[-1] if self.parts else None
        return last.last if isinstance(last, Settled) else self.length

    def finish_parts(self) -> list[PartDelta]:
        return self._send(self.whole())

    def feed(self, delta: str) -> tuple[str, str]:
        return joined_deltas(self.feed_parts(delta))

    def finish(self) -> tuple[str, str]:
        return joined_deltas(self.finish_parts())

    def _send(self, parts: Sequence[Part | Settled]) -> list[PartDelta]:
        self.parts = list(parts)
        out = []
        kinds: set[str] = set()
        for i, part in enumerate(parts):
            opens = i >= len(self.sent)
            if opens:
                self.sent.append(0)
            if part.kind != CALL:
                if isinstance(part, Part):
                    text, length = part.text[self.sent[i]:], len(part.text)
                else:
                    text, length = self.slice(part.first + self.sent[i], part.last), part.last - part.first
                if text or opens:
                    out.append(PartDelta(i, part.kind, text, opens and part.kind in kinds))
                self.sent[i] = max(self.sent[i], length)
            kinds.add(part.kind)
        return out


class ContentStream(PartStream):
    """An answer that is all content."""

    def settled(self) -> list[Settled]:
        return [Settled(CONTENT, 0, self.length, 0, self.length)]

    def whole(self) -> list[Part]:
        return [Part(CONTENT, 0, len(self.text), 0, self.text)]


class TokenParts:
    """Which part each of an answer's tokens is in, as the tokens and their text come; with their logprobs, which
    ``release`` hands out by part once the parts settle where each token starts."""

    def __init__(self) -> None:
        self.starts: list[int] = []  # where each token's text starts in the answer (never decreasing)
        self.entries: list[TokenLogprob] = []  # each token's logprob, where they came
        self.length = 0  # characters of the answer so far
        self.released = 0  # tokens handed out by ``release``

    def add(self, text: str, tokens: int, offsets: Sequence[int] | None,
            entries: Sequence[TokenLogprob] | None = None) -> None:
        """A step's ``tokens`` and ``text``: ``offsets`` where each token's text starts in it (None: every token
        of the step starts where its text does), ``entries`` their logprobs."""
        starts = offsets if offsets is not None else [0] * tokens
        self.starts += [self.length + o for o in starts]
        self.length += len(text)
        if entries:
            self.entries += entries

    def count(self, parts: Sequence[Stretch], kind: str) -> int:
        """How many tokens the parts of ``kind`` hold."""
        return sum(bisect_left(self.starts, p.end) - bisect_left(self.starts, p.start) for p in parts
                   if p.kind == kind)

    def release(self, spans: Sequence[Shown], final: bool = False) -> dict[int, list[TokenLogprob]]:
        """The logprobs of the tokens not yet handed out that start before the last of ``spans`` settles (``final``:
        every token), by the index of the part whose text each is: a token whose text starts in a span, or runs
        into it from before; a token outside them (a marker, a call, the whitespace a part's text leaves out) is no
        part's."""
        upto = len(self.starts) if final else bisect_left(self.starts, spans[-1].last if spans else 0)
        out: dict[int, list[TokenLogprob]] = {}
        k, first = 0, self.released
        for token in range(first, upto):
            start = self.starts[token]
            end = self.starts[token + 1] if token + 1 < len(self.starts) else self.length
            while k < len(spans) and spans[k].last <= start:
                k += 1
            if k < len(spans) and (spans[k].first <= start or end > spans[k].first) and token < len(self.entries):
                out.setdefault(spans[k].index, []).append(self.entries[token])
        self.released = max(first, upto)
        return out
