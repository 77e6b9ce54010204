"""The device layout of the strip-cache weights (``kestrel_cuda.layout``) and the kernels' byte tricks on it,
reproduced in Python from the kernel sources: the K-major packing, the 4x4 byte transpose, the int4 word dot
product, and what the preload uploads for a layer."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kestrel_cuda import kernels
from kestrel_cuda.layout import pack_kmajor, unpack_kmajor

from .forward_check import FIXTURES


@pytest.mark.parametrize("bits", (8, 4))
def test_pack_kmajor_layout(bits: int) -> None:
    lo, hi = (-127, 127) if bits == 8 else (-8, 7)
    codes = np.random.default_rng(0).integers(lo, hi + 1, size=(13, 64)).astype(np.int8)
    packed = pack_kmajor(codes, bits)
    assert packed.shape == ((64, 16) if bits == 8 else (8, 64))
    assert np.array_equal(unpack_kmajor(packed, bits)[:, :13], codes.T)
    assert np.all(unpack_kmajor(packed, bits)[:, 13:] == 0)
    if bits == 4:  # common.cuh's layout: word (kw, n), byte b = (c[8kw + b] + 8) | (c[8kw + 4 + b] + 8) << 4
        kw, n, b = 5, 7, 2
        assert packed[kw, 4 * n + b] == (int(codes[n, 8 * kw + b]) + 8) | ((int(codes[n, 8 * kw + 4 + b]) + 8) << 4)


def _byte_perm(x: int, y: int, s: int) -> int:
    src = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(s >> (4 * i)) & 0x7] << (8 * i) for i in range(4))


def _transpose4x4_from_source() -> list[tuple[str, str, str, int]]:
    """The __byte_perm calls of common.cuh's transpose4x4, in order: (dest, x, y, selector)."""
    text = (kernels.HERE / "common.cuh").read_text()
    body = text[text.index("void transpose4x4("):]
    body = body[:body.index("\n}\n")]
    calls = re.findall(r"(\w+) = __byte_perm\((\w+), (\w+), (0x[0-9a-fA-F]+)\)", body)
    return [(d, x, y, int(s, 16)) for d, x, y, s in calls]


def test_common_cuh_transpose4x4_transposes_a_4x4_byte_block() -> None:
    calls = _transpose4x4_from_source()
    assert len(calls) == 8
    rng = np.random.default_rng(1)
    for _ in range(20):
        block = rng.integers(0, 256, size=(4, 4))  # block[r][c]: row r (k), column c
        env = {f"w{r}": int(sum(int(block[r, c]) << (8 * c) for c in range(4))) for r in range(4)}
        for dest, x, y, sel in calls:
            env[dest] = _byte_perm(env[x], env[y], sel)
        for c in range(4):
            col = env[f"c{c}"]
            assert [(col >> (8 * r)) & 0xFF for r in range(4)] == [int(block[r, c]) for r in range(4)]


def test_int4_word_dot_product_as_the_kernels_compute_it() -> None:
    """gemv.cu's dot_slot on the int4 words: dp4a of (w & 0x0F0F0F0F) with a[k0..k0+3], dp4a.u32.s32 of
    (w & 0xF0F0F0F0) with a[k0+4..k0+7] (16 x the codes), that sum shifted right by 4, minus 8 * sum(a)."""
    rng = np.random.default_rng(2)
    codes = rng.integers(-8, 8, size=(4, 32)).astype(np.int8)  # [N=4][K=32]
    a = rng.integers(-127, 128, size=32)
    packed = pack_kmajor(codes, 4)  # [4][16]: 4 word rows x 4 columns x 4 bytes
    lo_sum, hi_sum = [0] * 4, [0] * 4
    for kw in range(4):
        for c in range(4):
            w = int.from_bytes(bytes(packed[kw, 4 * c:4 * c + 4]), "little")
            lo, hi = w & 0x0F0F0F0F, w & 0xF0F0F0F0
            for b in range(4):
                lo_sum[c] += ((lo >> (8 * b)) & 0xFF) * int(a[8 * kw + b])
                hi_sum[c] += ((hi >> (8 * b)) & 0xFF) * int(a[8 * kw + 4 + b])
    assert all(h % 16 == 0 for h in hi_sum)
    signed = [lo_sum[c] + (hi_sum[c] >> 4) - 8 * int(a.sum()) for c in range(4)]
    assert signed == (codes.astype(np.int64) @ a).tolist()


def test_layer_groups_of_an_expert_layer_cover_every_expert() -> None:
    """What the CUDA preload uploads: attention groups, then each expert's gate|up and down under its wkeys."""
    from kestrel_core.model.loader import load_model
    from kestrel_core.model.weights import engine_weights
    from kestrel_cuda.layout import layer_groups

    model = load_model(str(FIXTURES / "tiny-qwen3-moe"), "q8", cache="off").model
    keys = [g.fused_key or g.keys[0] for i, lw in enumerate(model.layers) for g in layer_groups(i, lw)]
    assert keys == [k for k, _ in engine_weights(model)][:-1]
    assert len(layer_groups(0, model.layers[0])) == 2 + 2 * model.config.num_experts
