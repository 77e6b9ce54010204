"""An answer as its parts: the stretches of its text that are reasoning or content, in order (a ``<think>`` block
and what follows it, kestrel_core.model.reasoning; each of harmony's messages, kestrel_core.model.harmony).

A part's stretch of the answer (``start``..``end``) lies between the markers around it: the whitespace that a
part's text leaves out at its edges is its too, a marker is no part's. ``PartStream`` is what the streamed readers
share: each part's text sent as far as the text so far settles it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

REASONING, CONTENT, CALL = "reasoning", "content", "call"  # a call (harmony's) is no text the answer says
SEPARATOR = "\n"  # between two parts of a kind, where the answer is one text of each kind (chat's message)


@dataclass(frozen=True)
class Part:
    """``kind``: REASONING, CONTENT or CALL; ``start``..``end``: its stretch of the answer's text (streamed: up to
    where the text so far settles it); ``text``: what it says."""

    kind: str
    start: int
    end: int
    text: str


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
    what goes out always starts the whole answer's parts, so it adds up to them."""

    def __init__(self) -> None:
        self.text = ""
        self.parts: list[Part] = []  # as the text so far settles them
        self.sent: list[int] = []  # characters of each part's text sent

    def settled(self) -> list[Part]:
        raise NotImplementedError

    def whole(self) -> list[Part]:
        raise NotImplementedError

    def feed_parts(self, delta: str) -> list[PartDelta]:
        self.text += delta
        return self._send(self.settled())

    def finish_parts(self) -> list[PartDelta]:
        return self._send(self.whole())

    def feed(self, delta: str) -> tuple[str, str]:
        return joined_deltas(self.feed_parts(delta))

    def finish(self) -> tuple[str, str]:
        return joined_deltas(self.finish_parts())

    def _send(self, parts: list[Part]) -> list[PartDelta]:
        self.parts = parts
        out = []
        kinds: set[str] = set()
        for i, part in enumerate(parts):
            opens = i >= len(self.sent)
            if opens:
                self.sent.append(0)
            if part.kind != CALL:
                text = part.text[self.sent[i]:]
                if text or opens:
                    out.append(PartDelta(i, part.kind, text, opens and part.kind in kinds))
                self.sent[i] = max(self.sent[i], len(part.text))
            kinds.add(part.kind)
        return out


class ContentStream(PartStream):
    """An answer that is all content."""

    def settled(self) -> list[Part]:
        return [Part(CONTENT, 0, len(self.text), self.text)]

    whole = settled
