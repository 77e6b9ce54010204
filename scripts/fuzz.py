"""Fuzz kestrel's untrusted-input paths: every case must end in success or a KestrelError, within limits.

    python3 scripts/fuzz.py --cases 10000 [--target gguf,gguf-meta,kst,safetensors,config,template]
                            [--seed 0] [--rlimit-mb 1024] [--case-timeout 10]

Targets: mutated bytes of a small valid GGUF / .kst artifact / safetensors checkpoint, GGUF files written with
random typed metadata values, random config.json dicts, random chat templates built from hostile pieces.
Each case runs in this process under ``RLIMIT_AS`` (the address space at start plus ``--rlimit-mb``: a case
that tries to allocate more fails with MemoryError, counted as a failure) and a SIGALRM per-case timeout
(a hang is a failure). Exit 0 when every case passed; the failures are printed (target, seed, exception).
tests/kestrel_core/model/test_fuzz.py runs the same checks under hypothesis, briefly, in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_core.errors import KestrelError  # noqa: E402
from kestrel_core.model.config import ModelConfig  # noqa: E402

TARGETS = ("gguf", "gguf-meta", "kst", "safetensors", "int-checkpoint", "config", "template")
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "models"
INT_TWINS = ("tiny-qwen3-gptq", "tiny-qwen3-awq", "tiny-llama-gptq-int8", "tiny-qwen3-moe-w4a16", "tiny-qwen2-w8a8",
             "tiny-qwen3-bnb-4bit", "tiny-qwen2-bnb-8bit")
INTERESTING = [0, 1, 2, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 2 ** 62, 2 ** 63 - 1, 2 ** 64 - 1]


class CaseTimeout(BaseException):
    """Raised by SIGALRM: the case hung (BaseException, so no ``except Exception`` in kestrel swallows it)."""


# -- seeds: small valid inputs -----------------------------------------------------------------------------


def tiny_config(arch: str = "llama") -> ModelConfig:
    """One layer, hidden 32 (the smallest width the G=32 quantizer takes), a 16-token vocabulary."""
    return ModelConfig(arch=arch, vocab_size=16, hidden_size=32, intermediate_size=32, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position=64,
                       tie_word_embeddings=arch != "llama", qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
                       bos_token_id=1, eos_token_ids=(2,))


def tiny_tensors(c: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under kestrel names, HF orientation."""
    rng = np.random.default_rng(seed)
    d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
    qn, kvn = c.num_heads * hd, c.num_kv_heads * hd
    t = {"embedding": rng.standard_normal((c.vocab_size, d)).astype(np.float32),
         "final_norm": np.ones(d, np.float32)}
    if not c.tie_word_embeddings:
        t["lm_head"] = rng.standard_normal((c.vocab_size, d)).astype(np.float32)
    for p, shape in {"q": (qn, d), "k": (kvn, d), "v": (kvn, d), "o": (d, qn), "gate": (f, d), "up": (f, d),
                     "down": (d, f)}.items():
        t[f"layers.0.{p}"] = rng.standard_normal(shape).astype(np.float32)
    t["layers.0.attn_norm"] = np.ones(d, np.float32)
    t["layers.0.mlp_norm"] = np.ones(d, np.float32)
    return t


_GGUF_NAMES = {"embedding": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}
_GGUF_LAYER = {"q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "o": "attn_output.weight",
               "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight",
               "attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight"}
_VOCAB = ["a", "b", "c", "d", "ab", "cd", "abcd", "<s>", "</s>", "Ġ", "Ġa", "e", "f", "ef", "g", "h"]
_MERGES = ["a b", "c d", "ab cd", "Ġ a", "e f"]


def gguf_bytes(tmp: Path, meta: dict[str, tuple[str, Any]] | None = None) -> bytes:
    """A small llama GGUF (F32 tensors, a byte-level BPE vocabulary, a chat template); ``meta`` overrides or
    adds metadata as {key: (gguf-py add_* kind, value)}."""
    import gguf

    c = tiny_config("llama")
    path = tmp / "seed.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    base: dict[str, tuple[str, Any]] = {
        "llama.block_count": ("uint32", c.num_layers), "llama.context_length": ("uint32", c.max_position),
        "llama.embedding_length": ("uint32", c.hidden_size),
        "llama.feed_forward_length": ("uint32", c.intermediate_size),
        "llama.attention.head_count": ("uint32", c.num_heads),
        "llama.attention.head_count_kv": ("uint32", c.num_kv_heads),
        "llama.rope.freq_base": ("float32", c.rope_theta),
        "llama.attention.layer_norm_rms_epsilon": ("float32", c.rms_norm_eps),
        "tokenizer.ggml.model": ("string", "gpt2"), "tokenizer.ggml.pre": ("string", "gpt2"),
        "tokenizer.ggml.tokens": ("array", _VOCAB), "tokenizer.ggml.merges": ("array", _MERGES),
        "tokenizer.ggml.token_type": ("array", [1] * 7 + [3, 3] + [1] * 7),
        "tokenizer.ggml.bos_token_id": ("uint32", 7), "tokenizer.ggml.eos_token_id": ("uint32", 8),
        "tokenizer.chat_template": ("string", "{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
                                              "{% endfor %}"),
    }
    base.update(meta or {})
    for key, (kind, value) in base.items():
        getattr(w, f"add_{kind}")(key, value)
    for name, arr in tiny_tensors(c).items():
        gname = _GGUF_NAMES.get(name) or "blk.0." + _GGUF_LAYER[name.split(".", 2)[2]]
        w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


class _Source:
    def __init__(self, config: ModelConfig, tensors: dict[str, np.ndarray]) -> None:
        self.config, self.tensors, self.description = config, tensors, "fuzz seed"

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> np.ndarray:
        return self.tensors[name]


def kst_bytes(tmp: Path) -> bytes:
    """A small q8 artifact of a qwen2 model (tied, with biases), written by save_artifact."""
    from kestrel_core.artifact_write import save_artifact
    from kestrel_core.model.quantize import quantize_model

    c = tiny_config("qwen2")
    t = tiny_tensors(c)
    for p in ("q", "k", "v"):
        t[f"layers.0.{p}_bias"] = np.zeros(t[f"layers.0.{p}"].shape[0], np.float32)
    model = quantize_model(_Source(c, t), "q8")
    path = save_artifact(tmp / "seed.kst", model, quant="q8", chat_template="{{ messages[0].content }}")
    return Path(path).read_bytes()


def safetensors_bytes() -> bytes:
    """The tiny llama's weights as a HF model.safetensors (F32, one BF16 tensor written as raw bits)."""
    c = tiny_config("llama")
    hf = {"embedding": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    layer = {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
             "o": "self_attn.o_proj.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
             "down": "mlp.down_proj.weight", "attn_norm": "input_layernorm.weight",
             "mlp_norm": "post_attention_layernorm.weight"}
    header: dict[str, Any] = {}
    blobs: list[bytes] = []
    pos = 0
    for name, arr in tiny_tensors(c).items():
        key = hf.get(name) or "model.layers.0." + layer[name.split(".", 2)[2]]
        if name == "final_norm":  # bf16 bits
            raw, dtype = (arr.view(np.uint32) >> 16).astype("<u2").tobytes(), "BF16"
        else:
            raw, dtype = arr.astype("<f4").tobytes(), "F32"
        header[key] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [pos, pos + len(raw)]}
        blobs.append(raw)
        pos += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 32, "intermediate_size": 32,
             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64,
             "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 32}}

# hostile and ordinary pieces a random chat template is assembled from
TEMPLATE_PIECES = [
    "{% for m in messages %}", "{% endfor %}", "{{ m.content }}", "{{ m['role'] }}", "{% if loop.last %}",
    "{% endif %}", "{% for i in range(1000) %}", "{% for i in range(99999) %}", "{% for c in 'abcdefgh' * 50 %}",
    "{{ 'a' * 300000000 }}", "{{ 'ab' * 1000 }}", "{{ [1] * 100000000 }}", "{{ 2 ** 100000000 }}", "{{ 9 ** 99 }}",
    "{{ 'x'|center(1000000000) }}", "{{ 'x'|indent(100) }}", "{{ 'y'|replace('', 'zz') }}",
    "{{ '%0999999999d' % 1 }}", "{{ '{:>999999999}'.format(1) }}", "{{ 'a'.ljust(99999999999) }}",
    "{% set ns = namespace(s='ab') %}", "{% set ns.s = ns.s ~ ns.s %}", "{{ ns.s|length }}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}", "{{ f(40) }}",
    "{% macro g() %}{{ g() }}{% endmacro %}{{ g() }}", "{{ raise_exception('no') }}", "{{ x.__class__ }}",
    "{{ messages.append(1) }}", "{{ bos_token }}", "{{ messages|tojson(indent=2) }}", "{{ 1 / 0 }}",
    "{{ (range(100000)|list)|join(',') }}", "{{ strftime_now('%Y') }}", "{{ loop.length }}", "{{", "{%", "}}",
    "{% for x in range(10) recursive %}{{ loop(range(10)) }}{% endfor %}", "text ", "\n", "{{ 10.0 ** 400 }}",
]


# -- mutation --------------------------------------------------------------------------------------------


def mutate(data: bytes, rng: random.Random, header: int | None = None) -> bytes:
    """A few random edits: bit flips, bytes, interesting 4/8-byte integers, a cut, a deletion, an insertion.
    ``header``: most edits land in the first ``header`` bytes (where the lengths are)."""
    buf = bytearray(data)
    span = min(len(buf), header or len(buf)) or 1
    for _ in range(rng.randint(1, 6)):
        kind = rng.random()
        pos = rng.randrange(span) if rng.random() < 0.85 else rng.randrange(max(len(buf), 1))
        if not buf:
            buf += bytes(rng.randrange(256) for _ in range(8))
        pos = min(pos, len(buf) - 1)
        if kind < 0.3:
            buf[pos] ^= 1 << rng.randrange(8)
        elif kind < 0.5:
            buf[pos] = rng.randrange(256)
        elif kind < 0.75:
            width = rng.choice((4, 8))
            value = rng.choice(INTERESTING) & ((1 << (8 * width)) - 1)
            buf[pos:pos + width] = value.to_bytes(width, "little")
        elif kind < 0.85:
            del buf[rng.randrange(len(buf) + 1):]
        elif kind < 0.93:
            del buf[pos:pos + rng.randint(1, 16)]
        else:
            buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    return bytes(buf)


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A JSON-ish value of a random type, often a boundary."""
    kinds = ["none", "bool", "int", "bigint", "float", "special", "str", "numstr"] + (["list", "dict"] if depth < 2
                                                                                       else [])
    kind = rng.choice(kinds)
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([-1, 0, 1, 2, 3, 4, 16, 32, 64, 1000])
    if kind == "bigint":
        return rng.choice([2 ** 31, 2 ** 62, -(2 ** 63), 10 ** 30])
    if kind == "float":
        return rng.choice([0.0, -1.0, 1e-5, 0.5, 3.5, 1e308, 1e-320])
    if kind == "special":
        return rng.choice([float("nan"), float("inf"), float("-inf")])
    if kind == "str":
        return rng.choice(["", "llama3", "default", "yarn", "x" * 100])
    if kind == "numstr":
        return rng.choice(["3", "1e-5", "nan", "-1"])
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["rope_type", "factor", "type", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings", "rope_theta"]): random_value(rng, depth + 1)
            for _ in range(rng.randint(0, 5))}


def random_config(rng: random.Random) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads(json.dumps(HF_CONFIG))
    for _ in range(rng.randint(1, 4)):
        key = rng.choice(list(HF_CONFIG) + ["rope_parameters", "model_type", "mlp_bias", "attention_bias"])
        if rng.random() < 0.15:
            cfg.pop(key, None)
        else:
            cfg[key] = random_value(rng)
    if rng.random() < 0.3 and isinstance(cfg.get("rope_scaling"), dict):
        cfg["rope_scaling"][rng.choice(list(HF_CONFIG["rope_scaling"]))] = random_value(rng)  # type: ignore[index]
    return cfg


GGUF_META_KEYS = ["llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
                  "llama.attention.head_count", "llama.attention.head_count_kv", "llama.attention.key_length",
                  "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon", "llama.context_length",
                  "llama.rope.scaling.type", "llama.rope.scaling.original_context_length", "general.architecture",
                  "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.tokens",
                  "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.pre", "tokenizer.ggml.model",
                  "tokenizer.chat_template", "general.alignment", "tokenizer.ggml.add_bos_token"]


def random_gguf_meta(rng: random.Random) -> dict[str, tuple[str, Any]]:
    """Metadata overrides with random GGUF types and values (bools, negative ints, NaN floats, strings...)."""
    out: dict[str, tuple[str, Any]] = {}
    for _ in range(rng.randint(1, 4)):
        key = rng.choice(GGUF_META_KEYS)
        kind = rng.choice(["uint32", "int32", "uint64", "int64", "float32", "float64", "bool", "string", "array"])
        if kind in ("uint32", "uint64"):
            value: Any = rng.choice([0, 1, 2, 3, 16, 32, 2 ** 31, 2 ** 32 - 1]
                                    + ([2 ** 63] if kind == "uint64" else []))
        elif kind in ("int32", "int64"):
            value = rng.choice([-1, 0, 1, 2, 16, -(2 ** 31)])
        elif kind in ("float32", "float64"):
            value = rng.choice([0.0, -1.0, 1e-5, 3.5, float("nan"), float("inf"), 1e30])
        elif kind == "bool":
            value = rng.random() < 0.5
        elif kind == "string":
            value = rng.choice(["", "llama", "gpt2", "qwen2", "linear", "{{ 'a' * 300000000 }}", "3"])
        else:
            value = rng.choice([[], [1, 2], ["a b"], ["x"] * 20, [1.5], ["a", "a"], [True]])
        if key == "general.architecture" and kind != "string":
            continue  # the writer names the architecture itself; a second entry is a duplicate key
        out[key] = (kind, value)
    return out


def random_template(rng: random.Random) -> str:
    return "".join(rng.choice(TEMPLATE_PIECES) for _ in range(rng.randint(1, 8)))


# -- the checks (each: success or KestrelError) -------------------------------------------------------------


def check_gguf_file(path: Path) -> None:
    """Read a GGUF the way the loader does: config, tokenizer (and its chat template), every tensor."""
    from kestrel_core.model.gguf_reader import GGUFCheckpoint
    from kestrel_core.model.tokenizer import Tokenizer

    ck = GGUFCheckpoint(path)
    tok = Tokenizer.from_gguf_vocab(ck.tokenizer_fields(), where=str(path))
    for name in list(ck._tensors):
        ck.get(name)
    if tok.chat_template:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def check_kst_file(path: Path) -> None:
    from kestrel_core.artifact_load import load_artifact

    load_artifact(path)


def check_hf_dir(root: Path) -> None:
    from kestrel_core.model.hf import HFCheckpoint

    ck = HFCheckpoint(root)
    for name in list(ck._files):
        ck.get(name)


def int_checkpoint_case(tmp: Path, rng: random.Random) -> Callable[[], None]:
    """One of the integer twins in ``tmp``/int, its bytes or its quantization_config mutated; the check loads it."""
    twin = FIXTURES / rng.choice(INT_TWINS)
    root = tmp / "int"
    root.mkdir(exist_ok=True)
    cfg = json.loads((twin / "config.json").read_text())
    if rng.random() < 0.5:
        cfg["quantization_config"] = mutate_json(cfg["quantization_config"], rng)
    (root / "config.json").write_text(json.dumps(cfg))
    data = (twin / "model.safetensors").read_bytes()
    header = 8 + struct.unpack("<Q", data[:8])[0]
    (root / "model.safetensors").write_bytes(mutate(data, rng, header) if rng.random() < 0.7 else data)
    return lambda: quantize_hf_dir(root)


def quantize_hf_dir(root: Path) -> None:
    """Every weight read and quantized as loading does (q8 and q4: the codes kept, or decoded and quantized)."""
    from kestrel_core.model.hf import HFCheckpoint
    from kestrel_core.model.quantize import parse_quant, quantize_tensor

    ck = HFCheckpoint(root)
    for name in list(ck._files):
        w = ck.get_weight(name)
        if w.ndim == 2 and w.shape[1] % 32 == 0:
            for quant in ("q8", "q4"):
                mode = parse_quant(quant)
                quantize_tensor(w, mode.bits, mode, name)
        else:
            ck.get(name)


def mutate_json(value: Any, rng: random.Random) -> Any:
    """``value`` with one entry somewhere replaced by a hostile one (another type, an extreme number, deleted)."""
    hostile = [None, True, -1, 0, 3, 7, 2 ** 31, 1e308, float("nan"), "", "x" * 1000, [], {}, [4], {"a": 1}, 4.0]
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        out = dict(value)
        if rng.random() < 0.15:
            del out[key]
        else:
            out[key] = mutate_json(value[key], rng)
        return out
    if isinstance(value, list) and value and rng.random() < 0.8:
        i = rng.randrange(len(value))
        return value[:i] + [mutate_json(value[i], rng)] + value[i + 1:]
    return rng.choice(hostile)


def check_config(cfg: dict[str, Any]) -> None:
    """hf_config.config_from_hf, which runs validate.check_hf_config first and ModelConfig's checks last."""
    from kestrel_core.model.hf_config import config_from_hf

    config_from_hf(cfg)


def check_template(source: str) -> None:
    """Render through Tokenizer.apply_chat_template (the path every prompt takes), on a trivial vocabulary."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    from kestrel_core.model.tokenizer import Tokenizer

    tok = Tokenizer(Backend(models.BPE()), chat_template=source, bos_token="<s>", eos_token="</s>")
    tok.apply_chat_template([{"role": "user", "content": "hi"}])


def fast_template_limits(steps: int = 200_000, seconds: float = 2.0) -> None:
    """Smaller per-render limits than production's, so that hostile cases end sooner."""
    from kestrel_core.model import chat_template

    chat_template.MAX_TEMPLATE_STEPS = steps
    chat_template.MAX_TEMPLATE_SECONDS = seconds


class Fuzzer:
    """Seeds built once in ``tmp``; ``case(target, rng)`` builds one input and checks it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.gguf = gguf_bytes(tmp)
        self.kst = kst_bytes(tmp)
        self.st = safetensors_bytes()
        n = struct.unpack("<Q", self.kst[:8])[0]
        self.kst_header = 8 + n
        self.st_header = 8 + struct.unpack("<Q", self.st[:8])[0]
        self.gguf_header = self.gguf.index(b"token_embd.weight") + 200

    def case(self, target: str, rng: random.Random) -> Callable[[], None]:
        """The check for one random input of ``target`` (built now, run by the caller)."""
        p = self.tmp / f"case-{target}"
        if target == "gguf":
            data = mutate(self.gguf, rng, self.gguf_header) if rng.random() < 0.9 else \
                b"GGUF" + bytes(rng.randrange(256) for _ in range(rng.randint(0, 96)))
            p.write_bytes(data)
            return lambda: check_gguf_file(p)
        if target == "gguf-meta":
            gdir = self.tmp / "meta"
            gdir.mkdir(exist_ok=True)
            try:
                data = gguf_bytes(gdir, random_gguf_meta(rng))
            except Exception:  # gguf-py refused to write these values: nothing to read
                data = self.gguf
            p.write_bytes(data)
            return lambda: check_gguf_file(p)
        if target == "kst":
            p = p.with_suffix(".kst")
            p.write_bytes(mutate(self.kst, rng, self.kst_header))
            return lambda: check_kst_file(p)
        if target == "safetensors":
            root = self.tmp / "hf"
            root.mkdir(exist_ok=True)
            (root / "config.json").write_text(json.dumps(HF_CONFIG))
            (root / "model.safetensors").write_bytes(mutate(self.st, rng, self.st_header))
            return lambda: check_hf_dir(root)
        if target == "int-checkpoint":
            return int_checkpoint_case(self.tmp, rng)
        if target == "config":
            cfg = random_config(rng)
            return lambda: check_config(cfg)
        if target == "template":
            src = random_template(rng)
            return lambda: check_template(src)
        raise ValueError(target)


def limit_memory(extra_mb: int) -> None:
    """Cap the address space at what the process maps now plus ``extra_mb``."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + extra_mb * 2 ** 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def run_one(check: Callable[[], None], timeout_s: float) -> str | None:
    """None when the case passed (success or KestrelError); else what went wrong."""

    def alarm(signum: int, frame: Any) -> None:
        raise CaseTimeout()

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        check()
        return None
    except KestrelError as exc:
        if "\n" in str(exc):
            return f"KestrelError of several lines: {str(exc)[:300]!r}"
        return None
    except CaseTimeout:
        return f"no result within {timeout_s:g} s"
    except MemoryError:
        return "MemoryError (past the address-space limit)"
    except Exception as exc:
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        return f"{type(exc).__name__}: {str(exc)[:200]} ({Path(tb.filename).name}:{tb.lineno})"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=1000, help="cases in all, spread over the targets")
    ap.add_argument("--target", default=",".join(TARGETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rlimit-mb", type=int, default=1024, help="address space a case may add (0: no limit)")
    ap.add_argument("--case-timeout", type=float, default=10.0)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    targets = [t for t in args.target.split(",") if t]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        ap.error(f"unknown target(s) {unknown}; known: {', '.join(TARGETS)}")
    import logging

    logging.disable(logging.CRITICAL)
    failures: list[tuple[str, int, str]] = []
    counts = dict.fromkeys(targets, 0)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kestrel-fuzz-") as tmp:
        fuzzer = Fuzzer(Path(tmp))
        fast_template_limits()
        if args.rlimit_mb:
            limit_memory(args.rlimit_mb)
        for i in range(args.cases):
            target = targets[i % len(targets)]
            case_seed = args.seed * 1_000_003 + i
            check = fuzzer.case(target, random.Random(case_seed))
            problem = run_one(check, args.case_timeout)
            counts[target] += 1
            if problem is not None:
                failures.append((target, case_seed, problem))
                print(f"FAIL {target} seed {case_seed}: {problem}", flush=True)
            if not args.quiet and (i + 1) % 1000 == 0:
                print(f"{i + 1} cases, {len(failures)} failures, {time.monotonic() - t0:.0f} s", flush=True)
    per = ", ".join(f"{t} {n}" for t, n in counts.items())
    print(f"{args.cases} cases ({per}) in {time.monotonic() - t0:.0f} s: {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("KESTREL_PLUGINS", "")
    sys.exit(main())
