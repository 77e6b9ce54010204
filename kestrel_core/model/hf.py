"""Read a Hugging Face model directory's *.safetensors shards (its config: model/hf_config.py).

Tensors are read lazily, one at a time, and handed out under kestrel names (see quantize.TensorSource).
numpy has no bfloat16, and safetensors' numpy framework refuses BF16 tensors, so those are read as raw
uint16 at the offsets of the safetensors header: the quantizer takes those bits (contract.BFloat16Bits) and
widens them a row at a time; ``get`` widens them to float32 (bf16 is the top half of an f32). FP8 weights
(model/fp8.py) are read as raw uint8 the same way and decoded with their scales to float32; integer ones (GPTQ,
AWQ, compressed-tensors: model/int_quant.py) and bitsandbytes ones (model/bnb.py) are read by those modules from
the tensors beside them (``tensor``, ``float_tensor``).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from kestrel_core.contract import BFloat16Bits
from kestrel_core.errors import KestrelError, os_error
from kestrel_core.model.bnb import bnb_scheme
from kestrel_core.model.bnb import read_weight as read_bnb_weight
from kestrel_core.model.config import ModelConfig
from kestrel_core.model.fp8 import SCALE_SUFFIXES, dequantize_fp8, fp8_scheme
from kestrel_core.model.hf_config import (
    GEMMA_ARCHITECTURES,
    HYBRID_ARCHITECTURES,
    POST_NORMED,
    read_hf_config,
    read_json,
)
from kestrel_core.model.int_quant import PACKED_SUFFIXES, IntWeight, int_scheme
from kestrel_core.model.int_quant import read_weight as read_int_weight
from kestrel_core.model.quantize import fused_parts, fused_rows, hybrid_splits, layer_name, map_tensor_name
from kestrel_core.model.validate import (
    check_regular_file,
    open_regular,
)
from kestrel_core.model.weights import expert_field

GEMMA_NORMS = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm", "final_norm")
# the architectures whose RMSNorms multiply by 1 + weight (GEMMA_NORMS; Qwen3.5's gated lin_norm is a plain factor)
ONE_PLUS_NORMS = (*GEMMA_ARCHITECTURES, *HYBRID_ARCHITECTURES)

_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
    # multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash)
    "self_attn.q_a_proj.weight": "q_a",
    "self_attn.q_a_layernorm.weight": "q_a_norm",
    "self_attn.q_b_proj.weight": "q_b",
    "self_attn.kv_a_proj_with_mqa.weight": "kv_a",
    "self_attn.kv_a_layernorm.weight": "kv_a_norm",
    "self_attn.kv_b_proj.weight": "kv_b",
}
# Qwen3.5's linear-attention layers (Gated DeltaNet); q_proj holds each head's query and gate rows in turn
_LINEAR_ATTN_MAP = {**_LAYER_MAP, "linear_attn.in_proj_qkv.weight": "lin_qkv", "linear_attn.in_proj_z.weight": "lin_z",
                    "linear_attn.in_proj_b.weight": "lin_beta", "linear_attn.in_proj_a.weight": "lin_alpha",
                    "linear_attn.out_proj.weight": "o", "linear_attn.conv1d.weight": "conv",
                    "linear_attn.A_log": "lin_decay", "linear_attn.dt_bias": "lin_dt_bias",
                    "linear_attn.norm.weight": "lin_norm"}
# the fused tensors of Qwen3.5 (q_proj: each head's query, then its gate) and Qwen3-Next (its linear attention's
# inputs, per key head), by their quantize.hybrid_splits role
_HYBRID_SPLITS = {"self_attn.q_proj.weight": "q_gate", "linear_attn.in_proj_qkvz.weight": "qkvz",
                  "linear_attn.in_proj_ba.weight": "ba"}
# LFM2's: its norms, attention output and MLP by their own names, and its short-convolution layers
_LFM2_LAYER_MAP = {**_LAYER_MAP, "operator_norm.weight": "attn_norm", "ffn_norm.weight": "mlp_norm",
                   "self_attn.out_proj.weight": "o", "self_attn.q_layernorm.weight": "q_norm",
                   "self_attn.k_layernorm.weight": "k_norm", "feed_forward.w1.weight": "gate",
                   "feed_forward.w3.weight": "up", "feed_forward.w2.weight": "down",
                   "conv.in_proj.weight": "conv_in", "conv.out_proj.weight": "o", "conv.conv.weight": "conv"}
# Granite 4.0-H's Mamba-2 layers and router (its shared MLP: tensor_parts; its experts: _granite_experts)
_GRANITE_HYBRID_MAP = {**_LAYER_MAP, "mamba.in_proj.weight": "mamba_in", "mamba.conv1d.weight": "conv",
                       "mamba.conv1d.bias": "conv_bias", "mamba.A_log": "ssm_a", "mamba.dt_bias": "ssm_dt_bias",
                       "mamba.D": "ssm_d", "mamba.norm.weight": "ssm_norm", "mamba.out_proj.weight": "o",
                       "block_sparse_moe.router.layer.weight": "router"}
_GRANITE_EXPERTS = ("block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight")
# Gemma 2 and 3 name their four norms by position around the attention and the MLP
_GEMMA_LAYER_MAP = {**_LAYER_MAP, "post_attention_layernorm.weight": "post_attn_norm",
                     "pre_feedforward_layernorm.weight": "mlp_norm",
                     "post_feedforward_layernorm.weight": "post_mlp_norm"}
# OLMo 2 and EXAONE 4 norm the attention's and the MLP's outputs, not their inputs
_OLMO2_LAYER_MAP = {**_LAYER_MAP, "post_attention_layernorm.weight": "post_attn_norm",
                    "post_feedforward_layernorm.weight": "post_mlp_norm"}
# GLM-4's four norms: before and after the attention, before (its post_attention_layernorm) and after the MLP
_GLM4_LAYER_MAP = {**_LAYER_MAP, "post_self_attn_layernorm.weight": "post_attn_norm",
                   "post_mlp_layernorm.weight": "post_mlp_norm"}
# the router and the experts of Qwen3-MoE (mlp.*) and Mixtral (block_sparse_moe.*, w1/w3/w2 = gate/up/down)
_EXPERT_RE = re.compile(r"^(?:mlp|block_sparse_moe|feed_forward)\.experts\.(\d+)\."
                        r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_FIELDS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight", "feed_forward.gate.weight")
# the bias on the scores a router chooses by (GLM-4.5's, DeepSeek-V3's; ERNIE 4.5's [1, E], read flat), and the
# shared experts as one
_CHOICE_ROUTER_MAP = {"mlp.gate.e_score_correction_bias": "router_choice_bias",
                      "mlp.moe_statics.e_score_correction_bias": "router_choice_bias",
                      "feed_forward.expert_bias": "router_choice_bias",  # LFM2-MoE's
                      "block_sparse_moe.e_score_correction_bias": "router_choice_bias",  # MiniMax-M2's
                      "mlp.e_score_correction_bias": "router_choice_bias",  # ... as transformers 5 names it
                      "mlp.shared_experts.gate_proj.weight": "shared_expert.gate",
                      "mlp.shared_experts.up_proj.weight": "shared_expert.up",
                      "mlp.shared_experts.down_proj.weight": "shared_expert.down"}
# gpt-oss: the attention's output bias and sinks, the router's bias; Seed-OSS: the output bias
# (attention_out_bias); by architecture
_GPT_OSS_MAP = {"self_attn.o_proj.bias": "o_bias", "self_attn.sinks": "sinks", "mlp.router.bias": "router_bias"}
_ARCH_LAYER_MAPS = {"gpt_oss": _GPT_OSS_MAP, "seed_oss": {"self_attn.o_proj.bias": "o_bias"}}
# experts stacked [E, ...] in one tensor each, as x @ W: gpt-oss's gate|up interleaved by column ([E, D, 2F], or MXFP4
# blocks [E, 2F, D/32, 16] and scales [E, 2F, D/32]), down ([E, F, D], or MXFP4 [E, D, F/32, 16]) and their biases;
# Qwen3-VL-MoE's gate|up as the two halves of [E, D, 2F]
_STACKED_EXPERTS = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
STACKED_ARCHITECTURES = ("gpt_oss", "qwen3_moe")
# Qwen2-MoE's shared expert and its gate
_SHARED_MAP = {"mlp.shared_expert.gate_proj.weight": "shared_expert.gate",
               "mlp.shared_expert.up_proj.weight": "shared_expert.up",
               "mlp.shared_expert.down_proj.weight": "shared_expert.down",
               "mlp.shared_expert_gate.weight": "shared_expert_gate"}
# the language model inside a multimodal checkpoint (Gemma3ForConditionalGeneration,
# Qwen3_5ForConditionalGeneration), as transformers 4 and 5 name it
_LM_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                ("language_model.lm_head.", "lm_head."),
                # a decoder saved without its head (embedding checkpoints): no ``model.`` prefix
                ("layers.", "model.layers."), ("embed_tokens.", "model.embed_tokens."), ("norm.", "model.norm."))
# Phi-3 checkpoints hold Q|K|V and gate|up as one tensor each: rows split into these kestrel tensors
_FUSED_MAP = {"self_attn.qkv_proj.weight": ("q", "k", "v"), "mlp.gate_up_proj.weight": ("gate", "up")}
_GLOBAL_MAP = {"model.embed_tokens.weight": "embedding", "model.norm.weight": "final_norm",
               "model.embedding_norm.weight": "final_norm",  # LFM2's name for the final norm
               "lm_head.weight": "lm_head"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)  # FP4 E2M1 by code, as the OCP MX format defines it
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
Rows = tuple[int, int] | np.ndarray  # a kestrel tensor's rows of a fused checkpoint tensor: a range, or their indices


def _plain_name(hf_name: str) -> str:
    """A tensor's name as a causal LM without a vision tower names it (``_LM_PREFIXES``)."""
    for prefix, plain in _LM_PREFIXES:
        if hf_name.startswith(prefix):
            return plain + hf_name[len(prefix):]
    return hf_name


def kestrel_name(hf_name: str, arch: str = "llama") -> str | None:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``layers.3.q`` (``...mlp.experts.5.up_proj.weight`` ->
    ``layers.3.experts.5.up``); None for tensors kestrel does not use."""
    hf_name = _plain_name(hf_name)
    m = _LAYER_RE.match(hf_name)
    if m is not None:
        e = _EXPERT_RE.match(m.group(2))
        if e is not None:
            return layer_name(int(m.group(1)), expert_field(int(e.group(1)), _EXPERT_FIELDS[e.group(2)]))
        if m.group(2) in _ROUTERS:
            return layer_name(int(m.group(1)), "router")
        if m.group(2) in _SHARED_MAP:
            return layer_name(int(m.group(1)), _SHARED_MAP[m.group(2)])
        if m.group(2) in _ARCH_LAYER_MAPS.get(arch, {}):
            return layer_name(int(m.group(1)), _ARCH_LAYER_MAPS[arch][m.group(2)])
        if m.group(2) in _CHOICE_ROUTER_MAP:
            return layer_name(int(m.group(1)), _CHOICE_ROUTER_MAP[m.group(2)])
    layer_map = (_GEMMA_LAYER_MAP if arch in GEMMA_ARCHITECTURES else _OLMO2_LAYER_MAP if arch in POST_NORMED
                 else _GLM4_LAYER_MAP if arch == "glm4" else _LINEAR_ATTN_MAP if arch in HYBRID_ARCHITECTURES
                 else _LFM2_LAYER_MAP if arch in ("lfm2", "lfm2_moe") else _GRANITE_HYBRID_MAP
                 if arch == "granitemoehybrid"
                 else _LAYER_MAP)
    return map_tensor_name(hf_name, _GLOBAL_MAP, _LAYER_RE, layer_map)


def tensor_parts(hf_name: str, c: ModelConfig) -> list[tuple[str, Rows | None]]:
    """The kestrel tensors a Hugging Face tensor holds where the config decides them, each with its rows of it
    (None: all of it): a hybrid's fused tensors (quantize.hybrid_splits), Phi-3's Q|K|V and gate|up, and Granite
    4.0-H's shared MLP (gate|up fused, then down: the layer's MLP, or beside experts its shared expert); empty for
    any other tensor (``kestrel_name`` names those)."""
    m = _LAYER_RE.match(_plain_name(hf_name))
    if m is None:
        return []
    layer, tensor = int(m.group(1)), m.group(2)
    if c.arch in HYBRID_ARCHITECTURES and tensor in _HYBRID_SPLITS:
        return [(layer_name(layer, name), rows) for name, rows in hybrid_splits(c)[_HYBRID_SPLITS[tensor]]]
    if c.arch == "granitemoehybrid" and tensor.startswith("shared_mlp."):
        prefix = "shared_expert." if c.is_moe else ""
        width = c.shared_expert_intermediate_size if c.is_moe else c.intermediate_size
        return {"shared_mlp.input_linear.weight": [(layer_name(layer, prefix + "gate"), (0, width)),
                                                   (layer_name(layer, prefix + "up"), (width, 2 * width))],
                "shared_mlp.output_linear.weight": [(layer_name(layer, prefix + "down"), None)]}.get(tensor, [])
    return list(fused_parts(layer, _FUSED_MAP.get(tensor, ()), c))


def kestrel_form(name: str, t: np.ndarray, c: ModelConfig, where: str) -> np.ndarray:
    """A Hugging Face tensor (float) as kestrel holds the tensor ``name``: Gemma's norms as the factor they multiply
    by, 1 + weight in float32 (its RMSNorm's ``1.0 + self.weight.float()``); a depthwise convolution [C, kernel]; a
    decay stored as A_log as the -exp(A_log) the model runs (GGUF's ssm_a); a router's choice bias, and q/k norms with
    a weight a head, flat."""
    field = name.rsplit(".", 1)[-1]
    if c.arch in ONE_PLUS_NORMS and field in GEMMA_NORMS:
        return np.float32(1) + t.astype(np.float32)
    if field == "conv":  # nn.Conv1d's depthwise weight [C, 1, kernel] (Qwen3.5's, LFM2's, Mamba-2's)
        if t.ndim == 0:
            raise KestrelError(f"{where}: tensor {name} is a scalar, not a convolution's weight")
        return t.reshape(t.shape[0], -1)
    if field in ("lin_decay", "ssm_a"):
        return -np.exp(t.astype(np.float32))
    if field == "router_choice_bias" or (c.qk_norm_heads and field in ("q_norm", "k_norm")):  # Cohere's [heads, hd]
        return t.reshape(-1)
    return t


_ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_OTHER_POOLING = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                     "pooling_mode_weightedmean_tokens")


def sentence_transformers_pooling(model_dir: Path) -> tuple[str, bool] | None:
    """(pooling, normalized) of a sentence-transformers directory (modules.json: the model, a Pooling module,
    maybe a Normalize), None for a directory without modules.json; other modules are refused by name."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return None
    try:
        modules = json.loads(check_regular_file(path, model_dir).read_text(encoding="utf-8"))
    except OSError as exc:
        raise os_error(exc, "cannot read", path) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KestrelError(f"{path}: cannot read it ({exc})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) and isinstance(m.get("type"), str)
                                                and isinstance(m.get("path", ""), str) for m in modules):
        raise KestrelError(f"{path}: expected a list of modules with a type and a path")
    pooling, normalized = None, False
    for module in modules:
        kind = module["type"].rsplit(".", 1)[-1]
        if kind == "Pooling":
            pooling = _st_pooling_mode(check_regular_file(model_dir / module["path"] / "config.json", model_dir))
        elif kind == "Normalize":
            normalized = True
        elif kind != "Transformer" or module.get("path", "") != "":
            raise KestrelError(f"{path}: module {module['type']} at {module.get('path')!r} is not supported "
                               "(kestrel reads the model itself, Pooling and Normalize)")
    if pooling is None:
        raise KestrelError(f"{path}: no Pooling module")
    return pooling, normalized


def _st_pooling_mode(path: Path) -> str:
    cfg = read_json(path)
    other = [k for k in _ST_OTHER_POOLING if cfg.get(k)]
    modes = [mode for key, mode in _ST_POOLING.items() if cfg.get(key)]
    if other or len(modes) != 1:
        named = ", ".join(other) if other else f"{len(modes)} modes"
        raise KestrelError(f"{path}: pooling by {named} is not supported (kestrel pools by one of "
                           f"{', '.join(_ST_POOLING)})")
    return modes[0]


def safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data section, the header dict) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def raw_elements(path: Path, name: str, dtype: str, header: tuple[int, dict[str, Any]] | None = None) -> np.ndarray:
    """A safetensors tensor's raw elements (bfloat16 bits as "<u2", FP8 codes as "u1") in its shape, mapped from the
    file at the offsets of its header (``safetensors_header``'s, read here where not given)."""
    base, entries = header if header is not None else safetensors_header(path)
    entry = entries[name]
    start, end = entry["data_offsets"]
    shape = tuple(entry["shape"])
    count = int(np.prod(shape, dtype=np.int64))
    if end - start != np.dtype(dtype).itemsize * count:
        raise KestrelError(f"{path}: tensor {name} has {end - start} bytes for shape {list(shape)}")
    if base + end > path.stat().st_size:
        raise KestrelError(f"{path}: truncated while reading {name}")
    # mapped, not read: the quantizer reads the page cache itself, and the mapping (its pages in this
    # process's RSS) goes with the array
    raw = np.memmap(path, dtype=dtype, mode="r", offset=base + start, shape=(count,))
    return raw.astype(np.dtype(dtype).newbyteorder("="), copy=False).reshape(shape)  # native order


def weight_files(model_dir: Path) -> list[str]:
    """The safetensors files of a checkpoint: the shards its index names, else every ``*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(check_regular_file(index, model_dir)).get("weight_map")
        if not isinstance(weight_map, dict):
            raise KestrelError(f"{index}: no weight_map")
        shards = sorted({str(v) for v in weight_map.values()})
        for shard in shards:
            if "/" in shard or "\\" in shard or shard.startswith("."):
                raise KestrelError(f"{index}: shard name {shard!r} points outside the model directory")
            if not (model_dir / shard).is_file():
                raise KestrelError(f"{model_dir}: shard {shard} named by the index is missing")
            check_regular_file(model_dir / shard, model_dir)  # a symlink out of the directory is refused
        return shards
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not shards:
        if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
            raise KestrelError(f"{model_dir}: only pickle checkpoints (.bin/.pt) found; kestrel reads "
                               "safetensors only (pickle files can run code)")
        raise KestrelError(f"{model_dir}: no *.safetensors weights found")
    for shard in shards:  # a FIFO would block safe_open; a symlink out of the directory is refused
        check_regular_file(model_dir / shard, model_dir)
    return shards


class HFCheckpoint:
    """A HF model directory as a TensorSource (float tensors by kestrel name, read on demand)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        self.description = str(self.dir)
        if not (self.dir / "config.json").is_file():
            raise KestrelError(f"{self.dir}: not a Hugging Face model directory (no config.json)")
        self.config = read_hf_config(self.dir)
        config_json = self.dir / "config.json"
        quantization = read_json(config_json).get("quantization_config")
        self.int_quant = int_scheme(quantization, str(config_json))
        self.bnb = bnb_scheme(quantization, str(config_json))
        self.fp8 = None if self.int_quant or self.bnb else fp8_scheme(quantization, str(config_json))
        self._files: dict[str, Path] = {}  # kestrel name -> shard
        self._hf_names: dict[str, str] = {}  # kestrel name -> HF name
        self._rows: dict[str, Rows] = {}  # kestrel name -> its rows of a fused HF tensor
        self._expert_part: dict[str, tuple[int, str]] = {}  # kestrel name -> (expert, part) of a stacked tensor
        self._paths: dict[str, Path] = {}  # HF name -> shard
        self._handles: dict[Path, Any] = {}
        self._headers: dict[Path, tuple[int, dict[str, Any]]] = {}
        self._index()
        self.fp4_experts = any(name.endswith("_blocks") for name in self._paths)  # gpt-oss as OpenAI ships it
        pooling = sentence_transformers_pooling(self.dir)
        if pooling is not None:  # an embedding model; its unused output head, often left out, is the embedding's
            tied = self.config.tie_word_embeddings or not self.has("lm_head")
            self.config = replace(self.config, pooling=pooling[0], normalize_embeddings=pooling[1],
                                  tie_word_embeddings=tied)

    def _index(self) -> None:
        for shard in weight_files(self.dir):
            path = self.dir / shard
            for hf_name in self._handle(path).keys():
                self._paths[hf_name] = path
                packed = next((s for s in PACKED_SUFFIXES if hf_name.endswith(s)), None)
                for name, rows in self._names(hf_name if packed is None else hf_name[:-len(packed)] + ".weight"):
                    self._files[name] = path
                    self._hf_names[name] = hf_name
                    if rows is not None:
                        self._rows[name] = rows

    def _names(self, hf_name: str) -> list[tuple[str, Rows | None]]:
        """The kestrel tensors ``hf_name`` holds: one, the rows of each part of a fused tensor (Q|K|V, gate|up,
        Qwen3.5's query|gate), or the experts of a stacked one."""
        c = self.config
        fused = tensor_parts(hf_name, c)
        if fused:
            return fused
        m = _LAYER_RE.match(_plain_name(hf_name))
        name = kestrel_name(hf_name, self.config.arch)
        if name is not None:
            return [(name, None)]
        if c.arch == "granitemoehybrid" and m is not None and m.group(2) in _GRANITE_EXPERTS:
            return self._granite_experts(int(m.group(1)), m.group(2))
        stacked = (_STACKED_EXPERTS.match(m.group(2)) if m is not None and c.arch in STACKED_ARCHITECTURES
                   else None)
        if stacked is not None:
            proj, suffix = stacked.groups()
            if suffix == "_scales":  # read beside its blocks
                return []
            parts = ("gate", "up") if proj == "gate_up_proj" else ("down",)
            if suffix == "_bias":
                parts = tuple(f"{p}_bias" for p in parts)
            out = []
            for e in range(self.config.num_experts):
                for part in parts:
                    name = layer_name(int(m.group(1)), expert_field(e, part))
                    self._expert_part[name] = (e, part)
                    out.append((name, None))
            return out
        return []

    def _granite_experts(self, layer: int, tensor: str) -> list[tuple[str, Rows | None]]:
        """Granite 4.0-H's experts, stacked: ``input_linear`` [E, 2F, D] (gate rows, then up) and ``output_linear``
        [E, D, F], read one expert's slice at a time."""
        parts = ("gate", "up") if tensor.endswith("input_linear.weight") else ("down",)
        out: list[tuple[str, Rows | None]] = []
        for e in range(self.config.num_experts):
            for part in parts:
                name = layer_name(layer, expert_field(e, part))
                self._expert_part[name] = (e, part)
                out.append((name, None))
        return out

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            # opened here first: safetensors says "No such file or directory" of any file it cannot open
            open_regular(path, self.dir).close()
            try:
                self._handles[path] = safe_open(str(path), framework="numpy")
            except SafetensorError as exc:
                raise KestrelError(f"{path}: truncated or corrupt safetensors file ({exc})") from None
            except OSError as exc:
                raise os_error(exc, "cannot read", path) from None
        return self._handles[path]

    def has(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32 or float16 (BF16 widened exactly to float32), in kestrel's form (``kestrel_form``)."""
        t = self.get_weight(name)
        return kestrel_form(name, t.to_float32() if isinstance(t, (BFloat16Bits, IntWeight)) else t, self.config,
                            str(self.dir))

    def get_weight(self, name: str) -> np.ndarray | BFloat16Bits | IntWeight:
        """Like get, but a BF16 tensor stays its raw bits (the quantizer widens it a row at a time) and an integer
        one its codes (the quantizer keeps them where it can)."""
        if name not in self._files:
            raise KestrelError(f"{self.dir}: the checkpoint has no tensor for {name} "
                               f"({_hf_name_hint(name)})")
        path, hf_name = self._files[name], self._hf_names[name]
        if name in self._expert_part:
            return self._expert_tensor(name, path, hf_name)
        handle = self._handle(path)
        dtype = handle.get_slice(hf_name).get_dtype()
        rows = self._rows.get(name)
        try:
            if hf_name.endswith(PACKED_SUFFIXES) or (dtype == "I8" and self.int_quant is not None):
                t = read_int_weight(self, hf_name, self.int_quant, f"{path}: {hf_name}")
            elif dtype in ("U8", "I8") and self.bnb is not None:
                t = read_bnb_weight(self, hf_name, self.bnb, f"{path}: {hf_name}")
            elif dtype == "BF16":
                bits = self._raw(path, hf_name, "<u2")
                return BFloat16Bits(bits if rows is None else fused_rows(bits, rows, str(path), hf_name))
            elif dtype == "F8_E4M3":
                t = self._fp8(path, hf_name)
            elif dtype not in _FLOAT_DTYPES:
                raise KestrelError(f"{path}: tensor {hf_name} has dtype {dtype}; kestrel reads BF16, F16, F32, "
                                   "F8_E4M3 and integer-quantized weights")
            else:
                t = handle.get_tensor(hf_name)
        except SafetensorError as exc:
            raise KestrelError(f"{path}: cannot read tensor {hf_name} ({exc})") from None
        t = t if rows is None else fused_rows(t, rows, str(path), hf_name)
        return t if isinstance(t, IntWeight) or t.dtype in (np.float32, np.float16) else t.astype(np.float32)

    def _expert_tensor(self, name: str, path: Path, hf_name: str) -> np.ndarray:
        """One expert's part of a stacked tensor, float32 in kestrel's orientation: gpt-oss's gate [F, D] (the even
        rows of gate|up as transformers computes x @ W), up [F, D] (the odd ones), down [D, F], or a bias;
        Granite 4.0-H's (``_granite_names``)."""
        e, part = self._expert_part[name]
        try:
            if self.config.arch == "granitemoehybrid":  # [2F, D]: gate rows, then up; down [D, F] as it is
                t = self._stacked_slice(path, hf_name, e)
                width = self.config.expert_intermediate_size
                return np.ascontiguousarray(t[:width] if part == "gate" else t[width:] if part == "up" else t)
            if hf_name.endswith("_blocks"):
                rows = self._mxfp4_rows(path, hf_name, e)  # [2F, D] or [D, F]
                return np.ascontiguousarray(rows[0::2] if part == "gate" else rows[1::2] if part == "up" else rows)
            t = self._stacked_slice(path, hf_name, e)
        except SafetensorError as exc:
            raise KestrelError(f"{path}: cannot read tensor {hf_name} ({exc})") from None
        if t.ndim != (1 if part.endswith("_bias") else 2):
            raise KestrelError(f"{path}: tensor {hf_name} has {t.ndim + 1} dimensions")
        if self.config.arch == "qwen3_moe":
            return self._halves_expert(t, part, path, hf_name)
        if part in ("gate", "up"):  # [D, 2F]: gate and up interleaved by column
            t = t[:, 0::2].T if part == "gate" else t[:, 1::2].T
        elif part == "down":  # [F, D]
            t = t.T
        elif part in ("gate_bias", "up_bias"):
            t = t[0::2] if part == "gate_bias" else t[1::2]
        return np.ascontiguousarray(t, dtype=np.float32)

    def _halves_expert(self, t: np.ndarray, part: str, path: Path, hf_name: str) -> np.ndarray:
        """Qwen3-VL-MoE's expert as its gate [F, D], up or down [D, F]: the hub's x @ W tensors, gate|up [D, 2F] (gate's
        columns, then up's) and down [F, D], or transformers 5's nn.Linear ones, [2F, D] and [D, F], told apart by
        their shapes as transformers' conversion tells them."""
        d, f = self.config.hidden_size, self.config.expert_intermediate_size
        linear = (d, f) if part == "down" else (2 * f, d)
        if t.shape not in (linear, linear[::-1]):
            raise KestrelError(f"{path}: tensor {hf_name} has an expert of shape {list(t.shape)}; expected "
                               f"{list(linear)} or {list(linear[::-1])}")
        rows = t if t.shape == linear else t.T
        if part != "down":
            rows = rows[:f] if part == "gate" else rows[f:]
        return np.ascontiguousarray(rows, dtype=np.float32)

    def _stacked_slice(self, path: Path, hf_name: str, e: int) -> np.ndarray:
        """Expert ``e``'s slice of a stacked tensor [E, ...] as float32."""
        stacked = self._handle(path).get_slice(hf_name)
        dtype, shape = stacked.get_dtype(), stacked.get_shape()
        if not shape or shape[0] <= e:
            raise KestrelError(f"{path}: tensor {hf_name} of shape {list(shape)} has no expert {e}")
        if dtype == "BF16":
            return BFloat16Bits(np.ascontiguousarray(self._raw(path, hf_name, "<u2")[e])).to_float32()
        if dtype not in _FLOAT_DTYPES:
            raise KestrelError(f"{path}: tensor {hf_name} has dtype {dtype}; kestrel reads BF16, F16, F32")
        return np.asarray(self._handle(path).get_slice(hf_name)[e:e + 1][0], dtype=np.float32)

    def _mxfp4_rows(self, path: Path, hf_name: str, e: int) -> np.ndarray:
        """Expert ``e``'s rows [N, K] of MXFP4 blocks [E, N, K/32, 16] (two FP4 E2M1 codes a byte, the low
        nibble first) and their power-of-two scales [E, N, K/32] (E8M0, bias 127), as transformers decodes them."""
        scales_name = hf_name.removesuffix("_blocks") + "_scales"
        if scales_name not in self._paths:
            raise KestrelError(f"{path}: {hf_name} has no {scales_name} beside it")
        blocks_slice = self._handle(path).get_slice(hf_name)
        scales_slice = self._handle(self._paths[scales_name]).get_slice(scales_name)
        if blocks_slice.get_dtype() != "U8" or scales_slice.get_dtype() != "U8":
            raise KestrelError(f"{path}: MXFP4 tensors {hf_name} and {scales_name} must be U8")
        blocks, scales = blocks_slice[e:e + 1][0], scales_slice[e:e + 1][0]  # [N, G, 16], [N, G]
        if blocks.ndim != 3 or blocks.shape[2] != 16 or scales.shape != blocks.shape[:2]:
            raise KestrelError(f"{path}: MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} of "
                               f"{hf_name} do not match")
        values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)  # [N, G, 16, 2]
        with np.errstate(over="ignore"):  # E8M0's 255 (NaN) overflows to inf, which the quantizer refuses by name
            scale = np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
        values = values.reshape(*scales.shape, 32) * scale
        return values.reshape(scales.shape[0], -1).astype(np.float32)

    def _raw(self, path: Path, hf_name: str, dtype: str) -> np.ndarray:
        """``raw_elements`` of a shard, its header read once."""
        if path not in self._headers:
            self._headers[path] = safetensors_header(path)
        return raw_elements(path, hf_name, dtype, self._headers[path])

    def _fp8(self, path: Path, hf_name: str) -> np.ndarray:
        """An FP8 weight decoded to float32 with its scale (model/fp8.py)."""
        if self.fp8 is None:
            raise KestrelError(f"{path}: tensor {hf_name} is FP8, but config.json has no FP8 quantization_config")
        scale_name = next((hf_name + s for s in SCALE_SUFFIXES if hf_name + s in self._paths), None)
        if scale_name is None:
            raise KestrelError(f"{path}: FP8 tensor {hf_name} has no {hf_name}_scale_inv or _scale beside it")
        codes = self._raw(path, hf_name, "u1")
        if codes.ndim != 2:
            raise KestrelError(f"{path}: FP8 tensor {hf_name} has {codes.ndim} dimensions; kestrel reads 2")
        return dequantize_fp8(codes, self.float_tensor(scale_name), self.fp8, f"{path}: {hf_name}")

    def projections_integer(self) -> bool:
        """Whether every projection the model quantizes at its mode's bits comes from an integer tensor (an ignore
        list or a module left out of the quantization keeps some float)."""
        from kestrel_core.model.weights import model_specs

        def integer(hf_name: str) -> bool:
            return hf_name.endswith(PACKED_SUFFIXES) or (
                self._handle(self._paths[hf_name]).get_slice(hf_name).get_dtype() == "I8")

        names = [spec.name for spec in model_specs(self.config) if spec.kind == "proj"]
        return self.int_quant is not None and all(n in self._hf_names and integer(self._hf_names[n]) for n in names)

    def has_tensor(self, hf_name: str) -> bool:
        return hf_name in self._paths

    def tensor(self, hf_name: str) -> np.ndarray:
        """A tensor by its name in the checkpoint, as it is stored (packed codes, zero points, a scale)."""
        if hf_name not in self._paths:
            raise KestrelError(f"{self.dir}: the checkpoint has no tensor {hf_name}")
        path = self._paths[hf_name]
        try:
            return self._handle(path).get_tensor(hf_name)
        except (SafetensorError, TypeError) as exc:
            raise KestrelError(f"{path}: cannot read tensor {hf_name} ({exc})") from None

    def float_tensor(self, hf_name: str) -> np.ndarray:
        """A float tensor by its name in the checkpoint (a scale), BF16 widened to float32."""
        if hf_name in self._paths and self._handle(self._paths[hf_name]).get_slice(hf_name).get_dtype() == "BF16":
            return BFloat16Bits(self._raw(self._paths[hf_name], hf_name, "<u2")).to_float32()
        return self.tensor(hf_name)


def _hf_name_hint(name: str) -> str:
    for hf, kn in _GLOBAL_MAP.items():
        if kn == name:
            return hf
    m = re.match(r"^layers\.(\d+)\.(.+)$", name)
    if m:
        for hf, kn in {**_LAYER_MAP, **_GPT_OSS_MAP}.items():
            if kn == m.group(2):
                return f"model.layers.{m.group(1)}.{hf}"
    return name
