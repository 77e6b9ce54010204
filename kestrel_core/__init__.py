"""kestrel: a pluggable runtime for quantized LLM inference."""

from __future__ import annotations

__version__ = "0.1.0"

from kestrel_core.contract import (  # noqa: E402
    StripCache,
    quantize_activations,
    quantize_weight,
    reference_gemm_f32,
    reference_gemm_q8,
)
from kestrel_core.dispatch import Offload  # noqa: E402
from kestrel_core.errors import BackendUnavailable, ContractError, KestrelError  # noqa: E402
from kestrel_core.hookspecs import API_VERSION, hookimpl  # noqa: E402
from kestrel_core.model.engine import Engine, load  # noqa: E402
from kestrel_core.registry import Backend, BackendInfo, Registry  # noqa: E402
from kestrel_core.wkey import Proj, decode_wkey, wkey  # noqa: E402

__all__ = [
    "API_VERSION", "Backend", "BackendInfo", "BackendUnavailable", "ContractError", "Engine", "KestrelError",
    "Offload", "Proj", "Registry", "StripCache", "__version__", "decode_wkey", "hookimpl", "load",
    "quantize_activations", "quantize_weight", "reference_gemm_f32", "reference_gemm_q8", "wkey",
]
