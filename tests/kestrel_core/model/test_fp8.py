"""FP8 checkpoints (model/fp8.py): tiny-qwen3 with its projections as float8 E4M3 codes and float32 scales, as
transformers' ``fp8`` (blocks, or one scale a tensor) and compressed-tensors (one a row, or blocks: llm-compressor's
FP8_BLOCK) store them, written here
with ml_dtypes' float8 as the reference encoder and decoder. kestrel's weights are the reference decoding times
the scales exactly, so its logits are those of the same weights saved as float32; what it cannot read is one line.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kestrel_core
from kestrel_core.errors import KestrelError
from kestrel_core.model.fp8 import E4M3_VALUES
from kestrel_core.model.hf import HFCheckpoint

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
SOURCE = FIXTURES / "tiny-qwen3"
E4M3_MAX = 448.0


def _scales(w: np.ndarray, scheme: str) -> np.ndarray:
    """float32 scales of ``w`` [N, K]: blocks of 32 x 32, one a row, or one for the tensor (amax / 448)."""
    n, k = w.shape
    if scheme.endswith("block"):
        pad = np.zeros((math.ceil(n / 32) * 32, math.ceil(k / 32) * 32), np.float32)
        pad[:n, :k] = np.abs(w)
        amax = pad.reshape(pad.shape[0] // 32, 32, pad.shape[1] // 32, 32).max(axis=(1, 3))
    elif scheme == "row":
        amax = np.abs(w).max(axis=1, keepdims=True)
    else:
        amax = np.abs(w).max().reshape(())
    return (np.maximum(amax, 1e-12) / E4M3_MAX).astype(np.float32)


def _spread(scale: np.ndarray, shape: tuple[int, int], scheme: str) -> np.ndarray:
    if not scheme.endswith("block"):
        return np.broadcast_to(scale, shape)
    return np.repeat(np.repeat(scale, 32, axis=0), 32, axis=1)[:shape[0], :shape[1]]


def make_fp8(fmt: SimpleNamespace, dst: Path, scheme: str) -> Path:
    """tiny-qwen3 with every projection FP8 (``scheme``: block, tensor, row, ct-block, ct-block-text: its block
    spelled "32x32"), and beside it ``dst``-f32 holding the reference decoding of the same weights as float32."""
    text = scheme.endswith("-text")
    scheme = scheme.removesuffix("-text")
    shutil.copytree(SOURCE, dst)
    ref = dst.with_name(dst.name + "-f32")
    shutil.copytree(SOURCE, ref)
    tensors = load_file(SOURCE / "model.safetensors")
    fp8: dict[str, tuple[str, np.ndarray]] = {}
    decoded = {}
    for name, t in tensors.items():
        t = t.astype(np.float32)
        if not name.endswith("_proj.weight"):
            fp8[name], decoded[name] = ("F32", t), t
            continue
        scale = _scales(t, scheme)
        codes = (t / _spread(scale, t.shape, scheme)).astype(ml_dtypes.float8_e4m3fn)
        fp8[name] = ("F8_E4M3", codes.view(np.uint8))
        suffix = "_scale_inv" if scheme in ("block", "tensor") else "_scale"
        fp8[name + suffix] = ("F32", scale)
        decoded[name] = codes.astype(np.float32) * _spread(scale, t.shape, scheme)
    fmt.write_raw_safetensors(dst / "model.safetensors", fp8)
    save_file(decoded, str(ref / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
        "tensor": {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None},
        "row": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}},
        "ct-block": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "block",
                                                            "block_structure": [32, 32], "symmetric": True}}}},
    }[scheme]
    if text:  # compressed-tensors' older spelling of the block, which it still reads
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["block_structure"] = "32x32"
    (dst / "config.json").write_text(json.dumps(cfg))
    return ref


def test_the_e4m3_table_is_ml_dtypes_decoding() -> None:
    codes = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(E4M3_VALUES, codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32))


@pytest.mark.parametrize("scheme", ["block", "tensor", "row", "ct-block", "ct-block-text"])
def test_an_fp8_checkpoint_is_its_weights_decoded(fmt: SimpleNamespace, tmp_path: Path, scheme: str) -> None:
    ref = make_fp8(fmt, tmp_path / "fp8", scheme)
    fp8, f32 = HFCheckpoint(tmp_path / "fp8"), HFCheckpoint(ref)
    for name in ("layers.0.q", "layers.1.down", "layers.2.gate"):
        np.testing.assert_array_equal(fp8.get(name), f32.get(name))
    ids = np.load(SOURCE / "golden.npz")["ids"]
    with kestrel_core.load(str(tmp_path / "fp8"), backend="cpu") as a, kestrel_core.load(str(ref), backend="cpu") as b:
        assert np.array_equal(a.logits(ids), b.logits(ids))


def _ct_block(rows: object, **more: list[int]) -> dict:
    """compressed-tensors FP8 weights in blocks of ``rows`` x 32 (group g), and of each of ``more``'s groups."""
    weights = {"type": "float", "num_bits": 8, "strategy": "block"}
    groups = {"g": {"weights": {**weights, "block_structure": None if rows is None else [rows, 32]}},
              **{name: {"weights": {**weights, "block_structure": block}} for name, block in more.items()}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": groups}


@pytest.mark.parametrize(("change", "says"), [
    (lambda c: {**c, "quantization_config": {"quant_method": "hqq"}}, r"quant_method 'hqq' is not supported"),
    (lambda c: {**c, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "g": {"weights": {"type": "int", "num_bits": 4}}, "h": {"weights": {"type": "float", "num_bits": 8}}}}},
     r"group 'g' is neither FP8 nor integer weights, or mixes them"),
    (lambda c: {**c, "quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
     r"q_proj.weight: scale of shape \[8, 2\] does not fit a weight of shape \[256, 64\] \(blocks of \[64, 64\]\)"),
    (lambda c: {k: v for k, v in c.items() if k != "quantization_config"}, r"is FP8, but config.json has no FP8"),
    (lambda c: {**c, "quantization_config": {"quant_method": "fp8", "weight_block_size": [True, 32]}},
     r"weight_block_size must be two positive integers, got \[True, 32\]"),
    (lambda c: {**c, "quantization_config": _ct_block(True)},
     r"group 'g' block_structure must be two positive integers, got \[True, 32\]"),
    (lambda c: {**c, "quantization_config": _ct_block(32, h="64x")},
     r"group 'h' block_structure must be two positive integers, got '64x'"),
    (lambda c: {**c, "quantization_config": _ct_block(None)},
     r"group 'g' block_structure must be two positive integers, got None"),
    (lambda c: {**c, "quantization_config": _ct_block(32, h=[64, 64])},
     r"groups' block_structure differ \(\[32, 32\], \[64, 64\]\)"),
])
def test_what_an_fp8_checkpoint_cannot_be_is_one_line(fmt: SimpleNamespace, tmp_path: Path, change,  # noqa: ANN001
                                                      says: str) -> None:
    make_fp8(fmt, tmp_path / "fp8", "block")
    path = tmp_path / "fp8" / "config.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    with pytest.raises(KestrelError, match=says):
        kestrel_core.load(str(tmp_path / "fp8"), backend="cpu")


def test_block_scales_larger_than_the_weight_apply_without_repeating_them() -> None:
    from kestrel_core.model.fp8 import dequantize_fp8, fp8_scheme

    scheme = fp8_scheme({"quant_method": "fp8", "weight_block_size": [2, 1 << 28]}, "config.json")
    codes = np.arange(64 * 64, dtype=np.uint32).reshape(64, 64).astype(np.uint8) & 0x7E
    scale = np.arange(1, 33, dtype=np.float32).reshape(32, 1)
    got = dequantize_fp8(codes, scale, scheme, "w")
    assert np.array_equal(got, E4M3_VALUES[codes] * np.repeat(scale, 2, axis=0))
