"""Float activations on an int8-only NPU: exact int8 slices per K-block (the Ozaki scheme's splitting).

Each K-block of a float32 activation row is written as ``sum_j slice_j * 2**(e - 7*j)`` with int8 slices:
``2**e`` is the smallest power of two with ``max|block| <= 127 * 2**e``, each slice is the rounded
remainder of the previous ones, so slice 0 lies in [-127, 127] and every later one in [-64, 64]. A float32
block whose nonzero magnitudes span less than a factor 2**17 is exact after at most 6 slices. The NPU runs
the exact integer matmul of every slice; the host recombines them in float64.

Reference: K. Ozaki, T. Ogita, S. Oishi, S. M. Rump, "Error-free transformations of matrix multiplication
by using fast routines of matrix multiplication and its applications", Numer. Algorithms 59 (2012);
H. Ootomo, K. Ozaki, R. Yokota, "DGEMM on integer matrix multiplication unit", IJHPCA 38 (2024).
"""

from __future__ import annotations

import numpy as np

MAX_SLICES = 6
SLICE_BITS = 7


def int8_slices(a: np.ndarray, group_size: int, max_slices: int = MAX_SLICES) -> tuple[np.ndarray, np.ndarray]:
    """a: float32 [M, K] (finite) -> (slices int8 [L, M, K], exponents int [M, K/G]) with L <= max_slices.

    Stops at the first L whose remainder is zero everywhere; at ``max_slices`` the remainder left out is at
    most ``2**(e + 6 - 7*L)`` per element, below 2**-41 of its block's largest magnitude.
    """
    m, k = a.shape
    x = a.astype(np.float64).reshape(m, k // group_size, group_size)           # [M, ng, G]
    _, e = np.frexp(np.abs(x).max(axis=-1) / 127.0)                             # max/127 <= 2**e
    e = np.where(np.abs(x).max(axis=-1) == 0, 0, e)                             # [M, ng]
    slices = []
    rest = x
    for j in range(max_slices):
        step = np.ldexp(1.0, e - SLICE_BITS * j)[..., None]                     # [M, ng, 1]
        s = np.rint(rest / step)                                                 # exact: step is 2**n
        rest = rest - s * step                                                   # exact in float64
        slices.append(s.astype(np.int8).reshape(m, k))
        if not rest.any():
            break
    return np.stack(slices), e


def recombine(sums: np.ndarray, e: np.ndarray) -> np.ndarray:
    """sums: int32 [ng, L, M, N] block sums of each slice; e: [M, ng] -> float64 block sums [ng, M, N]."""
    n_slices = sums.shape[1]
    weights = np.ldexp(1.0, e.T[:, None, :] - SLICE_BITS * np.arange(n_slices)[None, :, None])  # [ng, L, M]
    return np.einsum("glmn,glm->gmn", sums.astype(np.float64), weights)
