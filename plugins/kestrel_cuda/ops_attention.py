"""CupyOps' attention kernels (attention.cu, attention_prefill.cu), one launch each on the ops' stream: decode
(attn_decode), causal prefill (attn_prefill) and a batch's rows over the paged pool (attn_rows), with their
scratch and shared-memory sizes."""

from __future__ import annotations

from typing import Any

import numpy as np

from kestrel_cuda.forward_launch import i32_arg as _i32
from kestrel_cuda.forward_launch import ptr_arg as _ptr
from kestrel_cuda.plan import (
    ATTN_CODES_GROUP,
    ATTN_ROWS_HEADS,
    ATTN_ROWS_WARPS,
    ATTN_SPLITS,
    KV_BLOCK,
    Lin,
    attend_folds,
    attn_rows_buffers,
    attn_rows_instance,
    attn_rows_per_sm,
    attn_rows_splits,
)


class AttentionOps:
    """Mixed into ``ops_cupy.CupyOps``: its ``launch``, attention kernels (``_attn_rows``, ``_attn_decode``,
    ``_fn``), tiled GEMM input (``gemm_input``) and attention scratch (``attn_part``, ``attn_counters``)."""

    def attn_rows_plan(self, m: int, heads: int, kv_heads: int, hd: int) -> tuple[int, int, int, int]:
        """attn_rows for m rows: (instance, dynamic shared memory, blocks a KV head's group takes, position
        splits), the splits filling this GPU's block slots (its shared memory and the instance's registers)."""
        group = heads // kv_heads
        parts = -(-group // ATTN_ROWS_HEADS)
        hdp = attn_rows_instance(hd)
        smem = _attn_rows_smem(hdp, min(group, ATTN_ROWS_HEADS))
        per_sm = attn_rows_per_sm(smem, self.sm_smem, self._attn_rows_regs[hdp], self.sm_regs)
        return hdp, smem, parts, attn_rows_splits(kv_heads * m * parts, self.sm_count * per_sm)

    def attention(self, q: Any, kc: Any, vc: Any, heads: int, hd: int, scale: float, meta: Any,
                  out: Any, rows: Any = None, tables: Any = None, window: int = 0,
                  quantize_for: Lin | None = None, softcap: float = 0.0, sinks: Any = None) -> bool:
        """``rows``/``tables`` as ``qkv_rope``'s: each row attends over its own sequence (attn_rows: a
        block per row and KV head); else one sequence's rows at meta[0]..: decode (M = 1) or causal prefill.
        ``window`` > 0: a row sees only the last ``window`` positions (itself included). ``softcap`` > 0: each
        score becomes tanh(score / softcap) * softcap before the softmax (Gemma 2). ``sinks`` (float32 [heads],
        gpt-oss): each head's softmax has one more logit, which takes no value. ``quantize_for``: the
        projection that reads ``out`` next; where it runs on the tiled GEMM at G = 32 (M > 1) and a group is
        one head's (attn_rows, hd % 32 == 0), attn_rows also writes out's codes where that GEMM reads them,
        bit for bit quantize_rows', and this returns True (pass ``quantized`` to its ``gemv``)."""
        m = q.shape[0]
        kv_heads, cap = kc.shape[0], kc.shape[1]
        if rows is not None:
            hdp, smem, parts, splits = self.attn_rows_plan(m, heads, kv_heads, hd)
            if splits > 1:
                self._grow_attn_scratch(m * heads * splits * (hd + 4), m * kv_heads * parts)
            codes = scales = None
            lin = quantize_for
            if (lin is not None and m > 1 and self.gemm is not None and lin.group_size == ATTN_CODES_GROUP
                    and hd % ATTN_CODES_GROUP == 0 and lin.k == heads * hd):
                codes, scales = self.gemm_input(m, lin.k, ATTN_CODES_GROUP)
            self.launch(self._attn_rows[hdp], (kv_heads, m, parts * splits), (32 * ATTN_ROWS_WARPS,),
                        (_ptr(q), _ptr(kc), _ptr(vc), _i32(cap), _i32(heads), _i32(kv_heads), _i32(hd),
                         np.float32(scale), _ptr(rows), _ptr(tables), _i32(tables.shape[1]), _ptr(out),
                         _i32(splits), _ptr(self.attn_part), _ptr(self.attn_counters), _i32(window),
                         _ptr(codes), _ptr(scales), np.float32(softcap), _ptr(sinks)),
                        smem, name="attn_rows")
            return codes is not None
        if m == 1:
            self.launch(self._attn_decode[4 if hd <= 128 else 8], (heads, ATTN_SPLITS, 1), (128,),
                        (_ptr(q), _ptr(kc), _ptr(vc), _i32(cap), _i32(heads), _i32(kv_heads), _i32(hd),
                         np.float32(scale), _ptr(meta), _ptr(self.attn_part), _ptr(self.attn_counters),
                         _ptr(out), _i32(window), np.float32(softcap), _ptr(sinks)), name="attn_decode")
            return False
        self.launch(self._fn["attn_prefill"], (heads, -(-m // 16)), (256,),
                    (_ptr(q), _ptr(kc), _ptr(vc), _i32(cap), _i32(heads), _i32(kv_heads), _i32(hd),
                     np.float32(scale), _ptr(meta), _i32(m), _ptr(out), _i32(window), np.float32(softcap),
                     _ptr(sinks)),
                    _attn_prefill_smem(hd), name="attn_prefill")
        return False

    def attend_folds(self, qkv: Lin, capacity: int) -> bool:
        """Whether a decode step's attention folds into the q|k|v GEMV (plan.attend_folds)."""
        return attend_folds(qkv, capacity, self.cluster)

    def _grow_attn_scratch(self, floats: int, counters: int) -> None:
        """attn_rows' split scratch, grown in the eager step that precedes a batch graph's capture."""
        if floats > self.attn_part.size or counters > self.attn_counters.size:
            if self._capturing:
                raise RuntimeError("attention scratch must grow before a graph capture")
            self.reserve(0, 0, floats, counters)


def _attn_prefill_smem(hd: int) -> int:
    """attn_prefill's dynamic shared memory: a tile of keys (rows padded by 4) and values, 16 queries."""
    return (32 * (hd + 4) + 32 * hd + 16 * hd) * 4


def _attn_rows_smem(hdp: int, heads: int) -> int:
    """attn_rows' dynamic shared memory (instance ``hdp``, ``heads`` query heads a block): the query as two
    float16 terms, its page buffers of float16 keys and values, rows padded by 8."""
    return (2 * heads + 2 * attn_rows_buffers(hdp) * KV_BLOCK) * (hdp + 8) * 2
