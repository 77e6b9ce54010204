"""What a backend's results must be before the engine uses them: the checks the dispatcher (and selftest) apply to
every hook's result, each an answer to "why can this not be used?" (None: it can). They ask for exact types (a plain
list of plain numpy arrays, Python's or numpy's own integers...), so that no code of the backend's runs in them and
what is checked is what is used.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from numpy.lib.array_utils import byte_bounds

from kestrel_core.batch import BatchEntry, id_range
from kestrel_core.errors import safe_text

# numpy's own integer scalar types, by their type codes: np.longlong and np.intc are types of their own beside np.int64
# and np.int32 (on Linux); the checks ask for one of these exact types, so no subclass's code runs in them
NUMPY_INTS = frozenset(np.dtype(code).type for code in np.typecodes["AllInteger"])


# numpy's own number scalar types whose tolist() gives Python's numbers (bool, integers, float16/32/64), by type code
_NUMPY_NUMBERS = frozenset(np.dtype(code).type for code in "?" + np.typecodes["AllInteger"] + "efd")
_PLAIN = (type(None), bool, int, float, str)


def plain_counter(value: Any, nested: bool = False) -> Any:
    """A backend counter's value as Python's None, bool, int, float or str, or a list of them (a numpy number or an
    array of numbers as Python's numbers, a list's or a tuple's items each so; any other object as its text,
    ``safe_text``). Exact types only: no code of the backend's runs."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind in _NUMPY_NUMBERS or (kind is np.ndarray and value.dtype.type in _NUMPY_NUMBERS):
        return value.tolist()
    if kind in (list, tuple) and not nested:
        return [plain_counter(v, True) for v in value]
    return safe_text(value)


# Every result of every step is checked, so the check is the cheaper of two per size. Measured on the 2-core dev box
# (numpy 2.4, float32): np.isfinite(a).all() takes 1.8 us over 4,096 values (a decode row's projection), 14 us over a
# 151,936-vocabulary row of logits, 82 us over 1M values, where a float32 sum (np.add.reduce: no temporary, non-finite
# if any value is) takes 2.1, 25 and 159 us; past a few million values isfinite's temporary leaves the cache and both
# are bound by memory bandwidth, where the sum is the faster: 5.0 ms against 6.6 ms over a [2048, 14336] prefill
# projection (about 24 GB/s, as fast as the result's copy from a device).
SUM_CHECK_FROM = 1 << 22


def all_finite(a: np.ndarray) -> bool:
    """No NaN or infinity in ``a``, in one pass; from SUM_CHECK_FROM values a sum's (a sum of huge finite values that
    overflows then counts as non-finite too, which is as unusable)."""
    if a.size < SUM_CHECK_FROM:
        return bool(np.isfinite(a).all())
    return bool(np.isfinite(np.add.reduce(a, axis=None)))


def check_array(result: Any, shape: tuple[int, ...], inputs: Sequence[np.ndarray] = ()) -> str | None:
    """Why ``result`` cannot be used as a float32 array of ``shape`` that the engine owns (None: it can): not a
    plain writable numpy array (a matrix, a read-only view), or one sharing memory with the call's ``inputs``."""
    if type(result) is not np.ndarray:
        return f"got {type(result).__name__}, expected a numpy.ndarray"
    if not result.flags.writeable:
        return "a read-only array"
    if any(_overlap(result, x) for x in inputs):
        return "an array sharing memory with the call's input or another result"
    if result.dtype != np.float32:
        return f"dtype {result.dtype}, expected float32"
    if result.shape != shape:
        return f"shape {list(result.shape)}, expected {list(shape)}"
    if not all_finite(result):
        return "non-finite values"
    return None


def check_iterator(result: Any) -> str | None:
    return None if issubclass(type(result), Iterator) else f"{type(result).__name__}, not an iterator"


def check_batch(result: Any, batch: Sequence[BatchEntry], vocab: int) -> str | None:
    """Why ``result`` cannot be the batched whole step's result for ``batch`` (None: it can): one plain array per
    entry, each as ``check_array`` asks (or ``argmax_only`` token ids), no logits shared between entries. The
    dispatcher's test, and selftest's."""
    if type(result) not in (list, tuple) or len(result) != len(batch):
        return f"expected a list of {len(batch)} arrays"
    for r, e in zip(result, batch):
        if e.argmax_only and type(r) is np.ndarray and r.ndim == 1:
            bad = _check_ids(r, e.logit_rows, vocab)
        else:
            bad = check_array(r, (e.logit_rows, vocab))
        if bad:
            return bad
    # logits the engine may change in place (penalties, the temperature) must be each entry's own; ids it only reads
    logits = [r for r in result if r.dtype == np.float32]
    return "logits sharing memory with another entry's" if _any_shared(logits) else None


def _any_shared(arrays: Sequence[np.ndarray]) -> bool:
    """Whether two of ``arrays`` share an element. Their byte ranges in order of their starts: only arrays whose
    ranges meet are compared (a batch's results: one pass, not every pair of them)."""
    if len(arrays) < 2:
        return False
    spans = sorted((byte_bounds(a), i) for i, a in enumerate(arrays) if a.size)
    meeting: list[tuple[int, int]] = []  # (end, index) of the ranges the next may still meet
    for (start, end), i in spans:
        meeting = [(e, j) for e, j in meeting if e > start]
        if any(_overlap(arrays[i], arrays[j]) for _, j in meeting):
            return True
        meeting.append((end, i))
    return False


def _check_ids(result: np.ndarray, rows: int, vocab: int) -> str | None:
    """Token ids of an ``argmax_only`` entry: int64 [rows] in [0, vocab); -1 marks non-finite logits."""
    if result.dtype != np.int64:
        return f"token ids of dtype {result.dtype}, expected int64"
    if result.shape != (rows,):
        return f"token ids of shape {list(result.shape)}, expected [{rows}]"
    if not result.size:
        return None
    lo, hi = id_range(result)
    if lo == -1:
        return "non-finite values"
    if not (0 <= lo and hi < vocab):
        return f"token ids outside [0, {vocab})"
    return None


def check_arrays(result: Any, shapes: list[tuple[int, ...]], inputs: Sequence[np.ndarray] = ()) -> str | None:
    """Why the arrays of ``result`` cannot be a GEMM hook's results of ``shapes`` (None: they can): each as
    ``check_array`` asks, and none sharing memory with another. The dispatcher's test, and selftest's."""
    if type(result) not in (list, tuple) or len(result) != len(shapes):
        return f"expected a list of {len(shapes)} arrays"
    for i, (r, s) in enumerate(zip(result, shapes)):
        bad = check_array(r, s, [*inputs, *result[:i]])
        if bad:
            return bad
    return None


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` share an element (column slices of one array do not); where numpy cannot tell
    quickly, they count as sharing."""
    if not np.may_share_memory(a, b):
        return False
    try:
        return bool(np.shares_memory(a, b, max_work=10_000))
    except np.exceptions.TooHardError:
        return True
