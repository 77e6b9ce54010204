"""The kestrel artifact (``.kst``): one safetensors file of strip-cache tensors plus JSON metadata.

Per quantized weight ``<name>.codes`` (int8 [N, K]) and ``<name>.scales`` (float32 [N, K/G]); norms and biases
as float32 ``<name>``. Tensor names are kestrel's (``embedding``, ``lm_head``, ``final_norm``,
``layers.<i>.<q|k|v|o|gate|up|down|attn_norm|mlp_norm|q_bias|k_bias|v_bias|q_norm|k_norm>``). A tied lm_head
is not stored: it is the embedding. The safetensors header's ``__metadata__`` (string values only) holds
the format name and version, the layout flags, the quant mode, each weight's group size and bits, the
ModelConfig, the tokenizer.json text and the chat template. docs/formats.md describes it field by field.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from kestrel_core.contract import StripCache
from kestrel_core.errors import ContractError, KestrelError
from kestrel_core.model.config import ModelConfig
from kestrel_core.model.quantize import (
    LAYER_NORM_FIELDS,
    LAYER_PROJ_FIELDS,
    QK_NORM_FIELDS,
    QKV_BIAS_FIELDS,
    layer_name,
)
from kestrel_core.model.weights import LayerWeights, Model

FORMAT_NAME = "kestrel-strip-cache"
FORMAT_VERSION = 1
# What this kestrel understands. A producer that changes the bytes' meaning (e.g. a 4x4 int4 repack) adds a
# flag; an older reader then refuses the file instead of computing garbage.
LAYOUT_FLAGS = ("row-major-codes",)
REQUIRED_LAYOUT_FLAGS = ("row-major-codes",)
ARTIFACT_SUFFIX = ".kst"


@dataclass
class ArtifactMeta:
    format_version: int
    layout: list[str]
    quant: str
    config: ModelConfig
    tokenizer_json: str | None = None
    chat_template: str | None = None
    tensors: dict[str, dict[str, int]] = field(default_factory=dict)  # weight name -> group_size, bits
    extra: dict[str, Any] = field(default_factory=dict)


def model_tensors(model: Model) -> dict[str, StripCache | np.ndarray]:
    """Every tensor of ``model`` under its artifact name; a tied lm_head is left out (it is the embedding)."""
    out: dict[str, StripCache | np.ndarray] = {"embedding": model.embedding, "final_norm": model.final_norm}
    if model.lm_head is not model.embedding:
        out["lm_head"] = model.lm_head
    optional = QKV_BIAS_FIELDS + QK_NORM_FIELDS
    for i, layer in enumerate(model.layers):
        for name in LAYER_PROJ_FIELDS + LAYER_NORM_FIELDS + optional:
            value = getattr(layer, name)
            if value is not None:
                out[layer_name(i, name)] = value
    return out


def save_artifact(path: str | os.PathLike[str], model: Model, *, tokenizer_json: str | None = None,
                  chat_template: str | None = None, quant: str, extra: dict[str, Any] | None = None,
                  force: bool = False) -> Path:
    """Write ``model`` to ``path`` atomically (temp name in the same directory, then rename)."""
    path = Path(path)
    if path.exists() and not force:
        raise KestrelError(f"{path} already exists; pass --force to overwrite it")
    if path.is_dir():
        raise KestrelError(f"{path} is a directory")
    if model.config.tie_word_embeddings != (model.lm_head is model.embedding):
        raise KestrelError("the model's lm_head must be its embedding object exactly when tie_word_embeddings")
    arrays: dict[str, np.ndarray] = {}
    specs: dict[str, dict[str, int]] = {}
    for name, value in model_tensors(model).items():
        if isinstance(value, StripCache):
            arrays[f"{name}.codes"] = value.codes
            arrays[f"{name}.scales"] = value.scales
            specs[name] = {"group_size": value.group_size, "bits": value.bits}
        else:
            arrays[name] = np.ascontiguousarray(value, dtype=np.float32)
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "layout": json.dumps(list(LAYOUT_FLAGS)),
        "quant": quant,
        "tensors": json.dumps(specs, sort_keys=True),
        "config": json.dumps(model.config.as_dict(), sort_keys=True),
        "extra": json.dumps(extra or {}, sort_keys=True),
    }
    if tokenizer_json is not None:
        metadata["tokenizer_json"] = tokenizer_json
    if chat_template is not None:
        metadata["chat_template"] = chat_template
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise KestrelError(f"cannot write {path}: directory {parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    os.close(fd)
    try:
        save_file(arrays, tmp, metadata=metadata)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would surprise whoever shares the file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _refuse(path: Path, what: str) -> KestrelError:
    return KestrelError(f"{path}: {what}")


def read_meta(path: str | os.PathLike[str]) -> ArtifactMeta:
    """Only the metadata (cheap: the header), validated against what this kestrel understands."""
    path = Path(path)
    with _open(path) as f:
        return _parse_meta(path, f.metadata() or {})


def _open(path: Path) -> Any:
    if not path.is_file():
        raise KestrelError(f"{path}: no such artifact file")
    try:
        return safe_open(str(path), framework="numpy")
    except SafetensorError as exc:
        raise _refuse(path, f"not a readable kestrel artifact (truncated or corrupt safetensors: {exc})") from None
    except OSError as exc:
        raise _refuse(path, f"cannot read it: {exc.strerror or exc}") from None


def _json(path: Path, meta: dict[str, str], key: str, default: Any = None) -> Any:
    if key not in meta:
        if default is not None:
            return default
        raise _refuse(path, f"artifact metadata lacks {key!r}")
    try:
        return json.loads(meta[key])
    except json.JSONDecodeError:
        raise _refuse(path, f"artifact metadata {key!r} is not valid JSON") from None


def _parse_meta(path: Path, meta: dict[str, str]) -> ArtifactMeta:
    if meta.get("format") != FORMAT_NAME:
        raise _refuse(path, f"not a kestrel artifact (format {meta.get('format')!r}, expected {FORMAT_NAME!r})")
    try:
        version = int(meta.get("format_version", ""))
    except ValueError:
        raise _refuse(path, f"bad format_version {meta.get('format_version')!r}") from None
    if version != FORMAT_VERSION:
        raise _refuse(path, f"artifact format_version {version} is not supported "
                            f"(this kestrel reads format_version {FORMAT_VERSION})")
    layout = _json(path, meta, "layout")
    if not isinstance(layout, list) or not all(isinstance(x, str) for x in layout):
        raise _refuse(path, f"layout must be a list of flags, got {meta['layout']!r}")
    unknown = [x for x in layout if x not in LAYOUT_FLAGS]
    missing = [x for x in REQUIRED_LAYOUT_FLAGS if x not in layout]
    if unknown or missing:
        raise _refuse(path, f"artifact layout flags {layout} are not supported "
                            f"(this kestrel expects {list(REQUIRED_LAYOUT_FLAGS)}, understands {list(LAYOUT_FLAGS)})")
    try:
        config = ModelConfig.from_dict(_json(path, meta, "config"))
    except TypeError as exc:
        raise _refuse(path, f"artifact config does not fit this kestrel's ModelConfig ({exc})") from None
    tensors = _json(path, meta, "tensors")
    return ArtifactMeta(format_version=version, layout=layout, quant=meta.get("quant", "?"), config=config,
                        tokenizer_json=meta.get("tokenizer_json"), chat_template=meta.get("chat_template"),
                        tensors=tensors, extra=_json(path, meta, "extra", {}))


def load_artifact(path: str | os.PathLike[str]) -> tuple[Model, ArtifactMeta]:
    path = Path(path)
    with _open(path) as f:
        meta = _parse_meta(path, f.metadata() or {})
        keys = set(f.keys())

        def tensor(name: str) -> np.ndarray:
            if name not in keys:
                raise _refuse(path, f"artifact lacks tensor {name!r}")
            try:
                return f.get_tensor(name)
            except SafetensorError as exc:
                raise _refuse(path, f"cannot read tensor {name!r} ({exc})") from None

        def weight(name: str) -> StripCache:
            spec = meta.tensors.get(name)
            if not isinstance(spec, dict):
                raise _refuse(path, f"artifact metadata has no group size / bits for {name!r}")
            try:
                return StripCache(tensor(f"{name}.codes"), tensor(f"{name}.scales"), int(spec["group_size"]),
                                  int(spec["bits"]))
            except (ContractError, KeyError, ValueError) as exc:
                raise _refuse(path, f"tensor {name!r} breaks the strip-cache contract: {exc}") from None

        def vector(name: str) -> np.ndarray:
            v = tensor(name)
            if v.dtype != np.float32 or v.ndim != 1:
                raise _refuse(path, f"tensor {name!r} must be a float32 vector, got {v.dtype} {list(v.shape)}")
            return v

        c = meta.config
        layers = []
        for i in range(c.num_layers):
            fields: dict[str, Any] = {p: weight(layer_name(i, p)) for p in LAYER_PROJ_FIELDS}
            fields.update({n: vector(layer_name(i, n)) for n in LAYER_NORM_FIELDS})
            if c.qkv_bias:
                fields.update({n: vector(layer_name(i, n)) for n in QKV_BIAS_FIELDS})
            if c.qk_norm:
                fields.update({n: vector(layer_name(i, n)) for n in QK_NORM_FIELDS})
            layers.append(LayerWeights(**fields))
        embedding = weight("embedding")
        lm_head = embedding if c.tie_word_embeddings else weight("lm_head")
        model = Model(config=c, embedding=embedding, layers=layers, final_norm=vector("final_norm"),
                      lm_head=lm_head)
    _check_shapes(path, model)
    return model, meta


def _check_shapes(path: Path, model: Model) -> None:
    c = model.config
    qn, kvn = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    d, f = c.hidden_size, c.intermediate_size
    want = {"q": (qn, d), "k": (kvn, d), "v": (kvn, d), "o": (d, qn), "gate": (f, d), "up": (f, d),
            "down": (d, f), "attn_norm": (d,), "mlp_norm": (d,), "q_bias": (qn,), "k_bias": (kvn,),
            "v_bias": (kvn,), "q_norm": (c.head_dim,), "k_norm": (c.head_dim,)}
    checks = [("embedding", model.embedding.shape, (c.vocab_size, d)),
              ("lm_head", model.lm_head.shape, (c.vocab_size, d)), ("final_norm", model.final_norm.shape, (d,))]
    for name, value in model_tensors(model).items():
        if name.startswith("layers."):
            checks.append((name, value.shape, want[name.rsplit(".", 1)[1]]))
    for name, got, expected in checks:
        if tuple(got) != tuple(expected):
            raise _refuse(path, f"tensor {name!r} has shape {list(got)}, the config implies {list(expected)}")
