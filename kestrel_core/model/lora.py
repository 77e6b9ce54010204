"""LoRA adapters (PEFT's format), merged into the model's float weights before they are quantized.

A PEFT adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ...) and
``adapter_model.safetensors`` with, for each adapted projection, ``...<module>.lora_A.weight`` [r, in] and
``...lora_B.weight`` [out, r]. Merged, the projection is W + s * B @ A with s = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)) times the user's scale, exactly what PEFT's ``merge_and_unload`` computes, so the
strip-cache quantizes the adapted model itself and every backend runs it at no cost. ``LoraSource`` does the
merge for any TensorSource (a Hugging Face directory or a GGUF file: kestrel's names and HF's orientation are the
same for both), naming the adapter's modules as the base's architecture names its weights (LFM2's ``w1`` is its
gate); a module fused of several of kestrel's projections (Phi-3's ``qkv_proj``) gives each its rows of B. A
weight the adapter holds in full (PEFT's ``modules_to_save``, an embedding saved beside a resized vocabulary, a
trained norm) takes the base's place, as PEFT's loading puts it there. What PEFT can hold but kestrel does not
merge (DoRA, biases, LoRAs of embeddings or expert projections, per-module ranks) is refused by name.

llama.cpp's adapters (``convert_lora_to_gguf.py``: a GGUF of ``general.type`` adapter, ``adapter.lora.alpha``,
tensors ``blk.N.<tensor>.weight.lora_a`` [r, in] and ``.lora_b`` [out, r]) merge the same way, s = alpha / r; the
converter writes them in the layout it writes the base's weights in (Q and K rows permuted for llama's family,
Qwen3.5's value heads tiled along its linear attention's out_proj columns), which the merge takes B @ A back from
as the GGUF reader takes the base's (gguf_reader.hf_layout); a tensor it keeps fused (phi3's ``attn_qkv`` and
``ffn_up``, glm4's ``ffn_up``, gated attention's ``attn_q``) gives each part its rows of B as the reader gives the
base's (gguf_reader.tensor_parts), as a PEFT adapter's fused module does. The converter keeps an adapter's norms
(mergekit-extract-lora's) as tensors of their own, which take the base's place too (llama.cpp passes over them).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from kestrel_core.contract import BFloat16Bits
from kestrel_core.errors import KestrelError, os_error
from kestrel_core.model.config import ModelConfig
from kestrel_core.model.hf import Rows, kestrel_form, kestrel_name, raw_elements, tensor_parts
from kestrel_core.model.quantize import TensorSource, fused_rows
from kestrel_core.model.validate import ValidationError, check_bool, check_float, check_int, check_regular_file
from kestrel_core.model.weights import model_specs

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# the projections an adapter may change (q_a, q_b, kv_a, kv_b: a latent attention's; attn_gate: the gate rows of
# gated attention's q_proj)
MERGED = frozenset({"q", "k", "v", "o", "gate", "up", "down", "q_a", "q_b", "kv_a", "kv_b", "attn_gate"})
_PREFIX = "base_model.model."
LoraPaths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]  # one adapter, or several


@dataclass(frozen=True)
class Adapter:
    """An adapter read for merging: each adapted weight's name in the adapter's own vocabulary (``pairs``: a PEFT
    module's Hugging Face name, or a GGUF adapter's tensor name) -> (A [r, in], B [out, r]) float32, and its scale;
    ``key``: a hash of its files, which names it in the model cache; ``architecture``: a GGUF adapter's
    general.architecture (None for PEFT's); ``tensors``: the weights it holds in full, which replace the base's,
    by their names in its vocabulary (``model.norm.weight``, ``blk.0.attn_norm.weight``), float32. The names become
    kestrel's with the base's architecture, which only the base knows: ``LoraSource``."""

    path: Path
    scale: float
    pairs: dict[str, tuple[np.ndarray, np.ndarray]]
    key: str
    tensors: dict[str, np.ndarray]
    architecture: str | None = None


def lora_paths(lora: Any) -> list[str | os.PathLike[str]]:
    """``lora``, one adapter's path or a list of them, as a list; anything else is a KestrelError."""
    paths = [lora] if isinstance(lora, (str, os.PathLike)) else lora
    if not isinstance(paths, (list, tuple)) or not paths or not all(isinstance(p, (str, os.PathLike)) for p in paths):
        raise KestrelError(f"lora must be a path or a list of paths, got {type(lora).__name__}")
    return list(paths)


def read_adapters(lora: LoraPaths, scale: float | Sequence[float] = 1.0) -> tuple[Adapter, ...]:
    """The adapters at ``lora`` (a path, or a list of them: merged in order); ``scale`` multiplies their own, one
    for all of them, or a list of one each, in order (llama.cpp's --lora-scaled FNAME SCALE, one a file)."""
    paths = lora_paths(lora)
    scales = list(scale) if isinstance(scale, (list, tuple)) else [scale]
    if len(scales) == 1:
        scales *= len(paths)
    if len(scales) != len(paths):
        raise KestrelError(f"{len(paths)} LoRA adapters (--lora) and {len(scales)} scales (--lora-scale): give one "
                           "scale for all of them, or one for each, in order")
    return tuple(read_adapter(p, s) for p, s in zip(paths, scales, strict=True))


def read_adapter(path: str | Path, scale: float = 1.0) -> Adapter:
    """The LoRA adapter at ``path``: a PEFT directory or llama.cpp's GGUF; ``scale`` multiplies its own
    (llama.cpp's --lora-scaled)."""
    d = Path(path).expanduser()
    try:
        is_file, is_dir = d.is_file(), d.is_dir()
    except OSError as exc:  # a name too long, a directory it may not search
        raise os_error(exc, "LoRA adapter", d) from None
    if is_file and d.suffix in (".safetensors", ".json"):
        raise KestrelError(f"LoRA adapter {d}: a PEFT adapter is its directory ({d.parent}), not one of its files")
    if is_file:
        return _gguf_adapter(d, scale)
    if not is_dir:
        raise KestrelError(f"LoRA adapter {d}: no such directory or file (a PEFT adapter: {', '.join(ADAPTER_FILES)};"
                           " or llama.cpp's GGUF adapter)")
    files = [check_regular_file(d / name, d) for name in ADAPTER_FILES if (d / name).exists()]
    if len(files) != len(ADAPTER_FILES):
        raise KestrelError(f"LoRA adapter {d}: needs {' and '.join(ADAPTER_FILES)} (pickle .bin adapters are never "
                           "opened)")
    where = f"LoRA adapter {d}"
    try:
        cfg = json.loads(files[0].read_text(encoding="utf-8"))
    except OSError as exc:
        raise os_error(exc, f"{where}: cannot read", files[0]) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise KestrelError(f"{where}: adapter_config.json is not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise KestrelError(f"{where}: adapter_config.json must be an object")
    try:
        own = _scale(cfg)
        scale = check_float("LoRA scale", scale) * own
    except ValidationError as exc:
        raise KestrelError(f"{where}: {exc}") from None
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.read_bytes())
    digest.update(repr(scale).encode())
    pairs, tensors = _peft_tensors(files[1], where, int(cfg["r"]))
    return Adapter(d, scale, pairs, digest.hexdigest(), tensors)


def _scale(cfg: dict[str, Any]) -> float:
    """lora_alpha / r (rsLoRA: / sqrt(r)); what the merge cannot honour is a ValidationError naming it."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValidationError(f"peft_type {cfg.get('peft_type')!r} is not supported (kestrel merges LORA)")
    unsupported = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out weights", "rank_pattern": "per-module ranks",
                   "alpha_pattern": "per-module alphas", "layers_to_transform": "a subset of layers by index",
                   "use_qalora": "QA-LoRA", "layer_replication": "layers repeated", "alora_invocation_tokens":
                   "aLoRA (from its tokens on: not mergeable)", "arrow_config": "an Arrow router (not mergeable)"}
    for key, what in unsupported.items():
        value = cfg.get(key)  # unset: PEFT's None, false or empty; layers_to_transform 0 is layer 0
        if not (value is None or value is False or (isinstance(value, (list, dict, str)) and not value)):
            raise ValidationError(f"{key} ({what}) is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValidationError(f"bias {cfg.get('bias')!r} (trained biases) is not supported")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(("pissa", "olora", "corda", "loftq")):
        raise ValidationError(f"init_lora_weights {init!r} is not supported (PEFT changes the base weights as it "
                              "loads such an adapter; convert it to a plain LoRA as PEFT's docs say)")
    r = check_int("r", cfg.get("r"), 1)
    alpha = check_float("lora_alpha", cfg.get("lora_alpha", 8), 0.0)  # LoraConfig's default
    rs = check_bool("use_rslora", cfg.get("use_rslora", False))
    return alpha / (math.sqrt(r) if rs else r)


def _peft_tensors(path: Path, where: str, r: int
                  ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, np.ndarray]]:
    """Each adapted module's (A, B) of rank ``r``, by its Hugging Face name (``model.layers.0.self_attn.q_proj``),
    and each weight the adapter holds in full by its own (``model.norm.weight``): PEFT saves ``modules_to_save``
    and an embedding beside a resized vocabulary so, and PEFT's loading puts them in the base's place."""
    pairs: dict[str, dict[str, np.ndarray]] = {}
    tensors: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="numpy") as f:
            for key in f.keys():
                module, sep, part = key.rpartition(".lora_")
                if sep and part not in ("A.weight", "B.weight"):
                    raise KestrelError(f"{where}: tensor {key} is not a LoRA A or B matrix (kestrel merges those, and "
                                       "weights held in full)")
                dtype = f.get_slice(key).get_dtype()
                if not sep and dtype not in ("F32", "F16", "BF16"):
                    raise KestrelError(f"{where}: tensor {key} is {dtype}; a weight held in full must be F32, F16 "
                                       "or BF16")
                t = _bf16(path, key) if dtype == "BF16" else np.asarray(f.get_tensor(key), dtype=np.float32)
                if sep:  # numpy has no bfloat16: BF16 is widened from its bits
                    pairs.setdefault(module.removeprefix(_PREFIX), {})[part[0]] = t
                else:
                    tensors[key.removeprefix(_PREFIX)] = t
    except (SafetensorError, TypeError) as exc:  # TypeError: a dtype numpy does not have
        raise KestrelError(f"{where}: adapter_model.safetensors is unreadable ({exc})") from None
    return _checked(pairs, tensors, where, r)


def _bf16(path: Path, key: str) -> np.ndarray:
    """A BF16 tensor of a safetensors file as float32 (exactly: bf16 is the top half of an f32)."""
    return BFloat16Bits(raw_elements(path, key, "<u2")).to_float32()


def _checked(pairs: dict[str, dict[str, np.ndarray]], tensors: dict[str, np.ndarray], where: str,
             r: int | None = None) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, np.ndarray]]:
    """Each weight's (A, B), checked to make a finite rank-r product (``r``: the config's, which PEFT requires), and
    the weights held in full, checked finite."""
    out = {}
    for name, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise KestrelError(f"{where}: {name} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise KestrelError(f"{where}: {name}'s lora_A {list(a.shape)} and lora_B {list(b.shape)} do not make a "
                               "rank-r product")
        if r is not None and a.shape[0] != r:
            raise KestrelError(f"{where}: {name}'s lora_A has rank {a.shape[0]}; adapter_config.json says r {r}")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise KestrelError(f"{where}: {name} has NaN or infinite values")
        out[name] = (a, b)
    for name, t in tensors.items():
        if not np.isfinite(t).all():
            raise KestrelError(f"{where}: {name} has NaN or infinite values")
    if not out and not tensors:
        raise KestrelError(f"{where}: it holds no LoRA matrices")
    return out, tensors


def _gguf_adapter(path: Path, scale: float) -> Adapter:
    """llama.cpp's GGUF LoRA adapter at ``path``."""
    from gguf import GGUFReader

    from kestrel_core.model.gguf_bounds import check_gguf_bounds
    from kestrel_core.model.gguf_meta import dequantize_tensor

    where = f"LoRA adapter {path}"
    check_regular_file(path)
    check_gguf_bounds(path)
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # gguf-py raises ValueError, struct/IndexError... on bad bytes
        raise KestrelError(f"{where}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    if field("general.type") != "adapter" or field("adapter.type") != "lora":
        raise KestrelError(f"{where}: not a LoRA adapter (general.type {field('general.type')!r}, adapter.type "
                           f"{field('adapter.type')!r})")
    if field("adapter.alora.invocation_tokens") is not None:
        raise KestrelError(f"{where}: an aLoRA adapter (adapter.alora.invocation_tokens: from those tokens on) "
                           "cannot be merged")
    arch = field("general.architecture")
    if not isinstance(arch, str):
        raise KestrelError(f"{where}: it has no general.architecture (llama.cpp refuses such an adapter)")
    pairs: dict[str, dict[str, np.ndarray]] = {}
    tensors: dict[str, np.ndarray] = {}  # held in full: the norms the converter keeps (mergekit-extract-lora's)
    for t in reader.tensors:
        base, sep, part = t.name.rpartition(".lora_")
        if sep and part not in ("a", "b"):
            raise KestrelError(f"{where}: tensor {t.name} is not a LoRA matrix (.lora_a or .lora_b)")
        if sep:
            pairs.setdefault(base, {})[part.upper()] = dequantize_tensor(t, where)
        else:
            tensors[t.name] = dequantize_tensor(t, where)
    checked, tensors = _checked(pairs, tensors, where)
    ranks = {a.shape[0] for a, _ in checked.values()}
    if len(ranks) > 1:
        raise KestrelError(f"{where}: its matrices have several ranks; kestrel merges one alpha / r")
    alpha = field("adapter.lora.alpha")
    try:  # llama.cpp: alpha / r, or 1 where the file gives no alpha
        own = 1.0 if not alpha or not ranks else check_float("adapter.lora.alpha", alpha, 0.0) / ranks.pop()
        scale = check_float("LoRA scale", scale) * own
    except ValidationError as exc:
        raise KestrelError(f"{where}: {exc}") from None
    digest = hashlib.sha256(path.read_bytes())
    digest.update(repr(scale).encode())
    return Adapter(path, scale, checked, digest.hexdigest(), tensors, architecture=arch)


class LoraSource:
    """A TensorSource with LoRA adapters merged into its weights (float32 for those they change): W + s1 * B1 @ A1
    + s2 * B2 @ A2 + ..., each adapter's delta added in their order, as llama.cpp stacks repeated ``--lora``
    adapters; a weight an adapter holds in full takes the base's place, as PEFT loads it, and the deltas of the
    adapters after it add to it. ``architecture``: the base's general.architecture, as its GGUF file says or
    llama.cpp would write it (hf_config.llama_cpp_architecture): a GGUF adapter of another is refused, as llama.cpp
    refuses it."""

    def __init__(self, source: TensorSource, adapters: Sequence[Adapter], architecture: str) -> None:
        self.source = source
        self.adapters = tuple(adapters)
        self.config = source.config
        self.description = source.description + "".join(f" + LoRA {a.path.name}" for a in self.adapters)
        # by weight, in the adapters' order: each adapter's (A, B), or the weight it holds in full in kestrel's form
        self.changes: dict[str, list[tuple[Adapter, tuple[np.ndarray, np.ndarray] | np.ndarray]]] = {}
        for adapter in self.adapters:
            if adapter.architecture not in (None, architecture):
                raise KestrelError(f"LoRA adapter {adapter.path}: an adapter of a {adapter.architecture} model (its "
                                   f"general.architecture); the model is {architecture}")
            pairs, full = _kestrel_pairs(source, adapter), _kestrel_tensors(source, adapter)
            for name in sorted(pairs.keys() & full.keys()):
                raise KestrelError(f"LoRA adapter {adapter.path}: it both adapts {name} and holds it in full")
            for name, change in [*pairs.items(), *full.items()]:
                self.changes.setdefault(name, []).append((adapter, change))
        self.fp4_experts = getattr(source, "fp4_experts", False)

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def get(self, name: str) -> np.ndarray:
        w = self.source.get(name)
        changes = self.changes.get(name)
        if changes is None:
            return w
        merged = np.asarray(w, dtype=np.float32)
        for adapter, change in changes:
            if not isinstance(change, tuple):
                if change.shape != w.shape:
                    raise KestrelError(f"LoRA adapter {adapter.path}: {name} is {list(w.shape)} in the model but "
                                       f"{list(change.shape)} in the adapter (another base model's adapter?)")
                merged = change
                continue
            a, b = change
            if (b.shape[0], a.shape[1]) != w.shape:
                raise KestrelError(f"LoRA adapter {adapter.path}: {name} is {list(w.shape)} in the model but "
                                   f"B @ A is {[b.shape[0], a.shape[1]]} (another base model's adapter?)")
            delta = (np.float32(adapter.scale) * (b @ a)).astype(np.float32)
            if adapter.architecture is not None:
                delta = _hf_layout(delta, name, self.config, adapter.architecture)
            merged = merged + delta
        return merged

    def get_weight(self, name: str) -> Any:
        if name in self.changes:
            return self.get(name)
        get_weight = getattr(self.source, "get_weight", None)
        return get_weight(name) if get_weight is not None else self.source.get(name)


def _kestrel_pairs(source: TensorSource, adapter: Adapter) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The adapter's (A, B) by kestrel name (``_split``), a fused weight's as one pair per part, B's rows of it
    beside the same A (B @ A's rows are the fused weight's); a GGUF adapter's in the converter's layout
    (``_hf_layout`` takes their product to HF's)."""
    where, c = f"LoRA adapter {adapter.path}", source.config
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for own, (a, b) in adapter.pairs.items():
        gguf = adapter.architecture is not None
        weight = own if gguf else own + ".weight"  # a PEFT pair's own is its module
        for name, part in _split(b, weight, f"{own}'s {'lora_b' if gguf else 'lora_B'}", adapter, c):
            field = None if name is None else name.rsplit(".", 1)[-1]
            if name is None or field not in MERGED or ".experts." in name:
                raise KestrelError(f"{where}: {own} is not a projection kestrel merges into "
                                   f"({', '.join(sorted(MERGED - {'attn_gate'}))} of each layer)")
            if not source.has(name):
                raise KestrelError(f"{where}: the model has no {name} to adapt (another base model's adapter?)")
            if name in out:
                raise KestrelError(f"{where}: two of its matrices adapt {name}")
            out[name] = (a, part)
    return out


def _kestrel_tensors(source: TensorSource, adapter: Adapter) -> dict[str, np.ndarray]:
    """The weights the adapter holds in full by kestrel name (``_split``; a fused weight's rows split), in kestrel's
    form: a PEFT adapter's as a Hugging Face checkpoint's are read (hf.kestrel_form: Gemma's norms 1 + weight, ...),
    a GGUF adapter's as a GGUF file's (``_hf_layout``). Only a weight the model runs can be replaced (not a tied
    lm_head, which is the embedding)."""
    where, c = f"LoRA adapter {adapter.path}", source.config
    runs = {spec.name for spec in model_specs(c)}
    out: dict[str, np.ndarray] = {}
    for own, t in adapter.tensors.items():
        for name, part in _split(t, own, own, adapter, c):
            if name is None or name not in runs:
                tied = " (the model's lm_head is its embedding)" if name == "lm_head" else ""
                raise KestrelError(f"{where}: {own}, held in full, is not a weight of the model kestrel replaces{tied}")
            if name in out:
                raise KestrelError(f"{where}: two of its tensors replace {name}")
            held = (kestrel_form(name, part, c, where) if adapter.architecture is None
                    else _hf_layout(part, name, c, adapter.architecture))
            out[name] = np.asarray(held, dtype=np.float32)
    return out


def _split(t: np.ndarray, weight: str, label: str, adapter: Adapter, c: ModelConfig
           ) -> list[tuple[str | None, np.ndarray]]:
    """``t`` (a B, or a weight held in full) for each kestrel tensor the adapter's ``weight`` changes: named as
    the base's architecture names its weights (LFM2's ``feed_forward.w1`` is its gate, Granite-4.0-H's
    ``mamba.out_proj`` its o; a GGUF adapter's as its architecture's GGUF names them), None where kestrel has none;
    a fused weight (Phi-3's ``qkv_proj`` / ``attn_qkv``, Granite-4.0-H's ``shared_mlp.input_linear``, Qwen3.5's
    gated ``q_proj`` / ``attn_q``) gives each part its rows of ``t``, which must be the fused weight's rows."""
    where = f"LoRA adapter {adapter.path}"
    parts: list[tuple[str | None, Rows | None]]
    if adapter.architecture is not None:  # gguf-py is imported for GGUF adapters only
        from kestrel_core.model import gguf_reader

        parts = (list(gguf_reader.tensor_parts(weight, adapter.architecture, c))
                 or [(gguf_reader.kestrel_name(weight, adapter.architecture), None)])
    else:
        parts = list(tensor_parts(weight, c)) or [(kestrel_name(weight, c.arch), None)]
    heights = [r[1] - r[0] if isinstance(r, tuple) else len(r) for _, r in parts if r is not None]
    if heights and t.shape[0] != sum(heights):
        raise KestrelError(f"{where}: {label} has {t.shape[0]} rows, not the {sum(heights)} of the model's "
                           f"{', '.join(str(n) for n, _ in parts)} (another base model's adapter?)")
    return [(name, t if rows is None else fused_rows(t, rows, where, weight)) for name, rows in parts]


def _hf_layout(delta: np.ndarray, name: str, c: ModelConfig, architecture: str) -> np.ndarray:
    """A GGUF adapter's B @ A for ``name`` in Hugging Face's layout: llama.cpp's converter writes an adapter's
    weights as it writes the base's of its architecture (Q and K rows permuted for llama's family, Qwen3.5's value
    heads tiled along out_proj's columns), and the base's are read back to HF's layout the same way."""
    from kestrel_core.model.gguf_reader import PERMUTED_ARCHITECTURES, TILED_ARCHITECTURES, hf_layout
    from kestrel_core.model.hf_config import LLAMA_CPP_ARCHITECTURES

    permuted = architecture in {LLAMA_CPP_ARCHITECTURES[k] for k in PERMUTED_ARCHITECTURES}
    return hf_layout(delta, name, c, permuted, architecture in TILED_ARCHITECTURES)
