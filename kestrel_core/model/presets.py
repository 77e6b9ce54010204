"""Synthetic models with real shapes and seeded random strip-caches, and a byte-level toy tokenizer.

They let a backend be measured on 8B shapes without 8B of downloads. The int8 codes are tiled from a small
seeded random pool into one big buffer (a plain copy, no per-element random generation, no float
weights); the scales are chosen so that every projection maps unit-variance inputs to unit-variance
outputs, which keeps activations finite through any number of layers.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from kestrel_core.contract import CODE_RANGE, StripCache
from kestrel_core.errors import KestrelError
from kestrel_core.model.config import ModelConfig
from kestrel_core.model.quantize import QuantMode, parse_quant
from kestrel_core.model.weights import Model, assemble, model_specs


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then <bos> and <eos>; higher ids of a larger vocabulary decode to ''."""

    BOS = 256
    EOS = 257
    SIZE = 258

    def __init__(self, vocab_size: int = SIZE) -> None:
        if vocab_size < self.SIZE:
            raise KestrelError(f"the byte tokenizer needs a vocabulary of at least {self.SIZE}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = self.BOS
        self.eos_token_ids: tuple[int, ...] = (self.EOS,)

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        """The UTF-8 bytes of ``text`` (no special tokens are ever added), the first ``max_length`` of them."""
        return list(text.encode("utf-8"))[:max_length]

    left_context: tuple[int, ...] = ()  # bytes decode alone

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs))


def _preset(arch: str, vocab: int, d: int, f: int, layers: int, heads: int, kv: int, hd: int, theta: float,
            eps: float, max_pos: int, tied: bool, **extra: Any) -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=vocab, hidden_size=d, intermediate_size=f, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv, head_dim=hd, rms_norm_eps=eps, rope_theta=theta,
                       max_position=max_pos, tie_word_embeddings=tied, bos_token_id=ByteTokenizer.BOS,
                       eos_token_ids=(ByteTokenizer.EOS,), **extra)


_LLAMA32_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
_LLAMA31_ROPE = {**_LLAMA32_ROPE, "factor": 8.0}

_QWEN3_5 = dict(rotary_dim=64, qk_norm=True, attn_output_gate=True, linear_key_heads=16, linear_key_dim=128,
                linear_value_heads=32, linear_value_dim=128, linear_conv_kernel=4)  # and 3 linear layers to 1 full


def _qwen3_5_layers(n: int) -> tuple[str, ...]:
    return tuple("full" if (i + 1) % 4 == 0 else "linear" for i in range(n))


# Shapes from each model's Hugging Face config.json.
PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": _preset("llama", 49152, 576, 1536, 30, 9, 3, 64, 100000.0, 1e-5, 8192, True),
    "qwen3-0.6b": _preset("qwen3", 151936, 1024, 3072, 28, 16, 8, 128, 1e6, 1e-6, 40960, True, qk_norm=True),
    "qwen3-1.7b": _preset("qwen3", 151936, 2048, 6144, 28, 16, 8, 128, 1e6, 1e-6, 40960, True, qk_norm=True),
    "qwen3-4b": _preset("qwen3", 151936, 2560, 9728, 36, 32, 8, 128, 1e6, 1e-6, 40960, True, qk_norm=True),
    "qwen3-8b": _preset("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, 1e6, 1e-6, 40960, False, qk_norm=True),
    "llama3.2-1b": _preset("llama", 128256, 2048, 8192, 16, 32, 8, 64, 500000.0, 1e-5, 131072, True,
                           rope_scaling=_LLAMA32_ROPE),
    "qwen3-32b": _preset("qwen3", 151936, 5120, 25600, 64, 64, 8, 128, 1e6, 1e-6, 40960, False, qk_norm=True),
    "llama3-70b": _preset("llama", 128256, 8192, 28672, 80, 64, 8, 128, 500000.0, 1e-5, 131072, False,
                          rope_scaling=_LLAMA31_ROPE),  # Llama-3.1/3.3-70B
    "mistral-7b": _preset("mistral", 32768, 4096, 14336, 32, 32, 8, 128, 1e6, 1e-5, 32768, False),  # v0.3
    "phi3-mini": _preset("phi3", 32064, 3072, 8192, 32, 32, 32, 96, 10000.0, 1e-5, 4096, False,
                         sliding_window=2047),  # Phi-3-mini-4k
    "gemma2-9b": _preset("gemma2", 256000, 3584, 14336, 42, 16, 8, 256, 10000.0, 1e-6, 8192, True,
                         sliding_window=4096, layer_types=tuple("full" if i % 2 else "sliding" for i in range(42)),
                         query_scale=256 ** -0.5, embed_scale=math.sqrt(3584), activation="gelu_tanh",
                         post_norms=True, attn_softcap=50.0, final_softcap=30.0),
    "gemma3-12b": _preset("gemma3", 262208, 3840, 15360, 48, 16, 8, 256, 1e6, 1e-6, 131072, True,
                          rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_theta=10000.0,
                          sliding_window=1024, layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding"
                                                                 for i in range(48)),
                          query_scale=256 ** -0.5, embed_scale=math.sqrt(3840), activation="gelu_tanh",
                          post_norms=True, qk_norm=True),
    "qwen3-30b-a3b": _preset("qwen3_moe", 151936, 2048, 6144, 48, 32, 4, 128, 1e6, 1e-6, 40960, False,
                             qk_norm=True, num_experts=128, experts_per_token=8, expert_intermediate_size=768,
                             norm_topk_prob=True),
    "qwen1.5-moe-a2.7b": _preset("qwen2_moe", 151936, 2048, 5632, 24, 16, 16, 128, 1e6, 1e-6, 8192, False,
                                 qkv_bias=True, num_experts=60, experts_per_token=4, expert_intermediate_size=1408,
                                 shared_expert_intermediate_size=5632),
    "mixtral-8x7b": _preset("mixtral", 32000, 4096, 14336, 32, 32, 8, 128, 1e6, 1e-5, 32768, False,
                            num_experts=8, experts_per_token=2, expert_intermediate_size=14336, norm_topk_prob=True),
    "glm4.5-air": _preset("glm4_moe", 151552, 4096, 10944, 46, 96, 8, 128, 1e6, 1e-5, 131072, False,
                          rotary_dim=64, qkv_bias=True, num_experts=128, experts_per_token=8,
                          expert_intermediate_size=1408, shared_expert_intermediate_size=1408,
                          shared_expert_gated=False, dense_layers=(0,), norm_topk_prob=True, router_scoring="sigmoid",
                          router_choice_bias=True),
    # multi-head latent attention: GLM-4.7-Flash (its config.json), DeepSeek-V2-Lite (YaRN x40 with mscale 0.707 on
    # the softmax)
    "glm-4.7-flash": _preset("glm4_moe_lite", 154880, 2048, 10240, 47, 20, 20, 256, 1e6, 1e-5, 202752, False,
                             kv_lora_rank=512, q_lora_rank=768, rotary_dim=64, v_head_dim=256, rope_interleaved=True,
                             query_scale=256 ** -0.5, num_experts=64, experts_per_token=4,
                             expert_intermediate_size=1536, shared_expert_intermediate_size=1536,
                             shared_expert_gated=False, dense_layers=(0,), norm_topk_prob=True,
                             router_scoring="sigmoid", router_choice_bias=True, routed_scaling=1.8),
    "deepseek-v2-lite": _preset("deepseek_v2", 102400, 2048, 10944, 27, 16, 16, 192, 10000.0, 1e-6, 163840, False,
                                kv_lora_rank=512, rotary_dim=64, v_head_dim=128, rope_interleaved=True,
                                rope_scaling={"rope_type": "yarn", "factor": 40.0,
                                              "original_max_position_embeddings": 4096, "attention_factor": 1.0,
                                              "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True},
                                query_scale=192 ** -0.5 * (0.1 * 0.707 * math.log(40.0) + 1) ** 2,
                                num_experts=64, experts_per_token=6, expert_intermediate_size=1408,
                                shared_expert_intermediate_size=2816, shared_expert_gated=False, dense_layers=(0,)),
    "gpt-oss-20b": _preset("gpt_oss", 201088, 2880, 2880, 24, 64, 8, 64, 150000.0, 1e-5, 131072, False,
                           rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                         "attention_factor": 0.1 * math.log(32.0) + 1, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "truncate": False},
                           sliding_window=128, layer_types=tuple("full" if i % 2 else "sliding" for i in range(24)),
                           qkv_bias=True, o_bias=True, attn_sinks=True, num_experts=32, experts_per_token=4,
                           expert_intermediate_size=2880, norm_topk_prob=True, moe_bias=True, activation="swiglu_oai"),
    "lfm2-1.2b": _preset("lfm2", 65536, 2048, 8192, 16, 32, 8, 64, 1e6, 1e-5, 128000, True, qk_norm=True,
                         short_conv_kernel=3, layer_types=tuple("full" if i in (2, 5, 8, 10, 12, 14) else "conv"
                                                                for i in range(16))),
    # Command R7B: LayerNorms, the MLP beside the attention, three sliding layers with RoPE to one full one without
    "command-r7b": _preset("cohere2", 256000, 4096, 14336, 32, 32, 8, 128, 50000.0, 1e-5, 132096, True,
                           norm_type="layer", parallel_block=True, rope_interleaved=True, logits_scaling=4.0,
                           sliding_window=4096, nope_layers=tuple(range(3, 32, 4)),
                           layer_types=tuple("full" if i % 4 == 3 else "sliding" for i in range(32))),
    "qwen3.5-9b": _preset("qwen3_5", 248320, 4096, 12288, 32, 16, 4, 256, 1e7, 1e-6, 262144, False,
                          layer_types=_qwen3_5_layers(32), **_QWEN3_5),
    "qwen3.5-35b-a3b": _preset("qwen3_5_moe", 248320, 2048, 512, 40, 16, 2, 256, 1e7, 1e-6, 262144, False,
                               layer_types=_qwen3_5_layers(40), **_QWEN3_5, num_experts=256, experts_per_token=8,
                               expert_intermediate_size=512, norm_topk_prob=True,
                               shared_expert_intermediate_size=512),
}


def preset_config(name: str) -> ModelConfig:
    key = name.strip().lower()
    if key not in PRESETS:
        raise KestrelError(f"unknown preset {name!r}: known presets are {', '.join(PRESETS)}")
    return PRESETS[key]


def _code_rms(bits: int) -> float:
    lo, hi = CODE_RANGE[bits]
    return float(np.sqrt(np.mean(np.arange(lo, hi + 1, dtype=np.float64) ** 2)))


def _big_empty(nbytes: int) -> np.ndarray:
    """A uint8 buffer backed by anonymous memory advised for huge pages: first touch is several times
    cheaper than malloc'd pages on large models (measured: 256 MB in 0.17 s instead of 1 s here)."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    try:
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            mm.madvise(mmap.MADV_HUGEPAGE)
        return np.frombuffer(mm, np.uint8)
    except (AttributeError, OSError, ValueError):  # not Linux: ordinary memory
        return np.empty(nbytes, np.uint8)


class _Arena:
    """Carves C-contiguous weights out of two big buffers and fills them by tiling seeded random pools."""

    POOL = 1 << 20  # distinct random bytes per pool; weights start at random phases of it

    def __init__(self, shapes: list[tuple[int, int, int, int]], rng: np.random.Generator) -> None:
        # shapes: (N, K, G, bits) per weight, in creation order
        self.rng = rng
        self.codes = _big_empty(sum(n * k for n, k, _, _ in shapes))
        self.scales = _big_empty(4 * sum(n * (k // g) for n, k, g, _ in shapes)).view(np.float32)
        self.code_off = self.scale_off = 0
        self.pools = {bits: self._pool(rng.integers(lo, hi + 1, size=self.POOL, dtype=np.int8))
                      for bits, (lo, hi) in CODE_RANGE.items()}
        # scale jitter in [0.5, 1.5): exercises per-block scales without changing the variance much
        self.scale_pool = self._pool(rng.uniform(0.5, 1.5, size=self.POOL // 4 + 1).astype(np.float32))

    @staticmethod
    def _pool(values: np.ndarray) -> np.ndarray:
        return np.concatenate([values, values])  # [2P]: any window of P starting below P is contiguous

    def _tile(self, dst: np.ndarray, pool: np.ndarray) -> None:
        p = len(pool) // 2
        src = pool[int(self.rng.integers(p)):][:p]
        full = len(dst) // p
        dst[:full * p].reshape(full, p)[:] = src
        dst[full * p:] = src[:len(dst) - full * p]

    def weight(self, n: int, k: int, g: int, bits: int) -> StripCache:
        codes = self.codes[self.code_off:self.code_off + n * k].view(np.int8)
        self.code_off += n * k
        scales = self.scales[self.scale_off:self.scale_off + n * (k // g)]
        self.scale_off += n * (k // g)
        self._tile(codes, self.pools[bits])
        self._tile(scales, self.scale_pool)
        # unit-variance inputs -> outputs of variance ~1: the sum over K of (code * scale)^2 is ~1
        scales *= np.float32(1.0 / (_code_rms(bits) * np.sqrt(k)))
        return StripCache(codes.reshape(n, k), scales.reshape(n, k // g), g, bits)


def synthetic_model(config: ModelConfig, quant: str | QuantMode = "q8", seed: int = 0) -> Model:
    """A random model of ``config``'s shapes at ``quant`` (projections at the mode's bits, embedding and
    lm_head at 8 bits, G=32 where K is not a multiple of the mode's G)."""
    mode = quant if isinstance(quant, QuantMode) else parse_quant(quant)
    specs = model_specs(config)
    for s in specs:
        if s.kind in ("proj", "table") and s.shape[1] % 32:
            raise KestrelError(f"{s.name}: K={s.shape[1]} is not a multiple of 32")
    bits = {"proj": mode.bits, "table": 8}
    rng = np.random.default_rng(seed)
    arena = _Arena([(*s.shape, mode.group_for(s.shape[1]), bits[s.kind]) for s in specs if s.kind in bits], rng)
    tensors: dict[str, Any] = {}
    for s in specs:
        if s.kind in bits:  # unit-variance outputs; a tied embedding also gives logits of std ~1
            tensors[s.name] = arena.weight(*s.shape, mode.group_for(s.shape[1]), bits[s.kind])
        elif s.kind == "matrix":  # a router: logits of std ~1
            tensors[s.name] = (rng.standard_normal(s.shape) / np.sqrt(s.shape[1])).astype(np.float32)
        elif s.name.endswith("_bias"):
            tensors[s.name] = (0.1 * rng.standard_normal(s.shape)).astype(np.float32)
        elif s.name.endswith(".lin_decay"):  # -exp(A_log), A from 0.02 to 4: each step keeps some of the state
            tensors[s.name] = -np.exp(rng.uniform(np.log(0.02), np.log(4.0), s.shape)).astype(np.float32)
        elif s.name.endswith(".sinks"):  # attention sinks: logits of the size of a score's
            tensors[s.name] = rng.standard_normal(s.shape).astype(np.float32)
        else:  # norms
            tensors[s.name] = (1.0 + 0.1 * rng.standard_normal(s.shape)).astype(np.float32)
    return assemble(config, tensors)


def preset_model(name: str, quant: str | QuantMode = "q8", seed: int = 0, **overrides: Any) -> Model:
    """The synthetic model of a named preset; ``overrides`` replace config fields (e.g. num_layers=2; a
    per-layer pattern such as Gemma 3's layer types or Command R7B's layers without RoPE follows the new layer count,
    and only the dense layers among the first n stay)."""
    config = preset_config(name)
    n = overrides.get("num_layers")
    if n is not None:
        was = config.num_layers
        if config.layer_types and "layer_types" not in overrides:
            overrides["layer_types"] = tuple(config.layer_types[i % was] for i in range(n))
        overrides.setdefault("nope_layers", tuple(i for i in range(n) if i % was in config.nope_layers))
        overrides.setdefault("dense_layers", tuple(i for i in config.dense_layers if i < n))
    return synthetic_model(replace(config, **overrides) if overrides else config, quant, seed)
