"""The forward's diagnostic build (``KESTREL_CUDA_TRACE``): when each block's PDL wait returned, from which a
captured step's critical path splits by launch (benchmarks/cuda_step_trace.py).

Compiled with ``options()``, common.cuh's ``grid_dep_wait`` makes thread 0 of every block record the moment its
wait returned, with its launch's ``%gridid`` and its block index, in its SM's share of a device buffer
(``StepTrace``). A launch's release is its first record: its predecessor has completed by then, so a launch's
share of a step's critical path is the next launch's release less its own (``critical_path``). Each record costs
its block an uncontended atomic (issued before the wait) and a store: the traced step runs a little slower.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

TRACE_SMS = 256  # an SM's %smid is below this (the H200 has 132)
TRACE_PER_SM = 4096  # records an SM holds, from each reset: a qwen3-30b-a3b decode step makes about 900 an SM


def options() -> tuple[str, ...]:
    """The compiler options that make the forward module the diagnostic build."""
    return ("-DKESTREL_TRACE", f"-DKESTREL_TRACE_SMS={TRACE_SMS}", f"-DKESTREL_TRACE_PER_SM={TRACE_PER_SM}")


class StepTrace:
    """The records' device buffer and the SMs' counters, set into ``module``'s globals (``kestrel_trace_buf``,
    ``kestrel_trace_count``): one for the module, which every traced launch of the process records into."""

    def __init__(self, module: Any, cp: Any) -> None:
        self.cp = cp
        self.buf = cp.zeros(TRACE_SMS * TRACE_PER_SM * 2, np.uint64)  # [SM][record][t, grid << 32 | block]
        self.count = cp.zeros(TRACE_SMS, np.uint32)
        for name, array in (("kestrel_trace_buf", self.buf), ("kestrel_trace_count", self.count)):
            address = np.array([array.data.ptr], np.uint64)
            module.get_global(name).copy_from_host(address.ctypes.data, address.nbytes)

    def reset(self, stream: Any) -> None:
        """Forget the records (on ``stream``, before the launches to trace)."""
        with stream:
            self.count.fill(0)

    def read(self) -> tuple[np.ndarray, int]:
        """(the records so far as rows [t ns, grid, block], the records that did not fit)."""
        return records(self.cp.asnumpy(self.buf), self.cp.asnumpy(self.count))


def records(buf: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, int]:
    """The device buffer's records as rows [t ns, grid, block] (uint64), and how many did not fit."""
    kept = np.minimum(count.astype(np.int64), TRACE_PER_SM)
    per_sm = buf.reshape(TRACE_SMS, TRACE_PER_SM, 2)
    rows = np.concatenate([per_sm[sm, :n] for sm, n in enumerate(kept)] + [np.zeros((0, 2), np.uint64)])
    mask = np.uint64(0xFFFFFFFF)
    out = np.stack([rows[:, 0], rows[:, 1] >> np.uint64(32), rows[:, 1] & mask], axis=1)
    return out, int(count.astype(np.int64).sum() - kept.sum())


def releases(rows: np.ndarray) -> np.ndarray:
    """One row a launch, in the order of their releases: [grid, release ns, last block's release ns, blocks].
    A block that waits more than once counts by its first record."""
    if not len(rows):
        return np.zeros((0, 4), np.int64)
    rows = rows[np.lexsort((rows[:, 0], rows[:, 2], rows[:, 1]))]  # by grid, block, then time
    first = np.ones(len(rows), bool)
    first[1:] = (rows[1:, 1] != rows[:-1, 1]) | (rows[1:, 2] != rows[:-1, 2])
    rows = rows[first].astype(np.int64)
    grids, start, blocks = np.unique(rows[:, 1], return_index=True, return_counts=True)
    out = np.stack([grids, np.minimum.reduceat(rows[:, 0], start), np.maximum.reduceat(rows[:, 0], start), blocks],
                   axis=1)
    return out[np.argsort(out[:, 1], kind="stable")]


def critical_path(launches: np.ndarray, kinds: Sequence[str]) -> dict[str, tuple[int, float]]:
    """Per kind: (its launches, their microseconds of the critical path), launch i's share being release i + 1
    less release i; ``launches`` as ``releases`` gives them, ``kinds`` the kind of each in launch order. The
    last launch has no next release: it is left out."""
    if len(launches) != len(kinds):
        raise ValueError(f"{len(launches)} launches were traced, {len(kinds)} kinds given")
    out: dict[str, tuple[int, float]] = {}
    for kind, us in zip(kinds[:-1], np.diff(launches[:, 1]) / 1e3, strict=True):
        n, total = out.get(kind, (0, 0.0))
        out[kind] = (n + 1, total + float(us))
    return out
