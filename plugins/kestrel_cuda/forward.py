"""Whole-step decode on the device: one token step (or a prefill) of a ``Model`` run entirely on the GPU.

API (what the ``kestrel_forward`` / ``kestrel_release_sequence`` hookimpls call):

    fwd = DeviceForward(weight_source=None, layer_boundary=None, *, stream=None, gemm=None, pin=None,
                        unpin=None, max_context=None, use_graph=None, ops=None)
    fwd.forward(model, seq_id, tokens, start, all_logits) -> np.ndarray float32 [T or 1, vocab] | None
    fwd.greedy(model, seq_id, token, start, count) -> Iterator[int] | None
    fwd.release(seq_id) -> None
    fwd.stats() -> dict[str, int | float]
    fwd.close() -> None

- ``weight_source(wkey, strips) -> DeviceWeight | None``: the weight cache's get-or-upload
  (``residency.DeviceWeight``: ``.geometry``, ``.codes``, ``.scales`` in the K-major layout of weights.py).
  ``strips`` has one StripCache, or several (Q|K|V, gate|up) under their fused wkey when
  ``residency.fusable`` allows it; returning None for a fused request makes the forward ask per projection.
  ``None``: the forward packs and uploads its own copy of every weight (host packing: small models, tests).
- ``layer_boundary(layer)``: called before each layer. Given (residency window on, ``KESTREL_CUDA_STREAM``),
  it forces the non-graph path and weights are fetched through ``weight_source`` per layer per step: a
  captured graph bakes in device pointers that an eviction would invalidate. Uploads and these kernels
  must then share ``stream`` (stream order is what makes reusing an evicted buffer safe).
- Without a window, the decode step (T == 1) is captured once per sequence in a CUDA graph and replayed
  (``use_graph``; env ``KESTREL_CUDA_GRAPH=0`` turns it off); the position and the token are read from
  device memory, so one graph serves every position. A released sequence's KV cache and graph are kept for
  the next new sequence (one spare): capturing ~300 launches costs milliseconds, which `kestrel bench` and
  every `generate` would otherwise pay once per prompt. Its kernels are launched with programmatic dependent
  launch (``KESTREL_CUDA_PDL``, forward_launch.py). ``pin(wkey)``/``unpin(wkey)`` (the cache's) keep the
  weights a graph captured resident; they are unpinned when the model changes or at ``close``.
- ``gemm``: cuda-kernels' ``gemm.DeviceGemm``; prefill chunks of more than ``SMALL_M`` rows run its
  tensor-core GEMM (``q8``). Without it they run this module's fused GEMV, 8 rows per weight pass.
- ``stream``: a ``cupy.cuda.Stream(non_blocking=True)`` (capturable); default a new one.
- ``forward``: ``tokens`` (integers) [T] at absolute positions ``start..start+T-1`` of sequence ``seq_id``.
  The KV cache lives on the device, one per ``seq_id`` (float32, grown 1024 positions at a time up to
  ``max_context``: default min(model context, ``KESTREL_CUDA_MAX_CONTEXT`` or 32768)); ``start == 0``
  resets it; ``start`` below the cached length rewinds. Declines (returns None; the engine recomputes on
  the CPU): ``start`` above the cached length (the engine ran steps on the CPU meanwhile), a context beyond
  ``max_context``, a token outside the vocabulary, an unsupported model (head_dim over 128 or not a
  multiple of 4, heads not a multiple of KV heads). Any device error drops the sequence's state and
  propagates (the dispatcher declines). Returns all T rows of logits if ``all_logits`` else the last row, as [1, vocab].
- ``greedy``: pipelined greedy decode from the sequence's device KV cache: ``token`` at ``start``, then each
  step's argmax at the next position, at most ``count`` steps; yields the chosen tokens. The decode graph
  ends in ``lm_finish``, which writes its argmax into the next step's input and position on the device and
  into pinned host memory, so step i + 1 is launched before the host reads step i's token: the host's share
  of a token (launch, logits download, argmax: ~140 us on the H200 at the qwen3-8b shape) overlaps the GPU.
  The device may have run one step beyond what the consumer took; those positions are rewritten before they
  are read. Declines without the captured graph.

The model math is kestrel_core.model.decoder's; the kernels are forward.cu, launched by forward_ops.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kestrel_core.contract import StripCache
from kestrel_core.errors import KestrelError
from kestrel_core.model.config import ARCHITECTURES
from kestrel_core.model.decoder import PREFILL_CHUNK, rope_inv_freq
from kestrel_core.model.weights import LayerWeights, Model
from kestrel_core.wkey import Proj, decode_wkey, fused_wkey, lm_head_wkey, wkey
from kestrel_cuda.forward_ops import (
    EPI_ADD,
    EPI_STORE,
    FINISH_COLS,
    MAX_CLUSTER,
    MAX_HEAD_DIM,
    MERGE_SPLITS,
    PRO_PLAIN,
    PRO_RMSNORM,
    PRO_SILU_MUL,
    TILE_N,
    TOKEN_RING,
    Lin,
    QkvRope,
    attn_part_size,
    cluster_split,
    env_on,
    fuse_rope_enabled,
    gemv_scratch,
    head_scale,
    norm_tiles_enabled,
    pack_kmajor,
    plan_split,
    split_overrides,
    ssq_count,
)
from kestrel_cuda.residency import fusable, pad_n

CAP_CHUNK = 1024  # KV positions are allocated this many at a time
DEFAULT_MAX_CONTEXT = 32768
MAX_CONTEXT_ENV = "KESTREL_CUDA_MAX_CONTEXT"
GRAPH_ENV = "KESTREL_CUDA_GRAPH"

WeightSource = Callable[[int, Sequence[StripCache]], Any]


def unsupported_reason(model: Model) -> str | None:
    """Why the device forward cannot run ``model`` (None: it can)."""
    c = model.config
    if c.arch not in ARCHITECTURES:
        return f"architecture {c.arch!r}"
    if c.head_dim % 4 or c.head_dim > MAX_HEAD_DIM:
        return f"head_dim {c.head_dim} (needs a multiple of 4 <= {MAX_HEAD_DIM})"
    if c.num_kv_heads <= 0 or c.num_heads % c.num_kv_heads:
        return f"{c.num_heads} heads over {c.num_kv_heads} KV heads"
    if model.embedding.k != c.hidden_size:
        return "embedding width differs from hidden_size"
    return None


def rope_tables(config: Any, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [positions, hd/2] float32 of angle = position * inv_freq, as the CPU decoder computes them
    (float32 positions times the decoder's float32 inverse frequencies, llama3 scaling included)."""
    freqs = np.arange(positions, dtype=np.float32)[:, None] * rope_inv_freq(config)[None, :]
    return np.cos(freqs), np.sin(freqs)


def _env_max_context() -> int:
    raw = os.environ.get(MAX_CONTEXT_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_CONTEXT
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise KestrelError(f"{MAX_CONTEXT_ENV} must be a positive number of positions, got {raw!r}")
    return value


def _env_graph() -> bool:
    return env_on(GRAPH_ENV)


@dataclass
class _LayerWeights:
    qkv: list[Lin]
    o: Lin
    gate_up: list[Lin]
    down: Lin


@dataclass
class _Layer:
    attn_norm: Any
    mlp_norm: Any
    q_norm: Any
    k_norm: Any
    qkv_bias: Any
    weights: _LayerWeights | None = None  # None when fetched per step (residency window)


@dataclass
class _Seq:
    kv: Any  # float32 [L, 2, KV, cap, hd]
    length: int = 0
    graph: Callable[[], None] | None = None

    @property
    def capacity(self) -> int:
        return int(self.kv.shape[3])


@dataclass
class _State:
    """Everything on the device for one model: small tensors, weights, workspace."""

    model: Model  # strips for per-step fetches (window) and the identity check
    config: Any
    max_context: int
    emb_codes: Any
    emb_scales: Any
    emb_group: int
    final_norm: Any
    layers: list[_Layer]
    lm_head: Lin | None
    cos: Any
    sin: Any
    meta: Any  # int32 [1 + PREFILL_CHUNK]: position, then token ids
    h: Any
    ssq: Any  # float32 [ceil(D / 32)]: h's sums of squares per 32 columns, M = 1 (forward.cu)
    qkv: Any
    q: Any
    attn: Any
    gu: Any
    finish: tuple[Any, Any, Any]  # lm_finish's per-block (value, index) and its arrival counter
    tokens: np.ndarray  # int32 [TOKEN_RING] pinned host memory: lm_finish's greedy token by position
    logits: Any
    logits_all: Any = None
    pinned: list[int] = field(default_factory=list)
    own: list[Any] = field(default_factory=list)  # arrays of own uploads, kept alive

    @property
    def ids(self) -> Any:
        return self.meta[1:]


class DeviceForward:
    """The whole-step forward of the CUDA backend (see the module docstring for the API)."""

    def __init__(self, weight_source: WeightSource | None = None,
                 layer_boundary: Callable[[int], None] | None = None, *, stream: Any = None, gemm: Any = None,
                 pin: Callable[[int], None] | None = None, unpin: Callable[[int], None] | None = None,
                 max_context: int | None = None, use_graph: bool | None = None, ops: Any = None,
                 target_blocks: int | None = None) -> None:
        if ops is None:
            from kestrel_cuda.forward_ops import CupyOps

            ops = CupyOps(stream, gemm)
        self.ops = ops
        self.xp = ops.xp
        self.weight_source = weight_source
        self.layer_boundary = layer_boundary
        self.pin = pin
        self.unpin = unpin
        self.max_context = max_context
        self.use_graph = (_env_graph() if use_graph is None else use_graph) and layer_boundary is None
        self.sm_count = getattr(ops, "sm_count", 132)
        self.gemv_kind = getattr(ops, "gemv_kind", "chunk")
        self.clusters = bool(getattr(ops, "cluster", False))
        self.target_blocks = target_blocks  # None: each M=1 kernel's default (forward_ops.default_target_blocks)
        self.norm_tiles = norm_tiles_enabled()
        self.splits = split_overrides()
        self.fuse_rope = fuse_rope_enabled()
        self._st: _State | None = None
        self._seqs: dict[int, _Seq] = {}
        self._spare: _Seq | None = None  # the last released sequence: KV cache and graph, for the next one
        self.counters: dict[str, int] = {"steps": 0, "graph_replays": 0, "graph_captures": 0,
                                         "prefill_tokens": 0, "decode_tokens": 0, "declined": 0,
                                         "sequences_reused": 0}
        self.last_decline = ""

    # -- API -----------------------------------------------------------------------------------------

    def forward(self, model: Model, seq_id: int, tokens: Any, start: int, all_logits: bool) -> np.ndarray | None:
        toks = np.asarray(tokens).reshape(-1)
        if toks.size == 0 or not np.issubdtype(toks.dtype, np.integer) or start < 0:
            return self._decline("no tokens or a bad start")
        v = model.config.vocab_size
        if int(toks.min()) < 0 or int(toks.max()) >= v:
            return self._decline("token id outside the vocabulary")
        st = self._state(model)
        if st is None:
            return None
        end = start + len(toks)
        if end > st.max_context:
            return self._decline(f"context {end} beyond the device maximum {st.max_context}")
        try:
            seq = self._open_sequence(st, seq_id, start, end)
            if seq is None:
                return None
            return self._run(st, seq, toks.astype(np.int32), start, all_logits)
        except BaseException:
            self._seqs.pop(seq_id, None)  # its KV cache may be half written
            raise

    def greedy(self, model: Model, seq_id: int, token: int, start: int, count: int) -> Iterator[int] | None:
        if not self.use_graph:
            return self._decline("pipelined greedy decode needs the captured decode graph")
        if not 0 <= int(token) < model.config.vocab_size or start < 0 or count < 1:
            return self._decline("token id outside the vocabulary, a bad start or no steps")
        st = self._state(model)
        if st is None:
            return None
        count = min(count, st.max_context - start)
        if count < 1:
            return self._decline(f"context {start + 1} beyond the device maximum {st.max_context}")
        try:
            seq = self._open_sequence(st, seq_id, start, start + 1)  # the KV cache grows as the steps go
            if seq is None:
                return None
            self._graph(st, seq)
            self.ops.write_meta(st.meta, np.array([start, token], np.int32))
        except BaseException:
            self._seqs.pop(seq_id, None)
            raise
        return self._pipeline(st, seq_id, seq, start, count)

    def _pipeline(self, st: _State, seq_id: int, seq: _Seq, start: int, count: int) -> Iterator[int]:
        """Steps i and i + 1 in flight while the host waits for step i's token (lm_finish feeds each step's
        argmax to the next on the device). A step beyond the KV capacity first drains the steps in flight,
        grows the cache (which re-captures the graph) and writes its position and token from the host."""
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

        try:
            launch(0)
            for i in range(count):
                if i + 1 < count:
                    launch(i + 1)
                self.ops.wait(events[i])
                yield int(st.tokens[(start + i) % TOKEN_RING])
        except GeneratorExit:  # the consumer stopped: the cache holds every step launched, still valid
            raise
        except BaseException:
            self._seqs.pop(seq_id, None)  # its KV cache may be half written
            raise

    def _open_sequence(self, st: _State, seq_id: int, start: int, end: int) -> _Seq | None:
        """The sequence to run positions ``start``..``end - 1`` (rewound to ``start``, its KV cache grown to
        ``end``), the spare for a new one, or None (declined: the device holds fewer than ``start``)."""
        seq = self._seqs.get(seq_id)
        if seq is None and start == 0 and self._spare is not None:
            seq, self._spare = self._spare, None  # every position is written before it is read
            self._seqs[seq_id] = seq
            self.counters["sequences_reused"] += 1
        if start == 0:
            if seq is not None:
                seq.length = 0
        elif seq is None or start > seq.length:
            return self._decline("the device KV cache is behind the engine's")
        else:
            seq.length = start  # rewind: positions >= start are overwritten
        return self._reserve(st, seq_id, seq, end)

    def release(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._spare = seq

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {f"forward_{k}": v for k, v in self.counters.items()}
        out["forward_sequences"] = len(self._seqs)
        out["forward_launches"] = int(getattr(self.ops, "launches", 0))
        return out

    def close(self) -> None:
        self._teardown()

    # -- steps ---------------------------------------------------------------------------------------

    def _decline(self, reason: str) -> None:
        self.counters["declined"] += 1
        self.last_decline = reason
        return None

    def _run(self, st: _State, seq: _Seq, toks: np.ndarray, start: int, all_logits: bool) -> np.ndarray:
        ops, t = self.ops, len(toks)
        if all_logits and t > 1 and st.logits_all is None:
            st.logits_all = self.ops.zeros((PREFILL_CHUNK, st.config.vocab_size), np.float32)
        outs = []
        for c0 in range(0, t, PREFILL_CHUNK):
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
                self._step(st, seq, m, rows)
            seq.length = pos + m
            self.counters["steps"] += 1
            self.counters["decode_tokens" if m == 1 else "prefill_tokens"] += m
            if rows:
                outs.append(ops.download(st.logits_all if rows > 1 else st.logits, rows))
        ops.synchronize()
        return np.concatenate(outs) if len(outs) > 1 else outs[0]

    def _graph(self, st: _State, seq: _Seq) -> Callable[[], None]:
        """The sequence's decode step (M = 1) as a captured graph, captured on first use."""
        if seq.graph is None:
            self._pin_weights(st)
            seq.graph = self.ops.capture(lambda: self._step(st, seq, 1, 1))
            self.counters["graph_captures"] += 1
        return seq.graph

    def _step(self, st: _State, seq: _Seq, m: int, rows: int) -> None:
        """Every kernel of one pass over rows [0, m) at positions meta[0]..; logits of the last ``rows``."""
        ops, c = self.ops, st.config
        eps = float(c.rms_norm_eps)
        hd, heads, kv_heads, f = c.head_dim, c.num_heads, c.num_kv_heads, c.intermediate_size
        scale = head_scale(hd)
        h = st.h[:m]
        ssq = st.ssq if m == 1 and self.norm_tiles else None  # h's tile sums: left by its writers, read by norms
        ops.embed(st.emb_codes, st.emb_scales, st.emb_group, st.ids, h, ssq)
        for i, layer in enumerate(st.layers):
            if self.layer_boundary is not None:
                self.layer_boundary(i)
            w = layer.weights or self._layer_weights(st, i)
            kc, vc = seq.kv[i, 0], seq.kv[i, 1]
            rope = None  # qkv_rope's work in the q|k|v GEMV's epilogue: one head per column tile
            if m == 1 and self.fuse_rope and hd == TILE_N and len(w.qkv) == 1 and w.qkv[0].m1 == "chunk":
                rope = QkvRope(heads, kv_heads, layer.q_norm, layer.k_norm, eps, st.cos, st.sin, st.meta, st.q[:1],
                               kc, vc)
            for lin in w.qkv:
                bias = None if layer.qkv_bias is None else layer.qkv_bias[lin.col:lin.col + lin.n]
                ops.gemv(lin, h, PRO_RMSNORM, layer.attn_norm, eps, 0, st.qkv[:m, lin.col:lin.col + lin.n],
                         EPI_STORE, bias, ssq_in=ssq, rope=rope)
            if rope is None:
                ops.qkv_rope(st.qkv[:m], heads, kv_heads, hd, layer.q_norm, layer.k_norm, eps, st.cos, st.sin,
                             st.meta, st.q[:m], kc, vc)
            ops.attention(st.q[:m], kc, vc, heads, hd, scale, st.meta, st.attn[:m])
            ops.gemv(w.o, st.attn[:m], PRO_PLAIN, None, eps, 0, h, EPI_ADD, None, ssq_out=ssq)
            for lin in w.gate_up:
                ops.gemv(lin, h, PRO_RMSNORM, layer.mlp_norm, eps, 0, st.gu[:m, lin.col:lin.col + lin.n],
                         EPI_STORE, None, ssq_in=ssq)
            ops.gemv(w.down, st.gu[:m], PRO_SILU_MUL, None, eps, f, h, EPI_ADD, None, ssq_out=ssq)
        if rows:
            lm = st.lm_head or self._fetch([st.model.lm_head], [lm_head_wkey()], 0)[0]
            out = st.logits_all[:rows] if rows > 1 else st.logits
            ops.gemv(lm, st.h[m - rows:m], PRO_RMSNORM, st.final_norm, eps, 0, out, EPI_STORE, None, ssq_in=ssq)
            if m == 1:  # the next step's token and position, on the device (the pipelined greedy decode)
                ops.greedy_token(st.logits, st.finish, st.meta, seq.capacity, st.tokens)

    # -- sequences -----------------------------------------------------------------------------------

    def _reserve(self, st: _State, seq_id: int, seq: _Seq | None, end: int) -> _Seq:
        if seq is not None and end <= seq.capacity:
            return seq
        c = st.config
        cap = min(st.max_context, -(-end // CAP_CHUNK) * CAP_CHUNK)
        kv = self.ops.zeros((c.num_layers, 2, c.num_kv_heads, cap, c.head_dim), np.float32)
        if seq is None:
            seq = self._seqs[seq_id] = _Seq(kv)
        else:
            n = seq.length
            self.ops.copy(kv[:, :, :, :n], seq.kv[:, :, :, :n])
            seq.kv = kv
            seq.graph = None  # it captured the old buffer
        return seq

    # -- model state ---------------------------------------------------------------------------------

    def _state(self, model: Model) -> _State | None:
        st = self._st
        if st is not None and st.model is model:
            return st
        reason = unsupported_reason(model)
        if reason is not None:
            return self._decline(f"unsupported model: {reason}")
        self._teardown()
        self._st = self._build(model)
        return self._st

    def _teardown(self) -> None:
        st = self._st
        self._seqs.clear()
        self._spare = None
        self._st = None
        if st is not None and self.unpin is not None:
            for key in st.pinned:
                self.unpin(key)

    def _build(self, model: Model) -> _State:
        c, ops = model.config, self.ops
        up, zeros = ops.upload, ops.zeros
        d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
        nq, nkv = c.num_heads * hd, c.num_kv_heads * hd
        max_context = min(c.max_position, self.max_context or _env_max_context())
        cos, sin = rope_tables(c, max_context)
        layers = []
        for lw in model.layers:
            bias = None
            if lw.q_bias is not None:
                bias = up(np.concatenate([lw.q_bias, lw.k_bias, lw.v_bias]).astype(np.float32))
            layers.append(_Layer(up(lw.attn_norm), up(lw.mlp_norm),
                                 None if lw.q_norm is None else up(lw.q_norm),
                                 None if lw.k_norm is None else up(lw.k_norm), bias))
        emb = model.embedding
        t = PREFILL_CHUNK
        st = _State(model=model, config=c, max_context=max_context, emb_codes=up(emb.codes),
                    emb_scales=up(emb.scales), emb_group=emb.group_size, final_norm=up(model.final_norm),
                    layers=layers, lm_head=None, cos=up(cos), sin=up(sin),
                    meta=zeros(1 + t, np.int32), h=zeros((t, d), np.float32), ssq=zeros(ssq_count(d), np.float32),
                    qkv=zeros((t, nq + 2 * nkv), np.float32), q=zeros((t, nq), np.float32),
                    attn=zeros((t, nq), np.float32), gu=zeros((t, 2 * f), np.float32),
                    finish=(zeros(-(-c.vocab_size // FINISH_COLS), np.float32),
                            zeros(-(-c.vocab_size // FINISH_COLS), np.int32), zeros(1, np.int32)),
                    tokens=ops.mapped_ints(TOKEN_RING), logits=zeros((1, c.vocab_size), np.float32))
        self._reserve_scratch(model)
        if self.layer_boundary is None:
            for i in range(c.num_layers):
                layers[i].weights = self._layer_weights(st, i)
            st.lm_head = self._fetch([model.lm_head], [lm_head_wkey()], 0)[0]
        ops.synchronize_device()  # weights a cache uploaded on another stream are complete
        return st

    def _reserve_scratch(self, model: Model) -> None:
        """Split-K and attention scratch for every projection, from shapes alone (nothing uploaded)."""
        reserve = getattr(self.ops, "reserve", None)
        if reserve is None:
            return
        c = model.config
        lins = []
        keys = _group_keys(0) + [([lm_head_wkey()], 0)]
        for group, (members, key) in zip(_groups(model.layers[0]) + [[model.lm_head]], keys):
            n, k = sum(s.n for s in group), group[0].k
            lin = Lin(None, None, k, n, pad_n(n), group[0].group_size, group[0].bits,  # own bits: own plan
                      wkey=key or members[0])
            lin.ksplit = self._plan(lin)
            lins.append(lin)
            for s, member in zip(group, members):  # unfused members may have more tiles
                one = Lin(None, None, s.k, s.n, pad_n(s.n), s.group_size, s.bits, wkey=member)
                one.ksplit = self._plan(one)
                lins.append(one)
        part, counters, merge_tiles = gemv_scratch(lins)
        reserve(part, counters, attn_part_size(c.num_heads, c.head_dim), c.num_heads, merge_tiles)

    def _layer_weights(self, st: _State, i: int) -> _LayerWeights:
        qkv, o, gu, down = (self._fetch(strips, keys, fused) for strips, (keys, fused) in
                            zip(_groups(st.model.layers[i]), _group_keys(i)))
        return _LayerWeights(qkv=qkv, o=o[0], gate_up=gu, down=down[0])

    def _fetch(self, strips: list[StripCache], keys: list[int], fused_key: int) -> list[Lin]:
        """Device projections for ``strips`` (fused into one when allowed), with their output columns."""
        cols = np.cumsum([0] + [s.n for s in strips[:-1]]).tolist()
        if self.weight_source is None:
            same = len({(s.k, s.group_size, s.bits) for s in strips}) == 1
            if same:
                codes = strips[0].codes if len(strips) == 1 else np.concatenate([s.codes for s in strips])
                scales = strips[0].scales if len(strips) == 1 else np.concatenate([s.scales for s in strips])
                return [self._own(codes, scales, strips[0], fused_key if len(strips) > 1 else keys[0])]
            return [self._own(s.codes, s.scales, s, key, col) for s, key, col in zip(strips, keys, cols)]
        if len(strips) > 1 and fusable(strips):
            dw = self.weight_source(fused_key, strips)
            if dw is not None:
                return [self._adopt(dw, sum(s.n for s in strips), 0, fused_key)]
        return [self._adopt(self.weight_source(key, [s]), s.n, col, key) for s, key, col in zip(strips, keys, cols)]

    def _own(self, codes: np.ndarray, scales: np.ndarray, like: StripCache, key: int, col: int = 0) -> Lin:
        n, k = codes.shape
        npad = pad_n(n)
        sc = np.zeros((k // like.group_size, npad), np.float32)
        sc[:, :n] = scales.T
        packed = pack_kmajor(codes, like.bits)
        lin = Lin(self.ops.upload(packed), self.ops.upload(sc), k, n, npad, like.group_size, like.bits, col,
                  wkey=key)
        lin.ksplit = self._plan(lin)
        return lin

    def _adopt(self, dw: Any, n: int, col: int, key: int) -> Lin:
        if dw is None:
            raise KestrelError(f"the weight cache returned no weight for wkey {key:#x}")
        lin = Lin.from_device_weight(dw, n, col, key)
        lin.ksplit = self._plan(lin)
        lin.device_weight = dw  # type: ignore[attr-defined]  # the tiled GEMM takes the cache's object
        return lin

    def _plan(self, lin: Lin) -> int:
        """K splits of ``lin``'s M=1 GEMV (and the kernel it runs, ``lin.m1``)."""
        split = plan_split(lin, self.gemv_kind, self.sm_count, self.target_blocks, self.clusters)
        forced = self.splits.get(decode_wkey(lin.wkey)[1].name.lower()) if lin.wkey else None
        if forced is None:
            return split
        split = min(forced[0], lin.chunks, MERGE_SPLITS)
        lin.cluster = lin.m1 == "chunk" and self.clusters and (
            1 < split <= MAX_CLUSTER if forced[1] else cluster_split(lin, split, self.sm_count) == split)
        return split

    def _pin_weights(self, st: _State) -> None:
        """Before a graph captures weight addresses: pin them in the cache (once per model state)."""
        if self.pin is None or st.pinned or self.weight_source is None:
            return
        keys = [lin.wkey for layer in st.layers if layer.weights for lin in
                (*layer.weights.qkv, layer.weights.o, *layer.weights.gate_up, layer.weights.down)]
        if st.lm_head is not None:
            keys.append(st.lm_head.wkey)
        for key in keys:
            self.pin(key)
            st.pinned.append(key)


def _groups(lw: LayerWeights) -> list[list[StripCache]]:
    """The projections of a layer in launch order: Q|K|V, O, gate|up, down."""
    return [[lw.q, lw.k, lw.v], [lw.o], [lw.gate, lw.up], [lw.down]]


def _group_keys(layer: int) -> list[tuple[list[int], int]]:
    """``_groups``' wkeys: (each member's, the fused weight's or 0)."""
    return [([wkey(layer, Proj.Q), wkey(layer, Proj.K), wkey(layer, Proj.V)], fused_wkey(layer, Proj.QKV)),
            ([wkey(layer, Proj.O)], 0),
            ([wkey(layer, Proj.GATE), wkey(layer, Proj.UP)], fused_wkey(layer, Proj.GATE_UP)),
            ([wkey(layer, Proj.DOWN)], 0)]

