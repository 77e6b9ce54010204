"""Writing a kestrel artifact (the format: ``artifact``): atomically, and never leaving a partial file.

The safetensors layout is streamed to a temp file in the destination's directory with each tensor's XXH64
computed on the way, fsynced, then renamed over the destination, so a process that maps the old file keeps
its pages (a file rewritten in place would kill it with SIGBUS).
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from kestrel_core import checksum
from kestrel_core.artifact import (
    CHECKSUM_ALGORITHM,
    CHECKSUMS_KEY,
    CHUNK_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    INTEGRITY_KEY,
    INTEGRITY_VALUE,
    layout_flags,
    metadata_digest,
    model_tensors,
)
from kestrel_core.contract import StripCache
from kestrel_core.errors import KestrelError, os_error
from kestrel_core.model.weights import Model
from kestrel_core.progress import Report
from kestrel_core.temps import HELD_SUFFIX, TEMP_MAX_AGE_S, Temp, find_temps, held_temp_file, remove_stale

_ST_NAME = {np.dtype("i1"): "I8", np.dtype("<f4"): "F32"}
TEMP_NAME_CHARS = 200  # of the destination's name in its temp file's: 255 allowed, 18 more for ".", ".XXXXXXXX.writing"


def save_artifact(path: str | os.PathLike[str], model: Model, *, tokenizer_json: str | None = None,
                  chat_template: str | None = None, tool_template: str | None = None, quant: str,
                  extra: dict[str, Any] | None = None,
                  force: bool = False, bos_token: str | None = None, eos_token: str | None = None,
                  progress: Report | None = None) -> Path:
    """Write ``model`` to ``path`` atomically: a temp file in the same directory, fsync, then rename.

    A failure, or SIGTERM while writing, leaves neither a partial file nor the temp file; the temp file carries
    the writer's lock until it is renamed (temps.held_temp_file), so one of the same destination left by a
    writer that was killed outright is removed by the next write at once.
    """
    path = Path(path)
    check_output(path, force)
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
        "layout": json.dumps(layout_flags(model.config)),
        "quant": quant,
        "tensors": json.dumps(specs, sort_keys=True),
        "config": json.dumps(model.config.as_dict(), sort_keys=True),
        "extra": json.dumps(extra or {}, sort_keys=True),
    }
    optional = {"tokenizer_json": tokenizer_json, "chat_template": chat_template,
                "chat_template_tool_use": tool_template, "bos_token": bos_token, "eos_token": eos_token}
    metadata.update({k: v for k, v in optional.items() if v is not None})
    parent = path.parent if str(path.parent) else Path(".")
    remove_stale_temps(parent, path.name)
    with held_temp_file(parent, f".{path.name[:TEMP_NAME_CHARS]}.") as (fd, tmp):
        try:
            with os.fdopen(fd, "wb", closefd=False) as f:
                _write_safetensors(f, arrays, metadata, progress)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would surprise whoever shares the file
            _publish(tmp, path, force)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    _fsync_dir(parent)
    return path


def _write_safetensors(f: BinaryIO, arrays: list[tuple[str, np.ndarray]], metadata: dict[str, str],
                       progress: Report | None) -> None:
    """The safetensors layout, streamed: the header (checksums zeroed), the data while computing each
    tensor's XXH64, then the header again with the checksums (the same length: 16 hex digits each), the rest
    of the metadata's among them. Where hashing is not compiled (numba unusable) the file carries no checksums."""
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
    if with_sums:  # before the metadata's checksum, which covers it
        metadata = {**metadata, INTEGRITY_KEY: INTEGRITY_VALUE}
    metadata_sum = f"{metadata_digest(metadata):016x}" if with_sums else ""

    def header(sums: dict[str, int]) -> bytes:
        meta = dict(metadata)
        if with_sums:
            digests = {n: f"{sums[n]:016x}" for n in entries}
            meta[CHECKSUMS_KEY] = json.dumps({"algorithm": CHECKSUM_ALGORITHM, "tensors": digests,
                                              "metadata": metadata_sum}, sort_keys=True)
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


def check_output(path: Path, force: bool) -> None:
    """Raise unless ``path`` may be written: in a directory that exists and that this process may write in (the
    temp file goes there), and absent, or with ``force`` a regular file (or a link, replaced itself); never a
    directory, device, FIFO or socket, which renaming over would destroy."""
    if not str(path) or str(path) == ".":
        raise KestrelError("the output needs a file name")
    parent = path.parent if str(path.parent) else Path(".")
    try:
        if not parent.exists():
            raise KestrelError(f"cannot write {path}: directory {parent} does not exist")
        if not parent.is_dir():
            raise KestrelError(f"cannot write {path}: {parent} is not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise KestrelError(f"cannot write {path}: no permission to write in {parent}")
        st = path.lstat()
    except FileNotFoundError:
        return
    except OSError as exc:  # a name too long, a loop of links
        raise os_error(exc, "cannot write", path) from None
    if stat.S_ISDIR(st.st_mode):
        raise KestrelError(f"{path} is a directory")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        raise KestrelError(f"{path} is not a regular file; kestrel writes only files")
    if not force:
        raise KestrelError(f"{path} already exists; pass --force to overwrite it")


def _temp_pattern(name: str | None) -> re.Pattern[str]:
    """The names of the temp files ``save_artifact`` writes for ``name`` (None: for any name), mkstemp's exactly:
    ``.NAME.XXXXXXXX.writing``, and ``.NAME.XXXXXXXX.tmp`` (a writer that held no lock: an earlier kestrel);
    nothing of the user's that merely looks alike."""
    named = ".+" if name is None else re.escape(name[:TEMP_NAME_CHARS])
    return re.compile(rf"\.{named}\.[a-z0-9_]{{8}}(?:\.tmp|{re.escape(HELD_SUFFIX)})")


def artifact_temps(directory: Path) -> list[Temp]:
    """The temp files of artifacts being written in ``directory``, or left there by writers that died."""
    return find_temps(directory, _temp_pattern(None))


def remove_stale_temps(directory: Path, name: str | None = None, max_age_s: float = TEMP_MAX_AGE_S) -> list[Temp]:
    """Remove the temp files ``save_artifact`` writes for ``name`` (None: for any name) in ``directory`` whose
    writer is gone: at once where it held their lock, else once they were not modified for ``max_age_s``
    (temps.remove_stale); the ones removed."""
    return remove_stale(directory, _temp_pattern(name), max_age_s)


def _publish(tmp: str, path: Path, force: bool) -> None:
    """Rename the written ``tmp`` to ``path``; without ``force`` a hard link instead, which fails where a file
    appeared at ``path`` while it was written (check_output saw none), so that file is not overwritten."""
    if force:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        check_output(path, force)  # its one-line refusal
        raise
    except OSError:  # a file system without hard links: the check again, then the rename
        check_output(path, force)
        os.replace(tmp, path)
        return
    os.unlink(tmp)


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
