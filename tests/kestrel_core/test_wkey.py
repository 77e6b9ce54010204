"""Weight identity: the layout of a wkey is part of the contract (a residency window decodes it)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kestrel_core.wkey import (
    FUSED_LAYER_BASE,
    LM_HEAD_LAYER,
    NO_CACHE,
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
