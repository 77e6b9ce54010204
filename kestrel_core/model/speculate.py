"""Draft tokens for speculative decoding by prompt lookup: the text that followed the last time the sequence's
latest tokens appeared (in its prompt or its answer so far).

A greedy request's next ``k`` tokens are guessed from its own context (answers that quote, edit or repeat their
input: code edits, summaries, extraction), run with its next token as one chunk, and kept up to the first guess
the model's argmax disagrees with, plus that argmax. On the host a row's logits do not depend on the rest of the
batch (kestrel_core.model.kernels), so the kept tokens are exactly the ones decoding one at a time gives (a
backend's batched rows may round otherwise than its one-row step); what a step costs grows little with a few
more rows while decode is memory-bound.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 3  # the longest suffix looked up; a longer match is tried first
# The shortest: a one-token match guessed wrong too often. Default model, CPU, 128-token greedy answers
# (benchmarks/speculate.py, 4 drafts): from one-token matches a story kept 35 of 182 drafts and ran 112 -> 109
# tok/s alone, 247 -> 212 at 4 streams; from two-token matches it kept 24 of 74 and ran 110 -> 118 and 246 -> 251,
# while a code edit gained as much either way (100 -> 157, 99 -> 153 tok/s)
MIN_NGRAM = 2
MAX_PAUSE = 32  # tokens without drafts after checks that kept none of theirs: 2, 4, 8, ... up to this


class PromptLookup:
    """The latest continuation of every n-gram (n <= MAX_NGRAM) of one sequence's tokens, kept as they come; drafts
    follow suffixes of MIN_NGRAM tokens or more. A draft the model confirmed none of pauses drafting, for longer
    the more of them miss in a row, so that a context that offers only wrong guesses costs few checks."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> the index of the token that followed it last
        self._misses = 0  # drafts in a row that the model confirmed none of
        self._resume = 0  # no drafts before the sequence is this long

    @property
    def paused(self) -> bool:
        return len(self.tokens) < self._resume

    def checked(self, kept: int) -> None:
        """The model confirmed ``kept`` tokens of the last draft (the tokens are up to date)."""
        if kept:
            self._misses = 0
            return
        self._misses += 1
        self._resume = len(self.tokens) + min(2 ** self._misses, MAX_PAUSE)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            t = len(self.tokens)  # the n-grams ending just before it now have a continuation: it
            for n in range(1, min(MAX_NGRAM, t) + 1):
                self._next[tuple(self.tokens[t - n:t])] = t
            self.tokens.append(int(token))

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest suffix of the sequence seen before; [] if none was, or
        while paused."""
        if self.paused:
            return []
        tokens = self.tokens
        for n in range(min(MAX_NGRAM, len(tokens)), MIN_NGRAM - 1, -1):
            start = self._next.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + k]
        return []
