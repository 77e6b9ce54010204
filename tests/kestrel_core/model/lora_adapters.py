"""LoRA adapters for the tests, built from a tiny model's own weights: PEFT's directory, llama.cpp's GGUF adapter
(convert_lora_to_gguf.py's layout), and the reference they are compared with, the base with W + s * B @ A
written into a copy of it by hand."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

Pairs = dict[str, tuple[np.ndarray, np.ndarray]]  # a module's HF name -> (A [r, in], B [out, r])
_DTYPES = {"F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "U8": "u1", "I8": "i1"}


def checkpoint_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face directory's safetensors files, float ones as float32 (BF16 widened exactly:
    numpy has no bfloat16, so the files are read by their headers)."""
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        raw = path.read_bytes()
        size = struct.unpack("<Q", raw[:8])[0]
        start = 8 + size
        for name, info in json.loads(raw[8:start]).items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            data = raw[start + begin:start + end]
            if info["dtype"] == "BF16":
                t = (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view(np.float32)
            else:
                t = np.frombuffer(data, _DTYPES[info["dtype"]])
            out[name] = t.astype(np.float32) if t.dtype.kind == "f" else t.copy()
            out[name] = out[name].reshape(info["shape"])
    return out


def peft_adapter(out: Path, base: Path, targets: list[str], r: int = 4, alpha: float = 8, seed: int = 0,
                 full: dict[str, np.ndarray] | None = None) -> Pairs:
    """A PEFT adapter directory at ``out`` on every module of ``base`` whose name ends with one of ``targets``
    (``self_attn.q_proj``), random A and B of std 0.1; ``full``: weights it holds in full by their Hugging Face
    names, as PEFT saves ``modules_to_save``; its pairs, by module name."""
    rng = np.random.default_rng(seed)
    pairs: Pairs = {}
    for name, w in sorted(checkpoint_tensors(base).items()):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and any(module.endswith("." + t) for t in targets):
            pairs[module] = (rng.normal(0, 0.1, (r, w.shape[1])).astype(np.float32),
                             rng.normal(0, 0.1, (w.shape[0], r)).astype(np.float32))
    out.mkdir(parents=True)
    save_file({**{f"base_model.model.{m}.lora_{part}.weight": t for m, (a, b) in pairs.items()
                  for part, t in (("A", a), ("B", b))},
               **{f"base_model.model.{name}": t for name, t in (full or {}).items()}},
              str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": sorted({t.split(".")[-1] for t in targets}),
        "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
        "modules_to_save": sorted({n.removesuffix(".weight").split(".")[-1] for n in full}) if full else None}))
    return pairs


def trained_in_full(base: Path, names: list[str], seed: int = 2) -> dict[str, np.ndarray]:
    """The weights ``names`` (Hugging Face names) of ``base`` as training might leave them: each plus random values
    of std 0.1."""
    rng = np.random.default_rng(seed)
    tensors = checkpoint_tensors(base)
    return {n: (tensors[n] + rng.normal(0, 0.1, tensors[n].shape)).astype(np.float32) for n in names}


def peft_pairs(adapter: Path) -> Pairs:
    """A PEFT adapter directory's (A, B) by module name (not the weights it holds in full)."""
    t = load_file(str(adapter / "adapter_model.safetensors"))
    modules = {k.removeprefix("base_model.model.").split(".lora_")[0] for k in t if ".lora_" in k}
    return {m: (t[f"base_model.model.{m}.lora_A.weight"], t[f"base_model.model.{m}.lora_B.weight"]) for m in modules}


def gguf_adapter(path: Path, pairs: Pairs, arch: str, alpha: float | None, names: dict[str, str],
                 heads: tuple[int, int] | None = None, alora_tokens: list[int] | None = None,
                 value_heads: tuple[int, int, int] | None = None, full: dict[str, np.ndarray] | None = None) -> Path:
    """``pairs`` as llama.cpp's GGUF adapter of ``arch``: ``blk.N.<names[module]>.weight.lora_a`` / ``lora_b``;
    ``heads`` (query, key-value): B's Q and K rows permuted as the converter permutes llama's weights;
    ``alora_tokens``: an aLoRA's invocation tokens; ``value_heads`` (key heads, value heads, value head dim): A's
    columns of a linear attention's out_proj reordered as the converter's ``_reorder_v_heads`` reorders Qwen3.5's,
    from grouped by key head to tiled (value head j of every key head, then j + 1); ``full``: tensors written as they
    are, by their GGUF names (the norms the converter keeps from mergekit-extract-lora's adapters)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    if alpha is not None:
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    if alora_tokens is not None:
        w.add_array("adapter.alora.invocation_tokens", alora_tokens)
    for module, (a, b) in sorted(pairs.items()):
        layer, hf = module.split(".layers.", 1)[1].split(".", 1)
        if heads is not None and hf.endswith(("q_proj", "k_proj")):
            n = heads[0] if hf.endswith("q_proj") else heads[1]
            b = b.reshape(n, 2, -1, b.shape[1]).swapaxes(1, 2).reshape(b.shape)
        if value_heads is not None and hf.endswith("linear_attn.out_proj"):
            keys, values, dim = value_heads
            a = a.reshape(a.shape[0], keys, values // keys, dim).swapaxes(1, 2).reshape(a.shape)
        w.add_tensor(f"blk.{layer}.{names[hf]}.weight.lora_a", np.ascontiguousarray(a))
        w.add_tensor(f"blk.{layer}.{names[hf]}.weight.lora_b", np.ascontiguousarray(b))
    for name, t in (full or {}).items():
        w.add_tensor(name, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hand_merged(out: Path, base: Path,
                adapters: list[tuple[Pairs, float]] | list[tuple[Pairs, float, dict[str, np.ndarray]]]) -> Path:
    """A copy of ``base`` at ``out`` whose weights are float32 W + s1 * B1 @ A1 + s2 * B2 @ A2 ..., each adapter's
    pairs with its whole scale (alpha / r times the user's), added in order; an adapter's third member, weights by
    their Hugging Face names, first put in the base's place."""
    out.mkdir(parents=True)
    for f in base.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    tensors = checkpoint_tensors(base)
    for pairs, scale, *full in adapters:
        tensors.update(*full)
        for module, (a, b) in pairs.items():
            tensors[module + ".weight"] = tensors[module + ".weight"] + np.float32(scale) * (b @ a)
    save_file(tensors, str(out / "model.safetensors"))
    return out
