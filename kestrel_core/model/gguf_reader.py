"""Read a GGUF file (llama / qwen2 / qwen3) as a TensorSource: dequantized float32, HF layout.

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
from gguf.quants import dequantize

from kestrel_core.errors import KestrelError
from kestrel_core.model.config import ModelConfig
from kestrel_core.model.quantize import map_tensor_name

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
PERMUTED_ARCHITECTURES = ("llama",)

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
}
_GLOBAL_MAP = {"token_embd.weight": "embedding", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def kestrel_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``layers.3.q``; None for tensors kestrel does not use."""
    return map_tensor_name(gguf_name, _GLOBAL_MAP, _BLK_RE, _LAYER_MAP)


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


def _decimal(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


class GGUFCheckpoint:
    """A GGUF file as a TensorSource: each tensor dequantized (and un-permuted) when asked for."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.description = str(self.path)
        if not self.path.is_file():
            raise KestrelError(f"{self.path}: no such file")
        try:
            self.reader = GGUFReader(self.path)
        except OSError as exc:
            raise KestrelError(f"{self.path}: cannot read it ({exc.strerror or exc})") from None
        except Exception as exc:  # gguf-py raises ValueError, struct/IndexError... on bad bytes
            raise KestrelError(f"{self.path}: not a readable GGUF file (truncated or corrupt: "
                               f"{type(exc).__name__}: {' '.join(str(exc).split())})") from None
        self._tensors = {}
        for t in self.reader.tensors:
            name = kestrel_name(t.name)
            if name is not None:
                self._tensors[name] = t
        self._rope_freqs = next((t for t in self.reader.tensors if t.name == "rope_freqs.weight"), None)
        self.config = self._config()

    # -- metadata ----------------------------------------------------------------------------------------

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

    def _config(self) -> ModelConfig:
        arch = self.field("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise KestrelError(f"{self.path}: unsupported architecture {arch!r} "
                               f"(kestrel supports {', '.join(GGUF_ARCHITECTURES)})")
        if "embedding" not in self._tensors:
            raise KestrelError(f"{self.path}: no token_embd.weight tensor")
        vocab_size = int(self._tensors["embedding"].shape[-1])  # ggml order: [D, V]
        hidden = int(self._need(f"{arch}.embedding_length"))
        heads = int(self._need(f"{arch}.attention.head_count"))
        head_dim = int(self.field(f"{arch}.attention.key_length") or hidden // heads)
        theta = _decimal(self.field(f"{arch}.rope.freq_base", 10000.0))
        kind = self.field(f"{arch}.rope.scaling.type")
        if kind not in (None, "none"):
            raise KestrelError(f"{self.path}: rope scaling type {kind!r} is not supported")
        orig_ctx = self.field(f"{arch}.rope.scaling.original_context_length")
        scaling = None
        if self._rope_freqs is not None:
            scaling = llama3_scaling_from_factors(dequantize(self._rope_freqs.data, self._rope_freqs.tensor_type),
                                                  theta, head_dim, orig_ctx, str(self.path))
        bos = self.field("tokenizer.ggml.bos_token_id")
        eos = [int(v) for v in (self.field("tokenizer.ggml.eos_token_id"),
                                self.field("tokenizer.ggml.eot_token_id")) if v is not None]
        return ModelConfig(
            arch=arch,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(self._need(f"{arch}.feed_forward_length")),
            num_layers=int(self._need(f"{arch}.block_count")),
            num_heads=heads,
            num_kv_heads=int(self.field(f"{arch}.attention.head_count_kv") or heads),
            head_dim=head_dim,
            rms_norm_eps=_decimal(self.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position=int(self.field(f"{arch}.context_length", 4096)),
            tie_word_embeddings="lm_head" not in self._tensors,
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=tuple(dict.fromkeys(eos)),
        )

    def tokenizer_fields(self) -> dict[str, Any]:
        """Every tokenizer.* metadata value, decoded (what Tokenizer.from_gguf_vocab needs)."""
        return {key: self.field(key) for key in self.reader.fields if key.startswith("tokenizer.")}

    # -- tensors -----------------------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> np.ndarray:
        t = self._tensors.get(name)
        if t is None:
            raise KestrelError(f"{self.path}: the GGUF has no tensor for {name}")
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise KestrelError(f"{self.path}: tensor {t.name} uses {t.tensor_type.name}, which gguf-py cannot "
                               "dequantize") from None
        except (ValueError, IndexError) as exc:
            raise KestrelError(f"{self.path}: tensor {t.name} is corrupt ({exc})") from None
        w = np.asarray(w, dtype=np.float32)
        c = self.config
        if c.arch in PERMUTED_ARCHITECTURES:
            field = name.rsplit(".", 1)[-1]
            if field in ("q", "q_bias"):
                w = unpermute_rows(w, c.num_heads)
            elif field in ("k", "k_bias"):
                w = unpermute_rows(w, c.num_kv_heads)
        return w
