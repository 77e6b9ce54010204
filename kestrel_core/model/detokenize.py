"""Incremental detokenization: text as tokens arrive, whole characters only, cut at stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextStream:
    """Decodes generated ids incrementally: only whole characters come out, even when a character's UTF-8
    bytes span several tokens, and tokenizers that need left context (leading spaces) decode right.

    With ``stop`` strings, text that may be the start of one is held back until it is known not to be, and
    the text ends before the first stop string (``stopped`` turns True); with ``min_tokens``, one that ends within
    the text of the first min_tokens tokens does not count (vLLM's min_tokens: so min_tokens 1 never gives an
    empty answer). ``skip_special_tokens`` False keeps special tokens' text (harmony's channel markers,
    kestrel_core.model.harmony); ``include_stop`` ends the text with the stop string instead of before it (vLLM's
    ``include_stop_str_in_output``).
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), min_tokens: int = 0,
                 skip_special_tokens: bool = True, include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.floor = 0 if not min_tokens else None  # the first min_tokens tokens' text: stop strings end past it
        # ids decoded before the generated ones, never handed out (Tokenizer.left_context: a SentencePiece decoder
        # strips the first space of what it decodes, the generated text's without them; a caller's own tokenizer
        # may have none)
        self.ids: list[int] = list(getattr(tokenizer, "left_context", ()))
        self.base = len(self.ids)
        self.prefix = 0  # ids[prefix:read] is context already decoded
        self.read = self.base
        self.text = ""  # every character decoded so far
        self.sent = 0  # text[:sent] has been handed out
        self.stopped = False
        self.stopped_by: str | None = None  # the stop string the text ended before

    @classmethod
    def of(cls, tokenizer: Any, params: Any) -> TextStream:
        """The text stream of a request sampled by ``params`` (a SamplingParams)."""
        return cls(tokenizer, params.stop, params.min_tokens, params.skip_special_tokens,
                   params.include_stop_str_in_output)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def push(self, token: int) -> str:
        """The new text that ``token`` completes ('' while a character is incomplete or held back)."""
        if self.stopped:
            return ""
        self.ids.append(int(token))
        done = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            self.text += text[len(done):]
        if self.floor is None and len(self.ids) - self.base >= self.min_tokens:
            self.floor = len(self.text)
        return self._release(final=False)

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character comes out as U+FFFD)."""
        if not self.stopped:
            done = self._decode(self.ids[self.prefix:self.read])
            text = self._decode(self.ids[self.prefix:])
            self.prefix = self.read = len(self.ids)
            self.text += text[len(done):]
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        if self.stop and self.floor is not None:
            # one may straddle what was already handed out, or the floor: each is searched from where it would end
            # just past both
            end = max(self.sent, self.floor) + 1
            hits = [(i, s) for i, s in ((self.text.find(s, max(0, end - len(s))), s) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                first, self.stopped_by = min(hits)
                cut = max(first + (len(self.stopped_by) if self.include_stop else 0), self.sent)
                out, self.sent = self.text[self.sent:cut], cut
                return out
        safe = len(self.text) if final else len(self.text) - self._held()
        if safe <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def _held(self) -> int:
        """Characters at the end of the text that could begin a stop string (one that may end past the floor)."""
        return partial_suffix(self.text, self.stop, self.sent)


def partial_suffix(text: str, markers: Sequence[str], start: int = 0) -> int:
    """The length of the longest end of ``text[start:]`` that begins one of ``markers`` (text that what comes
    next may complete into one, so a stream holds it back)."""
    for n in range(min(len(text) - start, max(map(len, markers), default=1) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0
