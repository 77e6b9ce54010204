"""kestrel: a pluggable runtime for quantized LLM inference."""

from __future__ import annotations

__version__ = "0.1.0"

from kestrel_core.batch import BatchEntry  # noqa: E402
from kestrel_core.contract import (  # noqa: E402
    StripCache,
    quantize_activations,
    quantize_weight,
    reference_gemm_f32,
    reference_gemm_q8,
)
from kestrel_core.dispatch import Offload  # noqa: E402
from kestrel_core.errors import BackendUnavailable, ContractError, InvalidRequest, KestrelError, Overloaded  # noqa: E402
from kestrel_core.hookspecs import API_VERSION, hookimpl  # noqa: E402
from kestrel_core.model.async_engine import AsyncEngine  # noqa: E402
from kestrel_core.model.engine import Engine, load  # noqa: E402
from kestrel_core.model.sampling import SamplingParams  # noqa: E402
from kestrel_core.model.scheduler import RequestOutput, Scheduler  # noqa: E402
from kestrel_core.registry import Backend, BackendInfo, Registry  # noqa: E402
from kestrel_core.selftest import SelfTestCase  # noqa: E402
from kestrel_core.wkey import Proj, decode_wkey, wkey  # noqa: E402

__all__ = [
    "API_VERSION", "AsyncEngine", "Backend", "BackendInfo", "BackendUnavailable", "BatchEntry", "ContractError",
    "Engine", "InvalidRequest", "KestrelError", "Offload", "Overloaded", "Proj", "Registry", "RequestOutput",
    "SamplingParams", "Scheduler", "SelfTestCase", "StripCache", "__version__", "decode_wkey", "hookimpl", "load",
    "quantize_activations", "quantize_weight", "reference_gemm_f32", "reference_gemm_q8", "wkey",
]
