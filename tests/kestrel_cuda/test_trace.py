"""The diagnostic build's records (kestrel_cuda.trace) read back on the host: the device buffer decoded, each
launch's release the first of its blocks' first records, and a step's critical path split by kind."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kestrel_cuda import kernels
from kestrel_cuda.trace import TRACE_PER_SM, TRACE_SMS, critical_path, options, records, releases


def _buffer(per_sm: dict[int, list[tuple[int, int, int]]]) -> tuple[np.ndarray, np.ndarray]:
    """The device buffer and counters holding ``per_sm``'s (t ns, grid, block) records."""
    buf = np.zeros((TRACE_SMS, TRACE_PER_SM, 2), np.uint64)
    count = np.zeros(TRACE_SMS, np.uint32)
    for sm, rows in per_sm.items():
        for i, (t, grid, block) in enumerate(rows):
            buf[sm, i] = (t, grid << 32 | block)
        count[sm] = len(rows)
    return buf.reshape(-1), count


def test_records_decode_each_sms_share_and_count_what_did_not_fit() -> None:
    buf, count = _buffer({0: [(100, 7, 3), (250, 8, 0)], 131: [(120, 7, 0)]})
    count[5] = TRACE_PER_SM + 9  # an SM whose records ran past its share: the ones that fit are zeros here
    rows, dropped = records(buf, count)
    assert dropped == 9 and len(rows) == 3 + TRACE_PER_SM
    kept = rows[rows[:, 1] != 0]
    assert sorted(map(tuple, kept.tolist())) == [(100, 7, 3), (120, 7, 0), (250, 8, 0)]


def test_a_launch_is_released_by_its_first_block_and_a_block_counts_once() -> None:
    rows = np.array([  # t, grid, block: grid 9 before grid 4 in time; block 1 of grid 9 waits twice
        (1_000, 9, 0), (1_400, 9, 1), (1_900, 9, 1), (1_200, 9, 2),
        (3_000, 4, 0), (3_300, 4, 1),
        (5_000, 6, 0),
    ], np.uint64)
    launches = releases(rows[np.random.default_rng(0).permutation(len(rows))])
    assert launches.tolist() == [[9, 1_000, 1_400, 3], [4, 3_000, 3_300, 2], [6, 5_000, 5_000, 1]]
    assert releases(np.zeros((0, 3), np.uint64)).shape == (0, 4)


def test_the_critical_path_splits_by_kind_and_leaves_the_last_launch_out() -> None:
    launches = np.array([[1, 0, 0, 8], [2, 4_000, 4_500, 8], [3, 5_000, 5_000, 4], [4, 9_000, 9_000, 8],
                         [5, 9_500, 9_600, 2]])
    path = critical_path(launches, ["gemv q/k/v", "attn_decode", "gemv q/k/v", "attn_decode", "lm_finish"])
    assert path == {"gemv q/k/v": (2, 8.0), "attn_decode": (2, 1.5)}
    with pytest.raises(ValueError, match="5 launches were traced, 4 kinds given"):
        critical_path(launches, ["a", "b", "c", "d"])


def test_the_kernels_record_what_trace_reads() -> None:
    """common.cuh's records are the layout ``records`` reads ([t, grid << 32 | block], KESTREL_TRACE_PER_SM of
    them an SM, KESTREL_TRACE_SMS SMs) in the globals StepTrace sets, and the build's options define those."""
    text = kernels.source_text(("common.cuh",))
    body = text[text.index("void grid_dep_wait()"):]
    body = body[:body.index("\n}\n")]
    assert "kestrel_trace_buf + 2 * ((size_t)sm * KESTREL_TRACE_PER_SM + slot)" in body
    assert re.search(r"r\[0\] = t;\s*r\[1\] = grid << 32 \| block;", body)
    assert re.search(r"__constant__ unsigned long long\* kestrel_trace_buf;", text)
    assert re.search(r"__constant__ unsigned\* kestrel_trace_count;", text)
    assert "stamp = sm < KESTREL_TRACE_SMS;" in body
    assert options() == ("-DKESTREL_TRACE", f"-DKESTREL_TRACE_SMS={TRACE_SMS}",
                         f"-DKESTREL_TRACE_PER_SM={TRACE_PER_SM}")
