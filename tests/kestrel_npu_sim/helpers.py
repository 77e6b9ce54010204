"""Shared checks: results against kestrel_core.contract's reference GEMMs."""

from __future__ import annotations

import numpy as np

from kestrel_core.contract import StripCache, quantize_activations
from kestrel_core.selftest import compare_gemm_f32, compare_gemm_q8, random_strip_cache


def weight(n: int, k: int, g: int, bits: int, seed: int = 0) -> StripCache:
    return random_strip_cache(np.random.default_rng([seed, n, k, g, bits]), n, k, g, bits)


def activations(m: int, k: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([seed, m, k, 7]).standard_normal((m, k)).astype(np.float32)


def check_q8(got: np.ndarray, x: np.ndarray, w: StripCache) -> None:
    codes, scales = quantize_activations(x, w.group_size)
    result = compare_gemm_q8(got, codes, scales, w)
    assert result.ok, result.detail


def check_f32(got: np.ndarray, x: np.ndarray, w: StripCache) -> None:
    result = compare_gemm_f32(got, x, w)
    assert result.ok, result.detail
