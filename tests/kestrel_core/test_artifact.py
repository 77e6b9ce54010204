"""The .kst artifact: round trip, tied storage, atomic writes, and refusal of what this kestrel cannot read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from kestrel_core import artifact_write
from kestrel_core.artifact import FORMAT_VERSION, model_tensors, read_meta
from kestrel_core.artifact_load import load_artifact
from kestrel_core.artifact_write import save_artifact
from kestrel_core.contract import StripCache
from kestrel_core.errors import KestrelError
from kestrel_core.model.quantize import quantize_model

TOKENIZER_JSON = json.dumps({"version": "1.0", "model": {"type": "BPE"}})
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def _save(tmp_path: Path, model, name: str = "m.kst", **kw) -> Path:
    kw.setdefault("quant", "q8")
    return save_artifact(tmp_path / name, model, tokenizer_json=TOKENIZER_JSON, chat_template=TEMPLATE, **kw)


def _assert_same_model(a, b) -> None:
    assert a.config == b.config
    ta, tb = model_tensors(a), model_tensors(b)
    assert ta.keys() == tb.keys()
    for name, va in ta.items():
        vb = tb[name]
        if isinstance(va, StripCache):
            assert isinstance(vb, StripCache)
            assert (va.group_size, va.bits) == (vb.group_size, vb.bits), name
            np.testing.assert_array_equal(va.codes, vb.codes)
            np.testing.assert_array_equal(va.scales, vb.scales)
        else:
            assert vb.dtype == np.float32
            np.testing.assert_array_equal(va, vb)


@pytest.mark.parametrize("arch,mode", [("llama", "q8"), ("qwen2", "q4"), ("qwen3", "q8-g256"),
                                       ("llama", "q4-g256")])
def test_round_trip(tmp_path: Path, synth_source, arch: str, mode: str) -> None:
    model = quantize_model(synth_source(arch, seed=3), mode)
    path = _save(tmp_path, model, quant=mode, extra={"source": "unit test"})
    loaded, meta = load_artifact(path)
    _assert_same_model(model, loaded)
    assert meta.quant == mode and meta.format_version == FORMAT_VERSION
    assert meta.tokenizer_json == TOKENIZER_JSON and meta.chat_template == TEMPLATE
    assert meta.extra == {"source": "unit test"}
    assert (loaded.lm_head is loaded.embedding) == model.config.tie_word_embeddings
    assert read_meta(path).config == model.config


def test_tied_embedding_is_stored_once(tmp_path: Path, synth_source) -> None:
    model = quantize_model(synth_source("llama", tie_word_embeddings=True), "q8")
    assert model.lm_head is model.embedding
    path = _save(tmp_path, model)
    with safe_open(str(path), framework="numpy") as f:
        keys = set(f.keys())
        meta = f.metadata()
    assert "embedding.codes" in keys and not any(k.startswith("lm_head") for k in keys)
    assert json.loads(meta["layout"]) == ["row-major-codes"]
    assert json.loads(meta["tensors"])["layers.0.down"] == {"group_size": 32, "bits": 8}
    loaded, _ = load_artifact(path)
    assert loaded.lm_head is loaded.embedding


def test_existing_output_needs_force_and_write_is_atomic(tmp_path: Path, synth_source, monkeypatch) -> None:
    model = quantize_model(synth_source("llama"), "q8")
    path = tmp_path / "m.kst"
    path.write_bytes(b"the user's file")
    with pytest.raises(KestrelError, match="already exists; pass --force"):
        _save(tmp_path, model)
    assert path.read_bytes() == b"the user's file"

    def boom(f, *args, **kwargs):
        f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(artifact_write, "_write_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, model, force=True)
    assert path.read_bytes() == b"the user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.kst"]  # no temp file left behind
    monkeypatch.undo()
    _save(tmp_path, model, force=True)
    _assert_same_model(model, load_artifact(path)[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.kst"]


def _rewrite_meta(path: Path, **changes: str) -> None:
    with safe_open(str(path), framework="numpy") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(path))
    meta.update(changes)
    save_file(tensors, str(path), metadata=meta)


def test_unknown_version_is_refused_naming_both(tmp_path: Path, synth_source) -> None:
    path = _save(tmp_path, quantize_model(synth_source("llama"), "q8"))
    _rewrite_meta(path, format_version="2")
    with pytest.raises(KestrelError) as exc:
        load_artifact(path)
    msg = str(exc.value)
    assert "format_version 2" in msg and f"format_version {FORMAT_VERSION}" in msg and "\n" not in msg


def test_unknown_layout_flag_is_refused_naming_both(tmp_path: Path, synth_source) -> None:
    path = _save(tmp_path, quantize_model(synth_source("llama"), "q8"))
    _rewrite_meta(path, layout=json.dumps(["row-major-codes", "int4-4x4-repack"]))
    with pytest.raises(KestrelError) as exc:
        load_artifact(path)
    msg = str(exc.value)
    assert "int4-4x4-repack" in msg and "row-major-codes" in msg and "\n" not in msg
    _rewrite_meta(path, layout=json.dumps([]))
    with pytest.raises(KestrelError, match="layout flags"):
        read_meta(path)


def test_truncated_corrupt_and_foreign_files(tmp_path: Path, synth_source) -> None:
    path = _save(tmp_path, quantize_model(synth_source("llama"), "q8"))
    data = path.read_bytes()
    for i, blob in enumerate([data[: len(data) // 2], data[:100], b"", b"\x00" * 64, b"not safetensors at all"]):
        bad = tmp_path / f"bad{i}.kst"
        bad.write_bytes(blob)
        with pytest.raises(KestrelError) as exc:
            load_artifact(bad)
        assert "\n" not in str(exc.value) and str(bad) in str(exc.value)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": np.zeros(3, np.float32)}, str(foreign))
    with pytest.raises(KestrelError, match="not a kestrel artifact"):
        load_artifact(foreign)
    with pytest.raises(KestrelError, match="no such artifact"):
        load_artifact(tmp_path / "missing.kst")


def test_tensor_that_breaks_the_contract_or_config(tmp_path: Path, synth_source) -> None:
    path = _save(tmp_path, quantize_model(synth_source("llama"), "q8"))
    tensors = load_file(str(path))
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
    bad = dict(tensors)
    bad["layers.0.q.codes"] = np.full_like(tensors["layers.0.q.codes"], -128)  # outside int8 Q8_0 range
    save_file(bad, str(path), metadata=meta)  # the recorded checksum no longer matches
    with pytest.raises(KestrelError, match=r"tensor 'layers\.0\.q\.codes' is corrupt: its XXH64"):
        load_artifact(path)
    unchecked = {k: v for k, v in meta.items() if k not in ("checksums", "integrity")}  # another producer's file
    save_file(bad, str(path), metadata=unchecked)
    with pytest.raises(KestrelError, match=r"tensor 'layers\.0\.q' breaks the strip-cache contract: int8 codes"):
        load_artifact(path)
    q4 = dict(tensors)
    q4["layers.1.up.codes"] = np.full_like(tensors["layers.1.up.codes"], 8)  # outside int4's [-8, 7]
    specs = json.loads(meta["tensors"])
    specs["layers.1.up"]["bits"] = 4
    save_file(q4, str(path), metadata={**unchecked, "tensors": json.dumps(specs)})
    with pytest.raises(KestrelError, match=r"tensor 'layers\.1\.up' breaks the strip-cache contract: int4 codes"):
        load_artifact(path)
    meta = unchecked
    bad = dict(tensors)
    del bad["layers.1.v.scales"]
    save_file(bad, str(path), metadata=meta)
    with pytest.raises(KestrelError, match=r"lacks tensor 'layers\.1\.v\.scales'"):
        load_artifact(path)
    cfg = json.loads(meta["config"])
    cfg["intermediate_size"] = 128
    save_file(tensors, str(path), metadata={**meta, "config": json.dumps(cfg)})
    with pytest.raises(KestrelError, match="the config implies"):
        load_artifact(path)


def test_a_file_that_appears_while_the_output_is_written_is_not_overwritten(tmp_path: Path, synth_source,
                                                                            monkeypatch) -> None:
    """Without --force the output was absent when checked; a file created there during the write stays."""
    model = quantize_model(synth_source("llama"), "q8")
    path = tmp_path / "m.kst"
    write = artifact_write._write_safetensors

    def racing(f, *args, **kwargs):
        path.write_bytes(b"the user's file, saved meanwhile")
        return write(f, *args, **kwargs)

    monkeypatch.setattr(artifact_write, "_write_safetensors", racing)
    with pytest.raises(KestrelError, match="already exists; pass --force"):
        _save(tmp_path, model)
    assert path.read_bytes() == b"the user's file, saved meanwhile"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.kst"]


def test_an_output_name_as_long_as_the_file_system_allows_is_written(tmp_path: Path, synth_source) -> None:
    model = quantize_model(synth_source("llama"), "q8")
    name = "m" * 251 + ".kst"  # 255 bytes: its temp file's name must not be longer
    _assert_same_model(model, load_artifact(_save(tmp_path, model, name))[0])
