"""The decoder's row-wise host operations in float32: its norms (``NORMS``, by ``ModelConfig.norm_type``), the
sigmoid, and its MLP's gated activations (``GATED_ACTIVATIONS``, by ``ModelConfig.activation``). Each row is computed
on its own (``kernels``), so a row's bits do not depend on its batch."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kestrel_core.model import kernels


def _by_rows(kernel: Callable[..., None], x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``kernel`` (``kernels.rmsnorm_rows`` or ``layernorm_rows``) over the last axis of x, float32."""
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(rows)
    kernel(rows, np.ascontiguousarray(weight, dtype=np.float32), np.float32(eps), out)
    return out.reshape(x.shape)


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, float32, each row summed sequentially."""
    return _by_rows(kernels.rmsnorm_rows, x, weight, eps)


def layernorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """(x - mean) / sqrt(variance + eps) * weight over the last axis (a LayerNorm without a bias, as transformers'
    CohereLayerNorm), float32, each row summed sequentially."""
    return _by_rows(kernels.layernorm_rows, x, weight, eps)


NORMS = {"rms": rmsnorm, "layer": layernorm}  # by ModelConfig.norm_type


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)), element-wise float32 (exp overflows to inf for very negative x: the limit, 0)."""
    t = np.negative(x, dtype=np.float32)
    np.exp(t, out=t)
    t += np.float32(1)
    return np.reciprocal(t, out=t)


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up in place in ``gate`` [M, F] (``kernels.gated_mul``), the same bits for any M."""
    kernels.gated_mul(gate, up, False)
    return gate


def gelu_tanh_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gelu_tanh(gate) * up in place in ``gate`` [M, F] (``kernels.gated_mul``): torch's gelu(approximate="tanh"),
    Gemma's GeGLU, the same bits for any M."""
    kernels.gated_mul(gate, up, True)
    return gate


def swiglu_oai_mul(gate: np.ndarray, up: np.ndarray, limit: np.float32, alpha: np.float32) -> np.ndarray:
    """gpt-oss's clamped SwiGLU in place in ``gate`` [M, F]: g = min(gate, limit), u = clip(up, -limit, limit),
    (u + 1) * g * sigmoid(alpha * g), as transformers' GptOssExperts; element-wise numpy."""
    np.minimum(gate, limit, out=gate)
    t = gate * (-alpha)
    np.exp(t, out=t)
    t += np.float32(1)
    gate /= t
    gate *= np.clip(up, -limit, limit) + np.float32(1)
    return gate


# by ModelConfig.activation (swiglu_oai takes its limit and slope as keywords)
GATED_ACTIVATIONS = {"silu": silu_mul, "gelu_tanh": gelu_tanh_mul, "swiglu_oai": swiglu_oai_mul}
