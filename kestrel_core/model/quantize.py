"""Float weights + config -> a strip-cache ``Model``, one tensor at a time.

Every input format (Hugging Face safetensors, GGUF) is exposed as a ``TensorSource`` that names tensors the
kestrel way (``embedding``, ``layers.3.q``, ...). The quantizer pulls each tensor, quantizes it and drops the
float copy, so at most one float tensor is alive at a time.
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kestrel_core.contract import BFloat16Bits, StripCache, WeightInput, quantize_weight
from kestrel_core.errors import ContractError, KestrelError, safe_repr
from kestrel_core.model.config import ModelConfig
from kestrel_core.model.int_quant import IntWeight
from kestrel_core.model.rope import ROTARY_FIELDS, rotary_first, rotary_rows
from kestrel_core.model.weights import Model, TensorSpec, assemble, model_specs
from kestrel_core.model.weights import layer_name as layer_name

# mode -> (bits, group size)
QUANT_MODES: dict[str, tuple[int, int]] = {"q8": (8, 32), "q4": (4, 32), "q8-g256": (8, 256), "q4-g256": (4, 256)}
FALLBACK_GROUP = 32



def fused_rows(t: Any, rows: tuple[int, int] | np.ndarray, where: str, tensor: str) -> Any:
    """Rows of a fused checkpoint tensor (an array, or an int_quant.IntWeight, which selects rows alike): a range
    (Q|K|V, gate|up) or row indices (Qwen3.5's query and gate, interleaved per head: ``group_rows``), checked
    against what the config needs."""
    need = rows[1] if isinstance(rows, tuple) else int(rows.max()) + 1
    if t.ndim != 2 or t.shape[0] < need:
        raise KestrelError(f"{where}: fused tensor {tensor} has shape {list(t.shape)}; the config needs at "
                           f"least {need} rows")
    part = t[rows[0]:rows[1]] if isinstance(rows, tuple) else t[rows]
    return np.ascontiguousarray(part) if isinstance(part, np.ndarray) else part


def group_rows(groups: int, sizes: Sequence[int], parts: Sequence[int]) -> np.ndarray:
    """The rows of ``parts`` (in that order, each across every group) of a tensor made of ``groups`` groups that
    each hold parts of ``sizes`` rows in turn: Qwen3.5's q_proj (per head: query, gate), Qwen3-Next's in_proj_qkvz
    (per key head: q, k, v, z) and in_proj_ba (per key head: beta, alpha)."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return np.concatenate([(np.arange(groups)[:, None] * starts[-1] + starts[p] + np.arange(sizes[p])).reshape(-1)
                           for p in parts])


def fused_parts(layer: int, members: Sequence[str], c: ModelConfig) -> list[tuple[str, tuple[int, int]]]:
    """Layer ``layer``'s kestrel tensors ``members`` (q, k, v; gate, up) as one checkpoint tensor holds them, one
    after another (Phi-3's Q|K|V and gate|up, GLM-4's gate|up), each with its range of rows: the config's rows of
    each, in order."""
    out = []
    start = 0
    for member in members:
        out.append((layer_name(layer, member), (start, start + c.rows_of(member))))
        start += c.rows_of(member)
    return out


def hybrid_splits(c: ModelConfig) -> dict[str, tuple[tuple[str, np.ndarray], ...]]:
    """How a hybrid model's fused checkpoint tensors split into kestrel's, by role: "q_gate" (gated attention's
    q_proj), "qkvz" and "ba" (Qwen3-Next's linear-attention inputs); each (kestrel field, its rows)."""
    hd, hk = c.head_dim, c.linear_key_heads
    per_key = c.linear_value_heads // hk if hk else 0
    v = per_key * c.linear_value_dim
    qkvz = (c.linear_key_dim, c.linear_key_dim, v, v)
    return {"q_gate": (("q", group_rows(c.num_heads, (hd, hd), [0])),
                       ("attn_gate", group_rows(c.num_heads, (hd, hd), [1]))),
            "qkvz": (("lin_qkv", group_rows(hk, qkvz, [0, 1, 2])), ("lin_z", group_rows(hk, qkvz, [3]))),
            "ba": (("lin_beta", group_rows(hk, (per_key, per_key), [0])),
                   ("lin_alpha", group_rows(hk, (per_key, per_key), [1])))}


def map_tensor_name(name: str, global_map: dict[str, str], layer_re: re.Pattern[str],
                    layer_map: dict[str, str]) -> str | None:
    """A checkpoint's tensor name in kestrel's naming; ``layer_re`` captures (layer index, rest of the name).

    None for tensors kestrel does not use.
    """
    if name in global_map:
        return global_map[name]
    m = layer_re.match(name)
    if m and m.group(2) in layer_map:
        return layer_name(int(m.group(1)), layer_map[m.group(2)])
    return None


@dataclass(frozen=True)
class QuantMode:
    name: str
    bits: int
    group_size: int

    def group_for(self, k: int) -> int:
        """The block width for a tensor with ``k`` input columns: the mode's G, or 32 when K % G != 0."""
        return self.group_size if k % self.group_size == 0 else FALLBACK_GROUP


def parse_quant(name: str) -> QuantMode:
    """The quant mode named ``name`` (any case): a string, never a number (``5`` names no mode)."""
    if not isinstance(name, str):
        raise KestrelError(f"quant must be the name of a quant mode ({', '.join(QUANT_MODES)}), got {safe_repr(name)}")
    key = name.strip().lower()
    if key not in QUANT_MODES:
        raise KestrelError(f"unknown quant mode {name!r}: valid modes are {', '.join(QUANT_MODES)}")
    return QuantMode(key, *QUANT_MODES[key])


def model_quant(model: Model) -> str:
    """The quant mode a model was built with, read off its projections (G=256 modes fall back per tensor)."""
    projs = [w for _, w in model.weights()[:-1]]  # all but lm_head
    bits = projs[0].bits if projs else 8
    g256 = any(w.group_size == 256 for w in projs)
    return f"q{bits}" + ("-g256" if g256 else "")


def holds_quant(model: Model, mode: QuantMode) -> bool:
    """Whether ``model``'s projections are what quantizing to ``mode`` gives: its bits, and G=256 blocks where the
    mode has them and a tensor's K allows (a G=256 mode gives a model without such a tensor its G=32 blocks)."""
    return all(w.bits == mode.bits and (w.group_size == 256) == (mode.group_for(w.codes.shape[1]) == 256)
               for _, w in model.weights()[:-1])  # all but lm_head


class TensorSource(Protocol):
    """A checkpoint whose float tensors are read lazily, one by one, under kestrel names."""

    config: ModelConfig
    description: str

    def has(self, name: str) -> bool: ...

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32 (or float16), HF orientation [out, in] for matrices."""
        ...

    # Optional: ``get_weight(name) -> WeightInput``, a matrix as the quantizer takes it (bfloat16 may stay
    # contract.BFloat16Bits, so no float32 copy of the whole tensor is made). Sources without it use get.


def quantize_tensor(w: WeightInput | IntWeight, bits: int, mode: QuantMode, name: str) -> StripCache:
    """``w`` as a strip-cache of ``bits`` in ``mode``'s groups: an integer checkpoint's codes as they are where the
    strip-cache can hold them (IntWeight.strip_cache), else quantized."""
    if w.ndim != 2:
        raise KestrelError(f"{name}: expected a 2-D weight, got shape {list(w.shape)}")
    k = w.shape[1]
    if k % FALLBACK_GROUP:
        raise KestrelError(f"{name}: K={k} is not a multiple of {FALLBACK_GROUP}; kestrel cannot quantize it")
    if isinstance(w, IntWeight):
        kept = w.strip_cache(bits, mode.group_for(k))
        if kept is not None:
            return kept
        w = w.to_float32()
    try:
        return quantize_weight(w, bits=bits, group_size=mode.group_for(k))
    except ContractError as exc:  # NaN or infinity: the quantizer finds them in its pass over the data
        raise KestrelError(f"{name}: {exc} (corrupt checkpoint?)") from None


def _views_a_file(a: np.ndarray) -> bool:
    """Whether ``a``'s memory is a file's memory map (a GGUF's F32 tensor as gguf-py reads it is a view of one)."""
    base = a.base
    while base is not None:
        if isinstance(base, mmap.mmap):
            return True
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return False


def _float(source: TensorSource, spec: TensorSpec) -> np.ndarray:
    """A tensor the model keeps as float32 (a norm, a bias, a router), in memory of its own: a view of the
    checkpoint's memory map would keep the file mapped for the model's life (a file rewritten in place changes
    the model; one truncated kills the process with SIGBUS). No quantizer's pass refuses its NaN or infinity, so
    they are refused here."""
    v = np.ascontiguousarray(source.get(spec.name), dtype=np.float32)
    if _views_a_file(v):
        v = v.copy()
    if v.shape != spec.shape:
        raise KestrelError(f"{source.description}: {spec.name} has shape {list(v.shape)}, expected "
                           f"{list(spec.shape)}")
    if not np.isfinite(v).all():
        first = np.argwhere(~np.isfinite(v))[0]
        at = f"row {first[0]}" if v.ndim > 1 else f"element {first[0]}"
        raise KestrelError(f"{source.description}: {spec.name} contains NaN or infinity (first in {at}; corrupt "
                           "checkpoint?)")
    return v


def _turned(config: ModelConfig, w: WeightInput | IntWeight) -> WeightInput | IntWeight:
    """q or k rows reordered (rope.rotary_first) in the form the checkpoint gives them: bfloat16 bits, or an
    integer checkpoint's codes and scales, which the strip-cache can then keep as they are."""
    if isinstance(w, IntWeight):
        return w[rotary_rows(config, w.shape[0])]
    if isinstance(w, BFloat16Bits):
        return BFloat16Bits(rotary_first(config, w.raw))
    return rotary_first(config, w)


def _matrix(source: TensorSource, spec: TensorSpec, bits: int, mode: QuantMode, turned: bool = False) -> StripCache:
    """``turned``: q or k rows of a model whose RoPE turns part of each head, reordered (rope.rotary_first)."""
    get_weight = getattr(source, "get_weight", None)  # the optional, copy-free form of get
    w = get_weight(spec.name) if get_weight is not None else source.get(spec.name)
    if tuple(w.shape) != spec.shape:
        raise KestrelError(f"{source.description}: {spec.name} has shape {list(w.shape)}, expected "
                           f"{list(spec.shape)}")
    return quantize_tensor(_turned(source.config, w) if turned else w, bits, mode, spec.name)


def quantize_model(source: TensorSource, quant: str | QuantMode = "q8",
                   progress: Callable[[int, int], None] | None = None) -> Model:
    """Build the strip-cache model: projections (experts included) at the mode's bits, embedding and lm_head
    at 8 bits, norms, biases and the router float32.

    ``progress(done, total)``, if given, is called after each matrix with the weights quantized so far."""
    mode = quant if isinstance(quant, QuantMode) else parse_quant(quant)
    c = source.config
    specs = model_specs(c)
    total = sum(s.shape[0] * s.shape[1] for s in specs if s.kind in ("proj", "table"))
    done = 0
    tensors: dict[str, object] = {}
    for spec in specs:
        turned = c.qk_reordered and spec.name.rsplit(".", 1)[-1] in ROTARY_FIELDS
        if spec.kind in ("vector", "matrix"):
            v = _float(source, spec)
            tensors[spec.name] = rotary_first(c, v) if turned else v
            continue
        if spec.name == "lm_head" and not source.has("lm_head"):
            raise KestrelError(f"{source.description}: no lm_head weight and the embeddings are not tied")
        tensors[spec.name] = _matrix(source, spec, 8 if spec.kind == "table" else mode.bits, mode, turned)
        done += spec.shape[0] * spec.shape[1]
        if progress is not None:
            progress(done, total)
    return assemble(c, tensors)
