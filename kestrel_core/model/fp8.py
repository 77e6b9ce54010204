"""FP8 checkpoints: weights stored as float8 E4M3 codes with float32 scales beside them, as the Hub's ``-FP8``
repositories ship them (Qwen3, GLM-4.5, DeepSeek-V3, Ministral 3: transformers' ``fp8`` quant_method; RedHat's
``compressed-tensors`` and ``fbgemm_fp8``). A weight ``X.weight`` [N, K] is its codes times ``X.weight_scale_inv``
(``fp8``: one scale a ``weight_block_size`` block [bn, bk], or one for the tensor) or ``X.weight_scale``
(one a row, one for the tensor, or compressed-tensors' one a ``block_structure`` block), as DeepSeek's
``weight_dequant``, transformers and compressed-tensors decode it; the layers a config leaves unconverted stay BF16.
kestrel then quantizes the float32 weights to its own strip-cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kestrel_core.errors import KestrelError
from kestrel_core.model.validate import is_int

# a quant_method kestrel reads (FP8 weights; gpt-oss's MXFP4 experts are read by hf.py) -> whether it is FP8
QUANT_METHODS = {"fp8": True, "fbgemm_fp8": True, "compressed-tensors": True, "mxfp4": False}
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # beside X.weight: fp8's (multiplied, despite its name), the others'


def _e4m3_values() -> np.ndarray:
    """float32 [256]: each E4M3 (fn) code's value: sign, 4 exponent bits (bias 7), 3 mantissa bits, subnormals at
    exponent 0, NaN at S.1111.111, no infinities."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    value = np.where((exp == 0xF) & (man == 0x7), np.nan, value)
    return (sign * value).astype(np.float32)


E4M3_VALUES = _e4m3_values()


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint scales its FP8 weights: one scale a block of ``block`` rows x columns, else as the scale
    tensor's shape says (one a row, or one for the tensor)."""

    block: tuple[int, int] | None = None


def fp8_scheme(quantization: Any, where: str) -> Fp8Scheme | None:
    """The FP8 scheme of a config.json's ``quantization_config`` (None: the weights are not FP8), asked once
    ``int_quant.int_scheme`` and ``bnb.bnb_scheme`` have found none of theirs; a quant_method kestrel does not read
    (HQQ, NVFP4...) is refused by name."""
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if not isinstance(method, str) or method not in QUANT_METHODS:
        raise KestrelError(f"{where}: quantization_config quant_method {method!r} is not supported (kestrel reads "
                           "BF16, F16 and F32 checkpoints, FP8 ones (fp8, fbgemm_fp8, compressed-tensors FP8), "
                           "integer ones (gptq, awq, compressed-tensors), bitsandbytes and gpt-oss's MXFP4)")
    if not QUANT_METHODS[method]:
        return None
    if method == "compressed-tensors":
        if quantization.get("format") == "dense":
            return None  # saved uncompressed: plain float weights
        blocks: set[tuple[int, int]] = set()
        for name, group in (quantization.get("config_groups") or {}).items():
            weights = group.get("weights") if isinstance(group, dict) else None
            if not isinstance(weights, dict) or weights.get("type") != "float" or weights.get("num_bits") != 8:
                raise KestrelError(f"{where}: compressed-tensors group {name!r} is neither FP8 nor integer weights, "
                                   "or mixes them with the other kind (kestrel reads either, in every group)")
            if weights.get("strategy") == "block":  # llm-compressor's FP8_BLOCK
                structure = weights.get("block_structure")
                if isinstance(structure, str):  # the older spelling, "128x128", as compressed-tensors still reads it
                    parts = structure.split("x")
                    structure = [int(p) for p in parts] if all(p.isascii() and p.isdigit() for p in parts) \
                        else structure
                blocks.add(_block(structure, f"{where}: compressed-tensors group {name!r} block_structure"))
        if len(blocks) > 1:
            raise KestrelError(f"{where}: compressed-tensors groups' block_structure differ "
                               f"({', '.join(str(list(b)) for b in sorted(blocks))}); kestrel reads one for all")
        return Fp8Scheme(blocks.pop() if blocks else None)
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise KestrelError(f"{where}: FP8 format {quantization.get('fmt')!r} is not supported (kestrel reads e4m3)")
    block = quantization.get("weight_block_size")
    return Fp8Scheme(None if block is None else _block(block, f"{where}: weight_block_size"))


def _block(block: Any, what: str) -> tuple[int, int]:
    """A config's block of weights [rows, columns]: two positive integers (``True`` is an int to Python, not to a
    block), else ``what`` is refused."""
    if not (isinstance(block, list) and len(block) == 2 and all(is_int(b) and b > 0 for b in block)):
        raise KestrelError(f"{what} must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def dequantize_fp8(codes: np.ndarray, scale: np.ndarray, scheme: Fp8Scheme, where: str) -> np.ndarray:
    """float32 [N, K] of E4M3 ``codes`` (uint8 [N, K]) times ``scale``: a block's, a row's or the tensor's."""
    n, k = codes.shape
    w = E4M3_VALUES[codes]
    scale = np.asarray(scale, np.float32)
    if scale.size == 1:
        w *= scale.reshape(())
    elif scale.shape in ((n, 1), (n,)):
        w *= scale.reshape(n, 1)
    elif scheme.block is not None and scale.shape == (math.ceil(n / scheme.block[0]), math.ceil(k / scheme.block[1])):
        bn, bk = scheme.block  # each weight times its block's scale (a block may be larger than the weight)
        w *= scale[np.arange(n) // bn][:, np.arange(k) // bk]
    else:
        block = f"blocks of {list(scheme.block)}" if scheme.block else "no block size in quantization_config"
        raise KestrelError(f"{where}: scale of shape {list(scale.shape)} does not fit a weight of shape [{n}, {k}] "
                           f"({block})")
    return w
