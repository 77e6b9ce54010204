"""The model out of a kestrel artifact: views of the file's map assembled into a Model, then verified.

The metadata's XXH64 is checked against the one the header records before any tensor is read; then one pass
over the data, spread over threads, checks each tensor's XXH64 against the header's and each weight's codes
against the strip-cache contract's range; the shapes are checked against the config.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kestrel_core import checksum
from kestrel_core.artifact import (
    CHUNK_BYTES,
    INTEGRITY_KEY,
    INTEGRITY_VALUE,
    ArtifactMeta,
    metadata_digest,
    model_tensors,
    open_artifact_file,
    parse_meta,
    refuse,
)
from kestrel_core.contract import CODE_RANGE, StripCache
from kestrel_core.errors import ContractError
from kestrel_core.model.weights import Model, TensorSpec, assemble, model_specs
from kestrel_core.progress import Report

PARALLEL_MIN_BYTES = 64 << 20  # below this the pass runs in the calling thread
MAX_THREADS = 8


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

    ``verify``: compare the XXH64 of every tensor, and of the rest of the metadata, with the header's (a file
    without them, written before kestrel wrote them or by another producer, loads unverified unless
    ``require_checksums``). The code ranges of the strip-cache contract are checked in the same pass either
    way. Where hashing is not compiled (numba unusable), nothing is verified and no checksums are required.
    """
    path = Path(path)
    f = open_artifact_file(path)
    try:
        meta = parse_meta(path, f.metadata, f.entries)
        _check_present(path, meta, f.metadata, verify, require_checksums)
        if verify and meta.metadata_checksum is not None and checksum.fast():
            _check_metadata(path, f.metadata, meta.metadata_checksum)
        sums = meta.checksums if verify and meta.checksums is not None and checksum.fast() else None
        checks: list[_Check] = []

        def tensor(name: str, bits: int | None = None, weight: str = "") -> np.ndarray:
            arr = f.view(name)
            if sums is not None and name not in sums:
                raise refuse(path, f"the artifact has no checksum for tensor {name!r}")
            checks.append(_Check(name, arr, None if sums is None else sums[name], bits, weight))
            return arr

        def weight(name: str) -> StripCache:
            spec = meta.tensors.get(name)
            if not isinstance(spec, dict):
                raise refuse(path, f"artifact metadata has no group size / bits for {name!r}")
            try:
                g, bits = int(spec["group_size"]), int(spec["bits"])
                if bits not in CODE_RANGE:
                    raise ContractError(f"bits must be one of {tuple(CODE_RANGE)}, got {bits}")
                codes = tensor(f"{name}.codes", bits, name)
                # the code range is checked below, in the one pass over the data
                return StripCache(codes, tensor(f"{name}.scales"), g, bits, check_range=False)
            except (ContractError, KeyError, TypeError, ValueError) as exc:
                raise refuse(path, f"tensor {name!r} breaks the strip-cache contract: {exc}") from None

        def vector(name: str) -> np.ndarray:
            v = tensor(name)
            if v.dtype != np.float32 or v.ndim != 1:
                raise refuse(path, f"tensor {name!r} must be a float32 vector, got {v.dtype} {list(v.shape)}")
            return v

        def matrix(name: str) -> np.ndarray:
            m = tensor(name)
            if m.dtype != np.float32 or m.ndim != 2:
                raise refuse(path, f"tensor {name!r} must be a float32 matrix, got {m.dtype} {list(m.shape)}")
            return m

        read = {"proj": weight, "table": weight, "vector": vector, "matrix": matrix}
        specs = model_specs(meta.config)
        model = assemble(meta.config, {s.name: read[s.kind](s.name) for s in specs})
        _check_shapes(path, model, specs)
        _scan(path, checks, progress)
    finally:
        f.close()
    return model, meta


def _check_present(path: Path, meta: ArtifactMeta, metadata: dict[str, str], verify: bool,
                   require_checksums: bool) -> None:
    """Refuse a file without the checksums it says it carries (its INTEGRITY_KEY, or INTEGRITY_VALUE under a
    damaged name: the name of the entry holding them corrupt), and one without checksums where they are
    required."""
    renamed = [key for key, value in metadata.items() if value == INTEGRITY_VALUE and key != INTEGRITY_KEY]
    if verify and renamed:
        raise refuse(path, f"the header is corrupt: its entry {renamed[0]!r} holds the value of {INTEGRITY_KEY!r} "
                           f"({INTEGRITY_VALUE!r}: the file carries checksums) under another name (re-create or "
                           "re-download the artifact)")
    missing = ("checksums" if meta.checksums is None else
               "checksum of its metadata" if meta.metadata_checksum is None else None)
    if missing is None:
        return
    if verify and meta.integrity is not None:
        raise refuse(path, f"the header is corrupt: its {INTEGRITY_KEY!r} entry says it carries checksums, but it "
                            f"has no {missing} (re-create or re-download the artifact)")
    if require_checksums and checksum.fast():
        raise refuse(path, f"the artifact carries no {missing}")


def _check_metadata(path: Path, metadata: dict[str, str], recorded: int) -> None:
    """The metadata (config, tokenizer, chat template...) against its recorded XXH64: a flipped bit there would
    change every answer without touching a tensor."""
    digest = metadata_digest(metadata)
    if digest != recorded:
        raise refuse(path, f"the metadata is corrupt: its XXH64 is {digest:016x}, the header records "
                            f"{recorded:016x} (re-create or re-download the artifact)")


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
            raise refuse(path, f"tensor {ch.name!r} is corrupt: its XXH64 is {h.hexdigest()}, the header "
                                f"records {ch.digest:016x} (re-create or re-download the artifact)")
        if ch.bits is not None:
            low, high = CODE_RANGE[ch.bits]
            if lo < low or hi > high:
                raise refuse(path, f"tensor {ch.weight!r} breaks the strip-cache contract: int{ch.bits} codes "
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


def _check_shapes(path: Path, model: Model, specs: list[TensorSpec]) -> None:
    """Every tensor's shape against the one its config implies."""
    tensors = model_tensors(model)
    checks = [(s.name, tensors[s.name].shape, s.shape) for s in specs]
    for name, got, expected in checks:
        if tuple(got) != tuple(expected):
            raise refuse(path, f"tensor {name!r} has shape {list(got)}, the config implies {list(expected)}")
