"""What the batched whole-step hook (``kestrel_forward_batch``) receives: one entry per sequence."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchEntry:
    """One sequence's part of a batched step.

    ``tokens`` int64 [T] run at positions start..start+T-1; positions < start are in the backend's own KV
    cache of ``seq_id``, as its earlier steps left them (a backend that has fewer declines; since API 1.6, to a
    backend that declares it, one that has more computes the positions from ``start`` on again: the engine
    took back draft tokens the model did not confirm). The backend returns float32 logits [logit_rows, vocab]
    of the last ``logit_rows`` tokens (0: none, a prompt chunk whose next token is not sampled yet).

    ``blocks`` is the engine's page table of the sequence: position p lives in block ``blocks[p //
    block_size]`` (offset ``p % block_size``), with blocks for at least ``end`` positions; every block id is
    below ``num_blocks``. The engine admits, preempts and frees sequences by these blocks, so a backend that
    keeps its KV cache in a pool of ``num_blocks`` blocks laid out the same way never runs out of room and
    needs no allocator of its own. A backend may ignore them (empty when the engine has no page table).

    ``argmax_only``: the engine needs only each returned row's greedy token (greedy sampling, no penalties,
    no logprobs), so the backend may return int64 token ids [logit_rows] instead of the logits: numpy's
    argmax of each row (the first largest), or -1 for a row holding a NaN or an infinity (the step is then
    declined, as non-finite logits are). Since API 1.2.

    ``fed``: the entry's one token is not known to the engine yet: it is the token this backend chose on its
    device for the sequence's last row in the step before (an ``argmax_only`` entry of the step the engine
    has not yet taken the results of), and ``tokens`` holds a placeholder (-1). The engine offers such a
    step while the one before still runs, so the device need not wait for the host. A backend that cannot
    resolve a fed entry declines the step. Since API 1.4, and only to a backend that declares it.

    ``shared`` and ``publish``: the engine's prefix cache in the backend's pool, since API 1.5 and only to a
    backend that declares it (0 otherwise). Positions below ``shared`` are a prefix other sequences computed
    (the blocks at the start of ``blocks`` are theirs): a backend that holds nothing of ``seq_id`` finds their
    keys and values in those blocks of its pool, and declines the step if it cannot (the engine then offers
    the sequence from position 0). Positions below ``publish`` (the prompt's whole blocks so far, in a step of
    the prompt) are shared with later sequences once the step is done: the backend leaves their keys and
    values in the sequence's blocks of its pool by then, also where it runs the sequence in a cache of its own.
    """

    seq_id: int
    tokens: np.ndarray
    start: int
    logit_rows: int
    blocks: tuple[int, ...] = ()
    block_size: int = 0
    num_blocks: int = 0
    argmax_only: bool = False
    fed: bool = False
    shared: int = 0
    publish: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def greedy_token(out: np.ndarray) -> int:
    """The greedy token of an entry's result: its last row's id (argmax_only), or its last row's argmax."""
    return int(out[-1]) if out.ndim == 1 else int(np.argmax(out[-1]))


def greedy_probability(out: np.ndarray) -> float:
    """The probability of an entry's greedy token: the softmax of its last row of logits at their largest (the
    logits themselves, not argmax_only's ids)."""
    row = out[-1]
    return 1.0 / float(np.exp(row - row.max(), dtype=np.float64).sum())


def id_range(ids: np.ndarray) -> tuple[int, int]:
    """(min, max) of a non-empty integer array as Python ints; a decode row's one id is read directly, since
    numpy's reductions cost more than the check that wants them."""
    return (int(ids[0]),) * 2 if ids.size == 1 else (int(ids.min()), int(ids.max()))
