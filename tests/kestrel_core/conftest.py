"""Fixtures of the formats tests (artifact, HF, GGUF, tokenizer, loader): seeded synthetic checkpoints."""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kestrel_core.errors import KestrelError
from kestrel_core.model.config import ModelConfig


def synth_config(arch: str = "llama", **overrides: object) -> ModelConfig:
    """Hidden 64, 2 layers, GQA 4/2; qwen2 has q/k/v biases, qwen3 q/k norms and head_dim != D/H."""
    base: dict[str, object] = dict(arch=arch, vocab_size=96, hidden_size=64, intermediate_size=256, num_layers=2,
                                   num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                                   rope_theta=10000.0, max_position=128, tie_word_embeddings=False,
                                   bos_token_id=1, eos_token_ids=(2,))
    if arch == "qwen2":
        base.update(qkv_bias=True)
    if arch == "qwen3":
        base.update(qk_norm=True, head_dim=32, tie_word_embeddings=True)
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


class DictSource:
    """A TensorSource over a dict of float32 arrays named the kestrel way (HF orientation)."""

    def __init__(self, config: ModelConfig, tensors: dict[str, np.ndarray]) -> None:
        self.config = config
        self.tensors = tensors
        self.description = "synthetic"

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise KestrelError(f"synthetic: no {name}")
        return self.tensors[name]


def synth_tensors(c: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
    qn, kvn = c.num_heads * hd, c.num_kv_heads * hd

    def mat(n: int, k: int) -> np.ndarray:
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def vec(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"embedding": mat(c.vocab_size, d), "final_norm": vec(d)}
    if not c.tie_word_embeddings:
        t["lm_head"] = mat(c.vocab_size, d)
    shapes = {"q": (qn, d), "k": (kvn, d), "v": (kvn, d), "o": (d, qn), "gate": (f, d), "up": (f, d),
              "down": (d, f)}
    for i in range(c.num_layers):
        for p, (n, k) in shapes.items():
            t[f"layers.{i}.{p}"] = mat(n, k)
        t[f"layers.{i}.attn_norm"] = vec(d)
        t[f"layers.{i}.mlp_norm"] = vec(d)
        if c.qkv_bias:
            t[f"layers.{i}.q_bias"] = vec(qn) - 1
            t[f"layers.{i}.k_bias"] = vec(kvn) - 1
            t[f"layers.{i}.v_bias"] = vec(kvn) - 1
        if c.qk_norm:
            t[f"layers.{i}.q_norm"] = vec(hd)
            t[f"layers.{i}.k_norm"] = vec(hd)
    return t


@pytest.fixture
def synth_source() -> Callable[..., DictSource]:
    """``synth_source(arch="llama", seed=0, **config_overrides)`` -> a DictSource of random weights."""

    def make(arch: str = "llama", seed: int = 0, **overrides: object) -> DictSource:
        config = synth_config(arch, **overrides)
        return DictSource(config, synth_tensors(config, seed))

    return make


CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "What is the capital of France? Paris is the capital of France.",
    "In 2024 the price rose 12.5% to $1,234.56 -- numbers 0123456789.",
    "Ünïcödé: café, naïve, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji 🤖🚀✨.",
    "def f(x):\n    return x ** 2  # code\n\tindented\r\nwindows",
    "She'll say they've done it; we'd agree. I'm sure you're right.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_QWEN2_LIKE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@functools.cache
def _train_bpe_json(pre: str, vocab_size: int) -> str:
    return _train_bpe(pre, vocab_size).to_str()


def train_bpe(pre: str = "gpt2", vocab_size: int = 400) -> Tokenizer:
    """A fresh copy of the (cached) trained tokenizer."""
    return Tokenizer.from_str(_train_bpe_json(pre, vocab_size))


def _train_bpe(pre: str, vocab_size: int) -> Tokenizer:
    """A small byte-level BPE trained on CORPUS, split the way GGUF pre-tokenizer ``pre`` says."""
    tk = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "gpt2":
        tk.pre_tokenizer = byte_level
    elif pre == "smollm":
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre == "qwen2":  # as Qwen2's tokenizer.json: NFC, then its split regex
        tk.normalizer = normalizers.NFC()
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_LIKE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        raise ValueError(pre)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS * 4, trainer)
    return tk


def bpe_vocab(tk: Tokenizer) -> tuple[list[str], list[str], list[int]]:
    """(tokens by id, merges as "a b", llama.cpp token types) of a trained byte-level BPE."""
    model = json.loads(tk.to_str())["model"]
    tokens = [tok for tok, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return tokens, merges, types


def llamacpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp writes it."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight", "q": "attn_q.weight",
              "k": "attn_k.weight", "v": "attn_v.weight", "o": "attn_output.weight", "q_bias": "attn_q.bias",
              "k_bias": "attn_k.bias", "v_bias": "attn_v.bias", "q_norm": "attn_q_norm.weight",
              "k_norm": "attn_k_norm.weight", "gate": "ffn_gate.weight", "up": "ffn_up.weight",
              "down": "ffn_down.weight"}


def write_gguf(path: Path, src: DictSource, *, qtype: str = "F32", tokenizer: Tokenizer | None = None,
               pre: str = "gpt2", chat_template: str | None = None, rope_freqs: np.ndarray | None = None,
               permute: bool | None = None, arch: str | None = None,
               metadata: Callable[[gguf.GGUFWriter], None] | None = None, eos: str = "<|im_end|>",
               token_types: dict[str, int] | None = None) -> Path:
    """Write ``src`` as llama.cpp would: ggml names, Q/K permuted for llama, matrices as F32/F16/Q8_0/Q4_0;
    ``metadata(writer)`` adds more keys; ``eos``: the tokenizer's token the eos id names; ``token_types``: llama.cpp
    token types written for these tokens instead."""
    c = src.config
    arch = arch or c.arch
    permute = arch == "llama" if permute is None else permute
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if c.head_dim != c.hidden_size // c.num_heads:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if tokenizer is not None:
        tokens, merges, types = bpe_vocab(tokenizer)
        for text, kind in (token_types or {}).items():
            types[tokens.index(text)] = kind
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
        w.add_bos_token_id(tokens.index("<|im_start|>"))
        w.add_eos_token_id(tokens.index(eos))
        w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if metadata is not None:
        metadata(w)
    qt = getattr(gguf.GGMLQuantizationType, qtype)

    def put(name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.ndim == 1 or qtype == "F32":
            w.add_tensor(name, arr)
        elif qtype == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)

    put("token_embd.weight", src.tensors["embedding"])
    put("output_norm.weight", src.tensors["final_norm"])
    if "lm_head" in src.tensors:
        put("output.weight", src.tensors["lm_head"])
    if rope_freqs is not None:
        put("rope_freqs.weight", rope_freqs)
    for name, arr in src.tensors.items():
        if name.startswith("layers."):
            _, i, field = name.split(".")
            if permute and field in ("q", "q_bias"):
                arr = llamacpp_permute(arr, c.num_heads, c.num_heads)
            elif permute and field in ("k", "k_bias"):
                arr = llamacpp_permute(arr, c.num_heads, c.num_kv_heads)
            put(f"blk.{i}.{GGUF_NAMES[field]}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


HF_LAYER = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
            "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
            "o": "self_attn.o_proj.weight", "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
            "v_bias": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
            "k_norm": "self_attn.k_norm.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
            "down": "mlp.down_proj.weight"}
HF_GLOBAL = {"embedding": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_name(name: str) -> str:
    if name in HF_GLOBAL:
        return HF_GLOBAL[name]
    _, i, field = name.split(".")
    return f"model.layers.{i}.{HF_LAYER[field]}"


def hf_config(c) -> dict:
    cfg = {"architectures": [HF_ARCH[c.arch]], "model_type": c.arch, "vocab_size": c.vocab_size,
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
           "num_key_value_heads": c.num_kv_heads, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
           "max_position_embeddings": c.max_position, "tie_word_embeddings": c.tie_word_embeddings,
           "bos_token_id": c.bos_token_id, "eos_token_id": list(c.eos_token_ids), "torch_dtype": "float32"}
    if c.arch == "qwen3" or c.head_dim != c.hidden_size // c.num_heads:
        cfg["head_dim"] = c.head_dim
    return cfg


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bit patterns (what torch's .to(torch.bfloat16) does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_raw_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """safetensors by hand, for the dtypes numpy cannot write (BF16, F8_E4M3): each tensor its dtype's name and
    its raw elements; 8-byte header length, JSON header, raw data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, (dtype, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def write_bf16_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    write_raw_safetensors(path, {name: ("BF16", to_bf16_bits(arr)) for name, arr in tensors.items()})


def write_hf_dir(root: Path, src, dtype: str = "f32", shards: int = 1, generation_eos: list[int] | None = None):
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(hf_config(src.config)))
    if generation_eos is not None:
        (root / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    names = sorted(src.tensors)
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for s, group in enumerate(groups):
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {hf_name(n): src.tensors[n] for n in group}
        weight_map.update({k: fname for k in tensors})
        if dtype == "bf16":
            write_bf16_safetensors(root / fname, tensors)
        else:
            save_file({k: v.astype(np.float16 if dtype == "f16" else np.float32) for k, v in tensors.items()},
                      str(root / fname))
    if shards > 1:
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root



@pytest.fixture
def fmt() -> SimpleNamespace:
    """The formats test helpers: tokenizers, GGUF and HF writers, llama.cpp's permute, the corpus."""
    return SimpleNamespace(train_bpe=train_bpe, bpe_vocab=bpe_vocab, write_gguf=write_gguf,
                           write_hf_dir=write_hf_dir, to_bf16_bits=to_bf16_bits, hf_name=hf_name,
                           write_raw_safetensors=write_raw_safetensors,
                           llamacpp_permute=llamacpp_permute, synth_config=synth_config,
                           synth_tensors=synth_tensors, DictSource=DictSource, CORPUS=CORPUS, SPECIALS=SPECIALS)
