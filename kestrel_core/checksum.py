"""XXH64 (seed 0), the checksum of every tensor in a ``.kst`` artifact, compiled with numba.

XXH64 is xxHash's 64-bit hash (https://github.com/Cyan4973/xxHash, doc/xxhash_spec.md): any producer can
compute it, e.g. ``xxhash.xxh64(data).intdigest()`` from the ``xxhash`` package. It is 64 bits wide and runs
at several GB/s a core here (zlib.crc32: 2.7-4 GB/s, hashlib's blake2b: ~1), so verifying an 8B model's
9 GB costs about a second on two cores. numba releases the GIL, so threads hash different tensors at once.

``XXH64`` hashes a stream given in chunks; ``xxh64`` one buffer. Where numba is unusable, a plain Python
implementation (~10 MB/s, for small data and for checking the compiled one) is all there is, and
``FAST`` is False: the artifact code then neither writes nor verifies checksums, and says so.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger("kestrel")

_MASK = (1 << 64) - 1
P1 = 0x9E3779B185EBCA87
P2 = 0xC2B2AE3D27D4EB4F
P3 = 0x165667B19E3779F9
P4 = 0x85EBCA77C2B2AE63
P5 = 0x27D4EB2F165667C5
STRIPE = 32  # bytes: four 64-bit lanes


# -- plain Python: the definition, and the fallback -------------------------------------------------------

def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _MASK


def _round(acc: int, lane: int) -> int:
    return (_rotl((acc + lane * P2) & _MASK, 31) * P1) & _MASK


def _py_stripes(state: np.ndarray, data: np.ndarray) -> None:
    v = [int(x) for x in state]
    words = data[:len(data) // STRIPE * STRIPE].view("<u8")
    for s in range(0, len(words), 4):
        v = [_round(v[j], int(words[s + j])) for j in range(4)]
    state[:] = np.array(v, dtype=np.uint64)


def _py_digest(state: np.ndarray, tail: np.ndarray, total: int) -> int:
    """The final hash from the lanes (when ``total`` >= 32), the last ``total % 32`` bytes and the length."""
    if total >= STRIPE:
        v = [int(x) for x in state]
        h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & _MASK
        for lane in v:
            h = (((h ^ _round(0, lane)) * P1) + P4) & _MASK
    else:
        h = P5
    h = (h + total) & _MASK
    b = bytes(tail)
    i = 0
    while i + 8 <= len(b):
        h = ((_rotl(h ^ _round(0, int.from_bytes(b[i:i + 8], "little")), 27) * P1) + P4) & _MASK
        i += 8
    if i + 4 <= len(b):
        h = ((_rotl(h ^ ((int.from_bytes(b[i:i + 4], "little") * P1) & _MASK), 23) * P2) + P3) & _MASK
        i += 4
    while i < len(b):
        h = (_rotl(h ^ ((b[i] * P5) & _MASK), 11) * P1) & _MASK
        i += 1
    h ^= h >> 33
    h = (h * P2) & _MASK
    h ^= h >> 29
    h = (h * P3) & _MASK
    return h ^ (h >> 32)


# -- compiled ----------------------------------------------------------------------------------------------

_LOCK = threading.Lock()
_COMPILED: dict[str, Any] = {}


def _compiled() -> Callable[[np.ndarray, np.ndarray], None] | None:
    """The numba build of the stripe loop (cached on disk), or None where numba is unusable."""
    with _LOCK:
        if "stripes" not in _COMPILED:
            _COMPILED["stripes"] = _build()
        return _COMPILED["stripes"]


_U1, _U2, _R31, _R33 = np.uint64(P1), np.uint64(P2), np.uint64(31), np.uint64(33)  # numba: typed constants


def _stripes_kernel(state: np.ndarray, data: np.ndarray) -> None:
    """The stripe loop for numba: data uint8, a multiple of 32 bytes, any alignment (x86 and arm64 load
    unaligned words); state: the four uint64 lanes, updated in place."""
    words = data.view(np.uint64)
    v1, v2, v3, v4 = state[0], state[1], state[2], state[3]
    for s in range(0, words.size - 3, 4):
        a = v1 + words[s] * _U2
        v1 = ((a << _R31) | (a >> _R33)) * _U1
        a = v2 + words[s + 1] * _U2
        v2 = ((a << _R31) | (a >> _R33)) * _U1
        a = v3 + words[s + 2] * _U2
        v3 = ((a << _R31) | (a >> _R33)) * _U1
        a = v4 + words[s + 3] * _U2
        v4 = ((a << _R31) | (a >> _R33)) * _U1
    state[0] = v1
    state[1] = v2
    state[2] = v3
    state[3] = v4


def _build() -> Callable[[np.ndarray, np.ndarray], None] | None:
    if sys.byteorder != "little":  # the lanes are read as native uint64
        return None
    try:
        from numba import njit

        stripes = njit(cache=True, nogil=True, boundscheck=False)(_stripes_kernel)
        probe = np.arange(64, dtype=np.uint8)
        want, got = _initial(), _initial()
        _py_stripes(want, probe)
        stripes(got, probe)
        if not np.array_equal(want, got):
            raise RuntimeError("the compiled XXH64 disagrees with its definition")
    except Exception as exc:  # numba missing or broken: the plain Python fallback
        log.warning("numba is unusable for XXH64 (%s): artifact checksums are neither written nor verified",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    return stripes  # type: ignore[no-any-return]


def _initial() -> np.ndarray:
    return np.array([(P1 + P2) & _MASK, P2, 0, (-P1) & _MASK], dtype=np.uint64)


def fast() -> bool:
    """Whether hashing runs compiled (GB/s), not in plain Python."""
    return _compiled() is not None


class XXH64:
    """XXH64 with seed 0 over a stream of chunks (any sizes; chunks of a multiple of 32 bytes copy nothing)."""

    def __init__(self) -> None:
        self.state = _initial()
        self.total = 0
        self.pending = np.empty(0, np.uint8)  # < 32 bytes carried to the next update
        self.kernel = _compiled() or _py_stripes

    def update(self, data: np.ndarray | bytes | memoryview) -> None:
        buf = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
        self.total += buf.size
        if self.pending.size:
            need = STRIPE - self.pending.size
            self.pending = np.concatenate([self.pending, buf[:need]])
            buf = buf[need:]
            if self.pending.size < STRIPE:
                return
            self.kernel(self.state, self.pending)
            self.pending = np.empty(0, np.uint8)
        whole = buf.size // STRIPE * STRIPE
        if whole:
            self.kernel(self.state, buf[:whole])
        if whole < buf.size:
            self.pending = buf[whole:].copy()

    def intdigest(self) -> int:
        return _py_digest(self.state, self.pending, self.total)

    def hexdigest(self) -> str:
        return f"{self.intdigest():016x}"


def xxh64(data: np.ndarray | bytes | memoryview) -> int:
    """XXH64 (seed 0) of a buffer's bytes."""
    h = XXH64()
    h.update(data)
    return h.intdigest()
