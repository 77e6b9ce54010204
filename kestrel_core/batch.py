"""What the batched whole-step hook (``kestrel_forward_batch``) receives: one entry per sequence."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchEntry:
    """One sequence's part of a batched step.

    ``tokens`` int64 [T] run at positions start..start+T-1; positions < start are in the backend's own KV
    cache of ``seq_id``, as its earlier steps left them (a backend that has fewer declines). The backend
    returns float32 logits [logit_rows, vocab] of the last ``logit_rows`` tokens (0: none, a prompt chunk
    whose next token is not sampled yet).
    """

    seq_id: int
    tokens: np.ndarray
    start: int
    logit_rows: int

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)
