"""The streamed chunks' bytes: DeltaEvents against encoding each chunk whole."""

from __future__ import annotations

import json

import pytest

from kestrel_core.model.sampling import TokenLogprob
from kestrel_core.serve.generation import DeltaEvents, sse
from kestrel_core.serve.protocol import ChatShape, CompletionShape, TokenStrings


class _Letters:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


TEXTS = ["", "a", ' "quoted" \\ back', "line\nbreak\ttab", "\u00e9\u4e2d\U0001f600", "\x00\x1f", "</script>",
         "\ue000kestrel"]


@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("shape_type", [ChatShape, CompletionShape])
def test_delta_events_are_the_whole_chunks_bytes(shape_type: type, usage: bool) -> None:
    events = DeltaEvents(shape_type("id-x", "m\"odel", TokenStrings(_Letters()), include_usage=usage))
    reference = shape_type("id-x", "m\"odel", TokenStrings(_Letters()), include_usage=usage)
    reference.created = events.shape.created
    for index in (0, 1, 0):
        for text in TEXTS:
            got = events(text, None, index)
            assert got == sse(reference.delta_chunk(text, None, index))
            body = json.loads(got.decode()[len("data: "):])
            assert body["choices"][0]["index"] == index
    entries = [TokenLogprob(0, -1.0, [(0, -1.0)])]
    assert events("a", entries, 0) == sse(reference.delta_chunk("a", entries, 0))  # logprobs: encoded whole
