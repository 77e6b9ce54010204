"""Shared checks: results against kestrel_core.contract's reference GEMMs."""

from __future__ import annotations

import numpy as np

from kestrel_core.contract import StripCache, quantize_activations, reference_gemm_f32, reference_gemm_q8
from kestrel_core.selftest import random_strip_cache

EPS32 = float(np.finfo(np.float32).eps)


def weight(n: int, k: int, g: int, bits: int, seed: int = 0) -> StripCache:
    return random_strip_cache(np.random.default_rng([seed, n, k, g, bits]), n, k, g, bits)


def activations(m: int, k: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([seed, m, k, 7]).standard_normal((m, k)).astype(np.float32)


def _abs_terms(a_abs: np.ndarray, w: StripCache) -> np.ndarray:
    """sum_g w_scale * sum_k |a| |w|: the size of what float accumulation order can change."""
    g = w.group_size
    a = a_abs.astype(np.float64).reshape(a_abs.shape[0], -1, g).transpose(1, 0, 2)       # [ng, M, G]
    b = np.abs(w.codes.astype(np.float64)).reshape(w.n, -1, g).transpose(1, 2, 0)      # [ng, G, N]
    return (np.matmul(a, b) * w.scales.T[:, None, :]).sum(axis=0)                     # [M, N]


def assert_close(got: np.ndarray, ref: np.ndarray, terms: np.ndarray, ngroups: int) -> None:
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == ref.shape
    tol = 4 * (ngroups + 8) * EPS32 * terms + 1e-30
    err = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    worst = np.unravel_index(np.argmax(err / tol), err.shape)
    assert np.all(err <= tol), f"error {err[worst]:.3g} > tolerance {tol[worst]:.3g} at {worst}"


def check_q8(got: np.ndarray, x: np.ndarray, w: StripCache) -> None:
    codes, scales = quantize_activations(x, w.group_size)
    a_abs = np.abs(codes.astype(np.float32)) * np.repeat(scales, w.group_size, axis=1)
    assert_close(got, reference_gemm_q8(codes, scales, w), _abs_terms(a_abs, w), w.ngroups)


def check_f32(got: np.ndarray, x: np.ndarray, w: StripCache) -> None:
    assert_close(got, reference_gemm_f32(x, w), _abs_terms(np.abs(x), w), w.ngroups)
