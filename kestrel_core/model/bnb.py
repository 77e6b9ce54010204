"""bitsandbytes checkpoints (the Hub's ``-bnb-4bit`` repositories, transformers' ``load_in_4bit`` / ``load_in_8bit``
saved): each weight decoded to float32 as bitsandbytes' ``dequantize_4bit`` and ``int8_vectorwise_dequant`` decode
it, then quantized to kestrel's strip-cache like any float checkpoint (NF4 and FP4 values lie on no even grid, so
no strip-cache holds them as they are).

- 4-bit: ``X.weight`` uint8, two codes a byte, the first in the high nibble, over the weight [N, K] flattened;
  ``X.weight.quant_map`` float32 [16] the codes' values (NF4's or FP4's); ``X.weight.absmax`` one scale a block
  of ``blocksize`` codes, float32, or with double quantization uint8 codes of ``X.weight.nested_quant_map``
  [256] times ``X.weight.nested_absmax`` (one a block of ``nested_blocksize`` scales) plus ``nested_offset``;
  ``X.weight.quant_state.bitsandbytes__nf4`` (or ``__fp4``) the JSON of the rest (shape, block sizes, offset).
- 8-bit: ``X.weight`` int8 [N, K] and ``X.SCB`` float32 [N], the weight being codes times SCB / 127.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kestrel_core.errors import KestrelError
from kestrel_core.model.int_quant import StoredTensors

QUANT_STATE = ".weight.quant_state.bitsandbytes__"  # + nf4 or fp4


@dataclass(frozen=True)
class BnbScheme:
    """A bitsandbytes checkpoint's weights: 4 or 8 bits."""

    bits: int


def bnb_scheme(quantization: Any, where: str) -> BnbScheme | None:
    """The scheme of a config.json's ``quantization_config`` with quant_method bitsandbytes (None: another)."""
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "bitsandbytes":
        return None
    four, eight = quantization.get("load_in_4bit") is True, quantization.get("load_in_8bit") is True
    if four == eight:
        raise KestrelError(f"{where}: a bitsandbytes quantization_config must set one of load_in_4bit and "
                           "load_in_8bit")
    if four and quantization.get("bnb_4bit_quant_storage", "uint8") != "uint8":
        raise KestrelError(f"{where}: bnb_4bit_quant_storage {quantization.get('bnb_4bit_quant_storage')!r} is not "
                           "supported (kestrel reads uint8)")
    return BnbScheme(4 if four else 8)


def quant_state(raw: np.ndarray, where: str) -> dict[str, Any]:
    """The JSON a 4-bit weight's quant_state tensor holds, its fields checked."""
    try:
        state = json.loads(np.asarray(raw, np.uint8).tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise KestrelError(f"{where}: its quant_state is not JSON ({exc})") from None
    shape = state.get("shape") if isinstance(state, dict) else None
    if not (isinstance(shape, list) and len(shape) == 2 and all(_positive(x) for x in shape)):
        raise KestrelError(f"{where}: quant_state shape {shape!r} is not two positive sizes")
    for key in ("blocksize",) + (("nested_blocksize",) if "nested_blocksize" in state else ()):
        if not _positive(state.get(key)):
            raise KestrelError(f"{where}: quant_state {key} {state.get(key)!r} is not a positive integer")
    offset = state.get("nested_offset", 0.0)
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
        raise KestrelError(f"{where}: quant_state nested_offset {offset!r} is not a number")
    return state


def _positive(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def dequantize_4bit(packed: np.ndarray, quant_map: np.ndarray, absmax: np.ndarray, state: dict[str, Any],
                    nested: tuple[np.ndarray, np.ndarray] | None, where: str) -> np.ndarray:
    """float32 [N, K] of a 4-bit weight; ``nested``: (nested_quant_map, nested_absmax) under double quantization."""
    n, k = state["shape"]
    codes = np.asarray(packed).reshape(-1)
    qmap = np.asarray(quant_map, np.float32).reshape(-1)
    if codes.dtype != np.uint8 or codes.size * 2 != n * k or qmap.size != 16:
        raise KestrelError(f"{where}: {codes.size} bytes ({codes.dtype}) and a map of {qmap.size} values do not "
                           f"hold a [{n}, {k}] weight of 4-bit codes")
    scales = _absmax(absmax, state, nested, -(-n * k // state["blocksize"]), where)
    values = np.empty((codes.size, 2), np.float32)  # the high nibble is the first of the pair
    values[:, 0], values[:, 1] = qmap[codes >> 4], qmap[codes & 15]
    values = values.reshape(-1)
    size = state["blocksize"]  # each block times its scale, in place (a block may be larger than the weight)
    whole = values.size // size * size
    blocks = values[:whole].reshape(-1, size)
    blocks *= scales[:whole // size, None]
    values[whole:] *= scales[-1]
    return values.reshape(n, k)


def _absmax(absmax: np.ndarray, state: dict[str, Any], nested: tuple[np.ndarray, np.ndarray] | None, count: int,
            where: str) -> np.ndarray:
    """float32 [count]: each block's scale, decoded from its double quantization where there is one."""
    a = np.asarray(absmax).reshape(-1)
    if a.size != count:
        raise KestrelError(f"{where}: {a.size} absmax values for {count} blocks")
    if nested is None:
        return a.astype(np.float32)
    qmap, scale = (np.asarray(x, np.float32).reshape(-1) for x in nested)
    size = state.get("nested_blocksize", 0)
    if a.dtype != np.uint8 or qmap.size != 256 or not size or scale.size != -(-count // size):
        raise KestrelError(f"{where}: double-quantized absmax ({a.dtype}, {a.size}) does not fit its nested map "
                           f"({qmap.size}) and scales ({scale.size}, blocks of {size})")
    return qmap[a] * scale[np.arange(count) // size] + np.float32(state.get("nested_offset", 0.0))


def dequantize_8bit(weight: np.ndarray, scb: np.ndarray, where: str) -> np.ndarray:
    """float32 [N, K] of an 8-bit (LLM.int8) weight: codes times their row's SCB / 127."""
    w, s = np.asarray(weight), np.asarray(scb, np.float32).reshape(-1)
    if w.ndim != 2 or w.dtype != np.int8 or s.size != w.shape[0]:
        raise KestrelError(f"{where}: an int8 weight {list(w.shape)} ({w.dtype}) and {s.size} SCB values do not fit")
    return w.astype(np.float32) * (s / np.float32(127))[:, None]


def read_weight(ck: StoredTensors, hf_name: str, scheme: BnbScheme, where: str) -> np.ndarray:
    """float32 [N, K] of the bitsandbytes weight ``hf_name`` (X.weight), with the tensors beside it."""
    base = hf_name.removesuffix(".weight")
    if scheme.bits == 8:
        return dequantize_8bit(ck.tensor(hf_name), ck.float_tensor(base + ".SCB"), where)
    state_name = next((n for n in (base + QUANT_STATE + "nf4", base + QUANT_STATE + "fp4") if ck.has_tensor(n)), None)
    if state_name is None:
        raise KestrelError(f"{where}: a 4-bit bitsandbytes weight without its quant_state beside it")
    state = quant_state(ck.tensor(state_name), where)
    nested = ((ck.float_tensor(hf_name + ".nested_quant_map"), ck.float_tensor(hf_name + ".nested_absmax"))
              if ck.has_tensor(hf_name + ".nested_absmax") else None)
    return dequantize_4bit(ck.tensor(hf_name), ck.float_tensor(hf_name + ".quant_map"), ck.tensor(hf_name + ".absmax"),
                           state, nested, where)
