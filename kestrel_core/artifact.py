"""The kestrel artifact (``.kst``): one safetensors file of strip-cache tensors plus JSON metadata.

Per quantized weight ``<name>.codes`` (int8 [N, K]) and ``<name>.scales`` (float32 [N, K/G]); norms and biases
as float32 ``<name>``. Tensor names are kestrel's (``embedding``, ``lm_head``, ``final_norm``,
``layers.<i>.<q|k|v|o|gate|up|down|attn_norm|mlp_norm|q_bias|k_bias|v_bias|q_norm|k_norm>``). A tied lm_head
is not stored: it is the embedding. The safetensors header's ``__metadata__`` (string values only) holds
the format name and version, the layout flags, the quant mode, each weight's group size and bits, the
ModelConfig, the tokenizer.json text, the chat template, an XXH64 of every tensor's bytes and of the rest of
the metadata, and the entry that says the file carries them.
docs/formats.md describes it field by field.

This module is the format and its header: the names above, the header parsed (JSON and offsets, every offset
and length checked against the file's size before any view is made) and its metadata checked, and the
tensors handed out as numpy views of a map of the file: no copy, and the pages are the page cache's, shared
by every process that loads the same file. The map is copy-on-write (MAP_PRIVATE), not read-only: numba types
read-only arrays apart, and a kernel taking a tuple that mixes them with ordinary arrays (the CPU backend's
fused GEMM pads its tuple with module constants) fails to compile; a write into a weight stays in the writing
process (it copies that page) and never reaches the file. ``artifact_load`` builds the model from those views
and verifies it; ``artifact_write`` writes artifacts.

A mapped file must be replaced (a new file renamed over it, as save_artifact does), never truncated or
rewritten in place: a process whose map loses its pages to truncation dies of SIGBUS.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kestrel_core import checksum
from kestrel_core.errors import KestrelError, os_error, os_reason
from kestrel_core.model.config import ModelConfig
from kestrel_core.model.validate import check_artifact_meta
from kestrel_core.model.weights import model_tensors as model_tensors

FORMAT_NAME = "kestrel-strip-cache"
# a model whose RoPE turns part of each head: its q and k rows are reordered within each head (rope.rotary_first)
ROTARY_FIRST = "rotary-dims-first"
FORMAT_VERSION = 1
# What this kestrel understands. A producer that changes the bytes' meaning (e.g. a 4x4 int4 repack) adds a
# flag; an older reader then refuses the file instead of computing garbage.
LAYOUT_FLAGS = ("row-major-codes", ROTARY_FIRST)
REQUIRED_LAYOUT_FLAGS = ("row-major-codes",)
ARTIFACT_SUFFIX = ".kst"
CHECKSUM_ALGORITHM = "xxh64"  # XXH64, seed 0, of each tensor's bytes, as 16 lowercase hex digits (checksum.py)
CHECKSUMS_KEY = "checksums"  # the metadata entry holding them (metadata_digest covers every other entry)
# The entry that says the file carries checksums, of its tensors and its metadata: one flipped bit in the name of
# CHECKSUMS_KEY (or of its "metadata") would otherwise make the file look like one written without them, which
# loads unverified; this entry is under the metadata checksum, so a flipped bit in its own name is caught there.
# Damage to both names would still pass the file off as one without checksums, so the loader knows this entry by
# its value as well as its name: no other entry may hold INTEGRITY_VALUE, and a header where one does (the name
# damaged, however many of its bits) is refused. Files without checksums hold no such value and load as before.
# A reader that does not know the entry ignores it.
INTEGRITY_KEY = "integrity"
INTEGRITY_VALUE = CHECKSUM_ALGORITHM
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
CHUNK_BYTES = 4 << 20  # the writer and the checksum / range pass work in chunks of this size

# safetensors dtype name -> item size (every dtype of the format, so any valid file's offsets can be checked)
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_NUMPY = {"I8": np.dtype("i1"), "F32": np.dtype("<f4")}  # the two an artifact uses


@dataclass
class ArtifactMeta:
    format_version: int
    layout: list[str]
    quant: str
    config: ModelConfig
    tokenizer_json: str | None = None
    chat_template: str | None = None
    tool_template: str | None = None  # the tokenizer's named tool_use chat template
    tensors: dict[str, dict[str, int]] = field(default_factory=dict)  # weight name -> group_size, bits
    extra: dict[str, Any] = field(default_factory=dict)
    bos_token: str | None = None  # the tokenizer's special-token strings (chat templates read them)
    eos_token: str | None = None
    checksums: dict[str, int] | None = None  # tensor name -> XXH64; None: the file carries none
    metadata_checksum: int | None = None  # XXH64 of the rest of the metadata (metadata_digest); None: none recorded
    integrity: str | None = None  # INTEGRITY_KEY's value: the file carries both of the above; None: not said


# -- the header -------------------------------------------------------------------------------------------

def layout_flags(config: ModelConfig) -> list[str]:
    """The layout flags of an artifact of a model of ``config``."""
    return ["row-major-codes", *([ROTARY_FIRST] if config.qk_reordered else [])]


def refuse(path: Path, what: str) -> KestrelError:
    return KestrelError(f"{path}: {what}")


def _corrupt(path: Path, what: str) -> KestrelError:
    return refuse(path, f"not a readable kestrel artifact (truncated or corrupt: {what})")


@dataclass(frozen=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    offset: int  # in the file
    nbytes: int


@dataclass
class ArtifactFile:
    """An open artifact: its validated safetensors header and (once mapped) a copy-on-write map of it."""

    path: Path
    size: int
    metadata: dict[str, str]
    entries: dict[str, _Entry]
    fd: int
    map: mmap.mmap | None = None

    def close(self) -> None:
        os.close(self.fd)  # the map, if any, lives on for as long as views of it do

    def view(self, name: str) -> np.ndarray:
        """A view of tensor ``name`` in the map (a copy only if its offset breaks the dtype's alignment, which
        no safetensors writer does)."""
        if name not in self.entries:
            raise refuse(self.path, f"artifact lacks tensor {name!r}")
        e = self.entries[name]
        if e.dtype not in _NUMPY:
            raise refuse(self.path, f"tensor {name!r} has dtype {e.dtype}; an artifact holds only I8 and F32")
        if self.map is None:
            # copy-on-write: the pages are the page cache's until written, and a write stays private
            try:
                self.map = mmap.mmap(self.fd, self.size, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as exc:  # e.g. ENOMEM under a small RLIMIT_AS
                why = os_reason(exc) if isinstance(exc, OSError) else exc
                raise refuse(self.path, f"cannot map it into memory: {why}") from None
        dtype = _NUMPY[e.dtype]
        count = e.nbytes // dtype.itemsize
        arr = np.frombuffer(self.map, dtype=dtype, count=count, offset=e.offset)
        if e.offset % dtype.itemsize:
            arr = arr.copy()
        return arr.reshape(e.shape)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate keys in the header")
    return out


def open_artifact_file(path: Path) -> ArtifactFile:
    """Open and parse the header; every offset and length is checked against the file's size."""
    try:
        # O_NONBLOCK: a FIFO in place of the file must not hang the open
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise KestrelError(f"{path}: no such artifact file") from None
    except OSError as exc:
        raise os_error(exc, "cannot read", path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KestrelError(f"{path}: no such artifact file (not a regular file)")
        metadata, entries = _parse_header(path, fd, st.st_size)
    except BaseException:
        os.close(fd)
        raise
    return ArtifactFile(path, st.st_size, metadata, entries, fd)


def _read_exactly(fd: int, offset: int, n: int) -> bytes:
    data = os.pread(fd, n, offset)
    while len(data) < n:  # pread may return less than asked for large reads
        more = os.pread(fd, n - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data


def _parse_header(path: Path, fd: int, size: int) -> tuple[dict[str, str], dict[str, _Entry]]:
    if size < 8:
        raise _corrupt(path, f"{size} bytes, shorter than a safetensors header")
    try:
        (n,) = struct.unpack("<Q", _read_exactly(fd, 0, 8))
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise _corrupt(path, f"the header claims {n} bytes; the file has {size}")
        raw = _read_exactly(fd, 8, n)
    except OSError as exc:
        raise os_error(exc, "cannot read", path) from None
    if len(raw) != n:
        raise _corrupt(path, "the file shrank while being read")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise _corrupt(path, f"bad header JSON: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") \
            from None
    if not isinstance(header, dict):
        raise _corrupt(path, "the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _corrupt(path, "__metadata__ must map names to strings")
    data_start, data_size = 8 + n, size - 8 - n
    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        entries[name] = _entry(path, name, info, data_start, data_size)
    # as safetensors requires: the tensors tile the data section exactly, in some order, without overlap
    end = 0
    for e in sorted(entries.values(), key=lambda e: (e.offset, e.nbytes)):
        if e.offset - data_start != end:
            raise _corrupt(path, f"tensor data at byte {e.offset - data_start} of the data section, expected {end}")
        end += e.nbytes
    if end != data_size:
        raise _corrupt(path, f"the tensors cover {end} bytes of a {data_size}-byte data section")
    return metadata, entries


def _entry(path: Path, name: str, info: Any, data_start: int, data_size: int) -> _Entry:
    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(info, dict):
        raise _corrupt(path, f"the header entry of {name!r} is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _ITEMSIZE:
        raise _corrupt(path, f"tensor {name!r} has an unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(is_int(d) for d in shape):
        raise _corrupt(path, f"tensor {name!r} has a bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)):
        raise _corrupt(path, f"tensor {name!r} has bad data_offsets {offsets!r}")
    start, stop = offsets
    if not start <= stop <= data_size:
        raise _corrupt(path, f"tensor {name!r} spans bytes [{start}, {stop}) of a {data_size}-byte data section")
    count = 1
    for d in shape:
        count *= d  # Python ints: no overflow, whatever the header claims
    if count * _ITEMSIZE[dtype] != stop - start:
        raise _corrupt(path, f"tensor {name!r} has {stop - start} bytes for {dtype} {shape}")
    return _Entry(dtype, tuple(shape), data_start + start, stop - start)


def read_meta(path: str | os.PathLike[str]) -> ArtifactMeta:
    """Only the metadata (cheap: the header), validated against what this kestrel understands."""
    path = Path(path)
    f = open_artifact_file(path)
    try:
        return parse_meta(path, f.metadata, f.entries)
    finally:
        f.close()


def _json(path: Path, meta: dict[str, str], key: str, default: Any = None) -> Any:
    if key not in meta:
        if default is not None:
            return default
        raise refuse(path, f"artifact metadata lacks {key!r}")
    try:
        return json.loads(meta[key])
    except json.JSONDecodeError:
        raise refuse(path, f"artifact metadata {key!r} is not valid JSON") from None


def parse_meta(path: Path, meta: dict[str, str], tensor_names: Iterable[str]) -> ArtifactMeta:
    if meta.get("format") != FORMAT_NAME:
        raise refuse(path, f"not a kestrel artifact (format {meta.get('format')!r}, expected {FORMAT_NAME!r})")
    try:
        version = int(meta.get("format_version", ""))
    except ValueError:
        raise refuse(path, f"bad format_version {meta.get('format_version')!r}") from None
    if version != FORMAT_VERSION:
        raise refuse(path, f"artifact format_version {version} is not supported "
                            f"(this kestrel reads format_version {FORMAT_VERSION})")
    layout = _json(path, meta, "layout")
    if not isinstance(layout, list) or not all(isinstance(x, str) for x in layout):
        raise refuse(path, f"layout must be a list of flags, got {meta['layout']!r}")
    unknown = [x for x in layout if x not in LAYOUT_FLAGS]
    missing = [x for x in REQUIRED_LAYOUT_FLAGS if x not in layout]
    if unknown or missing:
        raise refuse(path, f"artifact layout flags {layout} are not supported "
                            f"(this kestrel expects {list(REQUIRED_LAYOUT_FLAGS)}, understands {list(LAYOUT_FLAGS)})")
    config_dict = _json(path, meta, "config")
    if not isinstance(config_dict, dict):
        raise refuse(path, "artifact config is not a JSON object")
    try:
        config = ModelConfig.from_dict(config_dict)
    except (TypeError, ValueError) as exc:
        raise refuse(path, f"artifact config does not fit this kestrel's ModelConfig ({exc})") from None
    if (ROTARY_FIRST in layout) != (ROTARY_FIRST in layout_flags(config)):
        raise refuse(path, f"layout flag {ROTARY_FIRST!r} {'is' if ROTARY_FIRST in layout else 'is not'} set "
                           f"but the model's RoPE turns {config.rotary} of each head's {config.head_dim} dims"
                           f"{' in interleaved pairs' if config.rope_interleaved else ''}")
    quant = check_artifact_meta(meta.get("quant"), config, tensor_names, str(path))
    tensors = _json(path, meta, "tensors")
    extra = _json(path, meta, "extra", {})
    if not isinstance(tensors, dict) or not isinstance(extra, dict):
        raise refuse(path, "artifact metadata 'tensors' and 'extra' must be JSON objects")
    return ArtifactMeta(format_version=version, layout=layout, quant=quant, config=config,
                        tokenizer_json=meta.get("tokenizer_json"), chat_template=meta.get("chat_template"),
                        tool_template=meta.get("chat_template_tool_use"),
                        tensors=tensors, extra=extra, bos_token=meta.get("bos_token"),
                        eos_token=meta.get("eos_token"), **_checksums(path, meta))


def metadata_digest(meta: dict[str, str]) -> int:
    """XXH64 of every metadata entry but the checksums, as canonical JSON: keys sorted, no spaces, ASCII (what
    the writer records and the loader compares; the checksums entry checks itself against the data)."""
    rest = {k: v for k, v in meta.items() if k != CHECKSUMS_KEY}
    return checksum.xxh64(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode("ascii"))


def _checksums(path: Path, meta: dict[str, str]) -> dict[str, Any]:
    """The ``checksums``, ``metadata_checksum`` and ``integrity`` fields of ArtifactMeta (None where the file records
    none)."""
    integrity = meta.get(INTEGRITY_KEY)
    if CHECKSUMS_KEY not in meta:
        return {"checksums": None, "metadata_checksum": None, "integrity": integrity}
    sums = _json(path, meta, CHECKSUMS_KEY)
    if not isinstance(sums, dict) or not isinstance(sums.get("tensors"), dict):
        raise refuse(path, "artifact metadata 'checksums' must be {\"algorithm\": ..., \"tensors\": {...}}")
    if sums.get("algorithm") != CHECKSUM_ALGORITHM:
        raise refuse(path, f"artifact checksums use {sums.get('algorithm')!r}; this kestrel verifies "
                            f"{CHECKSUM_ALGORITHM!r}")
    return {"checksums": {name: _digest(path, repr(name), value) for name, value in sums["tensors"].items()},
            "metadata_checksum": None if "metadata" not in sums else _digest(path, "the metadata", sums["metadata"]),
            "integrity": integrity}


def _digest(path: Path, what: str, value: Any) -> int:
    try:
        if not isinstance(value, str) or len(value) != 16:
            raise ValueError
        return int(value, 16)
    except ValueError:
        raise refuse(path, f"artifact checksum of {what} is not 16 hex digits: {value!r}") from None
