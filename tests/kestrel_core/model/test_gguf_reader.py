"""GGUF: config from metadata, dequantized tensors, llama.cpp's Q/K permutation undone, llama3 rope_freqs."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from kestrel_core.errors import KestrelError
from kestrel_core.model.gguf_reader import (
    GGUFCheckpoint,
    kestrel_name,
    llama3_scaling_from_factors,
    unpermute_rows,
)
from kestrel_core.model.quantize import quantize_model

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"


def test_unpermute_inverts_llamacpp_permute(fmt) -> None:
    rng = np.random.default_rng(0)
    for n_head, n_kv, hd in [(4, 2, 16), (9, 3, 64), (8, 8, 8)]:
        q = rng.standard_normal((n_head * hd, 32)).astype(np.float32)
        k = rng.standard_normal((n_kv * hd, 32)).astype(np.float32)
        bias = rng.standard_normal(n_head * hd).astype(np.float32)
        pq, pk = fmt.llamacpp_permute(q, n_head, n_head), fmt.llamacpp_permute(k, n_head, n_kv)
        assert not np.array_equal(pq, q)  # the permutation is not the identity: the test can fail
        np.testing.assert_array_equal(unpermute_rows(pq, n_head), q)
        np.testing.assert_array_equal(unpermute_rows(pk, n_kv), k)
        np.testing.assert_array_equal(unpermute_rows(fmt.llamacpp_permute(bias, n_head, n_head), n_head), bias)


def test_unpermute_pairs_rows_the_way_rotate_half_needs(fmt) -> None:
    # ggml's default RoPE rotates adjacent rows (2i, 2i+1) of each head; HF's rotate_half rotates (i, i+hd/2).
    hd, n_head = 8, 2
    rows = np.arange(n_head * hd, dtype=np.float32)[:, None]  # row r holds the value r
    gguf_rows = fmt.llamacpp_permute(rows, n_head, n_head)[:, 0]
    for h in range(n_head):
        for i in range(hd // 2):
            assert gguf_rows[h * hd + 2 * i] == h * hd + i
            assert gguf_rows[h * hd + 2 * i + 1] == h * hd + i + hd // 2


def test_name_mapping() -> None:
    assert kestrel_name("blk.3.attn_q.weight") == "layers.3.q"
    assert kestrel_name("blk.0.attn_k_norm.weight") == "layers.0.k_norm"
    assert kestrel_name("blk.1.attn_v.bias") == "layers.1.v_bias"
    assert kestrel_name("output.weight") == "lm_head"
    assert kestrel_name("rope_freqs.weight") is None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_reads_back_the_hf_weights_exactly(tmp_path: Path, synth_source, fmt, arch: str) -> None:
    src = synth_source(arch, seed=11)
    ckpt = GGUFCheckpoint(fmt.write_gguf(tmp_path / "m.gguf", src, qtype="F32"))
    c = ckpt.config
    want = src.config
    assert (c.arch, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads,
            c.num_kv_heads, c.head_dim, c.max_position, c.tie_word_embeddings, c.qkv_bias, c.qk_norm) == (
        want.arch, want.vocab_size, want.hidden_size, want.intermediate_size, want.num_layers, want.num_heads,
        want.num_kv_heads, want.head_dim, want.max_position, want.tie_word_embeddings, want.qkv_bias,
        want.qk_norm)
    assert c.rope_theta == want.rope_theta and math.isclose(c.rms_norm_eps, want.rms_norm_eps, rel_tol=1e-6)
    for name, arr in src.tensors.items():
        np.testing.assert_array_equal(ckpt.get(name), arr, err_msg=name)
    model = quantize_model(ckpt, "q8")
    assert (model.lm_head is model.embedding) == want.tie_word_embeddings


def test_llama_gguf_without_unpermute_would_differ(tmp_path: Path, synth_source, fmt) -> None:
    """The permuted file really differs from HF's rows; the reader undoes it only for llama."""
    src = synth_source("llama", seed=2)
    path = fmt.write_gguf(tmp_path / "m.gguf", src, qtype="F32")
    raw = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    assert not np.array_equal(raw["blk.0.attn_q.weight"], src.tensors["layers.0.q"])
    # a qwen2 file written unpermuted must come back as written
    src2 = synth_source("qwen2", seed=2)
    ckpt2 = GGUFCheckpoint(fmt.write_gguf(tmp_path / "q.gguf", src2, qtype="F32"))
    np.testing.assert_array_equal(ckpt2.get("layers.1.q"), src2.tensors["layers.1.q"])
    np.testing.assert_array_equal(ckpt2.get("layers.1.k_bias"), src2.tensors["layers.1.k_bias"])


@pytest.mark.parametrize("qtype,tol", [("F16", 1e-3), ("Q8_0", 1 / 127), ("Q4_0", 1 / 7)])
def test_quantized_gguf_dequantizes_close_to_the_source(tmp_path: Path, synth_source, fmt, qtype: str,
                                                        tol: float) -> None:
    src = synth_source("llama", seed=5, tie_word_embeddings=True)
    ckpt = GGUFCheckpoint(fmt.write_gguf(tmp_path / "m.gguf", src, qtype=qtype))
    assert ckpt.config.tie_word_embeddings and not ckpt.has("lm_head")
    for name in ("embedding", "layers.0.q", "layers.0.k", "layers.1.down"):
        got, want = ckpt.get(name), src.tensors[name]
        # block-relative error: each block's error is at most tol * its largest magnitude
        blocks = np.abs(want).reshape(want.shape[0], -1, 32).max(axis=-1, keepdims=True)
        err = np.abs(got - want).reshape(want.shape[0], -1, 32) / blocks
        assert err.max() <= tol, (name, err.max())
        # and reference: gguf-py's own dequantization of the same bytes, un-permuted the llama.cpp way
        ref = gguf.quants.dequantize(gguf.quants.quantize(
            fmt.llamacpp_permute(want, 4, 2 if name.endswith(".k") else 4) if name.split(".")[-1] in ("q", "k")
            else want, getattr(gguf.GGMLQuantizationType, qtype)), getattr(gguf.GGMLQuantizationType, qtype))
        if name.split(".")[-1] in ("q", "k"):
            ref = unpermute_rows(ref, 4 if name.endswith(".q") else 2)
        np.testing.assert_array_equal(got, ref.astype(np.float32))


def hf_llama3_inv_freq(theta: float, dim: int, rs: dict) -> np.ndarray:
    """transformers' _compute_llama3_parameters, transcribed (float64)."""
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    out = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, out)


def llamacpp_rope_factors(theta: float, dim: int, rs: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, transcribed."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


@pytest.mark.parametrize("theta,dim,rs", [
    (500000.0, 64, {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}),  # Llama 3.2
    (500000.0, 128, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}),  # Llama 3.1
    (10000.0, 16, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 32}),  # one medium frequency only
])
def test_llama3_scaling_recovered_from_rope_freqs(theta: float, dim: int, rs: dict) -> None:
    factors = llamacpp_rope_factors(theta, dim, rs)
    got = llama3_scaling_from_factors(factors, theta, dim, None, "test")
    assert got is not None and got["rope_type"] == "llama3" and got["factor"] == rs["factor"]
    np.testing.assert_allclose(hf_llama3_inv_freq(theta, dim, got), hf_llama3_inv_freq(theta, dim, rs),
                               rtol=1e-6)
    assert llama3_scaling_from_factors(np.ones(dim // 2, np.float32), theta, dim, None, "t") is None
    with pytest.raises(KestrelError, match="does not follow llama3"):
        llama3_scaling_from_factors(np.linspace(1, 4, dim // 2)[::-1].astype(np.float32), theta, dim, None, "t")


def test_rope_freqs_in_a_file(tmp_path: Path, synth_source, fmt) -> None:
    rs = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    src = synth_source("llama", rope_theta=500000.0)
    ckpt = GGUFCheckpoint(fmt.write_gguf(tmp_path / "m.gguf", src,
                                         rope_freqs=llamacpp_rope_factors(500000.0, 16, rs)))
    np.testing.assert_allclose(hf_llama3_inv_freq(500000.0, 16, ckpt.config.rope_scaling),
                               hf_llama3_inv_freq(500000.0, 16, rs), rtol=1e-6)


@pytest.mark.parametrize("tensor", ["rope_freqs.weight", "rope_factors_long.weight"])
@pytest.mark.parametrize("qtype", ["Q8_1", "I32"])
def test_rope_tensors_of_a_type_gguf_py_cannot_dequantize_are_one_line(tmp_path: Path, synth_source, fmt,
                                                                         tensor: str, qtype: str) -> None:
    """The RoPE tensors read while the config is built (llama3's rope_freqs, longrope's rope_factors_*) in a type
    gguf-py has no dequantization for: the error weight tensors get, naming the tensor and its type."""
    def add(w: gguf.GGUFWriter) -> None:
        raw = gguf.GGMLQuantizationType[qtype]
        if qtype == "I32":
            w.add_tensor(tensor, np.ones(8, np.int32))
        else:
            w.add_tensor(tensor, np.zeros((1, gguf.GGML_QUANT_SIZES[raw][1]), np.uint8), raw_dtype=raw)
        if tensor.startswith("rope_factors_"):
            w.add_tensor("rope_factors_short.weight", np.ones(8, np.float32))

    path = fmt.write_gguf(tmp_path / "m.gguf", synth_source("llama"), metadata=add)
    with pytest.raises(NotImplementedError):  # the reference: gguf-py has no dequantization for this type
        gguf.quants.dequantize(next(t for t in gguf.GGUFReader(path).tensors if t.name == tensor).data,
                               gguf.GGMLQuantizationType[qtype])
    with pytest.raises(KestrelError) as info:
        GGUFCheckpoint(path)
    assert str(info.value) == f"{path}: tensor {tensor} uses {qtype}, which gguf-py cannot dequantize"


@pytest.mark.parametrize(("keys", "scaling"), [
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    ({"llama.rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),  # llama.cpp's default type
    ({"llama.rope.scale_linear": 4.0}, {"rope_type": "linear", "factor": 4.0}),  # the key before rope.scaling.*
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, None),
    ({"llama.rope.scaling.factor": 1.0}, None),
])
def test_linear_rope_scaling_is_read_as_llama_cpp_reads_it(tmp_path: Path, synth_source, fmt, keys: dict,
                                                           scaling: dict | None) -> None:
    def add(w) -> None:
        for key, value in keys.items():
            (w.add_string if isinstance(value, str) else w.add_float32)(key, value)

    path = fmt.write_gguf(tmp_path / "m.gguf", synth_source("llama"), metadata=add)
    assert GGUFCheckpoint(path).config.rope_scaling == scaling


def test_general_sampling_is_the_models_recommendation(tmp_path: Path, synth_source, fmt) -> None:
    """llama.cpp's general.sampling.* keys, as gguf-py writes them (float32 values read back as decimals)."""
    def recommend(w: gguf.GGUFWriter) -> None:
        w.add_sampling_temp(0.6)
        w.add_sampling_top_k(20)
        w.add_sampling_top_p(0.95)
        w.add_sampling_min_p(0.05)
        w.add_sampling_penalty_repeat(1.1)
        w.add_sampling_mirostat(0)  # no kestrel sampler: not read

    ckpt = GGUFCheckpoint(fmt.write_gguf(tmp_path / "m.gguf", synth_source("llama"), metadata=recommend))
    assert ckpt.config.sampling == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                                    "repetition_penalty": 1.1}
    assert GGUFCheckpoint(fmt.write_gguf(tmp_path / "plain.gguf", synth_source("llama"))).config.sampling is None
    bad = fmt.write_gguf(tmp_path / "bad.gguf", synth_source("llama"), metadata=lambda w: w.add_sampling_top_p(2.0))
    with pytest.raises(KestrelError, match=r"metadata general\.sampling: sampling\.top_p must be in \(0, 1\]"):
        GGUFCheckpoint(bad)
    typed = fmt.write_gguf(tmp_path / "typed.gguf", synth_source("llama"),
                           metadata=lambda w: w.add_string("general.sampling.temp", "hot"))
    with pytest.raises(KestrelError, match="general.sampling.temp must be a number"):
        GGUFCheckpoint(typed)


def test_bad_files_are_one_line_errors(tmp_path: Path, synth_source, fmt) -> None:
    def err(path: Path) -> str:
        with pytest.raises(KestrelError) as exc:
            GGUFCheckpoint(path)
        assert "\n" not in str(exc.value)
        return str(exc.value)

    path = fmt.write_gguf(tmp_path / "m.gguf", synth_source("llama"), qtype="Q8_0")
    data = path.read_bytes()
    for cut in (10, 200, len(data) // 2, len(data) - 7):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        assert "truncated or corrupt" in err(bad)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    assert "truncated or corrupt" in err(junk)
    assert "no such file" in err(tmp_path / "missing.gguf")
    other = fmt.write_gguf(tmp_path / "gemma.gguf", synth_source("llama"), arch="gemma", permute=False)
    assert "unsupported architecture 'gemma'" in err(other)


def test_golden_fixture_gguf_matches_its_hf_twin() -> None:
    """tests/fixtures/models/tiny-llama.gguf was written by the golden script the llama.cpp way (Q8_0)."""
    from kestrel_core.model.hf import HFCheckpoint

    hf, gg = HFCheckpoint(FIXTURES / "tiny-llama"), GGUFCheckpoint(FIXTURES / "tiny-llama.gguf")
    assert gg.config.rope_scaling is not None
    np.testing.assert_allclose(hf_llama3_inv_freq(hf.config.rope_theta, hf.config.head_dim, gg.config.rope_scaling),
                               hf_llama3_inv_freq(hf.config.rope_theta, hf.config.head_dim, hf.config.rope_scaling),
                               rtol=1e-6)
    for name in ("layers.0.q", "layers.0.k", "layers.1.q", "layers.1.k", "embedding"):
        want, got = hf.get(name).astype(np.float32), gg.get(name)
        assert np.abs(got - want).max() <= np.abs(want).max() / 127, name


@pytest.mark.default_model
def test_default_model_config_and_tensors() -> None:
    from kestrel_core.model.pull import default_model_path

    ckpt = GGUFCheckpoint(default_model_path())
    c = ckpt.config
    assert (c.arch, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads,
            c.num_kv_heads, c.head_dim, c.tie_word_embeddings, c.rope_theta, c.max_position) == (
        "llama", 49152, 576, 1536, 30, 9, 3, 64, True, 100000.0, 8192)
    assert c.eos_token_ids == (2, 4, 0) and c.bos_token_id == 1  # <|im_end|>, <reponame>, <|endoftext|>
    assert ckpt.get("layers.0.q").shape == (576, 576) and ckpt.get("layers.0.k").shape == (192, 576)
