"""Opening an engine: ``load(model, backend, quant)`` and ``load_preset(name, ...)`` bind the backend first (one
that cannot bind fails fast, before any model is read), then resolve and load the model, set its context
(``with_context``) and make the ``Engine``, which preloads it onto the backend."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kestrel_core.errors import KestrelError
from kestrel_core.model.config import normalize_rope_scaling
from kestrel_core.model.engine import Engine
from kestrel_core.model.quantize import holds_quant, model_quant, parse_quant
from kestrel_core.model.rerank import as_reranker
from kestrel_core.model.validate import ValidationError, check_bool, is_int
from kestrel_core.model.weights import Model
from kestrel_core.registry import Registry

if TYPE_CHECKING:
    from kestrel_core.model.lora import LoraPaths

log = logging.getLogger("kestrel")


def _resolve_model(model: Any, quant: str | None, lora: LoraPaths | None = None,
                   lora_scale: float | Sequence[float] = 1.0) -> tuple[Model, Any, str]:
    """(Model, tokenizer, source description) from a path, None (the default model), a Model or a loaded
    model (anything with ``.model`` and ``.tokenizer``); ``lora``: adapters merged into a path's weights."""
    from kestrel_core.model.presets import ByteTokenizer

    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if isinstance(model, bytes):
        raise KestrelError("cannot load a model from bytes: give the path as text")
    if lora is not None and not (model is None or isinstance(model, str)):
        raise KestrelError("a LoRA adapter merges into a checkpoint as it loads: give the model's path")
    if isinstance(model, Model):
        _warn_kept_quant(model, quant, "in-memory model")
        return model, ByteTokenizer(model.config.vocab_size), "in-memory model"
    if hasattr(model, "model") and hasattr(model, "tokenizer"):
        source = str(getattr(model, "source", "in-memory model"))
        _warn_kept_quant(model.model, quant, source)
        return model.model, model.tokenizer, source
    if model is None or isinstance(model, str):
        try:
            from kestrel_core.model.loader import load_model
        except ImportError as exc:
            raise KestrelError(f"model loading is not available: {exc}") from None
        loaded = load_model(model, quant=quant, lora=lora, lora_scale=lora_scale)
        return loaded.model, loaded.tokenizer, str(loaded.source)
    raise KestrelError(f"cannot load a model from a {type(model).__name__}")


def _warn_kept_quant(model: Any, quant: str | None, source: str) -> None:
    """A warning where ``quant`` names another mode than a model in memory holds: it is used as it is (as an
    artifact is, kestrel_core.model.loader)."""
    if quant is not None and isinstance(model, Model) and not holds_quant(model, parse_quant(quant)):
        log.warning("%s holds %s weights; using them (a model in memory is not re-quantized, quant %s ignored)",
                    source, model_quant(model), quant)


def with_context(model: Model, max_model_len: int | None = None,
                 rope_scaling: dict[str, Any] | None = None) -> Model:
    """``model`` with its context (``config.max_position``) set to ``max_model_len`` positions and, given
    ``rope_scaling`` (transformers' form; ``{"rope_type": "default"}``: none), its RoPE scaling replaced; the
    weights are shared. The context cannot exceed what the RoPE is made for: the model's own, or with a
    scaling given, its original_max_position_embeddings times its factor (vLLM's rule), which is then also the
    context when ``max_model_len`` is None."""
    c = model.config
    limit = c.max_position
    if rope_scaling is not None:
        if not isinstance(rope_scaling, dict):
            raise KestrelError(f"rope_scaling must be an object, got {rope_scaling!r}")
        scaling = normalize_rope_scaling(rope_scaling, "rope_scaling", max_position=c.max_position)
        if scaling is not None and scaling["rope_type"] in ("linear", "llama3", "yarn"):
            original = scaling.get("original_max_position_embeddings", c.max_position)
            limit = max(limit, int(original * scaling["factor"]))
        try:
            c = replace(c, rope_scaling=scaling, max_position=limit)
        except ValidationError as exc:
            raise KestrelError(f"rope_scaling: {exc}") from None
    if max_model_len is not None:
        if not is_int(max_model_len) or not 1 <= max_model_len <= limit:
            raise KestrelError(f"max_model_len must be an integer in [1, {limit}] (the model's context), got "
                               f"{max_model_len!r}")
        c = replace(c, max_position=max_model_len)
    return model if c == model.config else replace(model, config=c)


def _open(resolve: Callable[[], tuple[Model, Any, str]], backend: str, kv_cache_mb: float | None = None,
          activations: str = "auto", backend_options: dict[str, str] | None = None,
          max_model_len: int | None = None, rope_scaling: dict[str, Any] | None = None,
          kv_cache_type: str = "f16", rerank: bool = False) -> Engine:
    """Bind first (a backend that cannot bind fails fast, before any model is read), then load, preload."""
    if backend_options is not None and not (isinstance(backend_options, Mapping) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in backend_options.items())):
        raise KestrelError(f"backend_options must map option names to strings, got {backend_options!r}")
    registry = Registry(backend_options)
    try:
        chosen = registry.select(backend)  # an explicit backend that did not bind raises with its reason
        cpu = registry.cpu()
        t0 = time.perf_counter()
        model, tokenizer, source = resolve()
        if rerank:
            model = as_reranker(model, tokenizer)
        model = with_context(model, max_model_len, rope_scaling)
        load_s = time.perf_counter() - t0
        engine = Engine(model, tokenizer, chosen, cpu, registry=registry, source=source, kv_cache_mb=kv_cache_mb,
                        activations=activations, kv_cache_type=kv_cache_type)
        engine.load_s = load_s
        return engine
    except BaseException:
        registry.close()
        raise


def load(model: str | Model | None = None, backend: str = "auto", quant: str | None = None,
         kv_cache_mb: float | None = None, activations: str = "auto",
         backend_options: dict[str, str] | None = None, max_model_len: int | None = None,
         rope_scaling: dict[str, Any] | None = None, lora: LoraPaths | None = None,
         lora_scale: float | Sequence[float] = 1.0,
         kv_cache_type: str = "f16", rerank: bool = False) -> Engine:
    """An engine for ``model`` (a path, None for the default model, or a Model) on ``backend`` (``auto``:
    the best bound gpu/npu accelerator, else cpu); the model is preloaded onto the backend. ``quant``:
    q8 (None: the default; an artifact or a Model keeps its own, with a warning where ``quant`` names another), q4,
    q8-g256 or q4-g256. ``kv_cache_mb``: the host KV
    cache's budget (default: 2 GiB, at least one sequence at the full context); ``kv_cache_type``: what it holds,
    f16 (float16 keys and values) or q8 (int8, a scale every 32 dims: about half the bytes). ``activations``: what the
    projections' inputs are, q8, f32, mixed (the prompt at f32, generated tokens at q8) or auto (see
    ``resolve_activations``). ``backend_options``: string KEY: VALUE pairs every backend's ``kestrel_open``
    receives. ``max_model_len``: the context (None: the model's); ``rope_scaling``: a RoPE scaling in place of
    the model's, e.g. YaRN for a longer context (``with_context``); ``lora``: a LoRA adapter (a PEFT directory or
    llama.cpp's GGUF adapter), or a list of them stacked in order, merged into the weights as they load, each
    one's scale times ``lora_scale`` (one for all, or a list of one each; kestrel_core.model.lora); ``rerank``: a
    Qwen3-Reranker checkpoint made the reranker it is (kestrel_core.model.rerank; a GGUF converted from one is one
    without it)."""
    if quant is not None:  # for every kind of model, a Model's too, which keeps its own
        parse_quant(quant)
    check_bool("rerank", rerank)  # "no" would be taken for True
    if lora is not None:
        from kestrel_core.model.lora import lora_paths

        lora_paths(lora)  # a wrong type fails before the backend is bound
    return _open(lambda: _resolve_model(model, quant, lora, lora_scale), backend, kv_cache_mb, activations,
                 backend_options, max_model_len, rope_scaling, kv_cache_type, rerank)


def load_preset(name: str, backend: str = "auto", quant: str | None = None, seed: int = 0,
                kv_cache_mb: float | None = None, activations: str = "auto", max_model_len: int | None = None,
                rope_scaling: dict[str, Any] | None = None, kv_cache_type: str = "f16", **overrides: Any) -> Engine:
    """An engine for a synthetic preset model (random weights of real shapes, byte tokenizer)."""
    quant = "q8" if quant is None else quant
    from kestrel_core.model.presets import ByteTokenizer, preset_model

    def resolve() -> tuple[Model, Any, str]:
        model = preset_model(name, quant, seed, **overrides)
        return model, ByteTokenizer(model.config.vocab_size), f"preset {name} ({quant}, seed {seed})"

    return _open(resolve, backend, kv_cache_mb, activations, max_model_len=max_model_len, rope_scaling=rope_scaling,
                 kv_cache_type=kv_cache_type)
