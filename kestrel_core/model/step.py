"""A batched step started on an engine (``Engine.start_batch``), whose outputs are taken once (``Step.result``).

Until they are, the step holds its engine for the thread that started it (kestrel_core.model.driver): a step the
device still runs reads and writes what another thread's step would change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kestrel_core.batch import BatchEntry, greedy_token
from kestrel_core.dispatch import Deferred
from kestrel_core.errors import KestrelError
from kestrel_core.model.driver import Hold

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
