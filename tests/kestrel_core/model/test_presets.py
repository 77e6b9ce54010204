"""Synthetic preset models and the byte tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_core.contract import CODE_RANGE
from kestrel_core.errors import KestrelError
from kestrel_core.model.decoder import Decoder
from kestrel_core.model.presets import PRESETS, ByteTokenizer, preset_config, preset_model, synthetic_model
from kestrel_core.model.quantize import parse_quant


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_a_consistent_model(name: str) -> None:
    cfg = preset_config(name)
    # the real widths, fewer rows; a hybrid's first full-attention layer (its first three are linear), GLM-4.5's
    # first with experts (its first is dense)
    first_moe = next((i for i in range(cfg.num_layers) if cfg.has_experts(i)), 0)
    layers = max(cfg.attention_layers[0], first_moe) + 1
    model = preset_model(name, "q4", num_layers=layers, vocab_size=512)
    lw = model.layers[layers - 1]
    qn, kvn = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if cfg.is_mla:  # the latent and each head's key (dims without RoPE) and value from it
        r, dn = cfg.kv_lora_rank, cfg.head_dim - cfg.rotary
        query = lw.q_b if cfg.q_lora_rank else lw.q
        assert query.shape == (qn, cfg.q_lora_rank or cfg.hidden_size) and lw.k is None
        assert lw.kv_a.shape == (r + cfg.rotary, cfg.hidden_size) and lw.kv_a_norm.shape == (r,)
        assert lw.kv_b.shape == (cfg.num_heads * (dn + cfg.value_dim), r)
        assert lw.o.shape == (cfg.hidden_size, cfg.num_heads * cfg.value_dim)
    else:
        assert lw.q.shape == (qn, cfg.hidden_size) and lw.k.shape == lw.v.shape == (kvn, cfg.hidden_size)
        assert lw.o.shape == (cfg.hidden_size, qn)
    mlps = lw.experts if cfg.is_moe else (lw,)
    f = cfg.expert_intermediate_size if cfg.is_moe else cfg.intermediate_size
    assert len(mlps) == max(cfg.num_experts, 1) and (lw.router is not None) == cfg.is_moe
    for mlp in mlps:
        assert mlp.down.shape == (cfg.hidden_size, f) and mlp.gate.shape == mlp.up.shape == (f, cfg.hidden_size)
    assert (lw.q_norm is not None) == cfg.qk_norm == (cfg.arch in ("qwen3", "qwen3_moe", "gemma3", "qwen3_5",
                                                                   "qwen3_5_moe", "lfm2"))
    for i, before in enumerate(model.layers[:layers - 1]):  # a hybrid's: Gated DeltaNet's q|k|v, or B|C|x; a dense
        if i in cfg.dense_layers:                           # layer among the experts: its own MLP
            assert before.gate.shape == (cfg.intermediate_size, cfg.hidden_size) and not before.experts
        elif before.is_linear:
            assert before.lin_qkv.shape == (cfg.linear_conv_dim, cfg.hidden_size) and before.q is None
            assert before.o.shape == (cfg.hidden_size, cfg.linear_value_heads * cfg.linear_value_dim)
        else:
            assert before.conv_in.shape == (3 * cfg.hidden_size, cfg.hidden_size) and before.q is None
            assert before.conv.shape == (cfg.hidden_size, cfg.short_conv_kernel)
    assert (model.lm_head is model.embedding) == cfg.tie_word_embeddings
    assert model.embedding.bits == model.lm_head.bits == 8 and lw.o.bits == 4
    assert cfg.num_heads % cfg.num_kv_heads == 0


def test_a_preset_cut_to_fewer_layers_keeps_its_pattern() -> None:
    """Command R7B's three sliding layers with RoPE to one full one without, on its first five layers."""
    small = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=64)
    c = preset_model("command-r7b", "q8", num_layers=5, **small).config
    assert c.layer_types == ("sliding", "sliding", "sliding", "full", "sliding") and c.nope_layers == (3,)
    assert preset_model("glm4.5-air", "q8", num_layers=1, **small).config.dense_layers == (0,)


def test_unknown_preset_is_named() -> None:
    with pytest.raises(KestrelError, match="unknown preset 'gpt5'"):
        preset_config("gpt5")


@pytest.mark.parametrize("quant", ["q8", "q4", "q8-g256", "q4-g256"])
def test_codes_scales_and_groups_follow_the_quant_mode(quant: str) -> None:
    model = preset_model("smollm2-135m", quant, num_layers=2, vocab_size=512)
    mode = parse_quant(quant)
    for _, w in model.weights():
        lo, hi = CODE_RANGE[w.bits]
        assert lo <= int(w.codes.min()) and int(w.codes.max()) <= hi
        assert w.group_size == mode.group_for(w.k)  # K=576 is not a multiple of 256: G=32 there
        assert np.isfinite(w.scales).all() and (w.scales > 0).all()
    spread = {int(v) for v in np.unique(model.layers[0].down.codes[:4])}
    assert len(spread) == CODE_RANGE[mode.bits][1] - CODE_RANGE[mode.bits][0] + 1  # the full code range
    if quant.endswith("g256"):
        assert model.layers[0].down.group_size == 256 and model.layers[0].q.group_size == 32


def test_the_seed_decides_the_weights(tiny_config) -> None:
    a, b, c = (synthetic_model(tiny_config("llama"), "q8", seed=s) for s in (1, 1, 2))
    np.testing.assert_array_equal(a.layers[1].up.codes, b.layers[1].up.codes)
    np.testing.assert_array_equal(a.layers[1].up.scales, b.layers[1].up.scales)
    assert not np.array_equal(a.layers[1].up.codes, c.layers[1].up.codes)
    assert not np.array_equal(a.layers[0].q.codes, a.layers[1].q.codes)  # weights differ from each other


@pytest.mark.parametrize("quant", ["q8", "q4"])
def test_activations_stay_finite_and_logits_spread_through_many_layers(quant: str, cpu_offload) -> None:
    model = preset_model("qwen3-0.6b", quant, num_layers=12, vocab_size=1024, hidden_size=256,
                         intermediate_size=512, num_heads=4, num_kv_heads=2)
    dec = Decoder(model, cpu_offload)
    logits = dec.forward(np.arange(8) + 3, dec.new_cache(), all_logits=True)
    assert np.isfinite(logits).all()
    assert 0.1 < float(logits.std()) < 10  # neither vanishing nor exploding


def test_byte_tokenizer_round_trips_utf8() -> None:
    tok = ByteTokenizer(49152)
    text = "héllo ✓ 日本"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids + [ByteTokenizer.EOS, 9000]) == text
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # a cut character is visible, not an exception
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|user|>\nhi\n<|assistant|>\n" and tok.encode_chat([{"role": "user", "content": "hi"}]) == \
        tok.encode(chat)
    with pytest.raises(KestrelError):
        ByteTokenizer(100)
