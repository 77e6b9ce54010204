"""A GGUF file's metadata as llama.cpp reads it: typed values (a bool, float or string where an integer is meant
is refused, not coerced), the recommended sampling, the pooling, the RoPE scaling, and each architecture's own
ModelConfig fields, with llama.cpp's rules for what the file does not say. model/gguf_reader.py reads the tensors
(GGUFCheckpoint is a GGUFMetadata).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from kestrel_core.errors import KestrelError
from kestrel_core.model.config import recommended_sampling, yarn_mscale
from kestrel_core.model.quantize import layer_name
from kestrel_core.model.rerank import gguf_rank_fields
from kestrel_core.model.validate import (
    MAX_EXPERTS,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_POSITION,
    ValidationError,
    check_float,
    check_int,
    is_int,
)

MOE_ARCHITECTURES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "qwen3vlmoe": "qwen3_moe",  # with experts
                     "llama": "mixtral"}
EXPERT_WEIGHTS_NORM = {"qwen2moe": False}  # llama.cpp's default where expert_weights_norm is absent: true
EXAONE4_SWA_PATTERN = 4  # llama.cpp's: every 4th EXAONE 4 layer is global (the file does not say)
COHERE2_SWA_PATTERN = 4  # llama.cpp's: every 4th cohere2 layer is global, without RoPE (the file does not say)
COHERE_ARCHITECTURES = {"command-r": "cohere", "cohere2": "cohere2"}  # llama.cpp's names -> kestrel's
SMOLLM3_NOPE_STEP = 4  # llama.cpp's: every 4th layer of SmolLM3 has no RoPE (the file does not say)
GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp's: every 2nd (Gemma 2), 6th (Gemma 3) layer is global
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales their queries by 1/sqrt(hidden / heads)
GEMMA3_SWA_THETA = 10000.0  # llama.cpp's RoPE base of Gemma 3's sliding layers (not in the file)
GGUF_POOLING = {0: None, 1: "mean", 2: "cls", 3: "last"}  # llama.cpp's pooling_type: none, mean, cls, last
RANK_POOLING = 4  # llama.cpp's pooling_type of a reranker (model/rerank.py)
# general.sampling.<key> -> SamplingParams' name: the sampling a file recommends (llama.cpp's keys)
GGUF_SAMPLING = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "penalty_repeat": "repetition_penalty"}
GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # llama.cpp's expert_gating_func
PER_LAYER_KV = ("lfm2", "lfm2moe", "granitehybrid")  # head_count_kv per layer: 0 where a layer has no attention
# linear attention beside gated attention
HYBRID_ARCHITECTURES = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe", "qwen3next": "qwen3_next"}

# -- metadata values ---------------------------------------------------------------------------------------

_INT_TYPES = {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
              GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64}
_FLOAT_TYPES = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}

# the largest value of an "<arch>." field that sizes per-layer, per-head or per-expert lists; any other integer field
# at most MAX_POSITION (a config cannot ask for absurd allocations before its tensors are checked)
_INT_MAX = {"block_count": MAX_LAYERS, "leading_dense_block_count": MAX_LAYERS, "nextn_predict_layers": MAX_LAYERS,
            "interleave_moe_layer_step": MAX_LAYERS, "full_attention_interval": MAX_LAYERS,
            "attention.head_count": MAX_HEADS, "attention.head_count_kv": MAX_HEADS, "ssm.group_count": MAX_HEADS,
            "expert_count": MAX_EXPERTS, "expert_used_count": MAX_EXPERTS, "expert_shared_count": MAX_EXPERTS,
            "expert_group_count": MAX_EXPERTS, "expert_group_used_count": MAX_EXPERTS}


def _decimal(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def dequantize_tensor(t: Any, where: str, data: np.ndarray | None = None) -> np.ndarray:
    """GGUF tensor ``t`` (a gguf-py ReaderTensor; or ``data``, a slice of it) as float32; a type gguf-py cannot
    dequantize (Q8_1, I32...) or bytes it cannot decode is one KestrelError naming the tensor (``where``: the file,
    as the message names it)."""
    try:
        w = dequantize(t.data if data is None else data, t.tensor_type)
    except NotImplementedError:
        raise KestrelError(f"{where}: tensor {t.name} uses {t.tensor_type.name}, which gguf-py cannot "
                           "dequantize") from None
    except (ValueError, IndexError) as exc:
        raise KestrelError(f"{where}: tensor {t.name} is corrupt ({exc})") from None
    return np.asarray(w, dtype=np.float32)


class GGUFMetadata:
    """The metadata of a GGUF file ``reader`` (``path`` names it in errors); ``_tensors`` (kestrel name -> tensor),
    ``_rope_factors`` and ``file_tensors`` (every tensor) say which optional tensors the file holds."""

    path: Path
    reader: GGUFReader
    _tensors: dict[str, Any]
    _rope_factors: dict[str, Any]
    file_tensors: list[Any]

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except Exception as exc:
            raise KestrelError(f"{self.path}: metadata {key} is unreadable ({exc})") from None

    def _need(self, key: str) -> Any:
        v = self.field(key)
        if v is None:
            raise KestrelError(f"{self.path}: GGUF metadata lacks {key}")
        return v

    def _typed(self, key: str, kinds: set[GGUFValueType], what: str) -> Any:
        """The scalar value of ``key`` (None when absent) if its GGUF type is one of ``kinds``."""
        f = self.reader.fields.get(key)
        if f is None:
            return None
        if len(f.types) != 1 or f.types[0] not in kinds:
            got = "/".join(t.name for t in f.types) or "?"
            raise KestrelError(f"{self.path}: metadata {key} must be {what}, got a {got} value")
        return self.field(key)

    def int_field(self, key: str, default: int | None = None, lo: int = 1, required: bool = False) -> int | None:
        """An integer-typed metadata value >= ``lo`` (a bool, float or string is refused, not coerced)."""
        v = self._typed(key, _INT_TYPES, "an integer")
        if v is None:
            if required:
                raise KestrelError(f"{self.path}: GGUF metadata lacks {key}")
            return default
        try:
            return check_int(key, v, lo, _INT_MAX.get(key.split(".", 1)[-1], MAX_POSITION))
        except ValidationError as exc:
            raise KestrelError(f"{self.path}: metadata {exc}") from None

    def bool_field(self, key: str, default: bool) -> bool:
        """A bool metadata value (an integer or string is refused, not coerced)."""
        v = self._typed(key, {GGUFValueType.BOOL}, "a bool")
        return default if v is None else bool(v)

    def float_field(self, key: str, default: float) -> float:
        """A float (or integer) metadata value, finite and > 0; float32 read back as its decimal."""
        v = self._typed(key, _FLOAT_TYPES | _INT_TYPES, "a number")
        if v is None:
            return default
        try:
            return check_float(key, _decimal(v), 0.0, lo_open=True)
        except ValidationError as exc:
            raise KestrelError(f"{self.path}: metadata {exc}") from None

    def _pooling(self, arch: str, hidden: int) -> dict[str, Any]:
        """An embedding model's pooling (llama.cpp's pooling_type; None for a model that generates), or a reranker's
        fields (rank pooling: model/rerank.py)."""
        if self.field(f"{arch}.attention.causal") is False:
            raise KestrelError(f"{self.path}: bidirectional attention ({arch}.attention.causal false) is not "
                               "supported")
        kind = self.int_field(f"{arch}.pooling_type", 0, lo=0)
        if kind == RANK_POOLING:
            return gguf_rank_fields(str(self.path), arch, self.field("tokenizer.chat_template.rerank"),
                                    self._tensors.get("classifier"), hidden, {t.name for t in self.file_tensors})
        if kind not in GGUF_POOLING:
            raise KestrelError(f"{self.path}: {arch}.pooling_type {kind} is not supported (kestrel pools by mean, cls "
                               "or last token, or ranks)")
        return {"pooling": GGUF_POOLING[kind]}

    def _sampling(self) -> dict[str, Any] | None:
        """The file's recommended sampling (general.sampling.*; None: none)."""
        values: dict[str, Any] = {}
        for key, name in GGUF_SAMPLING.items():
            integral = name == "top_k"
            v = self._typed(f"general.sampling.{key}", _INT_TYPES if integral else _FLOAT_TYPES | _INT_TYPES,
                            "an integer" if integral else "a number")
            if v is not None:
                values[name] = int(v) if integral else _decimal(v)
        try:
            return recommended_sampling(values)
        except ValidationError as exc:
            raise KestrelError(f"{self.path}: metadata general.sampling: {exc}") from None

    def _rope_scaling(self, arch: str, rotary_dim: int | None) -> dict[str, Any] | None:
        """linear or yarn scaling from the metadata, or longrope from phi3's rope_factors_long / _short tensors
        (llama3's rope_freqs tensor is read by the caller), as llama.cpp applies them."""
        key = f"{arch}.rope.scaling."
        kind = self.field(key + "type")
        if kind not in (None, "none", "linear", "yarn"):
            raise KestrelError(f"{self.path}: rope scaling type {kind!r} is not supported")
        context = self.int_field(f"{arch}.context_length", 4096)
        original = self.int_field(key + "original_context_length")
        if self._rope_factors:
            factors = {}
            for name in ("long", "short"):
                t = self._rope_factors.get(f"rope_factors_{name}.weight")
                if t is None:
                    raise KestrelError(f"{self.path}: rope_factors_{name}.weight is missing beside its pair")
                factors[f"{name}_factor"] = [float(f) for f in dequantize_tensor(t, str(self.path)).reshape(-1)]
            if (rotary_dim or 0) // 2 != len(factors["long_factor"]):
                raise KestrelError(f"{self.path}: rope_factors_long.weight has {len(factors['long_factor'])} "
                                   f"entries; {arch}.rope.dimension_count {rotary_dim} turns {(rotary_dim or 0) // 2} "
                                   "pairs")
            # llama.cpp's converter writes the attention factor transformers would compute
            attention = self.float_field(key + "attn_factor", 1.0)
            return {"rope_type": "longrope", **factors, "original_max_position_embeddings": original or context,
                    "attention_factor": attention}
        if kind in (None, "linear"):  # llama.cpp's default type, its factor under the old key too
            factor = self.float_field(key + "factor", 0.0) or self.float_field(f"{arch}.rope.scale_linear", 0.0)
            return {"rope_type": "linear", "factor": factor} if factor not in (0.0, 1.0) else None
        if kind != "yarn":
            return None
        # mistral3's yarn_log_multiplier is Ministral 3's mscale_all_dim, deepseek2's 0.1 mscale_all_dim; their mscale,
        # which the file does not keep, is the same in Ministral 3's and DeepSeek's configs, so transformers'
        # attention factor mscale(f, mscale) / mscale(f, all_dim) is 1 (deepseek2's multiplier scales the softmax:
        # _deepseek2_fields)
        mscaled = arch in ("mistral3", "deepseek2")
        for unsupported in ("yarn_ext_factor",) if mscaled else ("yarn_log_multiplier", "yarn_ext_factor"):
            if self.field(key + unsupported) is not None:
                raise KestrelError(f"{self.path}: {key}{unsupported} (DeepSeek's YaRN variant) is not supported")
        factor = self.float_field(key + "factor", 1.0)
        # llama.cpp's YaRN: its attention factor times YaRN's own temperature 0.1 ln(factor) + 1
        attention = 1.0 if mscaled else (self.float_field(key + "yarn_attn_factor", 1.0)
                                         * (0.1 * math.log(factor) + 1 if factor > 1 else 1))
        # gpt-oss was trained with YaRN's correction range not rounded out (transformers' truncate false)
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original or context,
                "attention_factor": attention, "beta_fast": self.float_field(key + "yarn_beta_fast", 32.0),
                "beta_slow": self.float_field(key + "yarn_beta_slow", 1.0), "truncate": arch != "gpt-oss"}

    def _arch_fields(self, arch: str, hidden: int, heads: int, head_dim: int, layers: int) -> dict[str, Any]:
        """The ModelConfig fields of Gemma 3 and of the mixture-of-experts files, as llama.cpp reads them."""
        if arch in GEMMA_SWA_PATTERN:
            pattern = self.field(f"{arch}.attention.sliding_window_pattern")
            if isinstance(pattern, list) and len(pattern) == layers:  # per layer: True = sliding
                types = tuple("sliding" if p else "full" for p in pattern)
            else:
                types = tuple("sliding" if (i + 1) % GEMMA_SWA_PATTERN[arch] else "full" for i in range(layers))
            # llama.cpp: 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 27B (its query_pre_attn_scalar,
            # which the file does not carry)
            scale_dim = hidden / heads if layers == GEMMA_27B_LAYERS[arch] else head_dim
            out: dict[str, Any] = {"layer_types": types, "query_scale": scale_dim ** -0.5,
                                   "embed_scale": math.sqrt(hidden), "activation": "gelu_tanh", "post_norms": True}
            if arch == "gemma3":
                out["rope_local_theta"] = GEMMA3_SWA_THETA
            else:
                out["attn_softcap"] = self.float_field(f"{arch}.attn_logit_softcapping", 50.0)
                out["final_softcap"] = self.float_field(f"{arch}.final_logit_softcapping", 30.0)
            return out
        if arch == "qwen3vl":  # Qwen3-VL's language model, qwen3's: rope.dimension_sections turn text as plain RoPE
            return {"arch": "qwen3"}
        if arch == "mistral3":  # Ministral 3: llama's layers (Q/K permuted), YaRN, Llama 4's attention temperature
            original = self.int_field(f"{arch}.rope.scaling.original_context_length")  # its length unless the file
            return {"arch": "ministral3",                                                # says another
                    "attn_temperature_scale": self.float_field(f"{arch}.attention.temperature_scale", 0.0),
                    "attn_temperature_length": self.int_field(f"{arch}.attention.temperature_length", original) or 0}
        if arch == "smollm3":
            return {"nope_layers": tuple(i for i in range(layers) if (i + 1) % SMOLLM3_NOPE_STEP == 0)}
        if arch == "glm4":  # interleaved RoPE pairs (llama.cpp's NORM rope), Gemma's four norms, q/k/v biases
            return {"rope_interleaved": True, "post_norms": True, "qkv_bias": "layers.0.q_bias" in self._tensors}
        if arch == "ernie4_5":  # llama's tensors, unpermuted: llama.cpp turns its interleaved pairs as HF does
            return {"rope_interleaved": True}
        if arch == "seed_oss":  # q/k/v biases, an o bias where the file has one
            return {"qkv_bias": True, "o_bias": "layers.0.o_bias" in self._tensors}
        if arch == "olmo2":  # post_attention_norm and post_ffw_norm after each block, whole-projection q/k norms
            out = {"qk_norm": True, "qk_norm_full": True, "pre_norms": False, "post_norms": True}
            window = self.int_field(f"{arch}.attention.sliding_window", 0, lo=0)
            if not window:
                return out
            # OLMo 3 (llama.cpp writes it as olmo2): sliding layers as the pattern says (else every 4th full), turned
            # by plain RoPE at the file's base, the full ones by its scaling
            pattern = self.field(f"{arch}.attention.sliding_window_pattern")
            types = (tuple("sliding" if p else "full" for p in pattern) if isinstance(pattern, list)
                     and len(pattern) == layers else tuple("sliding" if (i + 1) % 4 else "full" for i in range(layers)))
            return {**out, "arch": "olmo3", "layer_types": types, "sliding_window": window,
                    "rope_local_theta": self.float_field(f"{arch}.rope.freq_base", 10000.0)}
        if arch == "exaone4":  # as olmo2 with per-head q/k norms; llama.cpp's 3 sliding layers to 1 global, no RoPE
            window = self.int_field(f"{arch}.attention.sliding_window", lo=0) or None
            types = tuple("sliding" if window and (i + 1) % EXAONE4_SWA_PATTERN else "full" for i in range(layers))
            return {"qk_norm": True, "pre_norms": False, "post_norms": True, "layer_types": types,
                    "sliding_window": window,
                    "nope_layers": tuple(i for i, t in enumerate(types) if window and t == "full")}
        if arch == "granite":
            return self._granite_multipliers(arch)
        if arch in COHERE_ARCHITECTURES:
            return self._cohere_fields(arch, layers)
        experts = self.int_field(f"{arch}.expert_count", 0, lo=0) or 0
        if arch in HYBRID_ARCHITECTURES:
            return self._hybrid_fields(arch, layers, experts)
        if arch == "granitehybrid":
            return self._granite_hybrid_fields(arch, experts)
        if arch in ("glm4moe", "dots1"):
            return self._glm4moe_fields(arch, layers, experts)
        if arch == "deepseek2":
            return self._deepseek2_fields(arch, layers, experts)
        if arch == "minimax-m2":  # qwen3moe's layers with q/k norms over the whole projection, a sigmoid router
            return {"arch": "minimax_m2", "qk_norm": True, "qk_norm_full": True,
                    **self._sigmoid_router_fields(arch, layers, experts, "MiniMax-M2")}
        if arch == "ernie4_5-moe":  # ernie4_5's layers, every interleave_moe_layer_step-th past the leading dense ones
            step = self.int_field(f"{arch}.interleave_moe_layer_step", 1) or 1  # with experts
            lead = self.int_field(f"{arch}.leading_dense_block_count", 0, lo=0) or 0
            width = self.int_field(f"{arch}.expert_feed_forward_length", required=True)
            assert width is not None
            return {"arch": "ernie4_5_moe", "rope_interleaved": True, "num_experts": experts,
                    "experts_per_token": self.int_field(f"{arch}.expert_used_count", required=True),
                    "expert_intermediate_size": width,
                    "shared_expert_intermediate_size": width * (self.int_field(f"{arch}.expert_shared_count", 0, lo=0)
                                                                or 0),
                    "shared_expert_gated": False, "norm_topk_prob": True,
                    "router_choice_bias": layer_name(lead, "router_choice_bias") in self._tensors,
                    "dense_layers": tuple(i for i in range(layers) if (i + 1) % step or i < lead)}
        if arch in ("lfm2", "lfm2moe"):  # short convolutions where a layer has no KV heads; per-head q/k norms
            out = {"layer_types": tuple("full" if h else "conv" for h in self._per_layer_kv(arch)), "qk_norm": True,
                   "short_conv_kernel": self.int_field(f"{arch}.shortconv.l_cache", required=True)}
            if arch == "lfm2moe":
                out.update(arch="lfm2_moe", **self._sigmoid_router_fields(arch, layers, experts, "LFM2-MoE"))
            return out
        if arch == "gpt-oss":  # biases everywhere, sinks, the clamped SwiGLU (llama.cpp's fixed limit and slope)
            return {"arch": "gpt_oss", "num_experts": experts,
                    "experts_per_token": self.int_field(f"{arch}.expert_used_count", required=True),
                    "expert_intermediate_size": self.int_field(f"{arch}.expert_feed_forward_length", required=True),
                    "norm_topk_prob": True, "moe_bias": True, "qkv_bias": True, "o_bias": True, "attn_sinks": True,
                    "activation": "swiglu_oai", "layer_types": tuple("sliding" if i % 2 == 0 else "full"
                                                                     for i in range(layers))}
        if not experts:
            if arch in ("qwen2moe", "qwen3moe", "qwen3vlmoe"):
                raise KestrelError(f"{self.path}: {arch}.expert_count is missing")
            return {}
        if arch not in MOE_ARCHITECTURES:
            raise KestrelError(f"{self.path}: experts in a {arch} file are not supported")
        norm = self.bool_field(f"{arch}.expert_weights_norm", EXPERT_WEIGHTS_NORM.get(arch, True))
        ff = self.int_field(f"{arch}.expert_feed_forward_length") or self.int_field(f"{arch}.feed_forward_length")
        shared = self.int_field(f"{arch}.expert_shared_feed_forward_length", 0, lo=0) or 0
        return {"arch": MOE_ARCHITECTURES[arch], "num_experts": experts,
                "experts_per_token": self.int_field(f"{arch}.expert_used_count", required=True),
                "expert_intermediate_size": ff, "norm_topk_prob": norm, "shared_expert_intermediate_size": shared}

    def _cohere_fields(self, arch: str, layers: int) -> dict[str, Any]:
        """Cohere's, as llama.cpp runs command-r and cohere2: LayerNorms (``attention.layer_norm_epsilon``), the
        attention and the MLP in parallel from one norm, RoPE in interleaved pairs on unpermuted rows (llama.cpp's
        NORM rope), the logits times ``logit_scale``; command-r's per-head q/k norms where the file has them; cohere2's
        ``attention.sliding_window`` on three layers of four, the fourth full and without RoPE (without a window no
        layer slides or turns)."""
        out: dict[str, Any] = {
            "arch": COHERE_ARCHITECTURES[arch], "norm_type": "layer", "parallel_block": True, "rope_interleaved": True,
            "rms_norm_eps": self.float_field(f"{arch}.attention.layer_norm_epsilon", 1e-5),
            "logits_scaling": 1 / self.float_field(f"{arch}.logit_scale", 1.0)}
        if arch == "command-r":
            qk = "layers.0.q_norm" in self._tensors
            return {**out, "qk_norm": qk, "qk_norm_heads": qk}
        window = self.int_field(f"{arch}.attention.sliding_window", 0, lo=0)
        if not window:
            return {**out, "nope_layers": tuple(range(layers))}
        types = tuple("sliding" if (i + 1) % COHERE2_SWA_PATTERN else "full" for i in range(layers))
        return {**out, "layer_types": types, "sliding_window": window,
                "nope_layers": tuple(i for i, t in enumerate(types) if t == "full")}

    def _sigmoid_router_fields(self, arch: str, layers: int, experts: int, model: str) -> dict[str, Any]:
        """The experts of llama.cpp's sigmoid-routed files (LFM2-MoE, GLM-4.5, MiniMax-M2):
        ``leading_dense_block_count`` dense layers, then a sigmoid router (another ``expert_gating_func`` refused)
        with its choice bias ``exp_probs_b`` where the file has one, renormalised and scaled as
        ``expert_weights_norm`` and ``expert_weights_scale`` say (default: yes, 1)."""
        gating = self.int_field(f"{arch}.expert_gating_func", GATING_SIGMOID)
        if gating != GATING_SIGMOID:
            raise KestrelError(f"{self.path}: {arch}.expert_gating_func {gating} is not supported ({model}'s "
                               f"router is a sigmoid, {GATING_SIGMOID})")
        dense = self.int_field(f"{arch}.leading_dense_block_count", 0, lo=0) or 0
        first = min(dense, layers - 1)  # the first layer with experts names its optional tensors
        return {"num_experts": experts,
                "experts_per_token": self.int_field(f"{arch}.expert_used_count", required=True),
                "expert_intermediate_size": self.int_field(f"{arch}.expert_feed_forward_length", required=True),
                "dense_layers": tuple(range(min(dense, layers))), "router_scoring": "sigmoid",
                "router_choice_bias": layer_name(first, "router_choice_bias") in self._tensors,
                "norm_topk_prob": self.bool_field(f"{arch}.expert_weights_norm", True),
                "routed_scaling": self.float_field(f"{arch}.expert_weights_scale", 1.0)}

    def _glm4moe_fields(self, arch: str, layers: int, experts: int) -> dict[str, Any]:
        """GLM-4.5's and dots.llm1's, as llama.cpp reads them: the sigmoid router's experts, maybe chosen in
        groups, beside ``expert_shared_count`` ungated shared experts; q/k/v biases and q/k norms where the file
        has them."""
        out = self._sigmoid_router_fields(arch, layers, experts, "GLM-4.5" if arch == "glm4moe" else "dots.llm1")
        return {**out, "arch": "glm4_moe" if arch == "glm4moe" else "dots1",
                "qkv_bias": "layers.0.q_bias" in self._tensors, "qk_norm": "layers.0.q_norm" in self._tensors,
                "shared_expert_intermediate_size": out["expert_intermediate_size"]
                * (self.int_field(f"{arch}.expert_shared_count", 0, lo=0) or 0),
                "shared_expert_gated": False,
                "router_groups": self.int_field(f"{arch}.expert_group_count", 1),
                "router_topk_groups": self.int_field(f"{arch}.expert_group_used_count", 1)}

    def _deepseek2_fields(self, arch: str, layers: int, experts: int) -> dict[str, Any]:
        """Multi-head latent attention as llama.cpp writes it (DeepSeek-V2/V3, GLM-4.7-Flash): a head's key and value
        dims in ``key_length_mla`` and ``value_length_mla`` (the file's key_length and value_length then the latent's
        MQA view; files from before have none, and their own), RoPE in interleaved pairs (llama.cpp's NORM) on
        ``rope.dimension_count`` dims, the softmax scaled by YaRN's mscale(``yarn_log_multiplier`` / 0.1) squared.
        Experts: a sigmoid router (DeepSeek-V3's, GLM-4.5's) or a softmax one (DeepSeek-V2's), their weights
        renormalised only where ``expert_weights_norm`` says (llama.cpp's default for deepseek2: no), ungated shared
        experts."""
        heads = self.int_field(f"{arch}.attention.head_count", required=True)
        key = self.int_field(f"{arch}.attention.key_length_mla") or self.int_field(f"{arch}.attention.key_length",
                                                                                   required=True)
        value = (self.int_field(f"{arch}.attention.value_length_mla")
                 or self.int_field(f"{arch}.attention.value_length", required=True))
        rope = self.int_field(f"{arch}.rope.dimension_count", required=True)
        assert heads is not None and key is not None and rope is not None
        scale = key ** -0.5
        log_mul = self.float_field(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0) if self.field(
            f"{arch}.rope.scaling.type") == "yarn" else 0.0
        factor = self.float_field(f"{arch}.rope.scaling.factor", 1.0)
        if log_mul:
            scale *= yarn_mscale(factor, log_mul / 0.1) ** 2
        out: dict[str, Any] = {
            "arch": "deepseek_v2", "head_dim": key, "num_kv_heads": heads, "rotary_dim": rope, "v_head_dim": value,
            "rope_interleaved": True, "query_scale": scale,
            "kv_lora_rank": self.int_field(f"{arch}.attention.kv_lora_rank", required=True),
            "q_lora_rank": self.int_field(f"{arch}.attention.q_lora_rank", 0, lo=0)}
        if not experts:
            return out
        gating = self.int_field(f"{arch}.expert_gating_func", GATING_SOFTMAX)
        width = self.int_field(f"{arch}.expert_feed_forward_length", required=True)
        assert width is not None
        shared = width * (self.int_field(f"{arch}.expert_shared_count", 0, lo=0) or 0)
        norm = self.bool_field(f"{arch}.expert_weights_norm", False)  # llama.cpp's default for deepseek2
        if gating == GATING_SIGMOID:
            return {**out, **self._sigmoid_router_fields(arch, layers, experts, "DeepSeek-V3"), "arch": "deepseek_v3",
                    "norm_topk_prob": norm, "shared_expert_intermediate_size": shared, "shared_expert_gated": False,
                    "router_groups": self.int_field(f"{arch}.expert_group_count", 1),
                    "router_topk_groups": self.int_field(f"{arch}.expert_group_used_count", 1)}
        if gating != GATING_SOFTMAX:
            raise KestrelError(f"{self.path}: {arch}.expert_gating_func {gating} is not supported (softmax "
                               f"{GATING_SOFTMAX} or sigmoid {GATING_SIGMOID})")
        dense = self.int_field(f"{arch}.leading_dense_block_count", 0, lo=0) or 0
        return {**out, "num_experts": experts, "expert_intermediate_size": width,
                "experts_per_token": self.int_field(f"{arch}.expert_used_count", required=True),
                "dense_layers": tuple(range(min(dense, layers))), "shared_expert_intermediate_size": shared,
                "shared_expert_gated": False, "norm_topk_prob": norm,
                "routed_scaling": self.float_field(f"{arch}.expert_weights_scale", 1.0)}

    def _ssm_heads(self, arch: str) -> tuple[int, int]:
        """(heads, each one's dims) of llama.cpp's ssm metadata: ``ssm.time_step_rank`` heads sharing
        ``ssm.inner_size`` (Gated DeltaNet's value heads, Mamba-2's heads)."""
        heads = self.int_field(f"{arch}.ssm.time_step_rank", required=True)
        inner = self.int_field(f"{arch}.ssm.inner_size", required=True)
        assert heads is not None and inner is not None
        if inner % heads:
            raise KestrelError(f"{self.path}: {arch}.ssm.inner_size {inner} is not a multiple of "
                               f"{arch}.ssm.time_step_rank {heads}")
        return heads, inner // heads

    def _granite_hybrid_fields(self, arch: str, experts: int) -> dict[str, Any]:
        """Granite 4.0-H's, as llama.cpp reads them: Mamba-2 where a layer has no KV heads (``ssm.time_step_rank``
        heads sharing ``ssm.inner_size``, ``ssm.group_count`` groups, ``ssm.state_size``, ``ssm.conv_kernel``),
        attention without RoPE unless ``rope.scaling.finetuned``, Granite's multipliers; its shared MLP
        ``expert_shared_feed_forward_length`` wide, the layer's MLP or beside experts an ungated shared expert."""
        types = tuple("full" if h else "mamba" for h in self._per_layer_kv(arch))
        heads, head_dim = self._ssm_heads(arch)
        shared = self.int_field(f"{arch}.expert_shared_feed_forward_length", required=True)
        rope = self.field(f"{arch}.rope.scaling.finetuned") is True
        first = next((i for i, t in enumerate(types) if t == "mamba"), None)
        out: dict[str, Any] = {
            "arch": "granitemoehybrid",
            "layer_types": types, "nope_layers": () if rope else tuple(i for i, t in enumerate(types) if t == "full"),
            "mamba_heads": heads, "mamba_head_dim": head_dim,
            "mamba_groups": self.int_field(f"{arch}.ssm.group_count", required=True),
            "mamba_state": self.int_field(f"{arch}.ssm.state_size", required=True),
            "mamba_conv_kernel": self.int_field(f"{arch}.ssm.conv_kernel", required=True),
            "mamba_conv_bias": first is not None and layer_name(first, "conv_bias") in self._tensors,
            **self._granite_multipliers(arch)}
        if not experts:
            return {**out, "intermediate_size": shared}
        return {**out, "num_experts": experts, "norm_topk_prob": True, "shared_expert_gated": False,
                "experts_per_token": self.int_field(f"{arch}.expert_used_count", required=True),
                "expert_intermediate_size": self.int_field(f"{arch}.feed_forward_length", required=True),
                "shared_expert_intermediate_size": shared}

    def _granite_multipliers(self, arch: str) -> dict[str, Any]:
        """Granite's multipliers, as llama.cpp names them (absent: 1, and the usual query scale)."""
        scale = self.float_field(f"{arch}.attention.scale", 0.0)
        return {"embed_scale": self.float_field(f"{arch}.embedding_scale", 1.0),
                "residual_scale": self.float_field(f"{arch}.residual_scale", 1.0),
                "logits_scaling": self.float_field(f"{arch}.logit_scale", 1.0), "query_scale": scale or None}

    def _kv_heads(self, arch: str) -> int | None:
        """``attention.head_count_kv``: one number, or (LFM2, Granite 4.0-H) one per layer, 0 for a layer without
        attention."""
        if arch not in PER_LAYER_KV:
            return self.int_field(f"{arch}.attention.head_count_kv")
        per_layer = self._per_layer_kv(arch)
        heads = {h for h in per_layer if h}
        if len(heads) != 1:
            raise KestrelError(f"{self.path}: {arch}.attention.head_count_kv must give its attention layers one "
                               f"count of KV heads, got {per_layer}")
        return heads.pop()

    def _per_layer_kv(self, arch: str) -> list[int]:
        value = self.field(f"{arch}.attention.head_count_kv")
        layers = self.int_field(f"{arch}.block_count", required=True)
        if not isinstance(value, list) or len(value) != layers or not all(is_int(v) and v >= 0 for v in value):
            raise KestrelError(f"{self.path}: {arch}.attention.head_count_kv must be a count for each of the "
                               f"{layers} layers (0: a layer without attention)")
        return [int(v) for v in value]

    def _hybrid_fields(self, arch: str, layers: int, experts: int) -> dict[str, Any]:
        """Qwen3.5's, as llama.cpp reads them: every full_attention_interval-th layer full (gated attention, q/k
        norms), the others Gated DeltaNet with ssm.group_count key heads of ssm.state_size dims and
        ssm.time_step_rank value heads sharing ssm.inner_size; the experts and the shared expert of qwen35moe and
        qwen3next."""
        interval = self.int_field(f"{arch}.full_attention_interval", 4)
        assert interval is not None
        value_heads, value_dim = self._ssm_heads(arch)
        out: dict[str, Any] = {
            "arch": HYBRID_ARCHITECTURES[arch], "qk_norm": True, "attn_output_gate": True,
            "layer_types": tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(layers)),
            "linear_key_heads": self.int_field(f"{arch}.ssm.group_count", required=True),
            "linear_key_dim": self.int_field(f"{arch}.ssm.state_size", required=True),
            "linear_value_heads": value_heads, "linear_value_dim": value_dim,
            "linear_conv_kernel": self.int_field(f"{arch}.ssm.conv_kernel", required=True)}
        if arch in ("qwen35moe", "qwen3next"):
            shared = self.int_field(f"{arch}.expert_shared_feed_forward_length", 0, lo=0) or 0
            norm = self.bool_field(f"{arch}.expert_weights_norm", True)
            out.update(num_experts=experts, norm_topk_prob=norm, shared_expert_intermediate_size=shared,
                       experts_per_token=self.int_field(f"{arch}.expert_used_count", required=True),
                       expert_intermediate_size=self.int_field(f"{arch}.expert_feed_forward_length", required=True))
        return out
