"""The bounds pre-pass of a GGUF file: every length and offset its header names is checked against the file's
size (and element counts against caps) before gguf-py reads it, since gguf-py allocates what a header says.
A file that fails is one KestrelError naming what is wrong; ``check_gguf_bounds`` returns where the tensor data
starts. ``split_parts`` names the files of a GGUF split into parts.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES

from kestrel_core.errors import KestrelError
from kestrel_core.model.validate import open_regular

GGUF_VERSIONS = (2, 3)  # what gguf-py's reader handles
# gguf-py builds one numpy view per array element (two per string), so element counts are capped as well as
# checked against the file size: 2^21 is ~2.7x the metadata arrays of a 262k-token vocabulary (Gemma 3).
MAX_ARRAY_ELEMENTS = 1 << 21
MAX_ARRAY_DEPTH = 2  # arrays of arrays of scalars; deeper nesting is refused (gguf-py recurses)
GGML_MAX_DIMS = 4
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4
GGUF_DEFAULT_ALIGNMENT = 32
# a part of a GGUF split as llama.cpp's gguf-split and convert_hf_to_gguf.py --split-max-size name them
_SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})(?P<suffix>\.gguf)$", re.IGNORECASE)


class _Bounds:
    """A cursor over the file's bytes that refuses any length reaching past the end (before reading it)."""

    def __init__(self, buf: Any, size: int, where: str) -> None:
        self.buf, self.size, self.where, self.pos = buf, size, where, 0
        self.elements = 0

    def fail(self, what: str) -> KestrelError:
        return KestrelError(f"{self.where}: not a readable GGUF file ({what} at byte {self.pos}; truncated or "
                            "corrupt)")

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes, {self.size - self.pos} remain")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = struct.unpack_from("<I", self.buf, self.pos)
        self.pos += 4
        return int(v)

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = struct.unpack_from("<Q", self.buf, self.pos)
        self.pos += 8
        return int(v)

    def string(self, what: str) -> bytes:
        n = self.u64(f"{what} length")
        self.need(n, f"{what} of {n} bytes")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw

    def count(self, n: int, min_size: int, what: str) -> None:
        """``n`` more array elements of at least ``min_size`` bytes each: within the file and the cap."""
        self.need(n * min_size, f"{what} of {n} elements")
        self.elements += n
        if self.elements > MAX_ARRAY_ELEMENTS:
            raise KestrelError(f"{self.where}: GGUF metadata arrays hold more than {MAX_ARRAY_ELEMENTS} elements; "
                               "refused")

    def value(self, vtype: int, what: str, depth: int = 0) -> int | None:
        """Skip one value of type ``vtype``; returns a uint32 scalar's value (for general.alignment)."""
        if vtype in _SCALAR_SIZES:
            size = _SCALAR_SIZES[vtype]
            if vtype == _UINT32:
                return self.u32(what)
            self.need(size, what)
            self.pos += size
        elif vtype == _STRING:
            self.string(what)
        elif vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise self.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
            itype = self.u32(f"{what} element type")
            n = self.u64(f"{what} element count")
            if itype in _SCALAR_SIZES:
                self.count(n, _SCALAR_SIZES[itype], what)
                self.pos += n * _SCALAR_SIZES[itype]
            elif itype == _STRING:
                self.count(n, 8, what)
                for _ in range(n):
                    self.string(f"{what} element")
            elif itype == _ARRAY:
                self.count(n, 12, what)
                for _ in range(n):
                    self.value(_ARRAY, what, depth + 1)
            else:
                raise self.fail(f"{what}: unknown element type {itype}")
        else:
            raise self.fail(f"{what}: unknown value type {vtype}")
        return None


def _show(raw: bytes) -> str:
    """A key or tensor name from the file, safe for a one-line message (control bytes are escaped)."""
    text = raw[:64].decode("utf-8", "replace")
    return text if text.isprintable() else repr(text)


def split_parts(path: Path) -> list[Path]:
    """The files of the GGUF ``path``: itself, or, where its name is the first part of a split one
    (``NAME-00001-of-00003.gguf``), every part in order; a KestrelError for a later part."""
    m = _SPLIT_NAME.match(path.name)
    if m is None or int(m["count"]) <= 1:
        return [path]
    no, count = int(m["no"]), int(m["count"])
    if no != 1:
        raise KestrelError(f"{path}: part {no} of {count} of a split GGUF; give its first part, "
                           f"{m['stem']}-00001-of-{m['count']}{m['suffix']}")
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}{m['suffix']}") for i in range(1, count + 1)]


def check_gguf_bounds(path: str | Path) -> int:
    """Walk the GGUF header, metadata and tensor infos checking every length against the file size, before
    gguf-py reads it: a 49-byte file whose array header claims 2^62 elements must not make gguf-py allocate
    (it builds a Python list element by element: 3.7 GB, then a hang). Each string length, array count x
    element size and tensor extent (offset + bytes, after the aligned data start) must fit in the file; tensor
    types must be known to gguf-py and have at most 4 non-zero dimensions; the tensors must lie as llama.cpp
    requires (each offset the padded sizes of the tensors before it), and the file be little-endian. Returns where
    the tensor data start (the header's length, alignment included)."""
    where = str(path)
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise KestrelError(f"{where}: not a readable GGUF file ({size} bytes; truncated or corrupt)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _walk(buf, size, where)


def _walk(buf: Any, size: int, where: str) -> int:
    if bytes(buf[:4]) != b"GGUF":
        raise KestrelError(f"{where}: not a GGUF file (bad magic {bytes(buf[:4])!r}; truncated or corrupt?)")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version & 0xFFFF == 0:  # llama.cpp's test: a version this large is a small one in the other byte order
        raise KestrelError(f"{where}: a big-endian GGUF file; kestrel reads little-endian ones only (as llama.cpp "
                           "does on a little-endian host)")
    if version not in GGUF_VERSIONS:
        raise KestrelError(f"{where}: not a readable GGUF file (version {version}; kestrel reads versions 2 and 3; "
                           "truncated or corrupt?)")
    b = _Bounds(buf, size, where)
    b.pos = 8
    n_tensors = b.u64("tensor count")
    n_kv = b.u64("metadata count")
    b.need(n_kv * 13, f"{n_kv} metadata entries")  # key length 8 + >= 1 byte + type 4
    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = b.string("metadata key")
        vtype = b.u32(f"metadata {_show(key)} type")
        scalar = b.value(vtype, f"metadata {_show(key)}")
        if key == b"general.alignment":
            if vtype != _UINT32 or scalar is None or scalar == 0 or scalar & (scalar - 1):
                raise KestrelError(f"{where}: general.alignment must be a uint32 power of two")
            alignment = scalar
    b.need(n_tensors * 24, f"{n_tensors} tensor infos")  # name length 8 + n_dims 4 + type 4 + offset 8
    extents = []
    for _ in range(n_tensors):
        name = _show(b.string("tensor name"))
        n_dims = b.u32(f"tensor {name} dimension count")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise b.fail(f"tensor {name} has {n_dims} dimensions")
        dims = [b.u64(f"tensor {name} dimension") for _ in range(n_dims)]
        raw_type = b.u32(f"tensor {name} type")
        offset = b.u64(f"tensor {name} offset")
        qtype = next((t for t in GGML_QUANT_SIZES if int(t) == raw_type), None)
        if qtype is None:
            raise b.fail(f"tensor {name} has unknown type {raw_type}")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if min(dims) < 1 or dims[0] % block:
            raise b.fail(f"tensor {name} has dimensions {dims} (type {qtype.name}, blocks of {block})")
        n_elems = math.prod(dims)
        extents.append((name, offset, n_elems // block * type_size))
    start = b.pos + (-b.pos) % alignment
    expected = 0  # llama.cpp's rule: each tensor starts where the one before it ends, padded to the alignment
    for name, offset, nbytes in extents:
        if offset != expected:
            raise KestrelError(f"{where}: not a readable GGUF file (tensor {name} has offset {offset}, expected "
                               f"{expected}: tensors lie in order, each padded to {alignment} bytes, without gaps or "
                               "overlaps; corrupt)")
        expected += nbytes + (-nbytes) % alignment
        if start + offset + nbytes > size:
            raise KestrelError(f"{where}: not a readable GGUF file (tensor {name} needs bytes "
                               f"{start + offset}..{start + offset + nbytes}, the file has {size}; truncated or "
                               "corrupt)")
    return min(start, size)
