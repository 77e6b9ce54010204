"""Integer-quantized checkpoints (model/int_quant.py): the layouts against compressed-tensors' own compressors
(tests/fixtures/models/int-references.npz, scripts/make_golden.py), and what kestrel refuses, in one line. The
GPTQ, AWQ and compressed-tensors twins' logits against transformers are test_parity.py's."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kestrel_core
from kestrel_core.cli import main
from kestrel_core.errors import KestrelError
from kestrel_core.model.hf import HFCheckpoint
from kestrel_core.model.int_quant import IntScheme, int_scheme, read_awq, read_gptq, read_int8, read_packed

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
REFERENCES = FIXTURES / "int-references.npz"


@pytest.fixture(scope="module")
def refs() -> dict[str, np.ndarray]:
    with np.load(REFERENCES, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("case", ["packed4", "packed8"])
def test_pack_quantized_with_zero_points_is_compressed_tensors_reading(refs: dict[str, np.ndarray],
                                                                       case: str) -> None:
    bits = 4 if case == "packed4" else 8
    got = read_packed(refs[f"{case}.weight_packed"], refs[f"{case}.weight_shape"], refs[f"{case}.weight_scale"],
                      refs[f"{case}.weight_zero_point"], None, IntScheme("compressed-tensors", bits), case).to_float32()
    np.testing.assert_array_equal(got, refs[f"{case}.expected"])


def test_int_quantized_with_zero_points_is_compressed_tensors_reading(refs: dict[str, np.ndarray]) -> None:
    got = read_int8(refs["int8.weight"], refs["int8.weight_scale"], refs["int8.weight_zero_point"], None,
                    "w").to_float32()
    np.testing.assert_array_equal(got, refs["int8.expected"])


def test_the_twins_decode_to_what_their_configs_say() -> None:
    """Each twin's quantized weights decode to the float weights within half a 4-bit step (the scheme read off
    config.json: groups of 32, act-order for GPTQ), so the layouts agree before any logits do."""
    base = HFCheckpoint(FIXTURES / "tiny-qwen3")
    for twin in ("tiny-qwen3-gptq", "tiny-qwen3-awq"):
        ckpt = HFCheckpoint(FIXTURES / twin)
        assert ckpt.int_quant is not None and ckpt.int_quant.group_size == 32 and ckpt.fp8 is None
        for name in ("layers.0.q", "layers.1.down", "layers.2.gate"):
            w, ref = ckpt.get(name), base.get(name).astype(np.float32)
            assert w.shape == ref.shape and w.dtype == np.float32
            step = np.maximum(np.abs(ref).max(1) / 7, (ref.max(1) - ref.min(1)) / 15)  # symmetric or not, a row
            assert (np.abs(w - ref).max(1) <= step / 2 * 1.01).all(), (twin, name)


def _scheme(**kw: Any) -> dict[str, Any]:
    return kw


@pytest.mark.parametrize(("config", "says"), [
    (_scheme(quant_method="awq", bits=4, group_size=128, version="gemv"), "AWQ version 'gemv' is not supported"),
    (_scheme(quant_method="awq", bits=8, group_size=128), "AWQ with 8-bit weights is not supported"),
    (_scheme(quant_method="awq", bits=4, group_size=128, zero_point=False), "AWQ without zero points"),
    (_scheme(quant_method="gptq", bits=3, group_size=128), "GPTQ with 3-bit weights is not supported"),
    (_scheme(quant_method="gptq", bits=4, group_size=128, checkpoint_format="marlin"),
     "GPTQ format 'marlin' is not supported"),
    (_scheme(quant_method="gptq", bits=4, group_size=128, format="gptq_v2", checkpoint_format="gptq"),
     r"checkpoint_format and format disagree \('gptq', 'gptq_v2'\)"),
    (_scheme(quant_method="gptq", bits=4, group_size=128, format="gptq_p"), "GPTQ format 'gptq_p' is not supported"),
    (_scheme(quant_method="gptq", bits=4, group_size=128, pack_dtype="int16"), "pack_dtype 'int16'"),
    (_scheme(quant_method="gptq", bits=4, group_size=128, dynamic={"+:.*down_proj.*": {"bits": 8}}),
     r"per-module overrides \(dynamic\)"),
    (_scheme(quant_method="awq", bits=4, group_size=128, format="gemv"), "AWQ version 'gemv' is not supported"),
    (_scheme(quant_method="gptq", bits=4, group_size=0), "group_size must be a positive integer or -1, got 0"),
    (_scheme(quant_method="compressed-tensors", format="marlin-24",
             config_groups={"g": {"weights": {"type": "int", "num_bits": 4}}}),
     "compressed-tensors format 'marlin-24' is not supported"),
    (_scheme(quant_method="compressed-tensors", format="pack-quantized",
             config_groups={"g": {"weights": {"type": "int", "num_bits": 4}},
                            "h": {"weights": {"type": "int", "num_bits": 8}}}),
     r"integer weights of \['4', '8'\] bits are not supported"),
    (_scheme(quant_method="compressed-tensors", format="int-quantized",
             config_groups={"g": {"weights": {"type": "int", "num_bits": 4}}}),
     r"integer weights of \['4'\] bits are not supported"),
    (_scheme(quant_method="compressed-tensors", format="pack-quantized",
             sparsity_config={"format": "sparse-24-bitmask"},
             config_groups={"g": {"weights": {"type": "int", "num_bits": 4}}}),
     "sparsity format 'sparse-24-bitmask' is not supported"),
    (_scheme(quant_method="compressed-tensors", format="pack-quantized", transform_config={"t": {}},
             config_groups={"g": {"weights": {"type": "int", "num_bits": 4}}}), "transforms"),
])
def test_an_integer_scheme_kestrel_cannot_read_is_refused_by_name(config: dict[str, Any], says: str) -> None:
    with pytest.raises(KestrelError, match=says):
        int_scheme(config, "config.json")


def test_schemes_read_off_their_configs() -> None:
    assert int_scheme({"quant_method": "gptq", "bits": 4, "group_size": -1}, "c") == IntScheme("gptq", 4, 0, 1)
    assert int_scheme({"quant_method": "gptq", "bits": 8, "group_size": 64, "checkpoint_format": "gptq_v2"},
                      "c") == IntScheme("gptq", 8, 64, 0)
    assert int_scheme({"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "version": "GEMM"},
                      "c") == IntScheme("awq", 4, 128)
    assert int_scheme({"quant_method": "gptq", "bits": 4, "group_size": 32, "format": "gptq_v2"},
                      "c") == IntScheme("gptq", 4, 32, 0)  # transformers 5's and GPTQModel's name for it
    assert int_scheme({"quant_method": "gptq", "bits": 4, "group_size": 32, "dynamic": {"-:.*lm_head": {}}},
                      "c") == IntScheme("gptq", 4, 32, 1)  # modules left out: they are float
    dense = {"quant_method": "compressed-tensors", "format": "dense",
             "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4}}}}
    from kestrel_core.model.fp8 import fp8_scheme

    assert int_scheme(dense, "c") is None and fp8_scheme(dense, "c") is None  # saved uncompressed: float weights
    fp8 = {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8}}}}
    assert int_scheme(fp8, "c") is None and int_scheme({"quant_method": "fp8"}, "c") is None
    assert int_scheme(None, "c") is None
    per_group = {"quant_method": "compressed-tensors", "sparsity_config": {"format": "dense"},
                 "config_groups": {"g": {"format": "pack-quantized", "weights": {"type": "int", "num_bits": 4}}}}
    assert int_scheme(per_group, "c") == IntScheme("compressed-tensors", 4)


def test_packed_tensors_of_the_wrong_shape_are_errors_naming_them() -> None:
    gptq = IntScheme("gptq", 4, 32, 1)
    qweight, qzeros = np.zeros((8, 16), np.int32), np.zeros((2, 2), np.int32)
    scales = np.ones((2, 16), np.float16)
    assert read_gptq(qweight, qzeros, scales, None, gptq, "w").shape == (16, 64)
    with pytest.raises(KestrelError, match="w: qzeros has 1 groups, scales 2"):
        read_gptq(qweight, qzeros[:1], scales, None, gptq, "w")
    with pytest.raises(KestrelError, match="w: g_idx of shape"):
        read_gptq(qweight, qzeros, scales, np.full(64, 5, np.int32), gptq, "w")
    with pytest.raises(KestrelError, match=r"w: packed tensor of shape \[16, 8\] \(int64\)"):
        read_gptq(qweight.astype(np.int64), qzeros, scales, None, gptq, "w")
    with pytest.raises(KestrelError, match=r"N a multiple of 8"):
        read_awq(np.zeros((64, 2), np.int32), np.zeros((2, 2), np.int32), np.ones((2, 12), np.float16),
                 IntScheme("awq", 4, 32), "w")
    with pytest.raises(KestrelError, match="weight_shape"):
        read_packed(np.zeros((4, 8), np.int32), np.array([4, 64, 1]), np.ones((4, 2), np.float32), None, None,
                    IntScheme("compressed-tensors", 4), "w")


def _twin(tmp_path: Path, name: str = "tiny-qwen3-awq") -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def test_a_missing_zero_point_tensor_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _twin(tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.qzeros"]
    save_file(tensors, d / "model.safetensors")
    assert main(["run", "--model", str(d), "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "has no tensor model.layers.1.mlp.up_proj.qzeros" in err, err


def test_packed_weights_without_a_quantization_config_are_refused(tmp_path: Path) -> None:
    d = _twin(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KestrelError, match="is integer-quantized, but config.json has no GPTQ, AWQ or compressed"):
        kestrel_core.load(str(d), backend="cpu")


def test_an_unsupported_variant_is_refused_before_any_weight_is_read(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    d = _twin(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["version"] = "gemv_fast"
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(b"not read")
    assert main(["run", "--model", str(d), "hi"]) == 2
    assert "AWQ version 'gemv_fast' is not supported" in capsys.readouterr().err


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_compiled_decoder_is_its_definition(bits: int) -> None:
    """IntWeight's numba loop against its numpy definition, bit for bit, to float32 and to int8 codes, contiguous
    groups and act-order."""
    from kestrel_core.model import int_quant

    rng = np.random.default_rng(bits)
    n, k, groups = 24, 96, 3
    packed = rng.integers(0, 256, (n, k * bits // 8), dtype=np.uint8)
    zeros = rng.integers(0, 1 << bits, (n, groups)).astype(np.float32)
    scales = rng.uniform(-0.1, 0.1, (n, groups)).astype(np.float32)
    for column_group in (np.arange(k) // 32, rng.integers(0, groups, k)):
        w = int_quant._weight(packed, bits, zeros, scales, column_group)
        for scale, dtype in ((scales, np.float32), (np.ones_like(scales), np.int16)):
            want = np.empty((n, k), dtype)
            int_quant._decode_rows_reference(packed, bits, zeros, scale, column_group, want)
            np.testing.assert_array_equal(w._decode(scale, dtype), want)
    assert int_quant._COMPILED["rows"] is not None  # numba built it: the comparison above was not numpy with itself


def test_the_compiled_awq_unpacking_is_its_definition() -> None:
    from kestrel_core.model import int_quant

    rng = np.random.default_rng(7)
    k, n = 40, 48
    words = rng.integers(0, 256, (k, n // 2), dtype=np.uint8)
    order = int_quant.AWQ_ORDER.astype(np.int64)
    want, got = np.empty((n, k), np.uint8), np.empty((n, k), np.uint8)
    int_quant._awq_codes_reference(words, order, want)
    int_quant._run("columns", int_quant._awq_codes_loop, None, (words, order, got), n // 8, 8 * k)
    np.testing.assert_array_equal(got, want)
    assert int_quant._COMPILED["columns"] is not None


@pytest.mark.parametrize(("twin", "name", "quant", "kept"), [
    ("tiny-qwen3-awq", "layers.0.q", "q8", True),  # 4-bit codes less zero points in [-15, 15]
    ("tiny-qwen3-awq", "layers.1.down", "q8", True),
    ("tiny-qwen3-awq", "layers.0.q", "q4", False),  # asymmetric: beyond int4
    ("tiny-qwen3-awq", "layers.1.down", "q8-g256", False),  # K 256: groups of 32 are not whole blocks of 256
    ("tiny-qwen3-gptq", "layers.0.q", "q8", False),  # act-order: a column's group is not its block's
    ("tiny-qwen3-moe-w4a16", "layers.1.experts.3.down", "q4", True),  # symmetric 4-bit: int4 as it is
    ("tiny-qwen3-moe-w4a16", "layers.0.q", "q4", True),
    ("tiny-qwen2-w8a8", "layers.1.down", "q8", True),  # symmetric int8 within [-127, 127]
])
def test_a_strip_cache_keeps_the_checkpoints_codes_where_it_can(twin: str, name: str, quant: str, kept: bool) -> None:
    """Where the checkpoint's groups are whole blocks and its codes fit, the strip-cache holds the checkpoint's
    very weights (decoded, they equal the checkpoint's float32 decoding); elsewhere it is quantized again."""
    from kestrel_core.model.quantize import parse_quant, quantize_tensor

    mode = parse_quant(quant)
    w = HFCheckpoint(FIXTURES / twin).get_weight(name)
    cache = quantize_tensor(w, mode.bits, mode, name)
    assert np.array_equal(cache.dequantize(), w.to_float32()) == kept


@pytest.mark.parametrize(("twin", "asked", "built"), [
    ("tiny-qwen3-moe-w4a16", None, "q4"),  # symmetric 4-bit: its own codes, in half the memory
    ("tiny-qwen3-moe-w4a16", "q8", "q8"),  # what is asked for wins
    ("tiny-qwen3-awq", None, "q8"),  # asymmetric: q8 holds its codes, q4 cannot
    ("tiny-qwen3-gptq", None, "q8"),  # act-order
    ("tiny-qwen2-w8a8", None, "q8"),
])
def test_an_integer_checkpoint_loads_at_its_own_mode_unless_asked(twin: str, asked: str | None, built: str) -> None:
    from kestrel_core.model.loader import load_model
    from kestrel_core.model.quantize import model_quant

    loaded = load_model(str(FIXTURES / twin), quant=asked, cache="off")
    assert loaded.quant == built and model_quant(loaded.model) == built


def test_a_4_bit_checkpoint_with_an_adapter_loads_as_float_weights_do(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The merged weights lie off the checkpoint's 4-bit grid: q4 would round them again, so the default is a float
    checkpoint's (q8), and the log says why."""
    from kestrel_core.model.loader import load_model
    from kestrel_core.model.quantize import model_quant

    from .lora_adapters import peft_adapter

    twin, adapter = FIXTURES / "tiny-qwen3-moe-w4a16", tmp_path / "adapter"
    peft_adapter(adapter, FIXTURES / "tiny-qwen3-moe", ["self_attn.q_proj", "self_attn.o_proj"])
    with caplog.at_level(logging.INFO, logger="kestrel"):
        merged = load_model(str(twin), quant=None, cache="off", lora=str(adapter))
    assert merged.quant == "q8" and model_quant(merged.model) == "q8"
    assert "a LoRA adapter merged in, loaded at q8" in caplog.text, caplog.text
    asked = load_model(str(twin), quant="q8", cache="off", lora=str(adapter))
    for field in ("q", "o", "k"):
        np.testing.assert_array_equal(getattr(merged.model.layers[0], field).dequantize(),
                                      getattr(asked.model.layers[0], field).dequantize(), err_msg=field)


def test_reordered_q_and_k_rows_keep_the_checkpoints_codes(tmp_path: Path) -> None:
    """A model whose RoPE turns part of each head stores its q and k rows reordered within each head: the symmetric
    4-bit codes and scales are reordered with them, so at q4 every projection is still the checkpoint's weights."""
    from kestrel_core.model.loader import load_model
    from kestrel_core.model.rope import rotary_first

    d = _twin(tmp_path, "tiny-qwen3-moe-w4a16")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "partial_rotary_factor": 0.5}))
    checkpoint = HFCheckpoint(d)
    loaded = load_model(str(d), quant=None, cache="off")
    assert loaded.quant == "q4" and loaded.model.config.qk_reordered
    for field in ("q", "k", "v", "o"):
        want = checkpoint.get(f"layers.1.{field}")
        want = rotary_first(checkpoint.config, want) if field in ("q", "k") else want
        np.testing.assert_array_equal(getattr(loaded.model.layers[1], field).dequantize(), want, err_msg=field)


def test_natural_quant_reads_the_config_not_its_guesses() -> None:
    from kestrel_core.model.int_quant import natural_quant

    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
    assert natural_quant(gptq) == "q4"
    assert natural_quant({**gptq, "desc_act": True}) is None and natural_quant({**gptq, "sym": False}) is None
    assert natural_quant({**gptq, "group_size": 48}) is None and natural_quant({**gptq, "bits": 8}) is None
    assert natural_quant({**gptq, "bits": 3}) is None  # refused when it loads, with the reason
    assert natural_quant({"quant_method": "awq", "bits": 4, "group_size": 128}) is None
    assert natural_quant(None) is None and natural_quant("gptq") is None
    assert natural_quant({**gptq, "dynamic": {"-:.*mlp": {}}}) is None
    w4a16 = {"type": "int", "num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 128}
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": w4a16}}}
    assert natural_quant(ct) == "q4"
    for order, want in (("weight", "q4"), ("static", "q4"), ("group", None)):  # only "group" stores a g_idx
        groups = {"g": {"weights": {**w4a16, "actorder": order}}}
        assert natural_quant({**ct, "config_groups": groups}) == want, order


def test_a_4_bit_checkpoint_with_float_projections_loads_at_q8(tmp_path: Path) -> None:
    """An ignore list that leaves some projections float: q4 would round those, so the default stays q8."""
    from kestrel_core.model.loader import load_model

    d = _twin(tmp_path, "tiny-qwen3-moe-w4a16")
    tensors = load_file(d / "model.safetensors")
    base = load_file(FIXTURES / "tiny-qwen3-moe" / "model.safetensors")
    for suffix in ("weight_packed", "weight_scale", "weight_shape"):
        del tensors[f"model.layers.1.self_attn.o_proj.{suffix}"]
    tensors["model.layers.1.self_attn.o_proj.weight"] = base["model.layers.1.self_attn.o_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    assert HFCheckpoint(FIXTURES / "tiny-qwen3-moe-w4a16").projections_integer()
    assert not HFCheckpoint(d).projections_integer()
    assert load_model(str(d), cache="off").quant == "q8"


def test_gptq_v1_zero_points_are_read_as_gptqmodel_writes_them() -> None:
    """GPTQModel stores v1 zero points by subtracting 1 from every code of the word at once, so a zero point of 0
    borrows from the next code; reading adds the word back (transformers and GPTQModel do), not 1 a code."""
    zeros = np.array([[0, 5, 15, 8, 0, 0, 3, 1]])  # [G, N]: one group, eight columns
    word = np.uint32(sum(int(z) << (4 * i) for i, z in enumerate(zeros[0])))
    stored = np.array([[(int(word) - 0x11111111) % (1 << 32)]], np.uint32).view(np.int32)  # [G, N / 8]
    qweight = np.zeros((1, 8), np.int32)  # K = 8 codes of 0 along K, each column
    w = read_gptq(qweight, stored, np.ones((1, 8), np.float16), None, IntScheme("gptq", 4, 0, 1), "w")
    np.testing.assert_array_equal(w.zeros[:, 0], zeros[0])
    np.testing.assert_array_equal(w.to_float32()[:, 0], -zeros[0])


def test_zero_points_of_a_tensor_broadcast_and_must_be_int8(refs: dict[str, np.ndarray]) -> None:
    weight, scale = refs["int8.weight"], refs["int8.weight_scale"]
    one = read_int8(weight, scale, np.array([3], np.int8), None, "w").to_float32()
    np.testing.assert_array_equal(one, (weight.astype(np.float32) - 3) * scale)
    for bad in (np.array([65536], np.int32), np.array([np.inf], np.float32)):
        with pytest.raises(KestrelError, match="weight_zero_point is"):
            read_int8(weight, scale, bad, None, "w")
    with pytest.raises(KestrelError, match=r"weight_scale of shape \[48, 0\] does not fit 48 rows"):
        read_int8(weight, np.zeros((48, 0), np.float32), None, None, "w")


def test_a_nan_scale_is_named_not_kept(tmp_path: Path) -> None:
    """Codes kept as they are skip the quantizer's pass over the values: a scale of NaN must still be refused."""
    d = _twin(tmp_path, "tiny-qwen3-moe-w4a16")
    tensors = load_file(d / "model.safetensors")
    scale = tensors["model.layers.0.self_attn.q_proj.weight_scale"].copy()
    scale[3, 1] = np.nan
    tensors["model.layers.0.self_attn.q_proj.weight_scale"] = scale
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(KestrelError, match=r"layers.0.q: the weights contain NaN or infinity \(first in row 3\)"):
        kestrel_core.load(str(d), backend="cpu")


# -- bitsandbytes (model/bnb.py) ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("config", "says"), [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": True}, "must set one of load_in_4bit"),
    ({"quant_method": "bitsandbytes"}, "must set one of load_in_4bit"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"},
     "bnb_4bit_quant_storage 'bfloat16' is not supported"),
])
def test_a_bitsandbytes_config_kestrel_cannot_read_is_refused(config: dict[str, Any], says: str) -> None:
    from kestrel_core.model.bnb import bnb_scheme

    with pytest.raises(KestrelError, match=says):
        bnb_scheme(config, "config.json")


@pytest.mark.parametrize(("state", "says"), [
    (b"not json", "its quant_state is not JSON"),
    (b'{"shape": [64], "blocksize": 64}', "quant_state shape"),
    (b'{"shape": [64, 256], "blocksize": 0}', "quant_state blocksize 0"),
    (b'{"shape": [64, 256], "blocksize": 64, "nested_blocksize": 256, "nested_offset": "x"}', "nested_offset"),
    (b'{"shape": [6400000, 256000], "blocksize": 64, "nested_blocksize": 256, "nested_offset": 0.1}',
     "do not hold a \\[6400000, 256000\\] weight"),
])
def test_a_bad_quant_state_is_one_line(tmp_path: Path, state: bytes, says: str) -> None:
    d = _twin(tmp_path, "tiny-qwen3-bnb-4bit")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__nf4"] = np.frombuffer(state, np.uint8)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(KestrelError, match=says):
        HFCheckpoint(d).get("layers.0.q")



@pytest.mark.parametrize("blocksize", [64, 96, 1 << 36])  # whole blocks, a partial last one, one past the weight
def test_bitsandbytes_scales_apply_by_block_without_repeating_them(blocksize: int) -> None:
    from kestrel_core.model.bnb import dequantize_4bit

    rng = np.random.default_rng(0)
    n, k = 4, 80
    codes = rng.integers(0, 256, n * k // 2).astype(np.uint8)
    qmap = np.linspace(-1, 1, 16).astype(np.float32)
    blocks = -(-n * k // blocksize)
    absmax = rng.uniform(0.5, 2, blocks).astype(np.float32)
    got = dequantize_4bit(codes, qmap, absmax, {"shape": [n, k], "blocksize": blocksize}, None, "w")
    values = np.stack([qmap[codes >> 4], qmap[codes & 15]], axis=1).reshape(-1)
    want = values * absmax[np.arange(n * k) // blocksize]
    assert np.array_equal(got, want.reshape(n, k))
    nested = (np.linspace(0, 1, 256).astype(np.float32), np.array([3.0], np.float32))
    scales = rng.integers(0, 256, blocks).astype(np.uint8)
    got = dequantize_4bit(codes, qmap, scales, {"shape": [n, k], "blocksize": blocksize,
                                                 "nested_blocksize": 1 << 40}, nested, "w")
    assert np.array_equal(got, (values * (nested[0][scales] * 3.0)[np.arange(n * k) // blocksize]).reshape(n, k))
