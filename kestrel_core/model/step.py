"""A batched step started on an engine (``Engine.start_batch``), whose outputs are taken once (``Step.result``),
and the checks of what a step is given (``work_entry``, ``step_tokens``).

Until they are, the step holds its engine for the thread that started it (kestrel_core.model.driver): a step the
device still runs reads and writes what another thread's step would change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kestrel_core.batch import BatchEntry, greedy_token
from kestrel_core.dispatch import Deferred
from kestrel_core.errors import KestrelError, safe_repr
from kestrel_core.model.driver import Hold
from kestrel_core.model.validate import is_token_ids

if TYPE_CHECKING:
    from kestrel_core.model.engine import Engine, SeqState


class Step:
    """One started ``Engine.start_batch`` step; ``result()`` (once) gives its outputs, as ``run_batch`` does.
    ``after``: the step that was still running when this one started (its fed rows take that one's tokens)."""

    def __init__(self, engine: Engine, runs: list[tuple[SeqState, np.ndarray, int]], entries: list[BatchEntry],
                 batched: list[np.ndarray] | Deferred | None, after: Step | None = None) -> None:
        self._engine: Engine | None = engine
        self._runs, self._entries, self._batched, self._after = runs, entries, batched, after
        self._outs: list[np.ndarray] | None = None  # once taken
        self.on_device = False  # once taken: whether the backend's batched step gave every output
        self._hold = Hold(engine.driver)  # given back when taken, or left (``forget``)
        self._hold.set(self, True)

    @property
    def running(self) -> bool:
        """Whether the backend is still running it on its device (the caller may do other work meanwhile)."""
        return isinstance(self._batched, Deferred)

    def ends(self) -> dict[int, tuple[int, int, bool]]:
        """Each sequence's (positions after this step, tokens it adds, whether its next token may be fed: its
        last row's argmax is chosen on the device)."""
        return {e.seq_id: (e.end, len(new), e.argmax_only and e.logit_rows > 0)
                for (_, new, _), e in zip(self._runs, self._entries)}

    def forget(self) -> None:
        """Leave the step untaken (its engine closed): the engine is no longer held for this step."""
        self._engine = None
        self._hold.set(self, False)

    def result(self) -> list[np.ndarray]:
        if self._engine is None:
            raise KestrelError("a step's result is taken once")
        engine, self._engine = self._engine, None
        try:
            with engine.driver():
                return self._take(engine)
        finally:
            self._hold.set(self, False)

    def _take(self, engine: Engine) -> list[np.ndarray]:
        batched = self._batched.result() if isinstance(self._batched, Deferred) else self._batched
        after = self._after
        if after is not None:
            if after._outs is None:
                raise KestrelError("the step before a fed step failed")
            # the fed tokens: the step before's outputs; if the device did not give them all, its own fed rows
            # ran on tokens the engine did not keep, so the host recomputes this step as well
            chosen = {e.seq_id: greedy_token(out) for e, out in zip(after._entries, after._outs) if e.logit_rows}
            for (seq, new, _), e in zip(self._runs, self._entries):
                if e.fed:
                    new[0] = chosen[seq.seq_id]
        device = after is None or after.on_device
        self._outs = engine._finish_batch(self._runs, self._entries, batched if device else None, device)
        self.on_device = batched is not None
        self._after = None
        return self._outs


def work_entry(entry: Any) -> tuple[Any, Any, Any]:
    """A step's work entry as its (sequence, new tokens, logit rows), each checked by the engine."""
    if not isinstance(entry, (tuple, list)) or len(entry) != 3:
        got = f"a {type(entry).__name__} of {len(entry)}" if isinstance(entry, (tuple, list)) else safe_repr(entry)
        raise KestrelError(f"a step's work entry must be a (sequence, new tokens, logit rows) triple, got {got}")
    return entry[0], entry[1], entry[2]


def step_tokens(new: Any, vocab: int) -> np.ndarray:
    """A step's new tokens as int64 [T]: token ids (``is_token_ids``; a float would be cut to an integer, a bool
    taken for 0 or 1) in the vocabulary, and at least one (the host refuses none), which a backend's whole step is
    not asked to check."""
    if not is_token_ids(new):
        raise KestrelError(f"a step's new tokens must be a sequence of token ids (integers), got {safe_repr(new)}")
    ids = np.asarray(new, dtype=np.int64).reshape(-1)
    if not len(ids):
        raise KestrelError("a step's new tokens are empty: each sequence in a step runs at least one token")
    outside = ids[(ids < 0) | (ids >= vocab)]
    if len(outside):
        raise KestrelError(f"token id {int(outside[0])} is outside the vocabulary [0, {vocab})")
    return ids


def tokens_behind(tokens: list[int], start: int, new: np.ndarray) -> np.ndarray:
    """tokens[start:] (positions the runner has not seen) then ``new``: a fresh int64 array either way, so
    a backend that writes into its input cannot change the sequence's tokens."""
    if start >= len(tokens):
        return new.copy()
    return np.concatenate([np.asarray(tokens[start:], np.int64), new])
