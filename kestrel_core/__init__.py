"""kestrel: a pluggable runtime for quantized LLM inference.

The public API is imported on first use (PEP 562), so that ``import kestrel_core`` and the ``kestrel``
command start without loading the engine: a Ctrl-C in the first moments of the command is then still the
command's own "interrupted" (``kestrel_core.entry``), not a traceback from inside an import.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# a name that is also a submodule's must be bound now: importing kestrel_core.wkey would otherwise set the
# package attribute ``wkey`` to the module, over the function (wkey.py imports only the standard library)
from kestrel_core.wkey import Proj as Proj  # noqa: E402
from kestrel_core.wkey import decode_wkey as decode_wkey
from kestrel_core.wkey import wkey as wkey

_EXPORTS = {
    "BatchEntry": "kestrel_core.batch",
    "StripCache": "kestrel_core.contract", "quantize_activations": "kestrel_core.contract",
    "quantize_weight": "kestrel_core.contract", "reference_gemm_f32": "kestrel_core.contract",
    "reference_gemm_q8": "kestrel_core.contract",
    "Deferred": "kestrel_core.dispatch", "Offload": "kestrel_core.dispatch",
    "BackendUnavailable": "kestrel_core.errors", "ContractError": "kestrel_core.errors",
    "InvalidRequest": "kestrel_core.errors", "KestrelError": "kestrel_core.errors", "Overloaded": "kestrel_core.errors",
    # the backend interface (hookspecs imports no registry, so a backend may import these first)
    "API_VERSION": "kestrel_core.hookspecs", "BackendInfo": "kestrel_core.hookspecs", "KINDS": "kestrel_core.hookspecs",
    "hookimpl": "kestrel_core.hookspecs",
    # the model view of the whole-step hooks (docs/plugins.md)
    "ExpertWeights": "kestrel_core.model.weights", "LayerWeights": "kestrel_core.model.weights",
    "Model": "kestrel_core.model.weights",
    "PREFILL_CHUNK": "kestrel_core.model.weights", "engine_weights": "kestrel_core.model.weights",
    "rope_inv_freq": "kestrel_core.model.rope", "rope_tables": "kestrel_core.model.rope",
    "PROJ_GROUPS": "kestrel_core.wkey", "ProjGroup": "kestrel_core.wkey", "wkey_expert": "kestrel_core.wkey",
    "AsyncEngine": "kestrel_core.model.async_engine",
    "Engine": "kestrel_core.model.engine", "Step": "kestrel_core.model.engine",
    "load": "kestrel_core.model.engine_load",
    "SamplingParams": "kestrel_core.model.sampling",
    "EmbedJob": "kestrel_core.model.embed", "POOLINGS": "kestrel_core.model.config",
    "json_schema_grammar": "kestrel_core.model.grammar", "lark_grammar": "kestrel_core.model.grammar",
    "regex_grammar": "kestrel_core.model.grammar",
    "RequestOutput": "kestrel_core.model.request", "Scheduler": "kestrel_core.model.scheduler",
    "Backend": "kestrel_core.registry", "Registry": "kestrel_core.registry",
    "SelfTestCase": "kestrel_core.selftest",
}

__all__ = sorted([*_EXPORTS, "Proj", "__version__", "decode_wkey", "wkey"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kestrel_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
