"""Draft tokens for speculative decoding: where they come from (``Guesser``, which the scheduler asks), and prompt
lookup (``LookupGuesser``): the text that followed the last time the sequence's latest tokens appeared (in its
prompt or its answer so far). A draft model is the other source (kestrel_core.model.draft_model).

A greedy request's next ``k`` tokens are guessed from its own context (answers that quote, edit or repeat their
input: code edits, summaries, extraction), run with its next token as one chunk, and kept up to the first guess
the model's argmax disagrees with, plus that argmax. On the host a row's logits do not depend on the rest of the
batch (kestrel_core.model.kernels), so the kept tokens are exactly the ones decoding one at a time gives (a
backend's batched rows may round otherwise than its one-row step); what a step costs grows little with a few
more rows while decode is memory-bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kestrel_core.model.request import Request

MAX_NGRAM = 3  # the longest suffix looked up; a longer match is tried first
# The shortest: a one-token match guessed wrong too often. Default model, CPU, 128-token greedy answers
# (benchmarks/speculate.py, 4 drafts): from one-token matches a story kept 35 of 182 drafts and ran 112 -> 109
# tok/s alone, 247 -> 212 at 4 streams; from two-token matches it kept 24 of 74 and ran 110 -> 118 and 246 -> 251,
# while a code edit gained as much either way (100 -> 157, 99 -> 153 tok/s)
MIN_NGRAM = 2
MAX_PAUSE = 32  # tokens without drafts after checks that kept none of theirs: 2, 4, 8, ... up to this
# A draft model's guesses stop at the first that it gives a lower probability than this (--draft-p-min):
# llama.cpp's --draft-p-min default
DRAFT_P_MIN = 0.75
# A draft model's draft of fewer guesses than this is not checked (--draft-min): llama.cpp's --draft-min default
DRAFT_MIN = 0


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
        self._resume = len(self.tokens) + min(2**self._misses, MAX_PAUSE)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            t = len(self.tokens)  # the n-grams ending just before it now have a continuation: it
            for n in range(1, min(MAX_NGRAM, t) + 1):
                self._next[tuple(self.tokens[t - n : t])] = t
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
                return tokens[start : start + k]
        return []


class Guesser:
    """Where a scheduler's drafts come from (``Scheduler.guesser``). It is asked only for greedy requests that
    decode, for no more tokens than their max_tokens and the context leave. A draft of fewer than ``n_min`` tokens
    is not checked: the step decodes without it."""

    n_min = 0

    def offers(self, request: Request) -> bool:
        """Whether a draft may follow ``request``'s latest token (while it may, its steps are not pipelined)."""
        raise NotImplementedError

    def drafts(self, asks: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """Up to ``k`` tokens guessed after each (request, k)'s latest token, one list each ([]: no guess), none
        shorter than ``n_min``; the first j >= ``n_min`` tokens of a draft are the draft that asking for j gives (the
        scheduler may keep fewer)."""
        raise NotImplementedError

    def prefill(self, asks: Sequence[tuple[Request, int]]) -> None:
        """The coming step runs the last chunk of each (request, k)'s prompt, a greedy request that may be asked
        for up to ``k`` tokens after the token that step gives: what its first draft needs of its tokens may be
        read now, not in the step after."""

    def checked(self, request: Request, kept: int) -> None:
        """The model confirmed ``kept`` tokens of ``request``'s last draft (its tokens are up to date)."""

    def forget(self, request: Request) -> None:
        """``request`` ended or was preempted: what it holds here is let go."""


class LookupGuesser(Guesser):
    """Drafts by prompt lookup: each request's ``PromptLookup`` (``Request.lookup``), brought up to date with its
    tokens when asked; it stays with the request through a preemption (its tokens are the same)."""

    def offers(self, request: Request) -> bool:
        return bool(self.lookup(request).draft(1))

    def drafts(self, asks: Sequence[tuple[Request, int]]) -> list[list[int]]:
        return [self.lookup(request).draft(k) for request, k in asks]

    def checked(self, request: Request, kept: int) -> None:
        self.lookup(request).checked(kept)

    @staticmethod
    def lookup(request: Request) -> PromptLookup:
        """``request``'s prompt lookup, up to date with its tokens."""
        lookup = request.lookup = request.lookup if request.lookup is not None else PromptLookup()
        prompt = len(request.prompt_ids)
        if len(lookup.tokens) < prompt:
            lookup.extend(request.prompt_ids[len(lookup.tokens) :])
        lookup.extend(request.output_ids[len(lookup.tokens) - prompt :])
        return lookup
