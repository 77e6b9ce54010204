"""Checks for untrusted input: model paths, config values, artifact metadata and CLI values
(environment values: ``kestrel_core.env``).

Everything a file, a plugin or a user hands kestrel is checked here by type and range before it is used, so a
bad value is one ``KestrelError`` line (exit 2) naming the field, never a crash, a hang or a silently wrong
answer. ``bool`` is never accepted where an integer is asked for (``True`` would be one layer), and strings
are never coerced to numbers. The loaders call these functions; docs/formats.md lists the rules.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kestrel_core.errors import KestrelError, os_error


class ValidationError(KestrelError, ValueError):
    """A value of the wrong type or out of range. Also a ValueError, so callers that wrap ValueErrors into a
    message naming their file (artifact.py, hf.py) do so for these too."""


# -- primitive checks -------------------------------------------------------------------------------------


def is_int(x: object) -> bool:
    """An integer, and not a bool (``True`` is an int to Python, never a layer count to kestrel)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_number(x: object) -> bool:
    """A real number (int or float, numpy's too), not a bool and not a string."""
    return is_int(x) or isinstance(x, (float, np.floating))


def is_token_ids(ids: object) -> bool:
    """Whether ``ids`` is a sequence (or a 1-D integer array) of integers, as token ids are: not text, and not an
    iterator, whose ids the check itself would use up, nor a set, whose order is arbitrary."""
    if isinstance(ids, np.ndarray):
        return ids.ndim == 1 and (ids.dtype.kind in "iu" or ids.size == 0)
    text = (str, bytes, bytearray, memoryview)  # sequences too, bytes' of integers
    return isinstance(ids, Sequence) and not isinstance(ids, text) and all(is_int(i) for i in ids)


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an int in [lo, hi]; else a ValidationError naming ``name``."""
    if not is_int(value):
        raise ValidationError(f"{name} must be an integer, got {value!r}")
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        if hi is None:
            raise ValidationError(f"{name} must be an integer >= {lo}, got {v}")
        if lo is None:
            raise ValidationError(f"{name} must be an integer <= {hi}, got {v}")
        raise ValidationError(f"{name} must be an integer in [{lo}, {hi}], got {v}")
    return v


def check_float(name: str, value: Any, lo: float | None = None, hi: float | None = None, *,
                lo_open: bool = False) -> float:
    """``value`` as a finite float in [lo, hi] (``lo_open``: (lo, hi]); else a ValidationError naming ``name``."""
    if not is_number(value):
        raise ValidationError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValidationError(f"{name} must be finite, got {v}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise ValidationError(f"{name} must be {'>' if lo_open else '>='} {lo:g}, got {v:g}")
    if hi is not None and v > hi:
        raise ValidationError(f"{name} must be <= {hi:g}, got {v:g}")
    return v


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a bool; 0/1 and strings are refused (they are typos or a different schema)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValidationError(f"{name} must be true or false, got {value!r}")
    return bool(value)


# -- model files ------------------------------------------------------------------------------------------


def check_regular_file(path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> Path:
    """``path`` if it is a regular file (inside ``root``, once symlinks are resolved, when ``root`` is given).

    Call before opening any model file: a FIFO blocks ``open`` forever, a device reads without end, and a
    symlink in a model directory must not reach a file outside it. ``os.stat`` never blocks on a FIFO.
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise KestrelError(f"{p}: no such file") from None
    except OSError as exc:
        raise os_error(exc, "cannot read", p) from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise KestrelError(f"{p}: is {kind}; kestrel opens regular files only as model files")
    if root is not None:
        base = link_root(root)
        real = p.resolve()
        if real != base and base not in real.parents:
            raise KestrelError(f"{p}: is a link to {real}, outside the model directory {base}; refused")
    return p


def link_root(root: str | os.PathLike[str]) -> Path:
    """The directory the files of model directory ``root`` may link into: ``root`` itself, or for a snapshot in
    the Hugging Face cache (models--OWNER--NAME/snapshots/COMMIT, whose files link to ../../blobs) its
    repository's folder."""
    base = Path(root).resolve()
    if base.parent.name == "snapshots" and base.parent.parent.name.startswith("models--"):
        return base.parent.parent
    return base


def open_regular(path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> Any:
    """``open(path, "rb")`` that never blocks: checked with stat first, then opened non-blocking and checked
    again on the descriptor (the file cannot be swapped for a FIFO between the two)."""
    p = check_regular_file(path, root)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as exc:
        raise os_error(exc, "cannot read", p) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise KestrelError(f"{p}: is not a regular file; kestrel opens regular files only as model files")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


# -- Hugging Face config.json ------------------------------------------------------------------------------


def refuse_set(cfg: dict[str, Any], where: str, keys: dict[str, str]) -> None:
    """Refuse, by name, each of ``keys`` (config key -> what it is) the config sets to a truthy value."""
    for key, what in keys.items():
        if cfg.get(key):
            raise KestrelError(f"{where}: {key} ({what}) is not supported")


def named_layers(types: Any, names: dict[str, str], where: str) -> tuple[str, ...]:
    """config.json's layer_types as kestrel's (``names``: each name it may hold -> kestrel's)."""
    if not isinstance(types, list) or not all(isinstance(t, str) and t in names for t in types):
        raise KestrelError(f"{where}: layer_types must be a list of {' / '.join(names)}")
    return tuple(names[t] for t in types)


def sliding_layer_types(cfg: dict[str, Any], where: str, pattern: int) -> tuple[str, ...]:
    """config.json's layer_types, or every ``pattern``-th layer global and the others sliding."""
    types = cfg.get("layer_types")
    if types is None:
        layers = cfg["num_hidden_layers"]
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    return named_layers(types, {"sliding_attention": "sliding", "full_attention": "full"}, where)


# Upper bounds far above any real model, so a config cannot ask for absurd allocations (2^40 layers...)
MAX_DIM = 1 << 20  # hidden, intermediate, head_dim
MAX_VOCAB = 1 << 24
MAX_LAYERS = 4096
MAX_HEADS = 1 << 14
MAX_POSITION = 1 << 26
MAX_EXPERTS = 1 << 12

# field -> (kind, required); kinds: "pos" int >= 1, "nonneg" int >= 0, "float+" finite > 0, "bool", "rope" dict
HF_CONFIG_FIELDS: dict[str, tuple[str, bool]] = {  # in the order hf_config.config_from_hf reads them
    "num_attention_heads": ("pos", True),
    "hidden_size": ("pos", True),
    "vocab_size": ("pos", True),
    "intermediate_size": ("pos", False),  # absent from Qwen3.5-MoE (moe_intermediate_size); else required
    "num_hidden_layers": ("pos", True),
    "num_key_value_heads": ("pos", False),
    "head_dim": ("pos", False),
    "max_position_embeddings": ("pos", False),
    "rms_norm_eps": ("float+", False),
    "rope_theta": ("float+", False),
    "tie_word_embeddings": ("bool", False),
    "rope_scaling": ("rope", False),
    "rope_parameters": ("rope", False),
    "rope_local_base_freq": ("float+", False),  # Gemma 3
    "query_pre_attn_scalar": ("float+", False),
    "linear_num_key_heads": ("pos", False),  # Qwen3.5's linear attention
    "linear_num_value_heads": ("pos", False),
    "linear_key_head_dim": ("pos", False),
    "linear_value_head_dim": ("pos", False),
    "linear_conv_kernel_dim": ("pos", False),
    "full_attention_interval": ("pos", False),
    "norm_eps": ("float+", False),  # LFM2's rms_norm_eps
    "conv_L_cache": ("pos", False),
    "block_ff_dim": ("pos", False),
    "block_multiple_of": ("pos", False),
    "num_experts": ("pos", False),  # Qwen3-MoE; Mixtral says num_local_experts
    "num_local_experts": ("count", False),  # Granite 4.0-H: 0 for a dense model
    "num_experts_per_tok": ("pos", False),
    "moe_intermediate_size": ("pos", False),
    "n_routed_experts": ("pos", False),  # GLM-4.5's
    "n_shared_experts": ("count", False),
    "first_k_dense_replace": ("count", False),
    "n_group": ("pos", False),
    "topk_group": ("pos", False),
    "routed_scaling_factor": ("float+", False),
    "decoder_sparse_step": ("pos", False),  # Qwen2-MoE's
    "moe_num_experts": ("pos", False),  # ERNIE 4.5's
    "moe_k": ("pos", False),
    "moe_num_shared_experts": ("count", False),
    "moe_layer_start_index": ("count", False),
    "moe_layer_interval": ("pos", False),
    "num_dense_layers": ("count", False),  # LFM2-MoE's
    "layer_norm_eps": ("float+", False),  # Cohere's
    "logit_scale": ("float+", False),
}
# the largest value of a field, checked before the per-layer, per-head or per-expert lists it sizes are made
HF_CONFIG_MAX = {
    "num_hidden_layers": MAX_LAYERS, "num_attention_heads": MAX_HEADS, "num_key_value_heads": MAX_HEADS,
    "hidden_size": MAX_DIM, "intermediate_size": MAX_DIM, "head_dim": MAX_DIM, "moe_intermediate_size": MAX_DIM,
    "vocab_size": MAX_VOCAB, "max_position_embeddings": MAX_POSITION,
    "linear_num_key_heads": MAX_HEADS, "linear_num_value_heads": MAX_HEADS, "linear_key_head_dim": MAX_DIM,
    "linear_value_head_dim": MAX_DIM, "linear_conv_kernel_dim": MAX_DIM, "conv_L_cache": MAX_DIM,
    "block_ff_dim": MAX_DIM, "block_multiple_of": MAX_DIM,
    "num_experts": MAX_EXPERTS, "num_local_experts": MAX_EXPERTS, "num_experts_per_tok": MAX_EXPERTS,
    "n_routed_experts": MAX_EXPERTS, "n_shared_experts": MAX_EXPERTS, "moe_num_experts": MAX_EXPERTS,
    "moe_k": MAX_EXPERTS, "moe_num_shared_experts": MAX_EXPERTS, "n_group": MAX_EXPERTS, "topk_group": MAX_EXPERTS,
    "first_k_dense_replace": MAX_LAYERS, "decoder_sparse_step": MAX_LAYERS, "moe_layer_start_index": MAX_LAYERS,
    "moe_layer_interval": MAX_LAYERS, "num_dense_layers": MAX_LAYERS, "full_attention_interval": MAX_LAYERS,
}


def check_hf_config(cfg: Mapping[str, Any], where: str = "config.json") -> None:
    """Type and range of every config.json field kestrel reads, before ``int()``/``float()`` can coerce them.

    ``num_hidden_layers: true``, ``"3"`` and ``3.5`` are refused (int() would make them 1, 3 and 3); ``null``
    counts as absent for optional fields, as transformers treats it. hf_config.config_from_hf must call this first.
    """
    if not isinstance(cfg, Mapping):
        raise KestrelError(f"{where}: expected a JSON object")
    archs = cfg.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise KestrelError(f"{where}: architectures must be a list of names, got {archs!r}")
    if cfg.get("model_type") is not None and not isinstance(cfg.get("model_type"), str):
        raise KestrelError(f"{where}: model_type must be a name, got {cfg.get('model_type')!r}")
    for key in ("mlp_bias", "attention_bias"):
        if cfg.get(key) is not None and not isinstance(cfg.get(key), bool):
            raise KestrelError(f"{where}: {key} must be true or false, got {cfg.get(key)!r}")
    for key, (kind, required) in HF_CONFIG_FIELDS.items():
        value = cfg.get(key)
        if value is None:
            if required:
                raise KestrelError(f"{where}: missing {key!r}")
            continue
        try:
            if kind == "pos":
                check_int(key, value, 1, HF_CONFIG_MAX.get(key))
            elif kind == "count":
                check_int(key, value, 0, HF_CONFIG_MAX.get(key))
            elif kind == "float+":
                check_float(key, value, 0.0, lo_open=True)
            elif kind == "bool":
                check_bool(key, value)
            elif not isinstance(value, Mapping):
                raise ValidationError(f"{key} must be a JSON object or null, got {value!r}")
        except ValidationError as exc:
            raise KestrelError(f"{where}: {exc}") from None
    for key in ("bos_token_id", "eos_token_id"):
        check_token_ids(cfg, key, where)


def check_token_ids(cfg: Mapping[str, Any], key: str, where: str) -> None:
    """``cfg[key]``, where set, is a token id >= 0 or a list of them (config.json, generation_config.json)."""
    value = cfg.get(key)
    values = value if isinstance(value, list) else [value]
    if value is not None and not all(is_int(v) and v >= 0 for v in values):
        raise KestrelError(f"{where}: {key} must be a token id >= 0 or a list of them, got {value!r}")


# -- the .kst artifact --------------------------------------------------------------------------------------

_LAYER_TENSOR = re.compile(r"^layers\.(\d+)\.")


def check_artifact_meta(quant: Any, config: Any, tensor_names: Iterable[str], where: str) -> str:
    """An artifact's quant mode (a known one) and its tensors against its config: every ``layers.N.*`` tensor
    must have N < num_layers, so a ``num_layers`` edited down cannot silently drop layers. Returns the mode.

    ``config`` is the parsed ModelConfig (its own checks ran in ``ModelConfig.__post_init__``). artifact.py's
    metadata reader must call this with the file's tensor names.
    """
    from kestrel_core.model.quantize import QUANT_MODES

    if not isinstance(quant, str) or quant not in QUANT_MODES:
        raise KestrelError(f"{where}: artifact quant {quant!r} is not a known mode "
                           f"({', '.join(QUANT_MODES)})")
    n = config.num_layers
    beyond = sorted({int(m.group(1)) for name in tensor_names if (m := _LAYER_TENSOR.match(name))
                     and int(m.group(1)) >= n})
    if beyond:
        raise KestrelError(f"{where}: the artifact has tensors for layer {beyond[0]} but its config says "
                           f"num_layers {n}")
    return quant


# -- CLI values -------------------------------------------------------------------------------------------


# ``bench --concurrency``'s streams of one level, at most, and a server's running batch (``--max-batch``): each
# decode step's logits are a row a stream, and 4,096 rows of a 152k-token vocabulary (Qwen's) are 2.5 GB of float32
MAX_CONCURRENCY = 4096
# a server's queue past the batch (``--max-waiting``): 65,536 requests wait minutes at any rate one model serves,
# past the 10 minutes the OpenAI client waits for an answer
MAX_WAITING = 1 << 16
# tokens of one scheduler step (``--token-budget``): 128 prompt chunks of 512; a step's [T, D] activations of a
# 4096-wide model are then 1 GiB of float32
MAX_TOKEN_BUDGET = 1 << 16
CLI_INT_RANGES: dict[str, tuple[int, int | None]] = {
    "max_tokens": (1, None), "top_k": (0, None), "seed": (0, 2 ** 63 - 1), "seeds": (1, 10_000),
    "prompt_tokens": (1, None), "decode_tokens": (1, None), "runs": (1, 10_000), "warmup": (0, 10_000),
    "port": (0, 65535), "max_batch": (1, MAX_CONCURRENCY), "max_waiting": (0, MAX_WAITING),
    "token_budget": (1, MAX_TOKEN_BUDGET),
    "dimensions": (1, None), "speculate": (0, 64), "max_model_len": (1, None), "draft_min": (0, None),
}
CLI_FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 100.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0), "repetition_penalty": (0.0, 10.0),
    "kv_cache_mb": (0.0, 2.0 ** 40), "lora_scale": (-100.0, 100.0), "draft_p_min": (0.0, 1.0),
    "shutdown_grace": (0.0, 86400.0), "max_request_mb": (1e-6, 2.0 ** 20),  # at least a byte
}
# given, these must hold more than blanks: ``--api-key "$KEY"`` with KEY unset must not serve without a key, nor
# ``--preset ""`` load the default model, ``--lora ""`` merge the current directory or ``--concurrency ""`` run batch 1
CLI_TEXT = ("host", "served_model_name", "api_key", "quant", "backend", "model", "output", "preset", "lora",
            "concurrency", "draft_model")
_POSITIONAL = {"prompt": "the prompt", "texts": "a text to embed"}
_PATHS = frozenset({"model", "output", "lora", "draft_model"})


def concurrency_levels(text: str) -> list[int]:
    """``bench --concurrency``'s levels, ``N,N,...``: each an integer in [1, MAX_CONCURRENCY]."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise KestrelError(f"--concurrency takes integers separated by commas, got {text!r}") from None
    bad = next((n for n in levels if not 1 <= n <= MAX_CONCURRENCY), None)
    if not levels or bad is not None:
        raise KestrelError(f"--concurrency: each level must be an integer in [1, {MAX_CONCURRENCY}], got "
                           f"{text if bad is None else bad!r}")
    return levels


def check_cli_args(args: Any) -> None:
    """Every CLI value of every command in range, before a model is loaded: ``--seed -1``, ``--max-tokens -1``,
    ``--temperature nan``, ``--top-p 0``, ``--port 70000``, ``--host ""`` are one line naming the flag and the
    field (exit 2)."""
    for name, (lo, hi) in CLI_INT_RANGES.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        if not is_int(value) or value < lo or (hi is not None and value > hi):
            span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise KestrelError(f"--{name.replace('_', '-')}: {name} must be an integer {span}, got {value!r}")
    for name, (lo_f, hi_f) in CLI_FLOAT_RANGES.items():
        value = getattr(args, name, None)
        open_lo = name in ("top_p", "repetition_penalty", "kv_cache_mb")
        for one in value if isinstance(value, list) else [] if value is None else [value]:  # a repeatable one: each
            if not (is_number(one) and math.isfinite(one) and (lo_f < one if open_lo else lo_f <= one) and one <= hi_f):
                span = f"{'(' if open_lo else '['}{lo_f:g}, {hi_f:g}]"
                raise KestrelError(f"--{name.replace('_', '-')}: {name} must be in {span}, got {one!r}")
    for name in CLI_TEXT:
        value = getattr(args, name, None)
        for one in value if isinstance(value, list) else [value]:  # a repeatable option: each value
            if one is not None and not str(one).strip():
                raise KestrelError(f"--{name.replace('_', '-')}: {name} must not be empty, got {one!r}")
    if getattr(args, "concurrency", None):
        concurrency_levels(args.concurrency)
    if getattr(args, "draft_model", None) is not None and not getattr(args, "speculate", 0):
        raise KestrelError("--draft-model guesses the --speculate N tokens a step: give --speculate too")
    if getattr(args, "draft_p_min", None) is not None and getattr(args, "draft_model", None) is None:
        raise KestrelError("--draft-p-min is where the --draft-model's guesses stop: give --draft-model too")
    draft_min = getattr(args, "draft_min", None)
    if draft_min is not None and getattr(args, "draft_model", None) is None:
        raise KestrelError("--draft-min is the fewest guesses a --draft-model's draft is checked with: give "
                           "--draft-model too")
    if draft_min is not None and draft_min > getattr(args, "speculate", 0):
        raise KestrelError(f"--draft-min {draft_min} is more than --speculate {getattr(args, 'speculate', 0)}: no "
                           "draft would be checked")
    for name, value in vars(args).items():  # Python decodes the command line's invalid UTF-8 as lone surrogates
        if name in _PATHS:  # a file's name may be any bytes
            continue
        for one in value if isinstance(value, list) else [value]:
            if isinstance(one, str):
                strict_text(one, _POSITIONAL.get(name, f"--{name.replace('_', '-')}"))


def strict_text(text: str, what: str) -> str:
    """``text`` unless it holds lone surrogates: what a stream decoding with ``surrogateescape`` (Python's
    stdin under the C locale) makes of invalid UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise KestrelError(f"{what} is not valid UTF-8 (character {exc.start})") from None
    return text


MAX_STDIN_BYTES = 1 << 26  # 64 MiB of text on stdin, at most: some 16 million tokens, past any model's context


def read_text_stdin(stream: Any, what: str = "stdin") -> str:
    """All of ``stream`` as text, strictly UTF-8 whatever the stream's own error handler, newlines translated as
    a text stream does; invalid UTF-8 is one line naming ``what``, not a UnicodeDecodeError (exit 1), and so is
    more than MAX_STDIN_BYTES (``kestrel run < /dev/zero`` would fill the memory)."""
    buffer = getattr(stream, "buffer", None)
    raw = (stream if buffer is None else buffer).read(MAX_STDIN_BYTES + 1)
    if len(raw) > MAX_STDIN_BYTES:
        raise KestrelError(f"{what} holds more than {MAX_STDIN_BYTES >> 20} MiB of text")
    try:
        text = strict_text(raw, what) if buffer is None else raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KestrelError(f"{what} is not valid UTF-8 (byte {exc.start}: {exc.reason})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_line_stdin(stream: Any, what: str = "stdin") -> str:
    """One line of ``stream`` (``""`` at the end); invalid UTF-8 is one line naming ``what``, and so is a line of
    more than MAX_STDIN_BYTES."""
    try:
        line = strict_text(stream.readline(MAX_STDIN_BYTES + 1), what)
        if len(line) > MAX_STDIN_BYTES:
            raise KestrelError(f"{what}: a line of more than {MAX_STDIN_BYTES >> 20} MiB")
        return line
    except UnicodeDecodeError as exc:
        raise KestrelError(f"{what} is not valid UTF-8 (byte {exc.start}: {exc.reason})") from None
