"""Every launch of the forward's ops passes its kernel's parameters: as many as the CUDA source declares, each a
numpy scalar of the parameter's type (a pointer as uint64, an int as int32, a float as float32). A launch with one
argument too few, or a float where an int goes, is not caught by CuPy or the driver: the kernel reads the wrong
bytes. Checked without a GPU: ``CupyOps`` (with its mixins' launches) over numpy arrays, its ``launch`` recording
what it is given, against the parameter lists parsed from ``kernels.FORWARD_SOURCES``."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kestrel_cuda import ops_attention, ops_cupy, ops_moe
from kestrel_cuda.kernels import FORWARD_SOURCES, source_text
from kestrel_cuda.plan import (
    EPI_ADD,
    EPI_STORE,
    PRO_GELU_MUL,
    PRO_PLAIN,
    PRO_POSTNORM,
    PRO_RMSNORM,
    PRO_SWIGLU_OAI,
    AttendFold,
    Lin,
    PostNorm,
    QkvRope,
    RouteFold,
    route_fold_span,
)

_KINDS = {np.uint64: "pointer", np.int32: "int", np.float32: "float"}


def kernel_params(name: str) -> list[str]:
    """The kinds (pointer, int, float) of kernel ``name``'s parameters in the forward module's source."""
    text = source_text(FORWARD_SOURCES)
    found = list(re.finditer(rf"__global__ void (?:__launch_bounds__\([^)]*\) )?{name}\(", text))
    assert len(found) == 1, name
    at, depth = found[0].end(), 1
    end = at
    while depth:
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        end += 1
    kinds = []
    for param in text[at:end - 1].split(","):
        words = param.replace("*", " * ").split()
        if "*" in words:
            kinds.append("pointer")
        elif {"int", "unsigned"} & set(words):
            kinds.append("int")
        else:
            assert "float" in words, (name, param)
            kinds.append("float")
    return kinds


def _array(shape: Any, dtype: Any = np.float32) -> np.ndarray:
    """A host array standing for a device one: launches read its shape and strides (and ``_ptr`` its pointer)."""
    return np.zeros(shape, dtype)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[tuple[str, tuple]]]:
    """A CupyOps without CuPy whose launches are recorded as (kernel name, arguments)."""
    for module in (ops_cupy, ops_attention, ops_moe):
        monkeypatch.setattr(module, "_ptr", lambda a: np.uint64(0 if a is None else 1 << 20))
    launches: list[tuple[str, tuple]] = []
    ops = ops_cupy.CupyOps.__new__(ops_cupy.CupyOps)
    gemm = SimpleNamespace(q8=lambda *a, **k: None, grouped=lambda *a, **k: None, norm_fold=lambda *a: False)
    ops.__dict__.update(
        launch=lambda kernel, grid, block, args, smem=0, cluster=1, name="": launches.append((kernel, args)),
        zeros=lambda shape, dtype: _array(shape, dtype), _fn={k: k for k in ops_cupy.KERNELS},
        _gemv={v: "qgemv" for v in ops_cupy.GEMV_VARIANTS}, _attn_decode={4: "attn_decode", 8: "attn_decode"},
        _attn_rows={hd: "attn_rows" for hd in (16, 32, 64, 128, 256)},
        _attn_rows_regs={hd: 128 for hd in (16, 32, 64, 128, 256)},
        _quant={v: "quantize_rows" for v in ops_cupy.QUANT_VARIANTS},
        gemm=gemm, stream=None, on_launch=None, launches=0, pdl=False, cluster=True, merge_mode="counter",
        merge_tiles=0, _capturing=False, _captured=0, sm_count=132, sm_smem=233_472, sm_regs=65_536,
        _tiled_bufs={}, _outgrown=[], part=_array(1 << 20), counters=_array(1 << 12, np.int32),
        merge=_array(1, np.uint64), epochs=_array(1, np.uint32), attn_part=_array(1 << 20),
        attn_counters=_array(1 << 12, np.int32))
    return ops, launches


def _lin(k: int, n: int, ksplit: int = 1, cluster: bool = False) -> Lin:
    lin = Lin(_array((k, n), np.uint8), _array((k // 32, n)), k, n, n, 32, 8, ksplit=ksplit, cluster=cluster)
    lin.device_weight = SimpleNamespace(geometry=None)  # type: ignore[attr-defined]  # what the tiled GEMM takes
    return lin


def test_every_forward_launch_passes_its_kernels_parameters(recorded) -> None:  # type: ignore[no-untyped-def]
    ops, launches = recorded
    d, hd, heads, kv = 256, 128, 4, 2
    h1, h8, meta = _array((1, d)), _array((8, d)), _array(9, np.int32)
    kc = _array((kv, 64, hd), np.float16)
    ssq = _array(d // 32)
    rows, tables = _array((8, 2), np.int32), _array((3, 4), np.int32)
    qkv = _lin(d, (heads + 2 * kv) * hd, ksplit=2, cluster=True)
    ops.embed(_array((512, d), np.int8), _array((512, d // 32)), 32, meta[1:], h1, ssq, 16.0)
    ops.norm_add(h1, _array(d), 1e-6, h1, ssq)
    ops.gemv(_lin(d, d), h1, PRO_PLAIN, None, 1e-6, 0, h1, EPI_ADD, None, ssq_out=ssq, add_scale=0.22)
    ops.gemv(_lin(d, d), h8, PRO_RMSNORM, _array(d), 1e-6, 0, h8, EPI_STORE, _array(d))  # MR = 8, no tiled GEMM
    rope = QkvRope(heads, kv, None, None, 1e-6, _array((64, hd // 2)), _array((64, hd // 2)), meta, h1, kc, kc)
    ops.gemv(qkv, h1, PRO_RMSNORM, _array(d), 1e-6, 0, h1, EPI_STORE, None, ssq_in=ssq, rope=rope)
    rope.attend = AttendFold(h1, 0.0625, 0, _array(2 * kv * hd, np.uint64), _array(heads + 2 * kv, np.uint32))
    ops.gemv(qkv, h1, PRO_RMSNORM, _array(d), 1e-6, 0, h1, EPI_STORE, None, ssq_in=ssq, rope=rope)
    post = PostNorm(_array(d), h1, h1, _array(4 * 2), h1)
    ops.gemv(_lin(d, d), h1, PRO_PLAIN, None, 1e-6, 0, h1, EPI_STORE, None, post=post)
    ops.gemv(_lin(d, d), h1, PRO_POSTNORM, _array(d), 1e-6, 0, h1, EPI_STORE, None, post=post)
    o = _lin(d, d, ksplit=2)
    route = RouteFold(_array((9, 2 * d)), 8, 2, True, route_fold_span(d, d, 2), _array(64), _array(1, np.int32),
                      _array((1, 2), np.int32), _array((1, 3)))
    ops.gemv(o, h1, PRO_PLAIN, None, 1e-6, 0, h1, EPI_STORE, h1, route=route)
    ops.gemv(_lin(d, d), h1, PRO_GELU_MUL, None, 1e-6, 0, h8[:2], EPI_STORE, None,
             experts=(_array((256, 2), np.uint64), _array(2, np.int32), 2))
    table, swiglu = _array((256, 2), np.uint64), (7.0, 1.702)
    ops.gemv(_lin(d, d), h8[:2], PRO_SWIGLU_OAI, None, 1e-6, d, h8[:2], EPI_STORE, _array((8, d)),
             experts=(table, _array(2, np.int32), 2), swiglu=swiglu)  # gpt-oss's routed down: biases, its SwiGLU
    ops.gemv(_lin(d, d), h8, PRO_SWIGLU_OAI, None, 1e-6, d, h8, EPI_ADD, None, swiglu=swiglu)  # quantize_rows
    groups = _array((24, 3), np.int32)
    ops.experts_gemm(_lin(d, d), _array((16, 2 * d)), PRO_SWIGLU_OAI, d, _array((16, d)), table, groups, 24, 16,
                     swiglu=swiglu)
    ops.expert_bias(_array((16, d)), groups, _array((8, d)))
    ops.gemv(_lin(d, d), h8, PRO_PLAIN, None, 1e-6, 0, h8, EPI_ADD, None, add_scale=0.22)  # tiled: add_rows
    ops.gemv(_lin(d, d), h8, PRO_RMSNORM, _array(d), 1e-6, 0, h8, EPI_STORE, _array(d))
    for m, at in ((1, {}), (8, {}), (8, {"rows": rows, "tables": tables})):
        ops.attention(_array((m, heads * hd)), kc, kc, heads, hd, 0.0625, meta, _array((m, heads * hd)), **at,
                      window=8, softcap=50.0, sinks=_array(heads))
    ops.qkv_rope(_array((8, (heads + 2 * kv) * hd)), heads, kv, hd, None, None, 1e-6, _array((64, hd // 2)),
                 _array((64, hd // 2)), meta, _array((8, heads * hd)), kc, kc)
    logits = _array((8, 512))
    ops.finish_logits(logits, 8.0, 30.0)
    ops.greedy_token(logits[:1], (_array(1), _array(1, np.int32), _array(1, np.int32)), meta, 64,
                     np.zeros(64, np.int32))
    ops.argmax_rows(logits, 8, (_array((8, 1)), *(_array((8, 1), np.int32),) * 2, *(_array(8, np.int32),) * 2))
    sel, wts = _array((8, 2), np.int32), _array((8, 3))
    ops.moe_route(h8, _array(d), 1e-6, _array((9, d)), 8, 2, True, h8, (_array((8, 9)), _array(8, np.int32)), sel,
                  wts, bias=_array(8))
    ops.moe_group(sel, 8, _array(16, np.int32), _array(16, np.int32), _array((24, 3), np.int32), 16)
    ops.moe_combine(_array((24, d)), 2, wts, h8, _array(16, np.int32), _array((8, d)), None)
    seen = {name for name, _ in launches}
    assert {"qgemv", "add_rows", "quantize_rows", "attn_decode", "attn_prefill", "attn_rows", "finish_logits",
            "embed_rows", "norm_add_rows", "qkv_rope", "lm_finish", "argmax_rows", "moe_route", "moe_group",
            "moe_combine", "moe_bias"} <= seen, seen
    for name, args in launches:
        kinds = [_KINDS.get(type(a), repr(type(a))) for a in args]
        assert kinds == kernel_params(name), name
