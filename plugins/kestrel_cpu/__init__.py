"""kestrel_cpu: the reference backend. Always bound; the definition of "correct".

The GEMMs run compiled int8 kernels (``kestrel_cpu.kernels``, numba) that compute the contract's exact
integer block sums and differ from ``kestrel_core.contract.reference_gemm_*`` only in float rounding order
(tests/kestrel_cpu state the bound). On a CPU with VNNI (AVX-512 VNNI, or AVX-VNNI) each weight is repacked
once for them (the int8 and the float32 GEMMs share it), on first use, and kept under its wkey until the
device closes (as much memory again as the int8 codes, half as much for an int4 weight, whose packed codes
are two to a byte; ``KESTREL_CPU_PACKED=0`` keeps to the codes and the vpmaddwd kernels). On AVX2 alone only
int4 weights are repacked (``packed.PACKED_BITS``). Where numba cannot be imported, or with
``KESTREL_CPU_REFERENCE=1``, the backend runs the numpy reference functions themselves.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import numpy as np

import kestrel_core
from kestrel_core.contract import StripCache, reference_gemm_f32, reference_gemm_q8
from kestrel_core.env import env_flag
from kestrel_core.errors import ContractError, KestrelError
from kestrel_core.hookspecs import API_VERSION, BackendInfo, hookimpl
from kestrel_core.wkey import NO_CACHE

log = logging.getLogger("kestrel")

REFERENCE_ENV = "KESTREL_CPU_REFERENCE"
PACKED_ENV = "KESTREL_CPU_PACKED"  # 0: no packed copy of the weights (half the memory), the vpmaddwd kernels
LAYERS_ENV = "KESTREL_CPU_LAYERS"  # 0: every layer op by op, through the dispatcher (no compiled layer or experts)


def _load_kernels() -> tuple[ModuleType | None, str]:
    """The compiled kernels module, or None with the reason the numpy reference is used instead."""
    if env_flag(REFERENCE_ENV):
        return None, f"{REFERENCE_ENV} set"
    try:
        from kestrel_cpu import kernels
    except KestrelError:  # a bad setting (KESTREL_CPU_VNNI) is the user's to fix, not a reason to fall back
        raise
    except Exception as exc:  # numba missing or unusable on this platform: the reference still works
        log.debug("kestrel_cpu: compiled kernels unavailable", exc_info=exc)
        return None, f"numba kernels unavailable: {type(exc).__name__}: {exc}"
    return kernels, ""


class CpuDevice:
    def __init__(self) -> None:
        self.kernels, why = _load_kernels()
        kernels = self.kernels
        packing = kernels is not None and env_flag(PACKED_ENV, default=True)
        self.packed_bits = kernels.packed.PACKED_BITS if packing else ()  # weights packed for the packed kernels
        self.compiled_layers = bool(self.packed_bits) and env_flag(LAYERS_ENV, default=True)  # layer.py, experts.py
        self.vnni = 8 in self.packed_bits
        # the hooks' vnni argument: None lets a kernel take the packed path, False keeps the vpmaddwd one
        self.vnni_arg = None if packing else False
        vnni = (f", {'AVX-512 VNNI' if kernels.packed.PACK_COLS == 16 else 'AVX-VNNI'}" if self.vnni
                else ", AVX2, int4 weights packed" if self.packed_bits else "")
        self.description = (f"host CPU (numba int8 kernels{vnni})" if kernels
                            else f"host CPU (numpy reference; {why})")
        # wkey -> (the codes it was packed from, the VNNI-packed weight): packed once, on first use, and used
        # by the int8 and the float32 GEMMs alike
        self.packed: dict[int, tuple[np.ndarray, Any]] = {}

    def packed_for(self, wkey: int, weight: StripCache) -> Any:
        """The packed form of ``weight``, cached under ``wkey``; None where the packed kernels do not take its
        bits (``packed.PACKED_BITS``: with VNNI all, on AVX2 int4 only).

        An entry holds the codes it was made from, so their memory cannot be reused by another weight under
        the same wkey (another model's) while it lives; a different array under that wkey replaces it."""
        kernels = self.kernels
        if kernels is None or weight.bits not in self.packed_bits:
            return None
        if wkey == NO_CACHE:
            return kernels.Packed(weight.codes, weight.scales, weight.bits)
        hit = self.packed.get(wkey)
        if hit is None or hit[0] is not weight.codes:
            hit = (weight.codes, kernels.Packed(weight.codes, weight.scales, weight.bits))
            self.packed[wkey] = hit
        return hit[1]

    def dense_layer(self, wkeys: list[tuple[int, ...]], strips: tuple[tuple[StripCache, ...], ...]) -> Any:
        """A dense layer's GEMMs (Q|K|V, O, gate|up, down: their wkeys and strips) packed for one compiled call a
        layer (``layer.DenseLayer``), or None where the packed kernels do not take them all."""
        if not self.compiled_layers:
            return None
        from kestrel_cpu import layer

        packs = [[self.packed_for(k, w) for k, w in zip(keys, ws)] for keys, ws in zip(wkeys, strips)]
        return layer.dense_layer(packs, strips)

    def experts_pass(self, wkeys: list[list[tuple[int, ...]]], strips: list[tuple[tuple[StripCache, ...], ...]],
                     shared: bool) -> Any:
        """A mixture-of-experts layer's experts (each one's (gate, up), (down,): wkeys and strips; the shared expert
        last where ``shared``) packed for one compiled call a layer (``experts.ExpertsPass``), or None where the
        packed kernels do not take them all."""
        if not self.compiled_layers:
            return None
        from kestrel_cpu import experts

        packs = [[[self.packed_for(k, w) for k, w in zip(keys, ws)] for keys, ws in zip(ex_keys, ex_strips)]
                 for ex_keys, ex_strips in zip(wkeys, strips)]
        return experts.experts_pass(packs, strips, shared)


@hookimpl
def kestrel_backend_info() -> BackendInfo:
    return BackendInfo(name="cpu", version=kestrel_core.__version__, api_version=API_VERSION, kind="cpu",
                       description="numba int8 kernels, numpy reference semantics")


@hookimpl
def kestrel_open(options: dict[str, Any]) -> CpuDevice:
    return CpuDevice()


@hookimpl
def kestrel_close(device: CpuDevice) -> None:
    device.packed.clear()


def _c_array(x: Any, dtype: type, name: str) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.dtype != dtype or x.ndim != 2:
        got = f"{x.dtype} {list(x.shape)}" if isinstance(x, np.ndarray) else type(x).__name__
        raise ContractError(f"{name} must be a 2-D {np.dtype(dtype).name} array, got {got}")
    return np.ascontiguousarray(x)


def _activations(a_codes: Any, a_scales: Any, weight: StripCache) -> tuple[np.ndarray, np.ndarray]:
    # What quantize_activations returns passes the first test (this runs ~200 times per decoded token).
    if not (type(a_codes) is np.ndarray and a_codes.dtype == np.int8 and a_codes.ndim == 2
            and a_codes.flags.c_contiguous):
        a_codes = _c_array(a_codes, np.int8, "a_codes")
    if not (type(a_scales) is np.ndarray and a_scales.dtype == np.float32 and a_scales.ndim == 2
            and a_scales.flags.c_contiguous):
        a_scales = _c_array(a_scales, np.float32, "a_scales")
    if a_codes.shape[1] != weight.k or a_scales.shape != (a_codes.shape[0], weight.ngroups):
        raise ContractError(f"activations {list(a_codes.shape)} with scales {list(a_scales.shape)} do not "
                            f"match a weight of K={weight.k}, G={weight.group_size}")
    return a_codes, a_scales


@hookimpl
def kestrel_gemm_q8(device: CpuDevice, a_codes: np.ndarray, a_scales: np.ndarray, weight: StripCache,
                    wkey: int) -> np.ndarray:
    if device.kernels is None:
        return reference_gemm_q8(a_codes, a_scales, weight)
    a_codes, a_scales = _activations(a_codes, a_scales, weight)
    return device.kernels.gemm_q8(a_codes, a_scales, weight.codes, weight.scales, device.packed_for(wkey, weight),
                                  vnni=device.vnni_arg)


@hookimpl
def kestrel_gemm_fused_q8(device: CpuDevice, a_codes: np.ndarray, a_scales: np.ndarray,
                          weights: list[StripCache], wkeys: list[int], fused_wkey: int) -> list[np.ndarray] | None:
    """Q/K/V or gate/up in one parallel pass (one thread fork/join and one call instead of several); a larger
    group (Qwen3.5's four input projections) in passes of up to ``kernels.MAX_WEIGHTS``, the same bits."""
    if not weights:
        return []
    first = weights[0]
    if any(w.k != first.k or w.group_size != first.group_size for w in weights):
        return None  # declined: the core runs them one by one
    if device.kernels is None:
        return [reference_gemm_q8(a_codes, a_scales, w) for w in weights]
    a_codes, a_scales = _activations(a_codes, a_scales, first)
    packs = [device.packed_for(k, w) for k, w in zip(wkeys, weights)] if device.packed_bits else None
    step = device.kernels.MAX_WEIGHTS
    outs: list[np.ndarray] = []
    for s in range(0, len(weights), step):
        part = weights[s:s + step]
        outs += device.kernels.gemm_q8_multi(a_codes, a_scales, [w.codes for w in part], [w.scales for w in part],
                                             None if packs is None else packs[s:s + step], vnni=device.vnni_arg)
    return outs


@hookimpl
def kestrel_gemm_f32(device: CpuDevice, a: np.ndarray, weight: StripCache, wkey: int) -> np.ndarray:
    if device.kernels is None:
        return reference_gemm_f32(a, weight)
    a = _c_array(np.asarray(a, dtype=np.float32), np.float32, "a")
    if a.shape[1] != weight.k:
        raise ContractError(f"activations {list(a.shape)} do not match a weight of K={weight.k}")
    return device.kernels.gemm_f32(a, weight.codes, weight.scales, device.packed_for(wkey, weight),
                                   vnni=device.vnni_arg)
