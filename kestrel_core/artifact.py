"""The kestrel artifact (``.kst``): one safetensors file of strip-cache tensors plus JSON metadata.

Per quantized weight ``<name>.codes`` (int8 [N, K]) and ``<name>.scales`` (float32 [N, K/G]); norms and biases
as float32 ``<name>``. Tensor names are kestrel's (``embedding``, ``lm_head``, ``final_norm``,
``layers.<i>.<q|k|v|o|gate|up|down|attn_norm|mlp_norm|q_bias|k_bias|v_bias|q_norm|k_norm>``). A tied lm_head
is not stored: it is the embedding. The safetensors header's ``__metadata__`` (string values only) holds
the format name and version, the layout flags, the quant mode, each weight's group size and bits, the
ModelConfig, the tokenizer.json text, the chat template and an XXH64 of every tensor's bytes.
docs/formats.md describes it field by field.

Reading maps the file and hands out numpy views of the map: no copy, and the pages are the page cache's,
shared by every process that loads the same file. The map is copy-on-write (MAP_PRIVATE), not read-only:
numba types read-only arrays apart, and a kernel taking a tuple that mixes them with ordinary arrays (the CPU
backend's fused GEMM pads its tuple with module constants) fails to compile; a write into a weight stays in
the writing process (it copies that page) and never reaches the file. The header is parsed here (JSON and
offsets), every offset and length checked against the file's size before any view is made. One pass over
the data, spread over threads, checks each tensor's XXH64 and each weight's code range.

A mapped file must be replaced (a new file renamed over it, as save_artifact does), never truncated or
rewritten in place: a process whose map loses its pages to truncation dies of SIGBUS.
"""

from __future__ import annotations

import contextlib
import glob
import json
import mmap
import os
import signal
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from kestrel_core import checksum
from kestrel_core.contract import CODE_RANGE, StripCache
from kestrel_core.errors import ContractError, KestrelError
from kestrel_core.model.config import ModelConfig
from kestrel_core.model.quantize import (
    LAYER_NORM_FIELDS,
    LAYER_PROJ_FIELDS,
    QK_NORM_FIELDS,
    QKV_BIAS_FIELDS,
    layer_name,
)
from kestrel_core.model.validate import check_artifact_meta
from kestrel_core.model.weights import LayerWeights, Model
from kestrel_core.progress import Report

FORMAT_NAME = "kestrel-strip-cache"
FORMAT_VERSION = 1
# What this kestrel understands. A producer that changes the bytes' meaning (e.g. a 4x4 int4 repack) adds a
# flag; an older reader then refuses the file instead of computing garbage.
LAYOUT_FLAGS = ("row-major-codes",)
REQUIRED_LAYOUT_FLAGS = ("row-major-codes",)
ARTIFACT_SUFFIX = ".kst"
CHECKSUM_ALGORITHM = "xxh64"  # XXH64, seed 0, of each tensor's bytes, as 16 lowercase hex digits (checksum.py)
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
CHUNK_BYTES = 4 << 20  # the checksum / range pass and the writer work in chunks of this size
PARALLEL_MIN_BYTES = 64 << 20  # below this the pass runs in the calling thread
MAX_THREADS = 8
TEMP_MAX_AGE_S = 3600.0  # a temp file untouched this long belongs to a writer that died

# safetensors dtype name -> item size (every dtype of the format, so any valid file's offsets can be checked)
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_NUMPY = {"I8": np.dtype("i1"), "F32": np.dtype("<f4")}  # the two an artifact uses
_ST_NAME = {np.dtype("i1"): "I8", np.dtype("<f4"): "F32"}


@dataclass
class ArtifactMeta:
    format_version: int
    layout: list[str]
    quant: str
    config: ModelConfig
    tokenizer_json: str | None = None
    chat_template: str | None = None
    tensors: dict[str, dict[str, int]] = field(default_factory=dict)  # weight name -> group_size, bits
    extra: dict[str, Any] = field(default_factory=dict)
    bos_token: str | None = None  # the tokenizer's special-token strings (chat templates read them)
    eos_token: str | None = None
    checksums: dict[str, int] | None = None  # tensor name -> XXH64; None: the file carries none


def model_tensors(model: Model) -> dict[str, StripCache | np.ndarray]:
    """Every tensor of ``model`` under its artifact name; a tied lm_head is left out (it is the embedding)."""
    out: dict[str, StripCache | np.ndarray] = {"embedding": model.embedding, "final_norm": model.final_norm}
    if model.lm_head is not model.embedding:
        out["lm_head"] = model.lm_head
    optional = QKV_BIAS_FIELDS + QK_NORM_FIELDS
    for i, layer in enumerate(model.layers):
        for name in LAYER_PROJ_FIELDS + LAYER_NORM_FIELDS + optional:
            value = getattr(layer, name)
            if value is not None:
                out[layer_name(i, name)] = value
    return out


# -- writing -----------------------------------------------------------------------------------------------

def save_artifact(path: str | os.PathLike[str], model: Model, *, tokenizer_json: str | None = None,
                  chat_template: str | None = None, quant: str, extra: dict[str, Any] | None = None,
                  force: bool = False, bos_token: str | None = None, eos_token: str | None = None,
                  progress: Report | None = None) -> Path:
    """Write ``model`` to ``path`` atomically: a temp file in the same directory, fsync, then rename.

    A failure, or SIGTERM while writing, leaves neither a partial file nor the temp file; temp files of the
    same destination left by a writer that was killed outright are removed once they are an hour old.
    """
    path = Path(path)
    if path.exists() and not force:
        raise KestrelError(f"{path} already exists; pass --force to overwrite it")
    if path.is_dir():
        raise KestrelError(f"{path} is a directory")
    if model.config.tie_word_embeddings != (model.lm_head is model.embedding):
        raise KestrelError("the model's lm_head must be its embedding object exactly when tie_word_embeddings")
    arrays: list[tuple[str, np.ndarray]] = []
    specs: dict[str, dict[str, int]] = {}
    for name, value in model_tensors(model).items():
        if isinstance(value, StripCache):
            arrays += [(f"{name}.codes", value.codes), (f"{name}.scales", value.scales.astype("<f4", copy=False))]
            specs[name] = {"group_size": value.group_size, "bits": value.bits}
        else:
            arrays.append((name, np.ascontiguousarray(value, dtype="<f4")))
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "layout": json.dumps(list(LAYOUT_FLAGS)),
        "quant": quant,
        "tensors": json.dumps(specs, sort_keys=True),
        "config": json.dumps(model.config.as_dict(), sort_keys=True),
        "extra": json.dumps(extra or {}, sort_keys=True),
    }
    optional = {"tokenizer_json": tokenizer_json, "chat_template": chat_template, "bos_token": bos_token,
                "eos_token": eos_token}
    metadata.update({k: v for k, v in optional.items() if v is not None})
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise KestrelError(f"cannot write {path}: directory {parent} does not exist")
    remove_stale_temps(parent, f".{glob.escape(path.name)}.*.tmp")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    with _removed_on_sigterm(tmp):
        try:
            with os.fdopen(fd, "wb") as f:
                _write_safetensors(f, arrays, metadata, progress)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would surprise whoever shares the file
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    _fsync_dir(parent)
    return path


def _write_safetensors(f: BinaryIO, arrays: list[tuple[str, np.ndarray]], metadata: dict[str, str],
                       progress: Report | None) -> None:
    """The safetensors layout, streamed: the header (checksums zeroed), the data while computing each
    tensor's XXH64, then the header again with the checksums (the same length: 16 hex digits each). Where
    hashing is not compiled (numba unusable) the file carries no checksums."""
    order = sorted(arrays, key=lambda a: -a[1].dtype.itemsize)  # float32 first keeps every float 4-aligned
    entries: dict[str, Any] = {}
    offset = 0
    for name, arr in order:
        if arr.dtype not in _ST_NAME or not arr.flags.c_contiguous:
            raise KestrelError(f"cannot write tensor {name!r}: {arr.dtype} array, not int8/float32 C-contiguous")
        entries[name] = {"dtype": _ST_NAME[arr.dtype], "shape": list(arr.shape),
                         "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes

    with_sums = checksum.fast()

    def header(sums: dict[str, int]) -> bytes:
        meta = dict(metadata)
        if with_sums:
            digests = {n: f"{sums[n]:016x}" for n in entries}
            meta["checksums"] = json.dumps({"algorithm": CHECKSUM_ALGORITHM, "tensors": digests}, sort_keys=True)
        text = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode("utf-8")
        text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-aligned, as safetensors writes it
        return struct.pack("<Q", len(text)) + text

    first = header(dict.fromkeys(entries, 0))
    f.write(first)
    sums: dict[str, int] = {}
    done = 0
    for name, arr in order:
        flat = arr.reshape(-1).view(np.uint8)
        h = checksum.XXH64() if with_sums else None
        for i in range(0, flat.size, CHUNK_BYTES):
            chunk = flat[i:i + CHUNK_BYTES]
            if h is not None:
                h.update(chunk)
            f.write(chunk)
            done += chunk.size
            if progress is not None:
                progress(done, offset)
        sums[name] = h.intdigest() if h is not None else 0
    final = header(sums)
    if len(final) != len(first):  # cannot happen: every digest is 16 hex digits
        raise KestrelError("internal error: the artifact header changed length")
    f.seek(0)
    f.write(final)


def remove_stale_temps(directory: Path, pattern: str, max_age_s: float = TEMP_MAX_AGE_S) -> None:
    """Remove the regular files in ``directory`` matching ``pattern`` not modified for ``max_age_s``: the temp
    files of writers that were killed outright (a live writer touches its file with every chunk)."""
    now = time.time()
    for p in directory.glob(pattern):
        try:
            st = p.lstat()
            if stat.S_ISREG(st.st_mode) and now - st.st_mtime > max_age_s:
                p.unlink()
        except OSError:
            pass  # raced with another cleaner, or not ours to remove


@contextlib.contextmanager
def _removed_on_sigterm(tmp: str) -> Iterator[None]:
    """While writing ``tmp``: on SIGTERM with the default disposition (death, no ``finally``), remove it, then
    die of the signal as before. A handler installed by someone else stays (if it raises, the writer's
    ``except`` cleans up); off the main thread no handler can be installed, and ``except`` is all there is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        Path(tmp).unlink(missing_ok=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (best effort: not every file system lets a directory be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# -- reading: the header -----------------------------------------------------------------------------------

def _refuse(path: Path, what: str) -> KestrelError:
    return KestrelError(f"{path}: {what}")


def _corrupt(path: Path, what: str) -> KestrelError:
    return _refuse(path, f"not a readable kestrel artifact (truncated or corrupt: {what})")


@dataclass(frozen=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    offset: int  # in the file
    nbytes: int


@dataclass
class _File:
    """An open artifact: its validated safetensors header and (once mapped) a read-only map of it."""

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
            raise _refuse(self.path, f"artifact lacks tensor {name!r}")
        e = self.entries[name]
        if e.dtype not in _NUMPY:
            raise _refuse(self.path, f"tensor {name!r} has dtype {e.dtype}; an artifact holds only I8 and F32")
        if self.map is None:
            # copy-on-write: the pages are the page cache's until written, and a write stays private
            try:
                self.map = mmap.mmap(self.fd, self.size, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as exc:  # e.g. ENOMEM under a small RLIMIT_AS
                raise _refuse(self.path, f"cannot map it into memory: {exc}") from None
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


def _open(path: Path) -> _File:
    """Open and parse the header; every offset and length is checked against the file's size."""
    try:
        # O_NONBLOCK: a FIFO in place of the file must not hang the open
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise KestrelError(f"{path}: no such artifact file") from None
    except OSError as exc:
        raise _refuse(path, f"cannot read it: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KestrelError(f"{path}: no such artifact file (not a regular file)")
        metadata, entries = _parse_header(path, fd, st.st_size)
    except BaseException:
        os.close(fd)
        raise
    return _File(path, st.st_size, metadata, entries, fd)


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
        raise _refuse(path, f"cannot read it: {exc.strerror or exc}") from None
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
    f = _open(path)
    try:
        return _parse_meta(path, f.metadata, f.entries)
    finally:
        f.close()


def _json(path: Path, meta: dict[str, str], key: str, default: Any = None) -> Any:
    if key not in meta:
        if default is not None:
            return default
        raise _refuse(path, f"artifact metadata lacks {key!r}")
    try:
        return json.loads(meta[key])
    except json.JSONDecodeError:
        raise _refuse(path, f"artifact metadata {key!r} is not valid JSON") from None


def _parse_meta(path: Path, meta: dict[str, str], tensor_names: Iterable[str]) -> ArtifactMeta:
    if meta.get("format") != FORMAT_NAME:
        raise _refuse(path, f"not a kestrel artifact (format {meta.get('format')!r}, expected {FORMAT_NAME!r})")
    try:
        version = int(meta.get("format_version", ""))
    except ValueError:
        raise _refuse(path, f"bad format_version {meta.get('format_version')!r}") from None
    if version != FORMAT_VERSION:
        raise _refuse(path, f"artifact format_version {version} is not supported "
                            f"(this kestrel reads format_version {FORMAT_VERSION})")
    layout = _json(path, meta, "layout")
    if not isinstance(layout, list) or not all(isinstance(x, str) for x in layout):
        raise _refuse(path, f"layout must be a list of flags, got {meta['layout']!r}")
    unknown = [x for x in layout if x not in LAYOUT_FLAGS]
    missing = [x for x in REQUIRED_LAYOUT_FLAGS if x not in layout]
    if unknown or missing:
        raise _refuse(path, f"artifact layout flags {layout} are not supported "
                            f"(this kestrel expects {list(REQUIRED_LAYOUT_FLAGS)}, understands {list(LAYOUT_FLAGS)})")
    config_dict = _json(path, meta, "config")
    if not isinstance(config_dict, dict):
        raise _refuse(path, "artifact config is not a JSON object")
    try:
        config = ModelConfig.from_dict(config_dict)
    except (TypeError, ValueError) as exc:
        raise _refuse(path, f"artifact config does not fit this kestrel's ModelConfig ({exc})") from None
    quant = check_artifact_meta(meta.get("quant"), config, tensor_names, str(path))
    tensors = _json(path, meta, "tensors")
    extra = _json(path, meta, "extra", {})
    if not isinstance(tensors, dict) or not isinstance(extra, dict):
        raise _refuse(path, "artifact metadata 'tensors' and 'extra' must be JSON objects")
    return ArtifactMeta(format_version=version, layout=layout, quant=quant, config=config,
                        tokenizer_json=meta.get("tokenizer_json"), chat_template=meta.get("chat_template"),
                        tensors=tensors, extra=extra, bos_token=meta.get("bos_token"),
                        eos_token=meta.get("eos_token"), checksums=_checksums(path, meta))


def _checksums(path: Path, meta: dict[str, str]) -> dict[str, int] | None:
    if "checksums" not in meta:
        return None
    sums = _json(path, meta, "checksums")
    if not isinstance(sums, dict) or not isinstance(sums.get("tensors"), dict):
        raise _refuse(path, "artifact metadata 'checksums' must be {\"algorithm\": ..., \"tensors\": {...}}")
    if sums.get("algorithm") != CHECKSUM_ALGORITHM:
        raise _refuse(path, f"artifact checksums use {sums.get('algorithm')!r}; this kestrel verifies "
                            f"{CHECKSUM_ALGORITHM!r}")
    out: dict[str, int] = {}
    for name, value in sums["tensors"].items():
        try:
            if not isinstance(value, str) or len(value) != 16:
                raise ValueError
            out[name] = int(value, 16)
        except ValueError:
            raise _refuse(path, f"artifact checksum of {name!r} is not 16 hex digits: {value!r}") from None
    return out


# -- reading: the model ------------------------------------------------------------------------------------

@dataclass
class _Check:
    """One tensor of the checksum / range pass."""

    name: str  # the tensor's name in the file
    array: np.ndarray
    digest: int | None  # the expected XXH64, or None: no checksum to compare
    bits: int | None  # a weight's codes: the code range to check; None otherwise
    weight: str = ""  # the weight the codes belong to, for the contract message


def load_artifact(path: str | os.PathLike[str], *, verify: bool = True, require_checksums: bool = False,
                  progress: Report | None = None) -> tuple[Model, ArtifactMeta]:
    """The model of an artifact, its arrays views of a copy-on-write map of the file (no copy is made).

    ``verify``: compare every tensor's XXH64 with the header's (a file without checksums, written before
    kestrel wrote them or by another producer, loads unverified unless ``require_checksums``). The code
    ranges of the strip-cache contract are checked in the same pass either way. Where hashing is not
    compiled (numba unusable), nothing is verified and no checksums are required.
    """
    path = Path(path)
    f = _open(path)
    try:
        meta = _parse_meta(path, f.metadata, f.entries)
        if meta.checksums is None and require_checksums and checksum.fast():
            raise _refuse(path, "the artifact carries no checksums")
        sums = meta.checksums if verify and meta.checksums is not None and checksum.fast() else None
        checks: list[_Check] = []

        def tensor(name: str, bits: int | None = None, weight: str = "") -> np.ndarray:
            arr = f.view(name)
            if sums is not None and name not in sums:
                raise _refuse(path, f"the artifact has no checksum for tensor {name!r}")
            checks.append(_Check(name, arr, None if sums is None else sums[name], bits, weight))
            return arr

        def weight(name: str) -> StripCache:
            spec = meta.tensors.get(name)
            if not isinstance(spec, dict):
                raise _refuse(path, f"artifact metadata has no group size / bits for {name!r}")
            try:
                g, bits = int(spec["group_size"]), int(spec["bits"])
                if bits not in CODE_RANGE:
                    raise ContractError(f"bits must be one of {tuple(CODE_RANGE)}, got {bits}")
                codes = tensor(f"{name}.codes", bits, name)
                # the code range is checked below, in the one pass over the data
                return StripCache(codes, tensor(f"{name}.scales"), g, bits, check_range=False)
            except (ContractError, KeyError, TypeError, ValueError) as exc:
                raise _refuse(path, f"tensor {name!r} breaks the strip-cache contract: {exc}") from None

        def vector(name: str) -> np.ndarray:
            v = tensor(name)
            if v.dtype != np.float32 or v.ndim != 1:
                raise _refuse(path, f"tensor {name!r} must be a float32 vector, got {v.dtype} {list(v.shape)}")
            return v

        c = meta.config
        layers = []
        for i in range(c.num_layers):
            fields: dict[str, Any] = {p: weight(layer_name(i, p)) for p in LAYER_PROJ_FIELDS}
            fields.update({n: vector(layer_name(i, n)) for n in LAYER_NORM_FIELDS})
            if c.qkv_bias:
                fields.update({n: vector(layer_name(i, n)) for n in QKV_BIAS_FIELDS})
            if c.qk_norm:
                fields.update({n: vector(layer_name(i, n)) for n in QK_NORM_FIELDS})
            layers.append(LayerWeights(**fields))
        embedding = weight("embedding")
        lm_head = embedding if c.tie_word_embeddings else weight("lm_head")
        model = Model(config=c, embedding=embedding, layers=layers, final_norm=vector("final_norm"),
                      lm_head=lm_head)
        _check_shapes(path, model)
        _scan(path, checks, progress)
    finally:
        f.close()
    return model, meta


def _scan(path: Path, checks: list[_Check], progress: Report | None) -> None:
    """One pass over the tensors' bytes: XXH64s and code ranges, largest tensors first over a few threads
    (the compiled hash and numpy's reductions release the GIL)."""
    if not any(ch.digest is not None or ch.bits is not None for ch in checks):
        return
    checks = sorted(checks, key=lambda ch: -ch.array.nbytes)
    total = sum(ch.array.nbytes for ch in checks)
    done = [0]
    lock = threading.Lock()
    stop = threading.Event()

    def one(ch: _Check) -> None:
        flat = ch.array.reshape(-1)
        step = max(1, CHUNK_BYTES // flat.itemsize)
        h = checksum.XXH64() if ch.digest is not None else None
        lo, hi = 0, 0
        for i in range(0, flat.size, step):
            if stop.is_set():
                return
            chunk = flat[i:i + step]
            if h is not None:
                h.update(chunk)
            if ch.bits is not None:
                lo = min(lo, int(chunk.min()))
                if ch.bits != 8:  # int8 codes cannot exceed 127
                    hi = max(hi, int(chunk.max()))
            with lock:
                done[0] += chunk.nbytes
        if h is not None and h.intdigest() != ch.digest:
            raise _refuse(path, f"tensor {ch.name!r} is corrupt: its XXH64 is {h.hexdigest()}, the header "
                                f"records {ch.digest:016x} (re-create or re-download the artifact)")
        if ch.bits is not None:
            low, high = CODE_RANGE[ch.bits]
            if lo < low or hi > high:
                raise _refuse(path, f"tensor {ch.weight!r} breaks the strip-cache contract: int{ch.bits} codes "
                                    f"must lie in [{low}, {high}]")

    threads = min(MAX_THREADS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else
                  (os.cpu_count() or 1))
    if total < PARALLEL_MIN_BYTES or threads < 2:
        for ch in checks:
            one(ch)
            if progress is not None:
                progress(done[0], total)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kestrel-verify") as pool:
        futures = [pool.submit(one, ch) for ch in checks]
        try:
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, timeout=0.1, return_when=FIRST_EXCEPTION)
                for fut in finished:
                    fut.result()  # the first failure, with its message
                if progress is not None:
                    progress(done[0], total)
        finally:
            stop.set()


def _check_shapes(path: Path, model: Model) -> None:
    c = model.config
    qn, kvn = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    d, f = c.hidden_size, c.intermediate_size
    want = {"q": (qn, d), "k": (kvn, d), "v": (kvn, d), "o": (d, qn), "gate": (f, d), "up": (f, d),
            "down": (d, f), "attn_norm": (d,), "mlp_norm": (d,), "q_bias": (qn,), "k_bias": (kvn,),
            "v_bias": (kvn,), "q_norm": (c.head_dim,), "k_norm": (c.head_dim,)}
    checks = [("embedding", model.embedding.shape, (c.vocab_size, d)),
              ("lm_head", model.lm_head.shape, (c.vocab_size, d)), ("final_norm", model.final_norm.shape, (d,))]
    for name, value in model_tensors(model).items():
        if name.startswith("layers."):
            checks.append((name, value.shape, want[name.rsplit(".", 1)[1]]))
    for name, got, expected in checks:
        if tuple(got) != tuple(expected):
            raise _refuse(path, f"tensor {name!r} has shape {list(got)}, the config implies {list(expected)}")
