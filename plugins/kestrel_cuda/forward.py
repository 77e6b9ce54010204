"""Whole-step decode on the device: one token step (or a prefill) of a ``Model`` run entirely on the GPU.

API (what the ``kestrel_forward`` / ``kestrel_release_sequence`` hookimpls call):

    fwd = DeviceForward(weight_source=None, layer_boundary=None, *, config=None, stream=None, gemm=None,
                        pin=None, unpin=None, ops=None, target_blocks=None, fuse_rope=True,
                        fuse_attention=True)
    fwd.forward(model, seq_id, tokens, start, all_logits, ids=False) -> np.ndarray float32 [T or 1, vocab] | None
    fwd.greedy(model, seq_id, token, start, count) -> Iterator[int] | None
    fwd.release(seq_id) -> None
    fwd.stats() -> dict[str, int | float]
    fwd.close() -> None

- ``weight_source(wkey, strips) -> DeviceWeight | None``: the weight cache's get-or-upload
  (``residency.DeviceWeight``: ``.geometry``, ``.codes``, ``.scales`` in the K-major layout of layout.py).
  ``strips`` has one StripCache, or several (Q|K|V, gate|up) under their fused wkey when
  ``layout.fusable`` allows it; returning None for a fused request makes the forward ask per projection.
  ``None``: the forward packs and uploads its own copy of every weight (host packing: small models, tests).
- ``config``: a ``CudaConfig`` (default: every setting's default): ``max_context``, ``graph``, and, for the
  ``CupyOps`` made when ``ops`` is None, ``pdl`` and ``cluster``.
- ``layer_boundary(layer)``: called before each layer. Given (residency window on, ``KESTREL_CUDA_WINDOW``),
  it forces the non-graph path and weights are fetched through ``weight_source`` per layer per step: a
  captured graph bakes in device pointers that an eviction would invalidate. Uploads and these kernels
  must then share ``stream`` (stream order is what makes reusing an evicted buffer safe).
- Without a window, the decode step (T == 1) is captured once per sequence in a CUDA graph and replayed
  (``config.graph``); the position and the token are read from device memory, so one graph serves every
  position. A released sequence's KV cache and graph are kept for the next new sequence (one spare):
  capturing ~300 launches costs milliseconds, which `kestrel bench` and every `generate` would otherwise pay
  once per prompt. Its kernels are launched with programmatic dependent launch (``config.pdl``,
  forward_launch.py). ``pin(wkey)``/``unpin(wkey)`` (the cache's) keep the weights a graph captured
  resident; they are unpinned when the model changes or at ``close``.
- ``gemm``: ``gemm.DeviceGemm``; every step of more than one row (prefill chunks, batches) runs its
  tensor-core GEMM (``q8``). Without it they run the fused GEMV, ``SMALL_M`` rows per weight pass.
- ``stream``: a ``cupy.cuda.Stream(non_blocking=True)`` (capturable); default a new one.
- ``ops``: ``ops_numpy.NumpyOps()`` runs every step on the CPU mirrors (tests); default a ``CupyOps``.
- ``target_blocks``: the M=1 K-split planner's target (``plan.plan_split``; default its own rule);
  ``fuse_rope``: at M = 1 with head_dim == TILE_N the q|k|v GEMV's epilogue does qkv_rope's work (one head a
  column tile: a launch fewer per layer and step, the same bits); False keeps the separate kernel.
  ``fuse_attention``: with it, where ``ops.attend_folds`` says (plan.attend_folds), decode attention runs in
  that GEMV's clusters too (plan.AttendFold: another launch fewer; the splits' records merged in another
  order, so float32 rounding apart); False keeps attn_decode.
- ``forward``: ``tokens`` (integers) [T] at absolute positions ``start..start+T-1`` of sequence ``seq_id``.
  The KV cache lives on the device, one per ``seq_id`` (float16, grown 1024 positions at a time up to
  min(model context, ``config.max_context``)); ``start == 0`` resets it; ``start`` below the cached length
  rewinds. Declines (returns None; the engine recomputes on the CPU): ``start`` above the cached length (the
  engine ran steps on the CPU meanwhile), a context beyond the maximum, a token outside the vocabulary, an
  unsupported model (head_dim over 128 or not a multiple of 4, heads not a multiple of KV heads). Any device
  error drops the sequence's state and propagates (the dispatcher declines). Returns all T rows of logits if
  ``all_logits`` else the last row, as [1, vocab]; with ``ids``, those rows' greedy tokens instead (int64).
- ``greedy``: pipelined greedy decode from the sequence's device KV cache: ``token`` at ``start``, then each
  step's argmax at the next position, at most ``count`` steps; yields the chosen tokens. The decode graph
  ends in ``lm_finish``, which writes its argmax into the next step's input and position on the device and
  into pinned host memory, so step i + 1 is launched before the host reads step i's token: the host's share
  of a token (launch, logits download, argmax: ~140 us on the H200 at the qwen3-8b shape) overlaps the GPU.
  The device may have run one step beyond what the consumer took; those positions are rewritten before they
  are read. Declines without the captured graph.

The model math is kestrel_core.model.decoder's; the kernels are the ``.cu`` files of kernels.FORWARD_SOURCES,
launched by ops_cupy.py (its mixture-of-experts kernels by ops_moe.py); forward_state.py holds what one model
keeps on the device, forward_step.py launches one step's kernels, forward_moe.py a mixture of experts' MLP.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kestrel_core.batch import BatchEntry
from kestrel_core.model.decoder import PREFILL_CHUNK
from kestrel_core.model.weights import Model
from kestrel_cuda import paged
from kestrel_cuda.config import CudaConfig
from kestrel_cuda.forward_state import Projections, State, WeightSource, build_state, pin_weights, unsupported_reason
from kestrel_cuda.forward_step import Stepper
from kestrel_cuda.plan import KV_BLOCK, KV_DTYPE, PASS_ROWS, TOKEN_RING

UNFIT = ("the model's weights do not all fit the weight cache (KESTREL_CUDA_CACHE_MB); KESTREL_CUDA_WINDOW streams "
         "them a layer at a time")

CAP_CHUNK = 1024  # KV positions are allocated this many at a time
@dataclass
class _Seq:
    kv: Any  # float16 [L, 2, KV, cap, hd]
    length: int = 0
    pooled: int = 0  # its first positions that are in its blocks of the pool too (published, or moved there)
    graph: Callable[[], None] | None = None
    owner: int | None = None  # as the spare: the pooled sequence whose first ``length`` positions it still holds

    @property
    def capacity(self) -> int:
        return int(self.kv.shape[3])


class DeviceForward:
    """The whole-step forward of the CUDA backend (see the module docstring for the API)."""

    def __init__(self, weight_source: WeightSource | None = None,
                 layer_boundary: Callable[[int], None] | None = None, *, config: CudaConfig | None = None,
                 stream: Any = None, gemm: Any = None, pin: Callable[[int], None] | None = None,
                 unpin: Callable[[int], None] | None = None, ops: Any = None, target_blocks: int | None = None,
                 fuse_rope: bool = True, fuse_attention: bool = True) -> None:
        config = config or CudaConfig()
        if ops is None:
            from kestrel_cuda.ops_cupy import CupyOps

            ops = CupyOps(stream, gemm, pdl=config.pdl, cluster=config.cluster, trace=config.trace)
        self.ops = ops
        self.xp = ops.xp
        self.weight_source = weight_source
        self.layer_boundary = layer_boundary
        self.pin = pin
        self.unpin = unpin
        self.max_context = config.max_context
        self.use_graph = config.graph and layer_boundary is None
        self.projections = Projections(ops, weight_source, getattr(ops, "sm_count", 132),
                                       bool(getattr(ops, "cluster", False)), target_blocks)
        self.stepper = Stepper(ops, self.projections, layer_boundary, fuse_rope, fuse_attention)
        self._st: State | None = None
        self._unfit: Model | None = None  # a model whose weights the cache could not hold all at once
        self._seqs: dict[int, _Seq] = {}
        self._spare: _Seq | None = None  # the last released sequence: KV cache and graph, for the next one
        self._pool: paged.Pool | None = None  # batched steps' KV (paged.py), made at the first batch
        # the last pooled step's greedy ids on the device and each sequence's row there: what fed rows take
        self._feed: tuple[Any, dict[int, int]] | None = None
        self.counters: dict[str, int] = {"steps": 0, "graph_replays": 0, "graph_captures": 0,
                                         "prefill_tokens": 0, "decode_tokens": 0, "declined": 0,
                                         "sequences_reused": 0, "batch_steps": 0, "batch_rows": 0,
                                         "batch_graph_replays": 0, "batch_argmax_steps": 0, "pool_moves": 0,
                                         "fed_rows": 0, "prefix_positions": 0, "prefix_blocks_published": 0,
                                         "pool_out_of_memory": 0, "rewound_positions": 0, "pool_move_positions": 0}
        self.last_decline = ""

    # -- API -----------------------------------------------------------------------------------------

    def forward(self, model: Model, seq_id: int, tokens: Any, start: int, all_logits: bool,
                ids: bool = False) -> np.ndarray | None:
        toks = np.asarray(tokens).reshape(-1)
        if toks.size == 0 or not np.issubdtype(toks.dtype, np.integer) or start < 0:
            return self._decline("no tokens or a bad start")
        v = model.config.vocab_size
        if int(toks.min()) < 0 or int(toks.max()) >= v:
            return self._decline("token id outside the vocabulary")
        st = self._state(model)
        if st is None:
            return None
        self._feed = None
        end = start + len(toks)
        if end > st.max_context:
            return self._decline(f"context {end} beyond the device maximum {st.max_context}")
        try:
            self._leave_pool(st, seq_id, start)
            seq = self._open_sequence(st, seq_id, start, end)
            if seq is None:
                return None
            return self._run(st, seq, toks.astype(np.int32), start, all_logits, ids)
        except BaseException:
            self._seqs.pop(seq_id, None)  # its KV cache may be half written
            raise

    def greedy(self, model: Model, seq_id: int, token: int, start: int, count: int) -> Iterator[int] | None:
        if not self.use_graph:
            why = ("the residency window uploads weights between layers" if self.layer_boundary is not None else
                   "CUDA graphs are off")
            return self._decline(f"pipelined greedy decode needs the captured decode graph ({why})")
        if not 0 <= int(token) < model.config.vocab_size or start < 0 or count < 1:
            return self._decline("token id outside the vocabulary, a bad start or no steps")
        st = self._state(model)
        if st is None:
            return None
        count = min(count, st.max_context - start)
        if count < 1:
            return self._decline(f"context {start + 1} beyond the device maximum {st.max_context}")
        try:
            self._leave_pool(st, seq_id, start)
            seq = self._open_sequence(st, seq_id, start, start + 1)  # the KV cache grows as the steps go
            if seq is None:
                return None
            self._graph(st, seq)
            self.ops.write_meta(st.meta, np.array([start, token], np.int32))
        except BaseException:
            self._seqs.pop(seq_id, None)
            raise
        return self._pipeline(st, seq_id, seq, start, count)

    def _pipeline(self, st: State, seq_id: int, seq: _Seq, start: int, count: int) -> Generator[int, Any, None]:
        """Steps i and i + 1 in flight while the host waits for step i's token (lm_finish feeds each step's
        argmax to the next on the device). A step beyond the KV capacity first drains the steps in flight,
        grows the cache (which re-captures the graph) and writes its position and token from the host.
        ``send(False)`` returns the token of the step in flight and launches none after it."""
        events: list[Any] = []

        def launch(i: int) -> None:
            nonlocal seq
            pos = start + i
            if pos >= seq.capacity:
                self.ops.wait(events[i - 1])
                token = int(st.tokens[(pos - 1) % TOKEN_RING])
                seq = self._reserve(st, seq_id, seq, pos + 1)
                self._graph(st, seq)
                self.ops.write_meta(st.meta, np.array([pos, token], np.int32))
            seq.graph()
            seq.length = pos + 1
            events.append(self.ops.record())
            self.counters["graph_replays"] += 1
            self.counters["steps"] += 1
            self.counters["decode_tokens"] += 1

        last = count - 1  # the last step to launch
        try:
            launch(0)
            for i in range(count):
                if i < last:
                    launch(i + 1)
                self.ops.wait(events[i])
                if (yield int(st.tokens[(start + i) % TOKEN_RING])) is False:
                    last = min(last, i + 1)
                if i == last:
                    return
        except GeneratorExit:  # the consumer stopped: the cache holds every step launched, still valid
            raise
        except BaseException:
            self._seqs.pop(seq_id, None)  # its KV cache may be half written
            raise

    def _open_sequence(self, st: State, seq_id: int, start: int, end: int) -> _Seq | None:
        """The sequence to run positions ``start``..``end - 1`` (rewound to ``start``, its KV cache grown to
        ``end``), the spare for a new one, or None (declined: the device holds fewer than ``start``)."""
        seq = self._seqs.get(seq_id)
        if seq is None and start == 0 and self._spare is not None:
            seq, self._spare = self._spare, None  # every position is written before it is read
            seq.owner = None
            self._seqs[seq_id] = seq
            self.counters["sequences_reused"] += 1
        if start == 0:
            if seq is not None:
                seq.length = seq.pooled = 0
        elif seq is None or start > seq.length:
            return self._decline("the device KV cache is behind the engine's")
        else:
            self.counters["rewound_positions"] += seq.length - start
            seq.length = start  # rewind: positions >= start are overwritten
            seq.pooled = min(seq.pooled, start)
        return self._reserve(st, seq_id, seq, end)

    def release(self, seq_id: int) -> None:
        if self._pool is not None:
            self._pool.held.pop(seq_id, None)
        if self._spare is not None and self._spare.owner == seq_id:
            self._spare.owner = None
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._spare = seq

    def reset_pool(self) -> None:
        """Forget the pool, its sequences and its captured batch graphs (benchmarks switching kernels)."""
        self._pool = None

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {f"forward_{k}": v for k, v in self.counters.items()}
        out["forward_sequences"] = len(self._seqs)
        out["forward_launches"] = int(getattr(self.ops, "launches", 0))
        return out

    def close(self) -> None:
        self._teardown()

    def forward_batch(self, model: Model, batch: Sequence[BatchEntry]) -> list[np.ndarray] | None:
        """One step of several sequences: logits [logit_rows, vocab] each (ids where argmax_only), or None."""
        out = self.start_batch(model, batch)
        return out() if callable(out) else out

    def start_batch(self, model: Model, batch: Sequence[BatchEntry]
                    ) -> list[np.ndarray] | Callable[[], list[np.ndarray]] | None:
        """``forward_batch`` as ``kestrel_forward_batch`` runs it: a step of one pass over the pool returns,
        once launched, the call that waits for it and downloads its results.

        A batch of one runs the lone-sequence path (its own cache: captured step, pipelined greedy decode),
        but for a draft's check (``_checks_guesses``); more run their rows together over the paged pool, a
        step that wants every row's logits (decode rows, drafts' checks) as the captured step of its bucket.
        Declines (nothing changed): no page tables from the engine, a sequence the device is behind on, what
        ``forward`` declines."""
        st = self._state(model)
        if st is None:
            return None
        reason = paged.check(batch, model.config.vocab_size, st.max_context, PASS_ROWS)
        if reason is None and any(e.fed for e in batch):
            chosen = self._feed[1] if self._feed is not None and len(batch) > 1 else {}
            reason = None if all(e.seq_id in chosen for e in batch if e.fed) else "a fed row the device did not choose"
        if reason is not None:
            return self._decline(reason)
        self._feed, feed = None, self._feed
        if len(batch) == 1 and not (self._checks_guesses(batch[0]) and self._lone_pool(st, batch[0].num_blocks)):
            e = batch[0]
            pool = self._lone_pool(st, e.num_blocks) if e.shared or e.publish else None
            if e.shared and (pool is None or not self._adopt_prefix(pool, e)):
                return self._decline("a shared prefix's blocks are not in the device's pool")
            out = self.forward(model, e.seq_id, e.tokens, e.start, e.logit_rows > 1, ids=e.argmax_only)
            if out is None:
                return None
            if pool is not None and e.publish:
                self._publish(pool, e)
            return [out[len(out) - e.logit_rows:]]
        pool = self._pool_for(st, batch[0].num_blocks)
        rewound = 0  # positions the device holds from an entry's start on: written again (a rewind)
        for e in batch:
            if not self._adopt_prefix(pool, e):
                return self._decline("a shared prefix's blocks are not in the device's pool")
            own = self._seqs.get(e.seq_id)
            held = pool.held.get(e.seq_id, (own.length if own is not None else 0, ()))[0]
            if e.start > held:
                return self._decline("the device KV cache is behind the engine's")
            rewound += held - e.start
        self.counters["rewound_positions"] += rewound
        try:
            for e in batch:  # a lone sequence's own cache joins the pool: what its pool blocks lack
                own = self._seqs.pop(e.seq_id, None)
                if own is not None:
                    self.counters["pool_move_positions"] += paged.to_pool(self.ops, own.kv, pool, e.blocks,
                                                                          e.start, first=own.pooled)
                    own.length, own.owner = min(own.length, e.start), e.seq_id  # the spare, still its own
                    self._spare = own
                    self.counters["pool_moves"] += 1
                elif self._spare is not None and self._spare.owner == e.seq_id:
                    self._spare.length = min(self._spare.length, e.start)  # (a rewind in the pool)
                pool.held[e.seq_id] = (e.start, e.blocks)
            outs = self._run_pooled(st, pool, batch, feed)
        except BaseException:
            for e in batch:
                pool.held.pop(e.seq_id, None)  # their pool blocks may be half written
                pool.filled.difference_update(paged.written_blocks(e))
            raise
        for e in batch:
            pool.held[e.seq_id] = (e.end, e.blocks)
            pool.filled.update(e.blocks[e.start // KV_BLOCK:e.publish // KV_BLOCK])  # (the earlier ones are)
        return outs

    def _checks_guesses(self, e: BatchEntry) -> bool:
        """Whether a lone sequence's step runs in the pool, as the captured step of its rows' bucket: several
        rows whose every greedy token is wanted (a draft's check). In its own cache they would run as a prompt
        chunk, a kernel launched at a time, which costs the host several times the GPU's work at a few rows."""
        return (self.use_graph and e.argmax_only and 1 < len(e.tokens) == e.logit_rows
                and paged.bucket(len(e.tokens)) is not None)

    def _pool_for(self, st: State, blocks: int) -> paged.Pool:
        """The pool of the engine's ``blocks`` blocks (made anew for another engine's page tables)."""
        pool = self._pool
        if pool is None or pool.blocks != blocks:
            pool = self._pool = paged.new_pool(self.ops, st.config, blocks, PASS_ROWS, st.max_context)
            for seq in self._seqs.values():  # nothing of theirs is in the new pool
                seq.pooled = 0
            if self._spare is not None:
                self._spare.owner = None
        return pool

    def _lone_pool(self, st: State, blocks: int) -> paged.Pool | None:
        """The pool, for a lone sequence's prefixes; None where the device has no room for it (its prompts are
        then not published, and a prefix shared from it is declined: the engine computes it again)."""
        try:
            return self._pool_for(st, blocks)
        except MemoryError:  # CuPy's OutOfMemoryError among them
            self.counters["pool_out_of_memory"] += 1
            return None

    def _adopt_prefix(self, pool: paged.Pool, e: BatchEntry) -> bool:
        """Whether ``e`` can run as far as a shared prefix goes: the device holds the sequence already, or the
        pool holds the prefix's blocks (published, ``filled``), which the sequence then starts from."""
        if not e.shared or e.seq_id in self._seqs or e.seq_id in pool.held:
            return True
        if not pool.filled.issuperset(e.blocks[:-(-e.shared // KV_BLOCK)]):
            return False
        pool.held[e.seq_id] = (e.shared, e.blocks)
        self.counters["prefix_positions"] += e.shared
        return True

    def _publish(self, pool: paged.Pool, e: BatchEntry) -> None:
        """Positions below ``e.publish`` of a sequence that ran in its own cache, into its pool blocks."""
        own = self._seqs[e.seq_id]
        if own.pooled >= e.publish:
            return
        first = own.pooled // KV_BLOCK
        try:
            paged.to_pool(self.ops, own.kv, pool, e.blocks, e.publish, first=own.pooled)
        except BaseException:
            pool.filled.difference_update(e.blocks[first:-(-e.publish // KV_BLOCK)])  # may be half written
            raise
        own.pooled = e.publish
        pool.filled.update(e.blocks[first:e.publish // KV_BLOCK])
        self.counters["prefix_blocks_published"] += e.publish // KV_BLOCK - first

    def _run_pooled(self, st: State, pool: paged.Pool, batch: Sequence[BatchEntry],
                    feed: tuple[Any, dict[int, int]] | None = None
                    ) -> list[np.ndarray] | Callable[[], list[np.ndarray]]:
        """The passes of a pooled step; a step of one pass returns its results' call without waiting. Fed rows
        take their tokens from ``feed`` (the step before's ids on the device). A step of one pass that returns
        only greedy ids leaves them on the device for the next step's fed rows (``_feed``)."""
        ops, total = self.ops, sum(len(e.tokens) for e in batch)
        if st.logits_all is None:
            st.logits_all = ops.zeros((PASS_ROWS, st.config.vocab_size), np.float32)
        wanted, needs, at = [], [], 0  # rows whose logits are returned, in batch order; which need the logits
        for e in batch:
            at += len(e.tokens)
            wanted.extend(range(at - e.logit_rows, at))
            needs.extend([not e.argmax_only] * e.logit_rows)
        decode = len(wanted) == total  # every row's logits: decode rows, and drafts' checks
        b = paged.bucket(total) if decode and self.use_graph else None
        whole = all(needs)  # every row's logits come back, in one download a pass
        argmax_step = bool(needs) and not any(needs)  # token ids alone come back
        ids_only = argmax_step and total <= PASS_ROWS  # ... in one pass: chosen at launch (_ids_later)
        row_of = paged.fed_rows(batch, feed[1]) if feed is not None else {}
        if feed is not None and any(r >= PASS_ROWS for r in row_of):  # a later pass's fed rows: their tokens
            ids = ops.zeros(feed[0].shape, feed[0].dtype)  # kept apart from the ids an earlier pass's fetch writes
            ops.copy(ids, feed[0])
            feed = (ids, feed[1])
        fetched: list[tuple[np.ndarray, dict[int, np.ndarray]]] = []  # per pass: (logits or ids, logit rows)
        fetches: list[Callable[[], tuple[np.ndarray, dict[int, np.ndarray]]]] = []  # the passes' downloads
        done = 0  # returned rows so far
        for first in range(0, total, PASS_ROWS):
            if fetches:  # an earlier pass's results come back before the next pass reuses its buffers
                fetched.append(fetches.pop()())
            m = min(PASS_ROWS, total - first)
            tokens, rows, tables = paged.row_map(batch, first, m, b or m, pool.blocks, pool.table_width)
            tokens[tokens < 0] = 0  # fed rows: their tokens come from the device, below
            ops.write_meta(st.meta, np.concatenate([np.zeros(1, np.int32), tokens]))
            fed = [(r - first, src) for r, src in row_of.items() if first <= r < first + m]
            if fed:
                ops.put_ids(st.meta, np.array([1 + r for r, _ in fed], np.int32), feed[0],  # type: ignore[index]
                            np.array([src for _, src in fed], np.int32))
            ops.write_meta(pool.rows.reshape(-1), rows.reshape(-1))
            ops.write_meta(pool.tables.reshape(-1), tables.reshape(-1))
            if b is not None:
                self._batch_graph(st, pool, b)()
                self.counters["batch_graph_replays"] += 1
                fetches.append(self._ids_later(st, st.logits_all, batch, needs) if ids_only else
                               lambda: paged.fetch(ops, st.argmax, st.logits_all, needs, whole))
                continue
            local = [r - first for r in wanted if first <= r < first + m]
            index = None
            if local and local != list(range(m - len(local), m)):
                index = pool.index
                ops.write_meta(index, np.array(local, np.int32))
            self.stepper.run(st, None, m, len(local),
                             paged.Paged(pool.kv, pool.rows[:m], pool.tables, index, pool.hsel))
            if local:
                src = st.logits_all if len(local) > 1 else st.logits
                part = needs[done:done + len(local)]
                fetches.append(self._ids_later(st, src, batch, part) if ids_only else
                               lambda src=src, part=part: paged.fetch(ops, st.argmax, src, part, whole))
                done += len(local)
        self.counters["batch_steps"] += 1
        self.counters["batch_argmax_steps"] += argmax_step
        self.counters["batch_rows"] += total
        self.counters["fed_rows"] += len(row_of)

        def results() -> list[np.ndarray]:
            fetched.extend(f() for f in fetches)
            if not fetches:
                ops.synchronize()
            return paged.per_entry(batch, fetched, st.config.vocab_size, whole)

        return results if total <= PASS_ROWS else results()

    def _ids_later(self, st: State, logits: Any, batch: Sequence[BatchEntry], needs: list[bool]
                   ) -> Callable[[], tuple[np.ndarray, dict[int, np.ndarray]]]:
        """``paged.ids_later``, whose ids the next step's fed rows take (``_feed``)."""
        self._feed, call = paged.ids_later(self.ops, st.argmax, logits, batch, len(needs))
        return call

    def _batch_graph(self, st: State, pool: paged.Pool, b: int) -> Callable[[], None]:
        """The decode step of ``b`` pooled rows as a captured graph (rows, tables and tokens read from the
        device, so one graph serves every step of that bucket)."""
        graph = pool.graphs.get(b)
        if graph is None:
            self._pin_weights(st)
            view = paged.Paged(pool.kv, pool.rows[:b], pool.tables, None, pool.hsel)
            self.stepper.run(st, None, b, b, view)  # eagerly first: the tiled GEMM's scratch grows outside the capture
            graph = pool.graphs[b] = self.ops.capture(lambda: self.stepper.run(st, None, b, b, view))
            self.counters["graph_captures"] += 1
        return graph

    def _leave_pool(self, st: State, seq_id: int, start: int) -> None:
        """A pooled sequence that runs alone again: its first ``start`` positions back into a cache of its own."""
        pool = self._pool
        if pool is None or seq_id not in pool.held:
            return
        held, blocks = pool.held.pop(seq_id)
        if start > held:
            return
        self.counters["rewound_positions"] += held - start
        seq, self._spare = self._spare, None  # the last one's cache and the decode graph it captured: its own
        keep = 0  # cache's first positions where it was this sequence's (the pool never rewrote them)
        if seq is not None:
            keep = min(seq.length, start) if seq.owner == seq_id else 0
            seq.length, seq.owner = keep, None
            self._seqs[seq_id] = seq
        seq = self._reserve(st, seq_id, seq, max(start, 1))
        self.counters["pool_move_positions"] += paged.from_pool(self.ops, pool, blocks, start, seq.kv, first=keep)
        seq.length = seq.pooled = start
        self.counters["pool_moves"] += 1

    # -- steps ---------------------------------------------------------------------------------------

    def _decline(self, reason: str) -> None:
        self.counters["declined"] += 1
        self.last_decline = reason
        return None

    def _run(self, st: State, seq: _Seq, toks: np.ndarray, start: int, all_logits: bool,
             ids: bool = False) -> np.ndarray:
        """The chunks of a lone sequence's step: their logits, or with ``ids`` each returned row's greedy token
        (int64, -1 for a row with a NaN or an infinity: ``argmax_rows``), so only those cross the bus."""
        ops, t = self.ops, len(toks)
        if all_logits and t > 1 and st.logits_all is None:
            st.logits_all = self.ops.zeros((PASS_ROWS, st.config.vocab_size), np.float32)
        outs = []
        for c0 in range(0, t, PREFILL_CHUNK):  # a lone sequence's chunks, as the engine sends them
            chunk = toks[c0:c0 + PREFILL_CHUNK]
            m = len(chunk)
            last = c0 + PREFILL_CHUNK >= t
            rows = m if all_logits else (1 if last else 0)
            pos = start + c0
            ops.write_meta(st.meta, np.concatenate([np.array([pos], np.int32), chunk]))
            if m == 1 and self.use_graph:
                self._graph(st, seq)
                seq.graph()
                self.counters["graph_replays"] += 1
            else:
                self.stepper.run(st, seq.kv, m, rows)
            seq.length = pos + m
            self.counters["steps"] += 1
            self.counters["decode_tokens" if m == 1 else "prefill_tokens"] += m
            if rows:
                src = st.logits_all if rows > 1 else st.logits
                outs.append(ops.download(ops.argmax_rows(src, rows, st.argmax), rows).astype(np.int64) if ids
                            else ops.download(src, rows))
        ops.synchronize()
        return np.concatenate(outs) if len(outs) > 1 else outs[0]

    def _graph(self, st: State, seq: _Seq) -> Callable[[], None]:
        """The sequence's decode step (M = 1) as a captured graph, captured on first use."""
        if seq.graph is None:
            self._pin_weights(st)
            seq.graph = self.ops.capture(lambda: self.stepper.run(st, seq.kv, 1, 1))
            self.counters["graph_captures"] += 1
        return seq.graph

    # -- sequences -----------------------------------------------------------------------------------

    def _reserve(self, st: State, seq_id: int, seq: _Seq | None, end: int) -> _Seq:
        if seq is not None and end <= seq.capacity:
            return seq
        c = st.config
        cap = min(st.max_context, -(-end // CAP_CHUNK) * CAP_CHUNK)
        kv = self.ops.zeros((c.num_layers, 2, c.num_kv_heads, cap, c.head_dim), KV_DTYPE)
        if seq is None:
            seq = self._seqs[seq_id] = _Seq(kv)
        else:
            n = seq.length
            self.ops.copy(kv[:, :, :, :n], seq.kv[:, :, :, :n])
            seq.kv = kv
            seq.graph = None  # it captured the old buffer
        return seq

    # -- model state ---------------------------------------------------------------------------------

    def _state(self, model: Model) -> State | None:
        st = self._st
        if st is not None and st.model is model:
            return st
        reason = unsupported_reason(model)
        if reason is not None or model is self._unfit:
            return self._decline(UNFIT if reason is None else f"unsupported model: {reason}")
        self._teardown()
        resident = self.layer_boundary is None
        self._st = build_state(model, self.ops, self.projections, self.max_context, resident)
        if resident:  # pinned now: a weight a later fetch evicted would be read from another weight's buffer
            try:
                self._pin_weights(self._st)
            except KeyError:
                self._teardown()
                self._unfit = model
                return self._decline(UNFIT)
        return self._st

    def _teardown(self) -> None:
        st = self._st
        self._seqs.clear()
        self._spare = None
        self._pool = None
        self._st = None
        if st is not None and self.unpin is not None:
            for key in st.pinned:
                self.unpin(key)

    def _pin_weights(self, st: State) -> None:
        if self.pin is not None and self.weight_source is not None:
            pin_weights(st, self.pin)
