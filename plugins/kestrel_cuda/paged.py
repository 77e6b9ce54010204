"""The paged KV pool of batched steps: the engine's page tables, mirrored on the device.

The engine admits, preempts and frees sequences by the blocks of its own KV pool and hands each batched
step every sequence's page table (``BatchEntry.blocks``). The device keeps keys and values in a pool of as
many blocks, laid out like a sequence's own cache (float16 [L, 2, KV, positions, hd], position p of a
sequence at row ``blocks[p // KV_BLOCK] * KV_BLOCK + p % KV_BLOCK``), so the engine's accounting is the
device's: no allocator here, and a sequence never finds the pool full. One more block at the end takes the
writes of the rows that pad a captured batch to its bucket.

A sequence moves between its own cache (a lone sequence: the captured M = 1 step and the pipelined greedy
decode) and the pool (two sequences or more) by copying its positions block by block. ``fetch`` and
``ids_later`` download a pooled step's results, ``per_entry`` splits them back into each entry's, and
``fed_rows`` finds where a step's fed rows take their tokens from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kestrel_core.batch import BatchEntry, id_range
from kestrel_cuda.plan import KV_BLOCK, KV_DTYPE

BUCKETS = (2, 4, 8, 16, 32, 64, 128, 256)  # batch sizes a decode step is captured for (rows padded up)


@dataclass
class Pool:
    kv: Any  # float16 [L, 2, KV, (blocks + 1) * KV_BLOCK, hd]
    blocks: int  # the engine's; block ``blocks`` is the padding rows' scratch
    rows: Any  # int32 [R, 2] device: each row's position and page-table row
    tables: Any  # int32 [R + 1, tb] device: page tables
    index: Any  # int32 [R] device: the rows whose logits a step returns
    hsel: Any  # float32 [R, D] device: those rows of the residual stream, for the lm_head
    held: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)  # seq_id -> (positions, blocks)
    filled: set[int] = field(default_factory=set)  # blocks holding a published prefix (BatchEntry.publish)
    graphs: dict[int, Callable[[], None]] = field(default_factory=dict)  # bucket -> captured decode step

    @property
    def table_width(self) -> int:
        return int(self.tables.shape[1])


@dataclass(frozen=True)
class Paged:
    """What one pass of ``DeviceForward._step`` over pool rows reads."""

    kv: Any
    rows: Any
    tables: Any
    index: Any | None  # gather these rows for the lm_head (None: the last ``rows`` rows)
    hsel: Any


def new_pool(ops: Any, config: Any, blocks: int, max_rows: int, max_context: int) -> Pool:
    c = config
    tb = -(-max_context // KV_BLOCK)
    return Pool(kv=ops.zeros((c.num_layers, 2, c.num_kv_heads, (blocks + 1) * KV_BLOCK, c.head_dim), KV_DTYPE),
                blocks=blocks, rows=ops.zeros((max_rows, 2), np.int32), tables=ops.zeros((max_rows + 1, tb), np.int32),
                index=ops.zeros(max_rows, np.int32), hsel=ops.zeros((max_rows, c.hidden_size), np.float32))


def bucket(m: int) -> int | None:
    """The captured batch size for ``m`` decode rows (None: more than the largest)."""
    return next((b for b in BUCKETS if b >= m), None)


def check(batch: Sequence[BatchEntry], vocab: int, max_context: int, max_rows: int) -> str | None:
    """Why the device cannot run ``batch`` in its pool (None: it can): ``max_rows`` sequences at most."""
    if len(batch) > max_rows:
        return f"{len(batch)} sequences in one step (at most {max_rows})"
    for e in batch:
        toks = np.asarray(e.tokens)
        if toks.size == 0 or toks.dtype.kind not in "iu" or e.start < 0 or (e.fed and toks.size != 1):
            return "no tokens, a bad start or a fed entry of several tokens"
        lo, hi = id_range(toks)
        if not e.fed and (lo < 0 or hi >= vocab):
            return "token id outside the vocabulary"
        if e.end > max_context:
            return f"context {e.end} beyond the device maximum {max_context}"
        if e.block_size != KV_BLOCK or len(e.blocks) * KV_BLOCK < e.end:
            return f"the engine's page table (blocks of {e.block_size}) does not cover the step"
        if not 0 < e.num_blocks or min(e.blocks) < 0 or max(e.blocks) >= e.num_blocks:
            return "a block id outside the engine's pool"
    if len({e.seq_id for e in batch}) != len(batch):
        return "a sequence twice in one batch"
    return None


def slots(blocks: Sequence[int], n: int) -> list[tuple[int, int]]:
    """(pool row, length) of each run of positions 0..n-1: one per block."""
    return [(b * KV_BLOCK, min(KV_BLOCK, n - j * KV_BLOCK)) for j, b in enumerate(blocks[:-(-n // KV_BLOCK)])]


def to_pool(ops: Any, own_kv: Any, pool: Pool, blocks: Sequence[int], n: int, first: int = 0) -> int:
    """Positions 0..n-1 of a sequence's own cache ([L, 2, KV, cap, hd]) into its pool blocks; with ``first``,
    only the blocks from the one holding position ``first`` on. The positions copied."""
    copied = 0
    for j, (row, length) in enumerate(slots(blocks, n)):
        p = j * KV_BLOCK
        if p + KV_BLOCK > first:
            ops.copy(pool.kv[:, :, :, row:row + length], own_kv[:, :, :, p:p + length])
            copied += length
    return copied


def from_pool(ops: Any, pool: Pool, blocks: Sequence[int], n: int, own_kv: Any, first: int = 0) -> int:
    """The reverse of ``to_pool``."""
    copied = 0
    for j, (row, length) in enumerate(slots(blocks, n)):
        p = j * KV_BLOCK
        if p + KV_BLOCK > first:
            ops.copy(own_kv[:, :, :, p:p + length], pool.kv[:, :, :, row:row + length])
            copied += length
    return copied


def written_blocks(e: BatchEntry) -> tuple[int, ...]:
    """The blocks a step of ``e`` writes (its positions start..end-1)."""
    return e.blocks[e.start // KV_BLOCK:-(-e.end // KV_BLOCK)]


def row_map(batch: Sequence[BatchEntry], first: int, count: int, pad_to: int, scratch: int,
            table_width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``first``..``first + count - 1`` of the batch's rows (its entries' tokens in order), padded to
    ``pad_to`` rows: (tokens [pad_to], rows [pad_to, 2] of position and table row, tables [S + 1, tb]);
    padding rows are token 0 at position 0 of the last table, whose blocks are all ``scratch``."""
    tokens = np.zeros(pad_to, np.int32)
    rows = np.zeros((pad_to, 2), np.int32)
    tables = np.full((len(batch) + 1, table_width), scratch, np.int32)
    rows[:, 1] = len(batch)
    at = 0
    for i, e in enumerate(batch):
        need = -(-e.end // KV_BLOCK)
        tables[i, :need] = e.blocks[:need]
        t = len(e.tokens)
        lo, hi = max(first, at), min(first + count, at + t)
        if hi - lo == 1:  # a decode row: scalar stores (slices and aranges cost five times as much)
            tokens[lo - first] = e.tokens[lo - at]
            rows[lo - first] = (e.start + lo - at, i)
        elif lo < hi:
            tokens[lo - first:hi - first] = np.asarray(e.tokens)[lo - at:hi - at]
            rows[lo - first:hi - first, 0] = e.start + np.arange(lo - at, hi - at)
            rows[lo - first:hi - first, 1] = i
        at += t
    return tokens, rows, tables


def fetch(ops: Any, argmax: Any, logits: Any, needs: list[bool], whole: bool
          ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """The first ``len(needs)`` rows of ``logits`` on the host: all of them when the batch's every row needs its
    logits (``whole``: float32 [rows, vocab], {}); else their greedy tokens (int32 [rows], by ``argmax_rows``
    into its scratch ``argmax``) and the logits [1, vocab] of the rows that need them, by row, so only those
    cross the bus (in one download of the block when most do)."""
    rows = len(needs)
    if whole:
        return ops.download(logits, rows), {}
    ids = ops.download(ops.argmax_rows(logits, rows, argmax), rows)
    if 2 * sum(needs) > rows:
        block = ops.download(logits, rows)
        return ids, {r: block[r:r + 1] for r in range(rows) if needs[r]}
    return ids, {r: ops.download(logits[r:r + 1], 1) for r in range(rows) if needs[r]}


def ids_later(ops: Any, argmax: Any, logits: Any, batch: Sequence[BatchEntry], rows: int
              ) -> tuple[tuple[Any, dict[int, int]], Callable[[], tuple[np.ndarray, dict[int, np.ndarray]]]]:
    """A one-pass step's greedy ids (no row needs its logits), chosen now: (the ids on the device and each
    sequence's last returned row among them, for the next step's fed rows; the call that returns them as
    ``fetch`` does, waiting for their download alone, not for later work)."""
    ids = ops.argmax_rows(logits, rows, argmax)
    last, at = {}, 0
    for e in batch:
        at += e.logit_rows
        if e.logit_rows:
            last[e.seq_id] = at - 1
    host = ops.download_later(ids, rows)
    return (ids, last), lambda: (host(), {})


def fed_rows(batch: Sequence[BatchEntry], last: dict[int, int]) -> dict[int, int]:
    """Each fed entry's row of the step: its sequence's row among the step before's ids (``ids_later``)."""
    rows, at = {}, 0
    for e in batch:
        if e.fed:
            rows[at] = last[e.seq_id]
        at += len(e.tokens)
    return rows


def per_entry(batch: Sequence[BatchEntry], fetched: list[tuple[np.ndarray, dict[int, np.ndarray]]],
               vocab: int, whole: bool) -> list[np.ndarray]:
    """Each entry's result from the passes' downloads (``fetch``'s or ``ids_later``'s), in batch order: its
    logits [logit_rows, vocab] (views of one array when ``whole``: every row came back), or its greedy tokens
    int64 [logit_rows] (argmax_only)."""
    if not fetched:  # prompt chunks only, none of whose logits are due yet
        return [np.zeros(0, np.int64) if e.argmax_only else np.zeros((0, vocab), np.float32) for e in batch]
    if whole:
        rows_out = np.concatenate([out for out, _ in fetched]) if len(fetched) > 1 else fetched[0][0]
        parts, at = [], 0
        for e in batch:
            parts.append(rows_out[at:at + e.logit_rows])
            at += e.logit_rows
        return parts
    ids, logit_rows, base = [], {}, 0  # every returned row's greedy token, and the logits some rows need
    for out, extra in fetched:
        ids.append(out.astype(np.int64))
        logit_rows.update({base + r: row for r, row in extra.items()})
        base += len(out)
    all_ids = np.concatenate(ids)
    parts, at = [], 0
    for e in batch:
        rows = range(at, at + e.logit_rows)
        if e.argmax_only:
            parts.append(all_ids[at:at + e.logit_rows])
        else:
            parts.append(np.concatenate([logit_rows[r] for r in rows]) if rows else np.zeros((0, vocab), np.float32))
        at += e.logit_rows
    return parts
