"""Property-based fuzzing (hypothesis, bounded for CI) of every untrusted-input path.

Property: any input ends in success or a one-line KestrelError: never another exception, never a hang (no result
within HANG_GUARD_S: a time no example takes however busy the machine, not a bound on its speed), never a huge
allocation (the byte-level cases run under RLIMIT_AS in a subprocess, by
scripts/fuzz.py, which also does the long runs: docs/formats.md has the figures). The generators and the
checks are scripts/fuzz.py's, so the CI fuzz and the long run test the same thing.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kestrel_core
from kestrel_core.errors import KestrelError

from ..waits import HANG_GUARD_S, StillWaiting, within

REPO = Path(__file__).resolve().parents[3]
FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.cache
def harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kestrel_fuzz", REPO / "scripts" / "fuzz.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def workdir() -> Path:
    """One scratch directory for the module (hypothesis re-runs examples; function-scoped tmp_path does not fit),
    removed at exit."""
    path = Path(tempfile.mkdtemp(prefix="kestrel-fuzz-test-"))
    atexit.register(shutil.rmtree, path, True)
    return path


@functools.cache
def seeds() -> dict[str, bytes]:
    h = harness()
    return {"gguf": h.gguf_bytes(workdir()), "kst": h.kst_bytes(workdir()), "st": h.safetensors_bytes()}


class Hung(BaseException):
    """An example with no result within HANG_GUARD_S: a BaseException, which hypothesis does not catch, so the test
    ends at once rather than shrink the example, waiting HANG_GUARD_S a try."""


def must_end_well(check: Callable[[], None], example: object) -> None:
    """Success, or a KestrelError of one line; any other exception fails the example, and a hang (Hung, naming
    ``example``, the input) the test."""
    try:
        within(HANG_GUARD_S, check)
    except StillWaiting as exc:
        raise Hung(f"{exc}: {example!r}"[:4000]) from None
    except KestrelError as exc:
        assert "\n" not in str(exc), str(exc)


# an edit: (position, kind, value); positions wrap around the data, most land in the header
EDIT = st.tuples(st.integers(0, 1 << 20), st.sampled_from(["flip", "byte", "u32", "u64", "cut", "delete",
                                                             "insert"]),
                 st.one_of(st.sampled_from([0, 1, 0xFF, 0x7FFFFFFF, 0xFFFFFFFF, 2 ** 62, 2 ** 63, 2 ** 64 - 1]),
                           st.integers(0, 2 ** 64 - 1)))


def apply_edits(data: bytes, edits: list[tuple[int, str, int]], header: int) -> bytes:
    buf = bytearray(data)
    for pos, kind, value in edits:
        if not buf:
            break
        p = pos % (header if pos % 8 else len(buf)) if header < len(buf) else pos % len(buf)
        p = min(p, len(buf) - 1)
        if kind == "flip":
            buf[p] ^= 1 << (value % 8)
        elif kind == "byte":
            buf[p] = value % 256
        elif kind == "u32":
            buf[p:p + 4] = (value % 2 ** 32).to_bytes(4, "little")
        elif kind == "u64":
            buf[p:p + 8] = value.to_bytes(8, "little")
        elif kind == "cut":
            del buf[p:]
        elif kind == "delete":
            del buf[p:p + 1 + value % 16]
        else:
            buf[p:p] = value.to_bytes(8, "little")[: 1 + value % 8]
    return bytes(buf)


def header_len(name: str) -> int:
    data = seeds()[name]
    if name == "gguf":
        return data.index(b"token_embd.weight") + 200
    return 8 + int.from_bytes(data[:8], "little")


@settings(FUZZ, max_examples=300)
@given(st.lists(EDIT, min_size=1, max_size=6))
def test_fuzz_gguf_bytes(edits: list[tuple[int, str, int]]) -> None:
    path = workdir() / "fuzz.gguf"
    path.write_bytes(apply_edits(seeds()["gguf"], edits, header_len("gguf")))
    must_end_well(lambda: harness().check_gguf_file(path), edits)


@settings(FUZZ, max_examples=100)
@given(st.binary(max_size=128))
def test_fuzz_gguf_random_bytes_after_the_magic(tail: bytes) -> None:
    path = workdir() / "random.gguf"
    path.write_bytes(b"GGUF" + tail)
    must_end_well(lambda: harness().check_gguf_file(path), tail)


@settings(FUZZ, max_examples=80)
@given(st.integers(0, 2 ** 32))
def test_fuzz_gguf_metadata_values(seed: int) -> None:
    """GGUF files written by gguf-py with random types and values for the config and tokenizer keys."""
    h = harness()
    meta = h.random_gguf_meta(random.Random(seed))
    d = workdir() / "meta"
    d.mkdir(exist_ok=True)
    try:
        data = h.gguf_bytes(d, meta)
    except Exception:  # gguf-py will not write these values
        return
    path = workdir() / "meta.gguf"
    path.write_bytes(data)
    must_end_well(lambda: h.check_gguf_file(path), seed)


@settings(FUZZ, max_examples=200)
@given(st.lists(EDIT, min_size=1, max_size=6))
def test_fuzz_kst_bytes(edits: list[tuple[int, str, int]]) -> None:
    path = workdir() / "fuzz.kst"
    path.write_bytes(apply_edits(seeds()["kst"], edits, header_len("kst")))
    must_end_well(lambda: harness().check_kst_file(path), edits)


KST_META_KEYS = ["format", "format_version", "layout", "quant", "tensors", "config", "extra", "tokenizer_json",
                 "chat_template", "checksums", "integrity"]


@settings(FUZZ, max_examples=60)
@given(st.sampled_from(KST_META_KEYS), st.one_of(
    st.sampled_from(["q3", "q8", "", "1", "2", "[]", "{}", "null", "true", '["row-major-codes"]', "nan"]),
    st.text(max_size=20)), st.sampled_from([None, "arch", "num_layers", "rms_norm_eps", "rope_theta", "quant"]),
    st.sampled_from([True, "3", 3.5, 0, -1, None, "gpt2", float("nan"), 1e300, [1]]))
def test_fuzz_kst_metadata(key: str, text: str, config_key: str | None, config_value: Any) -> None:
    """An artifact whose metadata strings (and config fields) are replaced, through safetensors' own writer."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    src = workdir() / "seed.kst"
    if not src.exists():
        src.write_bytes(seeds()["kst"])
    with safe_open(str(src), framework="numpy") as f:
        meta = dict(f.metadata())
    meta[key] = text
    if config_key is not None:
        cfg = json.loads(meta.get("config", "{}")) if key != "config" else {}
        cfg[config_key] = config_value
        meta["config"] = json.dumps(cfg)
    path = workdir() / "meta.kst"
    save_file(load_file(str(src)), str(path), metadata=meta)
    must_end_well(lambda: harness().check_kst_file(path), (key, text, config_key, config_value))


@settings(FUZZ, max_examples=200)
@given(st.lists(EDIT, min_size=1, max_size=6))
def test_fuzz_safetensors_bytes(edits: list[tuple[int, str, int]]) -> None:
    h = harness()
    root = workdir() / "hf"
    root.mkdir(exist_ok=True)
    (root / "config.json").write_text(json.dumps(h.HF_CONFIG))
    (root / "model.safetensors").write_bytes(apply_edits(seeds()["st"], edits, header_len("st")))
    must_end_well(lambda: h.check_hf_dir(root), edits)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2 ** 64), 2 ** 64) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                max_size=3), max_leaves=6)
CONFIG_KEYS = ["architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
               "rope_scaling", "rope_parameters", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
               "eos_token_id", "mlp_bias", "attention_bias"]
ROPE_KEYS = ["rope_type", "type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
             "rope_theta"]


@settings(FUZZ, max_examples=600)
@given(st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON, max_size=4),
       st.dictionaries(st.sampled_from(ROPE_KEYS), JSON, max_size=3), st.sets(st.sampled_from(CONFIG_KEYS),
                                                                               max_size=2))
def test_fuzz_config_json(changes: dict[str, Any], rope: dict[str, Any], drop: set[str]) -> None:
    """A valid config.json with fields replaced by arbitrary JSON values, rope dicts fuzzed, fields dropped."""
    h = harness()
    cfg = {**json.loads(json.dumps(h.HF_CONFIG)), **changes}
    if rope:
        cfg["rope_scaling"] = {**h.HF_CONFIG["rope_scaling"], **rope}
    for key in drop:
        cfg.pop(key, None)
    must_end_well(lambda: h.check_config(cfg), cfg)


@pytest.fixture(autouse=True)
def _fast_template_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel_core.model import chat_template

    monkeypatch.setattr(chat_template, "MAX_TEMPLATE_STEPS", 100_000)
    monkeypatch.setattr(chat_template, "MAX_TEMPLATE_SECONDS", 1.0)


@settings(FUZZ, max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.one_of(st.sampled_from(harness().TEMPLATE_PIECES), st.text(max_size=12)), min_size=1,
                max_size=8))
def test_fuzz_chat_templates(pieces: list[str]) -> None:
    source = "".join(pieces)
    must_end_well(lambda: harness().check_template(source), source)


def test_the_fuzz_script_under_a_memory_limit() -> None:
    """scripts/fuzz.py, 600 cases over every target, each under RLIMIT_AS (+1 GiB); a case's timeout is half the
    hang guard, so a case that hangs is reported, with its seed, before the run is called a hang."""
    root = str(Path(kestrel_core.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "fuzz.py"), "--cases", "600", "--seed", "7",
                        "--case-timeout", str(HANG_GUARD_S / 2), "--quiet"], capture_output=True, text=True,
                       timeout=HANG_GUARD_S, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 failures" in r.stdout


@settings(FUZZ, max_examples=120)
@given(st.integers(0, 2 ** 32))
def test_fuzz_integer_checkpoints(seed: int) -> None:
    """The GPTQ, AWQ and compressed-tensors twins with mutated bytes and quantization_config values (scripts/fuzz.py's
    int-checkpoint target), every weight read and quantized at q8 and q4."""
    must_end_well(harness().int_checkpoint_case(workdir(), random.Random(seed)), seed)
