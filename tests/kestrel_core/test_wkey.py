"""Weight identity: the layout of a wkey is part of the contract (a residency window decodes it)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kestrel_core.contract import read_only_strip
from kestrel_core.wkey import (
    FUSED_LAYER_BASE,
    LM_HEAD_LAYER,
    NO_CACHE,
    PROJ_GROUPS,
    Proj,
    decode_wkey,
    fused_wkey,
    lm_head_wkey,
    model_layer,
    wkey,
)


def test_layout_is_layer_high_proj_plus_one_low() -> None:
    assert wkey(0, Proj.Q) == 1
    assert wkey(3, Proj.DOWN) == (3 << 32) | 7
    assert lm_head_wkey() == (0xFFFFFFFF << 32) | (Proj.LM_HEAD + 1)


@given(st.integers(0, 0xFFFFFFFF), st.sampled_from(list(Proj)))
def test_round_trip_and_never_zero(layer: int, proj: Proj) -> None:
    key = wkey(layer, proj)
    assert key != NO_CACHE
    assert decode_wkey(key) == (layer, proj)


def test_sentinels_decode_to_their_model_layer() -> None:
    layer, proj = decode_wkey(fused_wkey(5, Proj.QKV))
    assert layer == FUSED_LAYER_BASE + 5 and proj is Proj.QKV and model_layer(layer) == 5
    assert model_layer(decode_wkey(lm_head_wkey())[0]) is None and decode_wkey(lm_head_wkey())[0] == LM_HEAD_LAYER
    assert model_layer(7) == 7


def test_zero_and_overflow_are_refused() -> None:
    with pytest.raises(ValueError, match="do not cache"):
        decode_wkey(0)
    with pytest.raises(ValueError, match="32 bits"):
        wkey(1 << 32, Proj.Q)


def test_projection_groups_share_an_input_and_name_their_fused_weight() -> None:
    assert [g.members for g in PROJ_GROUPS] == [(Proj.Q, Proj.K, Proj.V), (Proj.O,), (Proj.GATE, Proj.UP),
                                                (Proj.DOWN,)]
    qkv, o, gate_up, down = PROJ_GROUPS
    assert qkv.keys(4) == (wkey(4, Proj.Q), wkey(4, Proj.K), wkey(4, Proj.V))
    assert qkv.fused_key(4) == qkv.key(4) == fused_wkey(4, Proj.QKV)
    assert gate_up.key(2) == fused_wkey(2, Proj.GATE_UP)
    assert o.fused_key(3) == NO_CACHE and o.key(3) == wkey(3, Proj.O) and down.key(0) == wkey(0, Proj.DOWN)


def test_layer_groups_and_engine_weights_follow_the_groups() -> None:
    from kestrel_core.model.config import ModelConfig
    from kestrel_core.model.presets import synthetic_model
    from kestrel_core.model.weights import engine_weights

    config = ModelConfig(arch="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=2, num_kv_heads=1, head_dim=32, max_position=32)
    model = synthetic_model(config, "q8", seed=0)
    lw = model.layers[1]
    assert all(a is b for a, b in zip(sum(lw.groups(), ()), (lw.q, lw.k, lw.v, lw.o, lw.gate, lw.up, lw.down)))
    assert [g for g, _ in lw.proj_groups()] == list(PROJ_GROUPS)
    got = engine_weights(model)
    assert [key for key, _ in got] == [g.key(i) for i in range(2) for g in PROJ_GROUPS] + [lm_head_wkey()]
    # each the read-only object the hooks are handed, over the model's own arrays
    assert [w is read_only_strip(s) and np.shares_memory(w.codes, s.codes) and not w.codes.flags.writeable
            for w, s in zip(got[4][1], (lw.q, lw.k, lw.v))] == [True] * 3
    assert len(got[-1][1]) == 1 and got[-1][1][0] is read_only_strip(model.lm_head)


def test_expert_wkeys_keep_their_layer_and_never_collide() -> None:
    """An expert's wkey decodes to its layer, projection and expert; no two weights of a model share a wkey,
    and a dense weight's wkey is the same as before experts existed."""
    from kestrel_core.model.config import ModelConfig
    from kestrel_core.model.presets import synthetic_model
    from kestrel_core.model.weights import engine_weights
    from kestrel_core.wkey import model_layer, wkey_expert

    assert wkey(3, Proj.UP) == (3 << 32) | 6 and wkey_expert(wkey(3, Proj.UP)) is None
    for e in (0, 7, 0xFFFE):
        key = wkey(5, Proj.DOWN, e)
        assert decode_wkey(key) == (5, Proj.DOWN) and wkey_expert(key) == e
        fused = fused_wkey(5, Proj.GATE_UP, e)
        assert model_layer(decode_wkey(fused)[0]) == 5 and wkey_expert(fused) == e
    with pytest.raises(ValueError):
        wkey(0, Proj.UP, 0xFFFF)
    config = ModelConfig(arch="qwen3_moe", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=2, num_kv_heads=1, head_dim=32, max_position=32, qk_norm=True, num_experts=4,
                         experts_per_token=2, expert_intermediate_size=32)
    model = synthetic_model(config, "q8", seed=0)
    for keys in ([k for k, _ in model.weights()], [k for k, _ in engine_weights(model)]):
        assert len(set(keys)) == len(keys)
        assert {wkey_expert(k) for k in keys} == {None, 0, 1, 2, 3}
    assert len(model.weights()) == 2 * (4 + 4 * 3) + 1


def test_hybrid_layers_have_their_own_groups_and_distinct_wkeys() -> None:
    """A Qwen3.5 model's linear-attention layers offer their four input projections as one fused group and the
    output as O; its gated attention layers offer the output gate fused with Q|K|V; every wkey is distinct."""
    from kestrel_core.model.config import ModelConfig
    from kestrel_core.model.presets import synthetic_model
    from kestrel_core.model.weights import engine_weights
    from kestrel_core.wkey import GATED_ATTENTION_GROUPS, LINEAR_GROUPS, MLP_GROUPS

    config = ModelConfig(arch="qwen3_5", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=2, num_kv_heads=1, head_dim=32, max_position=32, qk_norm=True, rotary_dim=8,
                         layer_types=("linear", "full"), attn_output_gate=True, linear_key_heads=1, linear_key_dim=16,
                         linear_value_heads=2, linear_value_dim=32, linear_conv_kernel=4)
    model = synthetic_model(config, "q8", seed=0)
    linear, full = model.layers
    assert [g for g, _ in linear.proj_groups()] == [*LINEAR_GROUPS, *MLP_GROUPS]
    assert linear.groups()[0] == (linear.lin_qkv, linear.lin_z, linear.lin_beta, linear.lin_alpha)
    assert [g for g, _ in full.proj_groups()] == [*GATED_ATTENTION_GROUPS, *MLP_GROUPS]
    assert full.groups()[0] == (full.q, full.k, full.v, full.attn_gate)
    keys = [k for k, _ in model.weights()]
    assert len(set(keys)) == len(keys) == 2 * (4 + 1 + 3) + 1  # per layer: 4 inputs (fused), O, the MLP; lm_head
    assert [k for k, _ in engine_weights(model)][:2] == [fused_wkey(0, Proj.LIN_IN), wkey(0, Proj.O)]
    assert decode_wkey(wkey(1, Proj.ATTN_GATE)) == (1, Proj.ATTN_GATE)
