"""Read a GGUF file (GGUF_ARCHITECTURES: llama incl. Mixtral, qwen2, qwen3 and Qwen3-VL's, phi3, gemma 2 and 3, the
mixtures of experts, gpt-oss, smollm3, granite, olmo2 (OLMo 3's too), exaone4, seed_oss, glm4 and glm4moe, ernie4_5
and its MoE, qwen35, qwen35moe, qwen3next, lfm2 and lfm2moe, granitehybrid, mistral3, deepseek2, minimax-m2, dots1,
command-r and cohere2;
one file, or the parts of a split one) as a TensorSource: dequantized float32, HF layout; the experts of a stacked
``ffn_*_exps`` tensor are read one slice at a time. Its metadata: model/gguf_meta.py.

llama.cpp's convert_hf_to_gguf.py permutes the rows of Q and K for the llama architecture only
(``LlamaModel.permute``: rows ``[n_head, 2, hd/2]`` -> ``[n_head, hd/2, 2]``), because ggml's default RoPE
rotates adjacent pairs while HF's rotate_half rotates the two halves of each head. kestrel's decoder uses
HF's layout, so the permutation is undone here. qwen2 / qwen3 GGUFs are written unpermuted (llama.cpp runs
them with NEOX-style RoPE, which is rotate_half) and are taken as they are.

llama3 RoPE scaling is stored by llama.cpp as a ``rope_freqs.weight`` tensor of per-frequency divisors, not as
metadata; the llama3 parameters are recovered from it and checked to reproduce it exactly.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

from kestrel_core.errors import KestrelError, os_error
from kestrel_core.model.config import ModelConfig
from kestrel_core.model.gguf_bounds import check_gguf_bounds, split_parts
from kestrel_core.model.gguf_meta import HYBRID_ARCHITECTURES, GGUFMetadata, dequantize_tensor
from kestrel_core.model.gguf_vocab import end_of_generation, special_id
from kestrel_core.model.quantize import fused_parts, fused_rows, hybrid_splits, layer_name, map_tensor_name
from kestrel_core.model.validate import ValidationError, check_regular_file
from kestrel_core.model.weights import expert_field

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen2moe", "qwen3moe", "gpt-oss",
                      "smollm3", "granite", "olmo2", "exaone4", "seed_oss", "glm4", "ernie4_5", "qwen35", "qwen35moe",
                      "qwen3next", "lfm2", "granitehybrid", "glm4moe", "ernie4_5-moe", "qwen3vl", "qwen3vlmoe",
                      "lfm2moe", "mistral3", "deepseek2", "minimax-m2", "dots1", "command-r", "cohere2")
# kestrel's names: a llama GGUF with experts is Mixtral; SmolLM3's and Ministral 3's converters are llama's
PERMUTED_ARCHITECTURES = ("llama", "mixtral", "smollm3", "granite", "granitemoehybrid", "ministral3")
# phi3 GGUFs hold Q|K|V and gate|up (llama.cpp's ffn_up of phi3: gate rows, then up) as one tensor each; glm4's
# gate|up too
FUSED = {"phi3": {"attn_qkv.weight": ("q", "k", "v"), "ffn_up.weight": ("gate", "up")},
         "glm4": {"ffn_up.weight": ("gate", "up")}}

_LAYER_MAP = {
    "attn_norm.weight": "attn_norm",
    "ffn_norm.weight": "mlp_norm",
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_output.weight": "o",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
    "ffn_gate_inp.weight": "router",
    "exp_probs_b.bias": "router_choice_bias",  # a router's choice bias (GLM-4.5; ERNIE 4.5's [1, E], read flat)
    "post_attention_norm.weight": "post_attn_norm",  # Gemma 3 (its ffn_norm is the pre-MLP norm)
    "post_ffw_norm.weight": "post_mlp_norm",
    "ffn_gate_inp_shexp.weight": "shared_expert_gate",  # Qwen2-MoE's shared expert
    "ffn_gate_shexp.weight": "shared_expert.gate",
    "ffn_up_shexp.weight": "shared_expert.up",
    "ffn_down_shexp.weight": "shared_expert.down",
    # multi-head latent attention (deepseek2): attn_kv_b, or as llama.cpp's converter writes it now, per head attn_k_b
    # (transposed) and attn_v_b (LATENT_UP)
    "attn_q_a.weight": "q_a",
    "attn_q_a_norm.weight": "q_a_norm",
    "attn_q_b.weight": "q_b",
    "attn_kv_a_mqa.weight": "kv_a",
    "attn_kv_a_norm.weight": "kv_a_norm",
    "attn_kv_b.weight": "kv_b",
}
# gpt-oss, seed_oss and glm4moe: what their names mean where they differ (post_attention_norm is the MLP's input
# norm), and gpt-oss's biases and sinks
_MLP_NORM_AFTER_ATTENTION_MAP = {**_LAYER_MAP, "post_attention_norm.weight": "mlp_norm", "attn_output.bias": "o_bias",
                "attn_sinks.weight": "sinks", "ffn_gate_inp.bias": "router_bias"}
# Qwen3.5's: a linear-attention layer's tensors (llama.cpp's SSM names), post_attention_norm the MLP's input norm
_HYBRID_MAP = {**_LAYER_MAP, "post_attention_norm.weight": "mlp_norm", "attn_qkv.weight": "lin_qkv",
               "attn_gate.weight": "lin_z", "ssm_beta.weight": "lin_beta", "ssm_alpha.weight": "lin_alpha",
               "ssm_out.weight": "o", "ssm_conv1d.weight": "conv", "ssm_a": "lin_decay",
               "ssm_dt.bias": "lin_dt_bias", "ssm_norm.weight": "lin_norm"}
# the fused tensors of the hybrids, by their quantize.hybrid_splits role: attn_q (each head's query, then its gate),
# qwen3next's ssm_ba (per key head: beta, alpha)
_HYBRID_SPLITS = {"attn_q.weight": "q_gate", "ssm_ba.weight": "ba"}
# LFM2's: its short convolutions, and its final norm under the name of an embedding norm
_LFM2_MAP = {**_LAYER_MAP, "shortconv.in_proj.weight": "conv_in", "shortconv.conv.weight": "conv",
             "shortconv.out_proj.weight": "o"}
# Granite 4.0-H's Mamba-2 layers (llama.cpp's names); ssm_a, ssm_d ([heads, 1]) and ssm_norm ([groups, inner / groups])
# are read flat
_GRANITE_HYBRID_MAP = {**_LAYER_MAP, "ssm_in.weight": "mamba_in", "ssm_conv1d.weight": "conv",
                       "ssm_conv1d.bias": "conv_bias", "ssm_dt.bias": "ssm_dt_bias", "ssm_a": "ssm_a", "ssm_d": "ssm_d",
                       "ssm_norm.weight": "ssm_norm", "ssm_out.weight": "o"}
_FLAT = ("ssm_a", "ssm_d", "ssm_norm")
LATENT_UP = ("attn_k_b.weight", "attn_v_b.weight")  # k_b [H, r, dn] and v_b [H, dv, r]: kv_b's rows of each head
TILED_ARCHITECTURES = ("qwen35", "qwen35moe")  # Qwen3.5's (Qwen3-Next's converter keeps HF's order)
# what llama.cpp's converter (_LinearAttentionVReorderBase) reorders from HF's value heads grouped by key head to
# tiled: each tensor's axis and the length of a head along it; kestrel takes them back to HF's order
_TILED_VALUE_HEADS = {"lin_qkv": (0, "dv"), "lin_z": (0, "dv"), "lin_beta": (0, 1), "lin_alpha": (0, 1),
                      "lin_decay": (0, 1), "lin_dt_bias": (0, 1), "conv": (0, "dv"), "o": (1, "dv")}
# a mixture-of-experts layer's experts, stacked [E, N, K] in one tensor each (gpt-oss's biases [E, N])
_STACKED = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up", "ffn_down_exps.weight": "down",
            "ffn_gate_exps.bias": "gate_bias", "ffn_up_exps.bias": "up_bias", "ffn_down_exps.bias": "down_bias"}
_GLOBAL_MAP = {"token_embd.weight": "embedding", "output_norm.weight": "final_norm", "output.weight": "lm_head",
               "cls.output.weight": "classifier"}  # a reranker's (model/rerank.py)
_LFM2_GLOBAL_MAP = {**_GLOBAL_MAP, "token_embd_norm.weight": "final_norm"}
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def kestrel_name(gguf_name: str, arch: str = "llama") -> str | None:
    """``blk.3.attn_q.weight`` -> ``layers.3.q``; None for tensors kestrel does not use."""
    layer_map = (_MLP_NORM_AFTER_ATTENTION_MAP if arch in ("gpt-oss", "seed_oss", "glm4moe") else _HYBRID_MAP
                 if arch in HYBRID_ARCHITECTURES else _LFM2_MAP if arch in ("lfm2", "lfm2moe") else _GRANITE_HYBRID_MAP
                 if arch == "granitehybrid" else _LAYER_MAP)
    return map_tensor_name(gguf_name, _LFM2_GLOBAL_MAP if arch in ("lfm2", "lfm2moe") else _GLOBAL_MAP, _BLK_RE,
                           layer_map)


def _fused(arch: str) -> dict[str, tuple[str, ...] | str]:
    """The fused tensors of ``arch``'s GGUF files, by name within a block: their kestrel members in row order
    (``FUSED``), or a hybrid's quantize.hybrid_splits role."""
    return {**FUSED.get(arch, {}), **(_HYBRID_SPLITS if arch in HYBRID_ARCHITECTURES else {})}


def tensor_parts(gguf_name: str, arch: str, c: ModelConfig) -> list[tuple[str, tuple[int, int] | np.ndarray]]:
    """The kestrel tensors a fused tensor of ``arch``'s GGUF holds, each with its rows of it (phi3's attn_qkv and
    ffn_up, glm4's ffn_up, a hybrid's attn_q and ssm_ba), as the llama.cpp converter writes the base's and an
    adapter's; empty for any other tensor (``kestrel_name`` names those)."""
    m = _BLK_RE.match(gguf_name)
    members = None if m is None else _fused(arch).get(m.group(2))
    if m is None or members is None:
        return []
    layer = int(m.group(1))
    if isinstance(members, str):
        return [(layer_name(layer, member), rows) for member, rows in hybrid_splits(c)[members]]
    return list(fused_parts(layer, members, c))


def hf_layout(w: np.ndarray, name: str, c: ModelConfig, permuted: bool, tiled: bool) -> np.ndarray:
    """The tensor ``name`` as llama.cpp's converter writes it (``w``, dequantized) in Hugging Face's layout, which
    kestrel runs: Q and K rows un-permuted where the converter permutes them (``permuted``), a linear attention's
    value heads grouped by key head again where it tiles them (``tiled``: Qwen3.5's), vectors stored [N, 1] (and
    per-head norm weights [heads, hd]) flat."""
    field = name.rsplit(".", 1)[-1]
    if ((field in _FLAT and c.arch == "granitemoehybrid") or field == "router_choice_bias"
            or (c.qk_norm_heads and field in ("q_norm", "k_norm"))):  # command-r's [heads, hd]
        w = w.reshape(-1)
    if tiled and field in _TILED_VALUE_HEADS and c.is_linear(int(name.split(".")[1])):
        axis, head = _TILED_VALUE_HEADS[field]
        w = grouped_value_heads(w, axis, c.linear_key_heads, c.linear_value_heads,
                                c.linear_value_dim if head == "dv" else 1)
    if permuted and field in ("q", "q_bias"):
        w = unpermute_rows(w, c.num_heads)
    elif permuted and field in ("k", "k_bias"):
        w = unpermute_rows(w, c.num_kv_heads)
    return w


def grouped_value_heads(w: np.ndarray, axis: int, key_heads: int, value_heads: int, head_dim: int) -> np.ndarray:
    """Value heads along ``axis`` from llama.cpp's tiled order (value head j of every key head, then j + 1) back
    to HF's, grouped by key head; the rows before them (a q|k|v tensor's q and k) stay."""
    w = np.moveaxis(w, axis, 0)
    lead = w.shape[0] - value_heads * head_dim
    heads = w[lead:].reshape(value_heads // key_heads, key_heads, head_dim, *w.shape[1:]).swapaxes(0, 1)
    out = np.concatenate([w[:lead], heads.reshape(-1, *w.shape[1:])])
    return np.ascontiguousarray(np.moveaxis(out, 0, axis))


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's ``LlamaModel.permute`` on Q or K rows (w: [n_head*hd, ...] or [n_head*hd])."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise KestrelError(f"cannot un-permute {rows} rows over {n_head} heads")
    # gguf row (h, i, j) holds HF row (h, j, i): [n_head, hd/2, 2, ...] -> [n_head, 2, hd/2, ...]
    return np.ascontiguousarray(
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores in rope_freqs.weight for llama3 scaling ([head_dim/2])."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    orig = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig / wavelen - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, medium))


def llama3_scaling_from_factors(factors: np.ndarray, theta: float, head_dim: int,
                                original_context: int | None, where: str) -> dict[str, Any] | None:
    """Recover llama3 rope scaling from rope_freqs.weight; refuse anything it cannot reproduce."""
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    if f.shape != (head_dim // 2,):
        raise KestrelError(f"{where}: rope_freqs.weight has {f.size} entries, expected {head_dim // 2}")
    if np.allclose(f, 1.0):
        return None
    factor = float(f.max())
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    orig = int(original_context or 8192)
    # Only orig/wavelen enters the formula, so orig may be chosen and low/high solved for:
    # medium band: smooth_i = (orig/wavelen_i - low) / (high - low), smooth_i = (1/f_i - 1/factor) / (1 - 1/factor)
    is_medium = (f > 1.0 + 1e-6) & (f < factor * (1 - 1e-6))
    x = orig / wavelen  # decreasing with i
    unscaled, scaled = x[f <= 1.0 + 1e-6], x[f >= factor * (1 - 1e-6)]
    top = float(unscaled.min()) if unscaled.size else float(x.max()) * 2  # high must stay below this
    bottom = float(scaled.max()) if scaled.size else 0.0  # low must stay above this
    s = (1.0 / f[is_medium] - 1.0 / factor) / (1.0 - 1.0 / factor)  # smooth, in (0, 1)
    xm = x[is_medium]
    if xm.size >= 2:  # x = s * (high - low) + low: a straight line, solved exactly
        a, b = np.polyfit(s, xm, 1)
        low, high = float(b), float(a + b)
    elif xm.size == 1:  # one equation, two unknowns: any (low, high) that keeps every band in place
        x0, s0 = float(xm[0]), float(s[0])
        cap = min(top, (x0 - (1 - s0) * bottom) / s0)  # beyond cap, low would fall below `bottom`
        high = (x0 + cap) / 2
        low = (x0 - s0 * high) / (1 - s0)
    else:  # a hard switch between the two bands
        low = (bottom + top) / 2
        high = low * (1 + 1e-9)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
               "original_max_position_embeddings": orig}
    if not np.allclose(llama3_rope_factors(theta, head_dim, scaling), f, rtol=1e-4, atol=1e-5):
        raise KestrelError(f"{where}: rope_freqs.weight does not follow llama3 rope scaling; not supported")
    return scaling


def _open_reader(path: Path) -> GGUFReader:
    """gguf-py's reader of one GGUF file, after the checks that keep it from blocking or over-allocating."""
    check_regular_file(path)  # a FIFO or a device would block or never end
    check_gguf_bounds(path)  # every length within the file before gguf-py allocates for it
    try:
        return GGUFReader(path)
    except OSError as exc:
        raise os_error(exc, "cannot read", path) from None
    except Exception as exc:  # gguf-py raises ValueError, struct/IndexError... on bad bytes
        raise KestrelError(f"{path}: not a readable GGUF file (truncated or corrupt: "
                           f"{type(exc).__name__}: {' '.join(str(exc).split())})") from None


class GGUFCheckpoint(GGUFMetadata):
    """A GGUF file as a TensorSource: each tensor dequantized (and un-permuted) when asked for."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.description = str(self.path)
        self.reader = _open_reader(self.path)  # the metadata: a split file's first part holds all of it
        self._tokenizer_fields: dict[str, Any] | None = None
        self.file_tensors = self._split_tensors()  # every part's
        self._tensors = {}
        self._rows: dict[str, tuple[int, int] | np.ndarray] = {}  # kestrel name -> its rows of a fused tensor
        self._experts: dict[str, tuple[Any, int]] = {}  # kestrel name -> (stacked tensor, expert)
        self._latent_up: dict[str, dict[str, Any]] = {}  # layers.N.kv_b -> its attn_k_b and attn_v_b
        file_arch = self.field("general.architecture")
        fused = _fused(file_arch)
        split = []  # split by rows once the config says how
        for t in self.file_tensors:
            m = _BLK_RE.match(t.name)
            if m and m.group(2) in fused:
                split.append(t)
                continue
            if m and m.group(2) in LATENT_UP:
                self._latent_up.setdefault(layer_name(int(m.group(1)), "kv_b"), {})[m.group(2)] = t
                continue
            if m and m.group(2) in _STACKED:
                stacked_dims = 2 if m.group(2).endswith(".bias") else 3
                for e in range(int(t.data.shape[0]) if t.data.ndim == stacked_dims else 0):
                    self._experts[layer_name(int(m.group(1)), expert_field(e, _STACKED[m.group(2)]))] = (t, e)
                continue
            name = kestrel_name(t.name, file_arch)
            if name is not None:
                self._tensors[name] = t
        self._rope_freqs = next((t for t in self.file_tensors if t.name == "rope_freqs.weight"), None)
        self.fp4_experts = any(t.tensor_type.name == "MXFP4" for t in self.file_tensors)
        self._rope_factors = {t.name: t for t in self.file_tensors if t.name.startswith("rope_factors_")}
        self.config = self._config()
        self.tiled_value_heads = file_arch in TILED_ARCHITECTURES
        for t in split:
            for name, rows in tensor_parts(t.name, file_arch, self.config):
                self._tensors[name] = t
                self._rows[name] = rows

    def _split_tensors(self) -> list[Any]:
        """Every tensor of the file, or of every part of a split one (llama.cpp's ``split.*`` metadata: each part
        names its index and the count, the first the tensors of all), the parts found by name."""
        count = self.int_field("split.count", 1, lo=1) or 1
        if count == 1:
            return list(self.reader.tensors)
        parts = split_parts(self.path)
        if len(parts) != count or self.int_field("split.no", 0, lo=0):
            raise KestrelError(f"{self.path}: the first of {count} parts of a split GGUF must be named "
                               f"NAME-00001-of-{count:05d}.gguf (its parts are found by name)")
        tensors = list(self.reader.tensors)
        for no, part in enumerate(parts[1:], start=1):
            if not part.exists():
                raise KestrelError(f"{self.path}: part {no + 1} of {count} of this split GGUF is missing ({part})")
            reader = _open_reader(part)
            said = tuple(reader.fields[k].contents() if k in reader.fields else None
                         for k in ("split.no", "split.count"))
            if said != (no, count):
                raise KestrelError(f"{part}: not part {no + 1} of {count} of {self.path.name} (its split.no and "
                                   "split.count say otherwise)")
            tensors += reader.tensors
        total = self.int_field("split.tensors.count", len(tensors), lo=0)
        if total != len(tensors):
            raise KestrelError(f"{self.path}: its {count} parts hold {len(tensors)} tensors, split.tensors.count "
                               f"says {total}")
        return tensors

    # -- metadata ----------------------------------------------------------------------------------------

    def _config(self) -> ModelConfig:
        arch = self.field("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise KestrelError(f"{self.path}: unsupported architecture {arch!r} "
                               f"(kestrel supports {', '.join(GGUF_ARCHITECTURES)})")
        if "embedding" not in self._tensors:
            raise KestrelError(f"{self.path}: no token_embd.weight tensor")
        emb_shape = [int(d) for d in self._tensors["embedding"].shape]
        if len(emb_shape) != 2:
            raise KestrelError(f"{self.path}: token_embd.weight has shape {emb_shape}, expected [hidden, vocab]")
        vocab_size = emb_shape[-1]  # ggml order: [D, V]
        hidden = self.int_field(f"{arch}.embedding_length", required=True)
        heads = self.int_field(f"{arch}.attention.head_count", required=True)
        assert hidden is not None and heads is not None
        head_dim = self.int_field(f"{arch}.attention.key_length") or hidden // heads
        theta = self.float_field(f"{arch}.rope.freq_base", 10000.0)
        rotary_dim = self.int_field(f"{arch}.rope.dimension_count", head_dim)
        scaling = self._rope_scaling(arch, rotary_dim)
        layers = self.int_field(f"{arch}.block_count", required=True)
        assert layers is not None
        nextn = self.int_field(f"{arch}.nextn_predict_layers", 0, lo=0) or 0  # multi-token prediction layers, last
        if nextn >= layers:
            raise KestrelError(f"{self.path}: {arch}.nextn_predict_layers {nextn} leaves none of the {layers} blocks")
        layers -= nextn
        extra = self._arch_fields(arch, hidden, heads, head_dim, layers)
        extra.update(self._pooling(arch, hidden))
        try:
            if self._rope_freqs is not None:
                freqs = dequantize_tensor(self._rope_freqs, str(self.path))
                orig_ctx = self.int_field(f"{arch}.rope.scaling.original_context_length")
                scaling = llama3_scaling_from_factors(freqs, theta, head_dim, orig_ctx, str(self.path))
            bos = special_id(self.tokenizer_fields(), "bos", str(self.path))
            return ModelConfig(
                arch=extra.pop("arch", arch),
                vocab_size=vocab_size,
                hidden_size=hidden,
                # qwen35moe's every MLP is its experts: no dense width; Granite 4.0-H's is its shared MLP's
                intermediate_size=extra.pop("intermediate_size", None)
                or self.int_field(f"{arch}.feed_forward_length", required=arch not in ("qwen35moe", "qwen3next"))
                or extra.get("expert_intermediate_size"),
                num_layers=layers,
                num_heads=heads,
                rope_theta=theta,
                rope_scaling=scaling,
                max_position=self.int_field(f"{arch}.context_length", 4096),
                tie_word_embeddings="lm_head" not in self._tensors,
                bos_token_id=bos,
                eos_token_ids=end_of_generation(self.tokenizer_fields(), str(self.path)),
                sampling=self._sampling(),
                **{"num_kv_heads": self._kv_heads(arch) or heads, "head_dim": head_dim,
                   "rms_norm_eps": self.float_field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
                   "rotary_dim": None if rotary_dim == head_dim else rotary_dim,
                   "qkv_bias": arch in ("qwen2", "qwen2moe"),
                   "qk_norm": arch in ("qwen3", "qwen3moe", "qwen3vl", "qwen3vlmoe", "gemma3"),
                   # llama.cpp's converter writes 0 for a phi3 without a window
                   "sliding_window": self.int_field(f"{arch}.attention.sliding_window", lo=0) or None
                   if arch in ("phi3", "gemma2", "gemma3", "gpt-oss") else None, **extra},
            )
        except ValidationError as exc:
            raise KestrelError(f"{self.path}: {exc}") from None
        except (ValueError, ArithmeticError, FloatingPointError) as exc:  # numpy on absurd rope values
            raise KestrelError(f"{self.path}: bad metadata ({type(exc).__name__}: {exc})") from None

    def _kv_b(self, name: str) -> np.ndarray:
        """HF's kv_b [H*(dn + dv), r] (per head its key's rows, then its value's) from llama.cpp's attn_k_b [H, r, dn]
        and attn_v_b [H, dv, r]."""
        parts = self._latent_up[name]
        if set(parts) != set(LATENT_UP):
            raise KestrelError(f"{self.path}: {name}: attn_k_b and attn_v_b come in pairs, found {sorted(parts)}")
        c = self.config
        k_b, v_b = (dequantize_tensor(parts[n], str(self.path)) for n in LATENT_UP)
        h, r, dn = c.num_heads, c.kv_lora_rank, c.head_dim - c.rotary
        if k_b.shape != (h, r, dn) or v_b.shape != (h, c.value_dim, r):
            raise KestrelError(f"{self.path}: {name}: attn_k_b {list(k_b.shape)} and attn_v_b {list(v_b.shape)} do "
                               f"not match {h} heads, a latent of {r}, keys of {dn} and values of {c.value_dim}")
        return np.ascontiguousarray(np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, r))

    def tokenizer_fields(self) -> dict[str, Any]:
        """Every tokenizer.* metadata value and general.name, decoded (what Tokenizer.from_gguf_vocab needs), once."""
        if self._tokenizer_fields is None:
            self._tokenizer_fields = {key: self.field(key) for key in self.reader.fields
                                      if key.startswith("tokenizer.") or key == "general.name"}
        return self._tokenizer_fields

    # -- tensors -----------------------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self._tensors or name in self._experts or name in self._latent_up

    def get(self, name: str) -> np.ndarray:
        if name in self._latent_up:
            return self._kv_b(name)
        t = self._tensors.get(name)
        data = None if t is None else t.data
        if t is None and name in self._experts:  # one expert's slice of a stacked tensor
            t, e = self._experts[name]
            data = t.data[e]
        if t is None:
            raise KestrelError(f"{self.path}: the GGUF has no tensor for {name}")
        w = dequantize_tensor(t, str(self.path), data)
        if name.endswith(".shared_expert_gate") and w.ndim == 1:  # llama.cpp stores the gate's one row as [D]
            w = w.reshape(1, -1)
        rows = self._rows.get(name)
        if rows is not None:
            w = fused_rows(w, rows, str(self.path), t.name)
        return hf_layout(w, name, self.config, self.config.arch in PERMUTED_ARCHITECTURES, self.tiled_value_heads)
