"""Integer-quantized checkpoints: GPTQ, AWQ and compressed-tensors (llm-compressor's W4A16 / W8A16 / W8A8), as the
Hub ships them (``-GPTQ-Int4``, ``-AWQ``, ``quantized.w4a16``). A weight is integer codes q, a zero point z and a
scale s a row per group of ``group_size`` input columns; its value is ``s * (q - z)``. A strip-cache holds the
codes as they are where it can (``IntWeight.strip_cache``); otherwise the weight is decoded to float32 exactly (the
products of a float16 or bfloat16 scale and a small integer are float32 numbers) and quantized like any float
checkpoint.

The layouts, [N, K] meaning output rows x input columns:

- GPTQ: ``X.qweight`` int32 [K * b / 32, N], 32 / b codes a word along K, the lowest bits first; ``X.qzeros``
  int32 [G, N * b / 32] along N; ``X.scales`` [G, N]; ``X.g_idx`` int32 [K], each column's group (act-order),
  else column k is in group k // group_size. ``checkpoint_format`` (or ``format``) gptq, v1 and the default,
  stores each zero point less 1, subtracted from the whole word (GPTQModel writes it so, a zero point of 0
  borrowing from the next, and adds it back as it reads, as transformers does); gptq_v2 stores it as it is.
- AWQ (``version`` gemm): ``X.qweight`` int32 [K, N / 8] and ``X.qzeros`` [K / g, N / 8], eight 4-bit codes a word
  along N with output columns 0, 2, 4, 6, 1, 3, 5, 7 of each eight in nibbles 0..7 (AutoAWQ's ``pack``);
  ``X.scales`` [K / g, N].
- compressed-tensors ``pack-quantized``: ``X.weight_packed`` int32 [N, K * b / 32] along K, codes offset by
  2^(b - 1) (unsigned in the word); ``X.weight_scale`` [N, K / g] (or [N, 1], or one); asymmetric ones have
  ``X.weight_zero_point`` packed the same way along N, [N * b / 32, K / g]; ``X.weight_shape`` [N, K].
  ``int-quantized`` / ``naive-quantized``: ``X.weight`` int8 [N, K] as it is, beside the same scales.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kestrel_core.contract import CODE_RANGE, StripCache, run_row_chunks
from kestrel_core.errors import KestrelError

INT_METHODS = ("gptq", "awq", "compressed-tensors")
PACKED_SUFFIXES = (".qweight", ".weight_packed")  # the tensor a quantized X.weight is read from
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what its zero points are stored less by
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # nibble i of an AWQ word holds output column AWQ_ORDER[i] of 8
CT_INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


@dataclass(frozen=True)
class IntScheme:
    """How a checkpoint's integer weights are stored: ``method`` (gptq, awq, compressed-tensors), ``bits`` a code,
    ``group_size`` (0: one group a row) and, for GPTQ, what its zero points are stored less by."""

    method: str
    bits: int
    group_size: int = 0
    zero_offset: int = 0


def int_scheme(quantization: Any, where: str) -> IntScheme | None:
    """The integer scheme of a config.json's ``quantization_config`` (None: not an integer one); a variant kestrel
    does not read (3-bit codes, AWQ's GEMV layout, mixed-precision compressed-tensors...) is refused by name."""
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method not in INT_METHODS:
        return None
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(quantization, where)
    bits, group = quantization.get("bits", quantization.get("w_bit")), quantization.get(
        "group_size", quantization.get("q_group_size"))
    if method == "awq":
        version = str(_one_of(quantization, ("version", "format"), "gemm", where)).lower()
        if version != "gemm":
            raise KestrelError(f"{where}: AWQ version {version!r} is not supported (kestrel reads AWQ's gemm layout)")
        if quantization.get("zero_point", True) is not True:
            raise KestrelError(f"{where}: AWQ without zero points is not supported")
        if not _is_bits(bits, (4,)):
            raise KestrelError(f"{where}: AWQ with {bits!r}-bit weights is not supported (kestrel reads 4-bit AWQ)")
        return IntScheme("awq", 4, _group(group, where))
    if not _is_bits(bits, (2, 4, 8)):
        raise KestrelError(f"{where}: GPTQ with {bits!r}-bit weights is not supported (kestrel reads 2, 4 and 8 bits)")
    fmt = _one_of(quantization, ("checkpoint_format", "format"), "gptq", where)
    if not isinstance(fmt, str) or fmt not in GPTQ_FORMATS:
        raise KestrelError(f"{where}: GPTQ format {fmt!r} is not supported (kestrel reads gptq and gptq_v2)")
    if quantization.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise KestrelError(f"{where}: GPTQ pack_dtype {quantization.get('pack_dtype')!r} is not supported (kestrel "
                           "reads codes packed in int32 words)")
    dynamic = quantization.get("dynamic") or {}
    if not isinstance(dynamic, dict) or any(not str(k).startswith("-:") for k in dynamic):
        raise KestrelError(f"{where}: GPTQ per-module overrides (dynamic) are not supported")
    return IntScheme("gptq", bits, _group(group, where), GPTQ_FORMATS[fmt])


def _one_of(config: dict, keys: tuple[str, ...], default: Any, where: str) -> Any:
    """The value of the first of ``keys`` in ``config`` (each a name the same setting goes by: transformers' and
    gptqmodel's), refused where two of them disagree."""
    values = [config[k] for k in keys if config.get(k) is not None]
    if any(v != values[0] for v in values[1:]):
        raise KestrelError(f"{where}: {' and '.join(keys)} disagree ({', '.join(map(repr, values))})")
    return values[0] if values else default


def _is_bits(bits: Any, allowed: tuple[int, ...]) -> bool:
    return isinstance(bits, int) and not isinstance(bits, bool) and bits in allowed


def _group(group: Any, where: str) -> int:
    if group is None or group == -1:
        return 0
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise KestrelError(f"{where}: group_size must be a positive integer or -1, got {group!r}")
    return group


def _compressed_tensors_scheme(quantization: dict, where: str) -> IntScheme | None:
    """compressed-tensors with integer weights in every config group (None: float ones, model/fp8.py's)."""
    groups = quantization.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise KestrelError(f"{where}: compressed-tensors config_groups must be an object")
    weights = [g.get("weights") if isinstance(g, dict) else None for g in groups.values()]
    if not weights or not all(isinstance(w, dict) and w.get("type") == "int" for w in weights):
        return None
    if quantization.get("format") == "dense":
        return None  # saved uncompressed: plain float weights
    formats = {g["format"] for g in groups.values() if isinstance(g.get("format"), str)}  # newer files: a group's
    fmt = quantization.get("format") or (formats.pop() if len(formats) == 1 else None)
    sparsity = quantization.get("sparsity_config") or {}
    if isinstance(sparsity, dict) and sparsity.get("format") not in (None, "dense"):
        raise KestrelError(f"{where}: compressed-tensors sparsity format {sparsity.get('format')!r} is not supported")
    if quantization.get("transform_config"):
        raise KestrelError(f"{where}: compressed-tensors transforms (transform_config: rotated weights) are not "
                           "supported")
    if fmt not in CT_INT_FORMATS:
        raise KestrelError(f"{where}: compressed-tensors format {fmt!r} is not supported for integer weights "
                           f"(kestrel reads {', '.join(CT_INT_FORMATS)})")
    allowed = (2, 4, 8) if fmt == "pack-quantized" else (8,)
    bits = sorted({str(w.get("num_bits")) for w in weights})
    if len(bits) != 1 or not _is_bits(weights[0].get("num_bits"), allowed):
        raise KestrelError(f"{where}: compressed-tensors integer weights of {bits} bits are not supported (kestrel "
                           "reads 2, 4 and 8 bits packed, 8 as int8)")
    return IntScheme("compressed-tensors", weights[0]["num_bits"])


def natural_quant(quantization: Any) -> str | None:
    """The quant mode a checkpoint of this ``quantization_config`` loads at when none is asked for: q4 where every
    weight is symmetric 4-bit codes in groups of whole 32-blocks (the strip-cache then holds them as they are, in
    half q8's memory), else None (kestrel's default). A config int_scheme refuses gives None: loading says why.
    The config alone does not say that every projection is quantized (an ignore list may leave some float): the
    loader checks the checkpoint's tensors too (HFCheckpoint.projections_integer)."""
    try:
        scheme = int_scheme(quantization, "config.json")
    except KestrelError:
        return None
    if scheme is None or scheme.bits != 4 or scheme.method == "awq":
        return None
    if scheme.method == "gptq":
        whole = scheme.group_size % 32 == 0 and quantization.get("sym") is True and not quantization.get("dynamic")
        return "q4" if whole and quantization.get("desc_act") is not True else None
    weights = [g["weights"] for g in quantization["config_groups"].values()]
    # act-order "group" stores a g_idx; "weight" (alias "static") only changed how the codes were found
    symmetric = all(w.get("symmetric") is True and w.get("actorder") in (None, False, "weight", "static")
                    for w in weights)
    groups = all(w.get("strategy") == "channel" or (isinstance(w.get("group_size"), int)
                                                    and w["group_size"] % 32 == 0) for w in weights)
    return "q4" if symmetric and groups else None


# -- decoding ---------------------------------------------------------------------------------------------
# Every layout comes down to rows of codes packed along K (uint8 [N, B], the lowest bits of each byte first: an
# int32 word's four bytes in order; AWQ's, which run along N, are unpacked to a byte a code first), a zero point
# and a scale per row and group, and each column's group: an IntWeight. Where its groups are whole runs of a
# strip-cache's blocks and its codes less their zero points fit kestrel's codes, it becomes a strip-cache as it
# is (q8: any 4-bit checkpoint and symmetric 8-bit ones; q4: symmetric 4-bit ones); otherwise it is decoded to
# float32 and quantized again. The loops are compiled (one pass, no [N, K] temporaries, row chunks on every core:
# 400-540 against 28-48 M params/s for numpy on two cores, docs/performance.md) where numba works; the numpy
# functions are their definitions, bit for bit.
_COMPILED: dict[str, Any] = {}


@dataclass(frozen=True, eq=False)
class IntWeight:
    """An integer checkpoint's weight [N, K]: codes ``packed`` uint8 [N, B] of ``bits`` each along K, ``zeros``
    and ``scales`` float32 [N, G] (zero points in the codes' own unsigned domain), ``column_group`` int64 [K]."""

    packed: np.ndarray
    bits: int
    zeros: np.ndarray
    scales: np.ndarray
    column_group: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], len(self.column_group)

    @property
    def ndim(self) -> int:
        return 2

    def __getitem__(self, rows: slice | np.ndarray) -> IntWeight:
        """Some rows (a fused tensor's part)."""
        return IntWeight(np.ascontiguousarray(self.packed[rows]), self.bits, np.ascontiguousarray(self.zeros[rows]),
                         np.ascontiguousarray(self.scales[rows]), self.column_group)

    def to_float32(self) -> np.ndarray:
        """float32 [N, K] = scales * (codes - zeros), by group."""
        return self._decode(self.scales, np.float32)

    def strip_cache(self, bits: int, group_size: int) -> StripCache | None:
        """The weight as a strip-cache of ``bits`` and ``group_size`` holding its very values, where one can (its
        groups whole runs of blocks, its codes less their zero points within the code range), else None."""
        n, k = self.shape
        groups = self.scales.shape[1]
        size = k // groups
        lo, hi = CODE_RANGE[bits]
        if k % groups or size % group_size or not np.array_equal(self.column_group, np.arange(k) // size):
            return None
        if not (np.isfinite(self.scales).all() and np.array_equal(self.zeros, np.round(self.zeros))
                and np.abs(self.zeros).max(initial=0) <= 1 << 12):
            return None  # decoded, the quantizer names a NaN or infinity; such zero points have no codes
        top = (1 << self.bits) - 1
        if self.zeros.min(initial=0) < top - hi or self.zeros.max(initial=0) > -lo:
            codes = self._decode(np.ones_like(self.scales), np.int16)  # a zero point may not bound the codes
            if codes.size and (codes.min() < lo or codes.max() > hi):
                return None
            codes = codes.astype(np.int8)
        else:
            codes = self._decode(np.ones_like(self.scales), np.int8)
        scales = np.ascontiguousarray(np.repeat(self.scales, size // group_size, axis=1), np.float32)
        return StripCache(codes, scales, group_size, bits, check_range=False)

    def _decode(self, scales: np.ndarray, dtype: Any) -> np.ndarray:
        out = np.empty(self.shape, dtype)
        args = (self.packed, self.bits, self.zeros, np.ascontiguousarray(scales, np.float32), self.column_group, out)
        _run("rows", _decode_rows_loop, _decode_rows_reference, args, self.shape[0], self.shape[1])
        return out


def _decode_rows_reference(packed: np.ndarray, bits: int, zeros: np.ndarray, scales: np.ndarray,
                           column_group: np.ndarray, out: np.ndarray) -> None:
    """out [N, K] = (q[n, k] - zeros[n, g(k)]) * scales[n, g(k)] in float32, q the codes of packed uint8 [N, B]."""
    codes = _codes(packed, bits, out.shape[1])
    out[...] = (codes.astype(np.float32) - zeros[:, column_group]) * scales[:, column_group]


def _codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """uint8 [R, count]: the codes of packed uint8 [R, B], the lowest bits of each byte first."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    return ((packed[:, :, None] >> shifts) & np.uint8((1 << bits) - 1)).reshape(len(packed), -1)[:, :count]


def _decode_rows_loop(packed: np.ndarray, bits: int, zeros: np.ndarray, scales: np.ndarray,
                      column_group: np.ndarray, out: np.ndarray, start: int, stop: int) -> None:
    """_decode_rows_reference for numba, rows start..stop-1."""
    per = 8 // bits
    mask = (1 << bits) - 1
    for r in range(start, stop):
        for c in range(out.shape[1]):
            q = (packed[r, c // per] >> ((c % per) * bits)) & mask
            g = column_group[c]
            out[r, c] = (np.float32(q) - zeros[r, g]) * scales[r, g]


def _run(name: str, loop: Any, reference: Any, args: tuple[Any, ...], rows: int, columns: int) -> None:
    """``loop`` compiled by numba (built once, cached on disk) on ``args``, ``rows`` chunks of ``columns`` each on
    a thread per core; else ``reference``, its definition, on all of them."""
    if name not in _COMPILED:
        try:
            from numba import njit

            _COMPILED[name] = njit(cache=True, nogil=True)(loop)
        except Exception as exc:  # numba missing or broken: the definition gives the same values
            _disable_compiled(name, exc)
    kernel = _COMPILED[name]
    if kernel is not None:
        try:
            run_row_chunks(lambda start, stop: kernel(*args, start, stop), rows, columns)
            return
        except Exception as exc:
            _disable_compiled(name, exc)
    reference(*args)


def _disable_compiled(name: str, exc: BaseException) -> None:
    logging.getLogger("kestrel").debug("compiled integer decoder %s unavailable: %s", name, exc)
    _COMPILED[name] = None


def _check_words(words: np.ndarray, bits: int, count: int, where: str) -> np.ndarray:
    """``words`` (int32 [R, W], 32 / bits codes a word) as uint8 [R, 4 W], if they hold ``count`` codes a row."""
    per = 32 // bits
    if words.ndim != 2 or words.dtype != np.int32 or not (words.shape[1] - 1) * per < count <= words.shape[1] * per:
        raise KestrelError(f"{where}: packed tensor of shape {list(words.shape)} ({words.dtype}) does not hold "
                           f"{count} {bits}-bit codes a row")
    return np.ascontiguousarray(words).view(np.uint8)


def unpack_rows(words: np.ndarray, bits: int, count: int, where: str) -> np.ndarray:
    """int32 codes [R, count] of int32 ``words`` [R, W] (zero points: small arrays)."""
    return _codes(_check_words(words, bits, count, where), bits, count).astype(np.int32)


def _groups_of(columns: int, groups: int, group_size: int, g_idx: np.ndarray | None, where: str) -> np.ndarray:
    """int [K]: each input column's group."""
    if g_idx is not None:
        g = np.asarray(g_idx).reshape(-1)
        if g.shape != (columns,) or g.dtype.kind not in "iu" or g.min(initial=0) < 0 or g.max(initial=0) >= groups:
            raise KestrelError(f"{where}: g_idx of shape {list(g.shape)} does not give each of {columns} columns one "
                               f"of {groups} groups")
        return g.astype(np.int64)
    size = group_size or columns
    if groups != -(-columns // size):
        raise KestrelError(f"{where}: {groups} groups of scales for {columns} columns (group_size {size})")
    return np.arange(columns) // size


def _scales(scales: np.ndarray, n: int, where: str) -> np.ndarray:
    """[N, G] float32 of a compressed-tensors weight_scale: [N, G], [N] or one for the tensor."""
    s = np.asarray(scales, np.float32)
    if s.size == 1:
        return np.full((n, 1), s.reshape(()), np.float32)
    if s.ndim == 1 and s.shape[0] == n:
        return s.reshape(n, 1)
    if s.ndim != 2 or s.shape[0] != n or s.shape[1] == 0:
        raise KestrelError(f"{where}: weight_scale of shape {list(s.shape)} does not fit {n} rows")
    return s


def _integer(zero_point: np.ndarray, where: str) -> np.ndarray:
    """An unpacked zero point (int8, as compressed-tensors stores one) as float32."""
    z = np.asarray(zero_point)
    if z.dtype != np.int8:
        raise KestrelError(f"{where}: weight_zero_point is {z.dtype}; expected int8")
    return z.astype(np.float32)


def _weight(packed: np.ndarray, bits: int, zeros: np.ndarray, scales: np.ndarray,
            column_group: np.ndarray) -> IntWeight:
    return IntWeight(np.ascontiguousarray(packed), bits, np.ascontiguousarray(zeros, np.float32),
                     np.ascontiguousarray(scales, np.float32), np.ascontiguousarray(column_group, np.int64))


class StoredTensors(Protocol):
    """A checkpoint's tensors by their own names, as stored (hf.HFCheckpoint)."""

    def has_tensor(self, hf_name: str) -> bool: ...

    def tensor(self, hf_name: str) -> np.ndarray: ...

    def float_tensor(self, hf_name: str) -> np.ndarray:
        """A float tensor (BF16 widened) as float32 or float16."""
        ...


def read_weight(ck: StoredTensors, hf_name: str, scheme: IntScheme | None, where: str) -> IntWeight:
    """The integer weight whose codes are ``hf_name`` (X.qweight, X.weight_packed, or an int8 X.weight), with the
    tensors beside it."""
    if scheme is None:
        raise KestrelError(f"{where} is integer-quantized, but config.json has no GPTQ, AWQ or compressed-tensors "
                           "quantization_config")
    if hf_name.endswith(".qweight"):
        if scheme.method not in ("gptq", "awq"):
            raise KestrelError(f"{where}: a GPTQ or AWQ tensor in a {scheme.method} checkpoint")
        base = hf_name.removesuffix(".qweight")
        qweight, qzeros, scales = ck.tensor(hf_name), ck.tensor(base + ".qzeros"), ck.float_tensor(base + ".scales")
        if scheme.method == "awq":
            return read_awq(qweight, qzeros, scales, scheme, where)
        g_idx = ck.tensor(base + ".g_idx") if ck.has_tensor(base + ".g_idx") else None
        return read_gptq(qweight, qzeros, scales, g_idx, scheme, where)
    if scheme.method != "compressed-tensors":
        raise KestrelError(f"{where}: a compressed-tensors tensor in a {scheme.method} checkpoint")
    base = hf_name.removesuffix(".weight_packed").removesuffix(".weight")
    scales = ck.float_tensor(base + ".weight_scale")
    zero_point, g_idx = (ck.tensor(base + f) if ck.has_tensor(base + f) else None
                         for f in (".weight_zero_point", ".weight_g_idx"))
    if hf_name.endswith(".weight_packed"):
        return read_packed(ck.tensor(hf_name), ck.tensor(base + ".weight_shape"), scales, zero_point, g_idx, scheme,
                           where)
    return read_int8(ck.tensor(hf_name), scales, zero_point, g_idx, where)


# -- the layouts ------------------------------------------------------------------------------------------


def read_gptq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray | None,
              scheme: IntScheme, where: str) -> IntWeight:
    """A GPTQ linear (see the module's docstring)."""
    s = np.asarray(scales, np.float32)  # [G, N]
    if s.ndim != 2 or np.asarray(qweight).ndim != 2:
        raise KestrelError(f"{where}: qweight {list(np.shape(qweight))} and scales {list(s.shape)} must be 2-D")
    groups, n = s.shape
    k = qweight.shape[0] * 32 // scheme.bits
    if qweight.shape[1] != n:
        raise KestrelError(f"{where}: qweight has {qweight.shape[1]} columns, scales {n}")
    packed = _check_words(np.ascontiguousarray(np.asarray(qweight).T), scheme.bits, k, where)  # [N, K b / 8]
    words = np.asarray(qzeros)
    if scheme.zero_offset and words.dtype == np.int32:  # v1: each zero point less 1, subtracted from the whole
        # word as GPTQModel writes it (a zero point of 0 borrows from the next) and adds it back as it reads
        ones = np.uint32(sum(1 << (scheme.bits * i) for i in range(32 // scheme.bits)))
        words = (words.view(np.uint32) + ones).view(np.int32)
    zeros = unpack_rows(words, scheme.bits, n, where)  # [G, N]
    if zeros.shape[0] != groups:
        raise KestrelError(f"{where}: qzeros has {zeros.shape[0]} groups, scales {groups}")
    return _weight(packed, scheme.bits, zeros.T, s.T, _groups_of(k, groups, scheme.group_size, g_idx, where))


def read_awq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, scheme: IntScheme,
             where: str) -> IntWeight:
    """An AWQ (gemm) linear: its codes, which run along N in AWQ_ORDER, unpacked to a byte each along K."""
    s = np.asarray(scales, np.float32)  # [G, N]
    if s.ndim != 2 or s.shape[1] % 8:
        raise KestrelError(f"{where}: scales of shape {list(s.shape)}; expected [groups, N], N a multiple of 8")
    groups, n = s.shape
    words = _check_words(np.asarray(qweight), 4, n, f"{where} (qweight)")  # [K, N / 2] bytes
    zeros = unpack_rows(np.asarray(qzeros), 4, n, f"{where} (qzeros)")  # [G, N] in AWQ_ORDER
    if zeros.shape[0] != groups:
        raise KestrelError(f"{where}: qzeros has {zeros.shape[0]} groups, scales {groups}")
    k = words.shape[0]
    codes = np.empty((n, k), np.uint8)
    args = (words, np.ascontiguousarray(AWQ_ORDER, np.int64), codes)
    _run("columns", _awq_codes_loop, _awq_codes_reference, args, n // 8, 8 * k)
    return _weight(codes, 8, _in_column_order(zeros, AWQ_ORDER).T, s.T,
                   _groups_of(k, groups, scheme.group_size, None, where))


def _in_column_order(codes: np.ndarray, order: np.ndarray) -> np.ndarray:
    """codes [R, N] in nibble order (nibble i of each eight holding column order[i]) as [R, N] in column order."""
    out = np.empty_like(codes)
    out.reshape(len(codes), -1, 8)[:, :, order] = codes.reshape(len(codes), -1, 8)
    return out


def _awq_codes_reference(words: np.ndarray, order: np.ndarray, out: np.ndarray) -> None:
    """out uint8 [N, K]: the 4-bit codes of words uint8 [K, N / 2] (word w's nibble i holding column 8 w + order[i]),
    a byte each."""
    out[...] = _in_column_order(_codes(words, 4, 2 * words.shape[1]), order).T


def _awq_codes_loop(words: np.ndarray, order: np.ndarray, out: np.ndarray, start: int, stop: int) -> None:
    """_awq_codes_reference for numba, words start..stop-1 of each row of ``words`` (rows 8 start .. 8 stop - 1 of
    out), 16 columns of out at a time (its rows' lines stay cached)."""
    k = out.shape[1]
    for k0 in range(0, k, 16):
        for w in range(start, stop):
            for i in range(8):
                col = 8 * w + order[i]
                for c in range(k0, min(k0 + 16, k)):
                    out[col, c] = (words[c, 4 * w + i // 2] >> (4 * (i % 2))) & 15


def read_packed(packed: np.ndarray, shape: Any, scales: np.ndarray, zero_point: np.ndarray | None,
                g_idx: np.ndarray | None, scheme: IntScheme, where: str) -> IntWeight:
    """A compressed-tensors ``pack-quantized`` weight (``shape``: its weight_shape)."""
    dims = np.asarray(shape).reshape(-1)
    if dims.shape != (2,) or dims.dtype.kind not in "iu" or dims.min() < 1:
        raise KestrelError(f"{where}: weight_shape {dims.tolist()} is not two positive sizes")
    n, k = int(dims[0]), int(dims[1])
    rows = _check_words(np.asarray(packed), scheme.bits, k, where)
    if rows.shape[0] != n:
        raise KestrelError(f"{where}: weight_packed has {rows.shape[0]} rows, weight_shape {n}")
    s = _scales(scales, n, where)
    zeros = np.full(s.shape, 1 << (scheme.bits - 1), np.float32)  # the codes' offset: symmetric
    if zero_point is not None and np.size(zero_point) == 1 and s.size == n:  # a tensor's: one, unpacked, signed
        zeros = zeros + _integer(zero_point, where).reshape(())
    elif zero_point is not None:  # a group's or a row's: packed with the same offset
        zeros = unpack_rows(np.ascontiguousarray(np.asarray(zero_point).T), scheme.bits, n, where).T
        if zeros.shape != s.shape:
            raise KestrelError(f"{where}: weight_zero_point unpacks to {list(zeros.shape)}, weight_scale is "
                               f"{list(s.shape)}")
    return _weight(rows, scheme.bits, zeros, s, _groups_of(k, s.shape[1], k // s.shape[1], g_idx, where))


def read_int8(weight: np.ndarray, scales: np.ndarray, zero_point: np.ndarray | None, g_idx: np.ndarray | None,
              where: str) -> IntWeight:
    """A compressed-tensors ``int-quantized`` weight (int8 [N, K] as it is), its codes moved to unsigned bytes
    (code + 128) and its zero points with them."""
    w = np.asarray(weight)
    if w.ndim != 2 or w.dtype != np.int8:
        raise KestrelError(f"{where}: int8 weight of shape {list(w.shape)} ({w.dtype}); expected int8 [N, K]")
    n, k = w.shape
    s = _scales(scales, n, where)
    zeros = np.zeros(s.shape, np.float32)
    if zero_point is not None:
        if np.size(zero_point) not in (1, s.size):
            raise KestrelError(f"{where}: weight_zero_point of shape {list(np.shape(zero_point))} does not fit "
                               f"weight_scale {list(s.shape)}")
        zeros = zeros + _integer(zero_point, where).reshape(s.shape if np.size(zero_point) > 1 else ())
    if k % s.shape[1]:
        raise KestrelError(f"{where}: {s.shape[1]} groups of scales for {k} columns")
    return _weight(w.view(np.uint8) ^ np.uint8(0x80), 8, zeros + 128, s,
                   _groups_of(k, s.shape[1], k // s.shape[1], g_idx, where))
