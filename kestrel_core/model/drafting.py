"""The scheduler's draft tokens (``Engine.speculate``): a greedy request's decode row followed by guesses, from its
context or a draft model (kestrel_core.model.speculate), each row's argmax kept while the guesses agree.

``Drafting`` is a base of ``Scheduler`` (kestrel_core.model.scheduler): its methods use the scheduler's ``engine``,
``pool``, ``speculate``, ``guesser``, ``drafted`` and ``accepted``, and its ``_chunk``, ``_sample`` and ``_accept``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kestrel_core.model.request import Request
from kestrel_core.model.sampling import TokenLogprob
from kestrel_core.model.speculate import Guesser


class Drafting:
    """A greedy request's guessed tokens (see the module docstring)."""

    engine: Any
    pool: Any
    speculate: int
    guesser: Guesser
    drafted: int
    accepted: int

    def _decoding_greedily(self, request: Request) -> bool:
        """Whether ``request``'s step may carry a draft (where speculation is on): it decodes greedily, alone."""
        return request.argmax_only and request.pending == 1 and len(request.seq.tokens) >= len(request.prompt_ids)

    def _would_guess(self, request: Request) -> bool:
        """Whether the guesser may offer a guess after ``request``'s latest token, with room in max_tokens and
        context."""
        if not (self.speculate > 0 and self.engine.rewinds and request.seq is not None
                and self._decoding_greedily(request) and request.params.max_tokens - len(request.output_ids) > 1
                and len(request.tokens) + 1 < self.engine.config.max_position):
            return False
        return self.guesser.offers(request)

    def _guess(self, work: list[tuple[Request, list[int] | None, int]], budget: int) -> None:
        """Drafts after the next token of each greedy request of ``work`` (``request.draft``, its chunk then
        carrying them), asked of the guesser together: up to ``speculate`` tokens within its ``max_tokens`` and
        the context, then, in ``work``'s order, within the ``budget`` of tokens the step has left and the KV
        blocks free now (a guess never preempts anyone). The greedy requests whose prompt's last chunk this step
        runs are the guesser's to read beside it (``Guesser.prefill``), not at their first draft."""
        self.guesser.prefill([(r, self.speculate) for r, _, rows in work if rows and r.argmax_only
                              and not self._decoding_greedily(r) and r.params.max_tokens - len(r.output_ids) > 2])
        asks = [(i, request, min(self.speculate, budget, request.params.max_tokens - len(request.output_ids) - 1,
                                 self.engine.config.max_position - len(request.tokens) - 1))
                for i, (request, _, _) in enumerate(work) if self._decoding_greedily(request)]
        asks = [(i, request, k) for i, request, k in asks if k > 0]
        drafts = self.guesser.drafts([(request, k) for _, request, k in asks]) if asks else []
        for (i, request, _), draft in zip(asks, drafts):
            draft = draft[:budget]
            checked = len(draft) >= max(1, self.guesser.n_min)  # the budget may cut it short of n_min
            if checked and self.pool.reserve(request.seq.cache, len(request.seq.tokens) + 1 + len(draft)):
                request.draft = draft
                self.drafted += len(draft)
                work[i] = self._chunk(request, 1 + len(draft))
                budget -= len(draft)

    def _take_draft(self, request: Request, out: np.ndarray) -> list[tuple[int, TokenLogprob | None]]:
        """A speculative step's tokens: each row's argmax while the draft agrees with the one before, and the
        first that disagrees (or the row after the whole draft); the positions of the guesses it did not keep
        are rewound."""
        draft, request.draft = request.draft, []
        sampled: list[tuple[int, TokenLogprob | None]] = []
        for j in range(len(draft) + 1):
            sampled.append(self._accept(request, self._sample(request, out[j])))
            if request.finished or j == len(draft) or sampled[-1][0] != draft[j]:
                break
        kept = len(sampled) - 1  # guesses confirmed: the inputs of the rows after them were right
        self.accepted += kept
        self.guesser.checked(request, kept)
        if not request.finished:
            self.engine.rewind(request.seq, len(request.seq.tokens) - (len(draft) - kept))
        return sampled

