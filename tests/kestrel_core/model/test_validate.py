"""Untrusted values: every config field by type and range, regular files only, CLI and environment values."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from kestrel_core.errors import KestrelError
from kestrel_core.model.config import ModelConfig, normalize_rope_scaling
from kestrel_core.model.validate import (
    ValidationError,
    check_artifact_meta,
    check_cli_args,
    check_hf_config,
    check_regular_file,
    open_regular,
    read_line_stdin,
    read_text_stdin,
)

BASE = dict(arch="llama", vocab_size=16, hidden_size=32, intermediate_size=32, num_layers=2, num_heads=2,
            num_kv_heads=1, head_dim=16)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
HF = {"architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 32, "intermediate_size": 32,
      "num_hidden_layers": 2, "num_attention_heads": 2}


def test_a_valid_config_passes() -> None:
    c = ModelConfig(**BASE, rope_scaling=dict(LLAMA3), eos_token_ids=(2, 3), bos_token_id=1)
    assert ModelConfig.from_dict(json.loads(json.dumps(c.as_dict()))) == c


@pytest.mark.parametrize("field, value", [
    ("num_layers", True), ("num_layers", "3"), ("num_layers", 3.5), ("num_layers", 0), ("num_layers", -1),
    ("num_layers", 10 ** 9), ("num_heads", 0), ("num_kv_heads", 0), ("num_kv_heads", 3), ("head_dim", 15),
    ("vocab_size", None), ("hidden_size", False), ("arch", "gpt2"), ("arch", 1),
    ("rms_norm_eps", math.nan), ("rms_norm_eps", -1e-5), ("rms_norm_eps", 0.0), ("rms_norm_eps", "1e-5"),
    ("rope_theta", 0.0), ("rope_theta", math.nan), ("rope_theta", math.inf), ("rope_theta", True),
    ("max_position", 0), ("tie_word_embeddings", 1), ("qk_norm", "yes"), ("bos_token_id", -1),
    ("bos_token_id", True), ("eos_token_ids", (1, -2)), ("eos_token_ids", (True,)), ("rope_scaling", [1]),
    ("rope_scaling", {**LLAMA3, "factor": 0.0}), ("rope_scaling", {**LLAMA3, "factor": math.nan}),
    ("rope_scaling", {**LLAMA3, "high_freq_factor": 1.0}), ("rope_scaling", {**LLAMA3, "low_freq_factor": 0}),
    ("rope_scaling", {**LLAMA3, "original_max_position_embeddings": 8192.5}), ("norm_type", "group"),
    ("norm_type", None), ("parallel_block", 1), ("qk_norm_heads", "yes"),
])
def test_each_bad_field_is_one_line_naming_it(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as info:
        ModelConfig(**{**BASE, field: value})
    msg = str(info.value)
    assert "\n" not in msg
    assert field.split("_")[0] in msg or field in msg or "rope_scaling" in msg, msg
    assert isinstance(info.value, KestrelError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("fields", [
    {"qk_norm_heads": True}, {"qk_norm_heads": True, "qk_norm": True, "qk_norm_full": True},
    {"parallel_block": True, "pre_norms": False, "post_norms": True}, {"parallel_block": True, "post_norms": True},
], ids=["per-head q/k norm weights without q/k norms", "per-head and whole-projection q/k norms",
        "a parallel block without its norm", "a parallel block with norms after"])
def test_cohere_fields_that_contradict_the_others_are_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="qk_norm_heads|parallel_block"):
        ModelConfig(**{**BASE, **fields})


@pytest.mark.parametrize("change", [
    {"num_hidden_layers": True}, {"num_hidden_layers": "3"}, {"num_hidden_layers": 3.5}, {"num_hidden_layers": 0},
    {"num_hidden_layers": -1}, {"num_attention_heads": 0}, {"rms_norm_eps": math.nan}, {"rms_norm_eps": -1.0},
    {"rope_theta": 0}, {"rope_theta": math.nan}, {"rope_scaling": "llama3"}, {"rope_parameters": [1]},
    {"tie_word_embeddings": "false"}, {"architectures": "LlamaForCausalLM"}, {"eos_token_id": [1, "2"]},
    {"vocab_size": None}, {"mlp_bias": "no"}, {"layer_norm_eps": "1e-5"}, {"logit_scale": 0.0},
])
def test_hf_config_values_are_checked_before_coercion(change: dict[str, Any]) -> None:
    with pytest.raises(KestrelError) as info:
        check_hf_config({**HF, **change}, "m/config.json")
    assert str(info.value).startswith("m/config.json: ") and "\n" not in str(info.value)


def test_hf_config_accepts_real_spellings() -> None:
    check_hf_config({**HF, "num_key_value_heads": None, "head_dim": None, "rope_scaling": None, "eos_token_id": [1, 2],
                     "rms_norm_eps": 1e-6, "rope_theta": 500000, "rope_parameters": {"rope_type": "default"}})


def test_hf_loader_gets_the_model_config_checks() -> None:
    """End to end through hf.py: the ModelConfig checks reach it without edits there (0 and -1 layers, NaN)."""
    from kestrel_core.model.hf_config import config_from_hf

    for change in ({"num_hidden_layers": 0}, {"num_hidden_layers": -1}, {"num_key_value_heads": -2},
                   {"rms_norm_eps": math.nan}, {"rope_theta": 0.0},
                   {"rope_scaling": {**LLAMA3, "factor": 0}}):
        with pytest.raises(KestrelError, match="config.json"):
            config_from_hf({**HF, **change})


@pytest.mark.parametrize("change", [{"num_hidden_layers": True}, {"num_hidden_layers": "3"},
                                    {"num_hidden_layers": 3.5}, {"num_attention_heads": 0},
                                    {"rope_parameters": 5}, {"architectures": 5}])
def test_hf_loader_refuses_coercible_values(change: dict[str, Any]) -> None:
    from kestrel_core.model.hf_config import config_from_hf

    with pytest.raises(KestrelError):
        config_from_hf({**HF, **change})


def test_a_projections_width_is_bounded_before_its_row_maps_are_made() -> None:
    """Heads within their bound times dims within theirs can still ask for a 2^30-row map of a fused tensor."""
    from kestrel_core.model.hf_config import config_from_hf

    with pytest.raises(KestrelError, match="num_heads x head_dim \\(16384 x 65536\\) must be at most 1048576"):
        config_from_hf({**HF, "num_attention_heads": 1 << 14, "num_key_value_heads": 1 << 14, "head_dim": 1 << 16})


@pytest.mark.parametrize(("arch", "change"), [
    ("Gemma2ForCausalLM", {"num_hidden_layers": 10**10}),  # its layer types are a list a layer
    ("Qwen3MoeForCausalLM", {"num_hidden_layers": 10**10, "num_experts": 8, "num_experts_per_tok": 2,
                             "moe_intermediate_size": 8}),
    ("Qwen3MoeForCausalLM", {"num_experts": 10**9, "num_experts_per_tok": 2, "moe_intermediate_size": 8}),
])
def test_counts_that_size_lists_are_bounded_before_the_lists_are_made(arch: str, change: dict[str, Any]) -> None:
    from kestrel_core.model.hf_config import config_from_hf

    with pytest.raises(KestrelError, match="must be an integer in \\[1, 4096\\]"):
        config_from_hf({**HF, "architectures": [arch], **change})


@pytest.mark.parametrize("bad", ["q3", None, 8, "Q8 "])
def test_artifact_quant_must_be_a_known_mode(bad: Any) -> None:
    with pytest.raises(KestrelError, match="quant"):
        check_artifact_meta(bad, ModelConfig(**BASE), [], "m.kst")


def test_artifact_tensors_beyond_num_layers_are_refused() -> None:
    names = ["embedding.codes", "layers.0.q.codes", "layers.1.q.codes", "layers.2.q.codes"]
    with pytest.raises(KestrelError, match="layer 2 .* num_layers 2"):
        check_artifact_meta("q8", ModelConfig(**BASE), names, "m.kst")
    assert check_artifact_meta("q4", ModelConfig(**{**BASE, "num_layers": 3}), names, "m.kst") == "q4"


def test_artifact_config_with_a_bad_field_is_refused_by_the_loader(tmp_path: Path) -> None:
    """A .kst whose config says arch gpt2 or num_layers true: ModelConfig.from_dict raises a ValueError, which
    artifact.py turns into one line naming the file."""
    for change in ({"arch": "gpt2"}, {"num_layers": True}, {"rms_norm_eps": -1}, {"eos_token_ids": 3}):
        d = {**ModelConfig(**BASE).as_dict(), **change}
        with pytest.raises(ValueError):
            ModelConfig.from_dict(d)


def test_normalize_rope_scaling_refuses_non_dicts_and_bad_values() -> None:
    for bad in ("llama3", [1], {**LLAMA3, "factor": 0}, {**LLAMA3, "factor": "8"}, {**LLAMA3, "factor": True}):
        with pytest.raises(KestrelError):
            normalize_rope_scaling(bad, "x")  # type: ignore[arg-type]
    assert normalize_rope_scaling({"rope_type": "default"}, "x") is None


# -- files --------------------------------------------------------------------------------------------------


def test_fifo_device_directory_are_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "FIFO"), (Path("/dev/zero"), "device"), (tmp_path, "directory")):
        with pytest.raises(KestrelError, match=kind):
            check_regular_file(path)
        with pytest.raises(KestrelError, match=kind):
            open_regular(path)
    with pytest.raises(KestrelError, match="no such file"):
        check_regular_file(tmp_path / "missing")


def test_symlinks_leaving_the_model_directory_are_refused(tmp_path: Path) -> None:
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"x")
    root = tmp_path / "model"
    root.mkdir()
    (root / "inside.safetensors").write_bytes(b"y")
    (root / "ok.safetensors").symlink_to(root / "inside.safetensors")
    (root / "bad.safetensors").symlink_to(outside)
    assert check_regular_file(root / "ok.safetensors", root) == root / "ok.safetensors"
    with pytest.raises(KestrelError, match="outside the model directory"):
        check_regular_file(root / "bad.safetensors", root)
    with open_regular(root / "ok.safetensors", root) as f:
        assert f.read() == b"y"


def test_a_hugging_face_cache_snapshot_may_link_into_its_own_blobs_only(tmp_path: Path) -> None:
    """The cache's layout: snapshots/COMMIT/FILE -> ../../blobs/HASH, inside models--OWNER--NAME."""
    repo = tmp_path / "hub" / "models--org--m"
    snap, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "f00d").write_bytes(b"w")
    (snap / "model.safetensors").symlink_to(Path("../../blobs/f00d"))
    (tmp_path / "hub" / "models--org--other").mkdir()
    (tmp_path / "hub" / "models--org--other" / "x").write_bytes(b"o")
    (snap / "other.safetensors").symlink_to(tmp_path / "hub" / "models--org--other" / "x")
    assert check_regular_file(snap / "model.safetensors", snap) == snap / "model.safetensors"
    with pytest.raises(KestrelError, match="outside the model directory .*models--org--m; refused"):
        check_regular_file(snap / "other.safetensors", snap)
    plain = tmp_path / "snapshots" / "m"  # a directory named like one, outside a cache's models-- folder
    plain.mkdir(parents=True)
    (plain / "w.safetensors").symlink_to(blobs / "f00d")
    with pytest.raises(KestrelError, match="outside the model directory"):
        check_regular_file(plain / "w.safetensors", plain)


def test_gguf_reader_refuses_a_fifo(tmp_path: Path) -> None:
    from kestrel_core.model.gguf_reader import GGUFCheckpoint

    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    with pytest.raises(KestrelError, match="FIFO"):
        GGUFCheckpoint(fifo)


# -- CLI and environment ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, value, flag", [
    ("seed", -1, "--seed"), ("max_tokens", -1, "--max-tokens"), ("temperature", math.nan, "--temperature"),
    ("temperature", math.inf, "--temperature"), ("top_p", 0.0, "--top-p"), ("top_p", 1.5, "--top-p"),
    ("top_k", -3, "--top-k"), ("seed", 2 ** 64, "--seed"), ("runs", 0, "--runs"), ("port", 70000, "--port"),
])
def test_cli_values_are_checked(name: str, value: Any, flag: str) -> None:
    args = argparse.Namespace(max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, seed=0)
    setattr(args, name, value)
    with pytest.raises(KestrelError) as info:
        check_cli_args(args)
    assert str(info.value).startswith(f"{flag}: {name} must be ") and "\n" not in str(info.value)


def test_cli_defaults_pass() -> None:
    check_cli_args(argparse.Namespace(max_tokens=128, temperature=0.7, top_p=0.9, top_k=40, seed=0, port=0))


def test_invalid_utf8_on_stdin_is_one_line() -> None:
    bad = io.TextIOWrapper(io.BytesIO(b"caf\xe9\n"), encoding="utf-8")
    with pytest.raises(KestrelError, match="not valid UTF-8"):
        read_text_stdin(bad)
    bad = io.TextIOWrapper(io.BytesIO(b"\xff\xfe\n"), encoding="utf-8")
    with pytest.raises(KestrelError, match="not valid UTF-8"):
        read_line_stdin(bad)
    assert read_text_stdin(io.TextIOWrapper(io.BytesIO("café".encode()), encoding="utf-8")) == "café"
    assert read_text_stdin(io.StringIO("plain")) == "plain"


def _artifact_with_meta(tmp_path: Path, **changes: str) -> Path:
    """scripts/fuzz.py's small q8 artifact, its metadata strings replaced."""
    import importlib.util

    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    spec = importlib.util.spec_from_file_location("kestrel_fuzz", Path(__file__).resolve().parents[3] / "scripts"
                                                  / "fuzz.py")
    assert spec is not None and spec.loader is not None
    h = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(h)
    import tempfile

    work = Path(tempfile.mkdtemp(dir=tmp_path))
    src = work / "seed.kst"
    src.write_bytes(h.kst_bytes(work))
    with safe_open(str(src), framework="numpy") as f:
        meta = dict(f.metadata())
    meta.update(changes)
    meta.pop("checksums", None)
    meta.pop("integrity", None)  # else the file says it has the checksums it lacks
    out = work / "edited.kst"
    save_file(load_file(str(src)), str(out), metadata=meta)
    return out


def test_kst_config_arch_gpt2_is_one_line(tmp_path: Path) -> None:
    from kestrel_core.artifact_load import load_artifact

    path = _artifact_with_meta(tmp_path)
    with __import__("safetensors").safe_open(str(path), framework="numpy") as f:
        cfg = json.loads(f.metadata()["config"])
    for change in ({"arch": "gpt2"}, {"num_layers": True}, {"rope_theta": 0}):
        bad = _artifact_with_meta(tmp_path, config=json.dumps({**cfg, **change}))
        with pytest.raises(KestrelError) as info:
            load_artifact(bad)
        assert str(bad) in str(info.value) and "\n" not in str(info.value)


def test_kst_quant_must_be_known_when_loading(tmp_path: Path) -> None:
    from kestrel_core.artifact_load import load_artifact

    with pytest.raises(KestrelError, match="q3"):
        load_artifact(_artifact_with_meta(tmp_path, quant="q3"))


def test_stdin_decoded_with_surrogateescape_is_still_refused() -> None:
    """Python's stdin under the C locale turns invalid bytes into lone surrogates instead of raising."""
    lax = io.TextIOWrapper(io.BytesIO(b"caf\xe9\n"), encoding="utf-8", errors="surrogateescape")
    with pytest.raises(KestrelError, match="not valid UTF-8"):
        read_line_stdin(lax)
    assert read_text_stdin(io.TextIOWrapper(io.BytesIO(b"a\r\nb\rc"), encoding="utf-8")) == "a\nb\nc"


def test_cli_main_turns_ctrl_c_into_exit_130(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from kestrel_core import cli

    def interrupt(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupt)  # Ctrl-C before the command's own try
    assert cli.main(["backends"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_hf_directory_files_must_be_regular_and_inside(tmp_path: Path) -> None:
    """Shards, config.json and tokenizer files: a FIFO or a symlink out of the directory is one line."""
    import importlib.util

    from kestrel_core.model.hf import HFCheckpoint
    from kestrel_core.model.tokenizer import Tokenizer

    spec = importlib.util.spec_from_file_location("kestrel_fuzz", Path(__file__).resolve().parents[3] / "scripts"
                                                  / "fuzz.py")
    assert spec is not None and spec.loader is not None
    h = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(h)
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(h.safetensors_bytes())
    root = tmp_path / "m"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(h.HF_CONFIG))
    (root / "model.safetensors").symlink_to(outside)
    with pytest.raises(KestrelError, match="outside the model directory"):
        HFCheckpoint(root)
    (root / "model.safetensors").unlink()
    os.mkfifo(root / "model.safetensors")
    with pytest.raises(KestrelError, match="FIFO"):
        HFCheckpoint(root)
    (root / "tokenizer.json").symlink_to(outside)
    with pytest.raises(KestrelError, match="outside the model directory"):
        Tokenizer.from_hf_dir(root)


MOE = {"num_experts": 8, "experts_per_token": 2, "expert_intermediate_size": 32}


@pytest.mark.parametrize("field, value", [
    ("num_experts", True), ("num_experts", -1), ("experts_per_token", 9), ("experts_per_token", 0),
    ("expert_intermediate_size", 0), ("norm_topk_prob", 1), ("layer_types", ("full", "local")),
    ("layer_types", ("full",)), ("query_scale", 0.0), ("query_scale", math.nan), ("embed_scale", -1.0),
    ("activation", "relu"), ("post_norms", "yes"), ("rope_local_theta", 0.0),
])
def test_each_bad_gemma_or_expert_field_is_one_line_naming_it(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as info:
        ModelConfig(**{**BASE, **MOE, field: value})
    assert "\n" not in str(info.value) and field.split("_")[0] in str(info.value), str(info.value)


@pytest.mark.parametrize("change", [
    {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 5},
    {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": True},
    {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "moe_intermediate_size": 32,
     "mlp_only_layers": [99]},
    {"architectures": ["Qwen3MoeForCausalLM"], "moe_intermediate_size": 32},
    {"architectures": ["MixtralForCausalLM"], "num_local_experts": "8"},
    {"architectures": ["Gemma3ForCausalLM"], "final_logit_softcapping": 30.0},
    {"architectures": ["Gemma3ForCausalLM"], "hidden_activation": "gelu"},
    {"architectures": ["Gemma3ForCausalLM"], "query_pre_attn_scalar": 0},
    {"architectures": ["Gemma3ForCausalLM"], "layer_types": ["sliding_attention"]},
    {"architectures": ["Gemma3ForCausalLM"], "layer_types": "sliding_attention"},
    {"architectures": ["Gemma3ForCausalLM"], "rope_local_base_freq": math.nan},
    {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": [1]},
])
def test_bad_gemma3_and_expert_configs_are_one_line(change: dict[str, Any]) -> None:
    from kestrel_core.model.hf_config import config_from_hf

    with pytest.raises(KestrelError) as info:
        config_from_hf({**HF, **change}, where="m/config.json")
    assert str(info.value).startswith("m/config.json: ") and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("eos", ["x", [1, -2], True])
def test_generation_configs_eos_ids_are_checked_and_named_as_its(eos: Any) -> None:
    from kestrel_core.model.hf_config import config_from_hf

    with pytest.raises(KestrelError, match="^generation_config.json: eos_token_id must be a token id"):
        config_from_hf(dict(HF), {"eos_token_id": eos})
