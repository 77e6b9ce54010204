"""Streamed answers checked against the whole answer's parts (model/parts.py's readers)."""

from __future__ import annotations

import random

from kestrel_core.model.parts import CALL, Part, PartStream


def chunkings(text: str, rng: random.Random) -> list[list[str]]:
    """``text`` cut every 1, 2, 3 and 7 characters, whole, and at random places (markers split anywhere)."""
    cuts = [list(range(size, len(text), size)) for size in (1, 2, 3, 7, len(text) + 1)]
    cuts += [sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) for _ in range(30)
             if len(text) > 1]
    return [[text[a:b] for a, b in zip([0, *c], [*c, len(text)])] for c in cuts]


def streamed(stream: PartStream, chunks: list[str], whole: list[Part]) -> list[tuple[str, str, bool]]:
    """Each part's text as the stream's deltas add it up (kind, text, whether it joins one of its kind), checking
    that whatever goes out starts the whole answer's part."""
    opened: dict[int, tuple[str, bool]] = {}
    texts: dict[int, str] = {}
    for delta in [d for chunk in chunks for d in stream.feed_parts(chunk)] + stream.finish_parts():
        opened.setdefault(delta.index, (delta.kind, delta.joins))
        texts[delta.index] = texts.get(delta.index, "") + delta.text
        assert delta.index < len(whole) and whole[delta.index].text.startswith(texts[delta.index]), (chunks, delta)
    return [(*opened[i][:1], texts[i], opened[i][1]) for i in sorted(opened)]


def expected(whole: list[Part]) -> list[tuple[str, str, bool]]:
    """The whole answer's parts as ``streamed`` gives them (a call's is no text)."""
    return [(p.kind, p.text, p.kind in {q.kind for q in whole[:i]}) for i, p in enumerate(whole) if p.kind != CALL]
