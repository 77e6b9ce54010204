"""kestrel: a pluggable runtime for quantized LLM inference.

The public API is imported on first use (PEP 562), so that ``import kestrel_core`` and the ``kestrel``
command start without loading the engine: a Ctrl-C in the first moments of the command is then still the
command's own "interrupted" (``kestrel_core.entry``), not a traceback from inside an import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
    "NonFiniteLogits": "kestrel_core.errors", "ShuttingDown": "kestrel_core.errors",
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
    "Engine": "kestrel_core.model.engine", "Step": "kestrel_core.model.step",
    "load": "kestrel_core.model.engine_load",
    "SamplingParams": "kestrel_core.model.sampling", "TokenLogprob": "kestrel_core.model.sampling",
    "EmbedJob": "kestrel_core.model.embed", "POOLINGS": "kestrel_core.model.config",
    "json_schema_grammar": "kestrel_core.model.grammar", "lark_grammar": "kestrel_core.model.grammar",
    "regex_grammar": "kestrel_core.model.grammar",
    "RequestOutput": "kestrel_core.model.request", "Scheduler": "kestrel_core.model.scheduler",
    "Scoring": "kestrel_core.model.scoring",
    "Backend": "kestrel_core.registry", "Registry": "kestrel_core.registry",
    "SelfTestCase": "kestrel_core.selftest",
}

if TYPE_CHECKING:  # what type checkers see of the names imported on first use (the same as _EXPORTS)
    from kestrel_core.batch import BatchEntry as BatchEntry
    from kestrel_core.contract import StripCache as StripCache
    from kestrel_core.contract import quantize_activations as quantize_activations
    from kestrel_core.contract import quantize_weight as quantize_weight
    from kestrel_core.contract import reference_gemm_f32 as reference_gemm_f32
    from kestrel_core.contract import reference_gemm_q8 as reference_gemm_q8
    from kestrel_core.dispatch import Deferred as Deferred
    from kestrel_core.dispatch import Offload as Offload
    from kestrel_core.errors import BackendUnavailable as BackendUnavailable
    from kestrel_core.errors import ContractError as ContractError
    from kestrel_core.errors import InvalidRequest as InvalidRequest
    from kestrel_core.errors import KestrelError as KestrelError
    from kestrel_core.errors import NonFiniteLogits as NonFiniteLogits
    from kestrel_core.errors import Overloaded as Overloaded
    from kestrel_core.errors import ShuttingDown as ShuttingDown
    from kestrel_core.hookspecs import API_VERSION as API_VERSION
    from kestrel_core.hookspecs import KINDS as KINDS
    from kestrel_core.hookspecs import BackendInfo as BackendInfo
    from kestrel_core.hookspecs import hookimpl as hookimpl
    from kestrel_core.model.async_engine import AsyncEngine as AsyncEngine
    from kestrel_core.model.config import POOLINGS as POOLINGS
    from kestrel_core.model.embed import EmbedJob as EmbedJob
    from kestrel_core.model.engine import Engine as Engine
    from kestrel_core.model.engine_load import load as load
    from kestrel_core.model.grammar import json_schema_grammar as json_schema_grammar
    from kestrel_core.model.grammar import lark_grammar as lark_grammar
    from kestrel_core.model.grammar import regex_grammar as regex_grammar
    from kestrel_core.model.request import RequestOutput as RequestOutput
    from kestrel_core.model.rope import rope_inv_freq as rope_inv_freq
    from kestrel_core.model.rope import rope_tables as rope_tables
    from kestrel_core.model.sampling import SamplingParams as SamplingParams
    from kestrel_core.model.sampling import TokenLogprob as TokenLogprob
    from kestrel_core.model.scheduler import Scheduler as Scheduler
    from kestrel_core.model.scoring import Scoring as Scoring
    from kestrel_core.model.step import Step as Step
    from kestrel_core.model.weights import PREFILL_CHUNK as PREFILL_CHUNK
    from kestrel_core.model.weights import ExpertWeights as ExpertWeights
    from kestrel_core.model.weights import LayerWeights as LayerWeights
    from kestrel_core.model.weights import Model as Model
    from kestrel_core.model.weights import engine_weights as engine_weights
    from kestrel_core.registry import Backend as Backend
    from kestrel_core.registry import Registry as Registry
    from kestrel_core.selftest import SelfTestCase as SelfTestCase
    from kestrel_core.wkey import PROJ_GROUPS as PROJ_GROUPS
    from kestrel_core.wkey import ProjGroup as ProjGroup
    from kestrel_core.wkey import wkey_expert as wkey_expert

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
