"""The CPU backend's compiled experts pass (kestrel_cpu.experts): a mixture-of-experts layer's experts in one call,
beside its attention compiled alone (kestrel_cpu.layer), the op-by-op decoder's bits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kestrel_core.contract import quantize_weight
from kestrel_core.model.decoder import Decoder
from kestrel_core.model.presets import preset_config, synthetic_model
from kestrel_core.model.weights import Model

from .conftest import cpu_offload

kernels = pytest.importorskip("kestrel_cpu.kernels")
PACKED_BITS = kernels.packed.PACKED_BITS


def _model(preset: str, quant: str, seed: int, **overrides: object) -> Model:
    """A preset's mixture of experts at test size: 2 layers of 16 experts."""
    small = dict(num_layers=2, vocab_size=512, max_position=512, hidden_size=256, intermediate_size=256, num_heads=4,
                 num_kv_heads=2, head_dim=64, num_experts=16, expert_intermediate_size=128)
    config = preset_config(preset)
    if config.shared_expert_intermediate_size:
        small["shared_expert_intermediate_size"] = 192
    if config.dense_layers:
        small["dense_layers"] = ()  # both layers' experts
    return synthetic_model(replace(config, **{**small, **overrides}), quant, seed=seed)


def _needs(*bits: int) -> None:
    if not set(bits) <= set(PACKED_BITS):
        pytest.skip(f"this CPU's packed kernels take {PACKED_BITS}-bit weights; the experts need {bits}")


def _run(model: Model, compiled: bool) -> tuple[list[np.ndarray], Decoder, dict]:
    """Logits of a prompt (int8 rows), decode steps, and a two-sequence step."""
    offload = cpu_offload(layers=compiled)
    dec = Decoder(model, offload, activations="q8")
    rng = np.random.default_rng(8)
    a, b = dec.new_cache(), dec.new_cache()
    outs = [dec.forward(rng.integers(0, 512, 19).tolist(), a, all_logits=True)]
    outs += [dec.forward([int(t)], a) for t in rng.integers(0, 512, 3)]
    dec.forward(rng.integers(0, 512, 6).tolist(), b)
    outs += dec.forward_batch([(a, np.array([4]), 1), (b, np.array([40, 41]), 2)])
    return outs, dec, offload.stats()["kestrel_gemm_q8"]


def _same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    return x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.mark.parametrize(("preset", "quant"), [
    ("qwen3-30b-a3b", "q8"),  # softmax routing, top-8 renormalised
    ("qwen3-30b-a3b", "q4"),
    ("qwen1.5-moe-a2.7b", "q8"),  # a shared expert scaled by its sigmoid gate
    ("glm4.5-air", "q4"),  # sigmoid scores, a choice bias, an ungated shared expert
])
def test_the_compiled_experts_give_the_op_by_op_bits(preset: str, quant: str) -> None:
    _needs(4 if quant == "q4" else 8)
    model = _model(preset, quant, seed=3)
    got, dec, got_counts = _run(model, compiled=True)
    want, slow, want_counts = _run(model, compiled=False)
    assert all(dec.experts[i] is not None for i in range(2)) and not any(slow.experts.values())
    assert all(dec.dense[i] is not None and not dec.dense[i][0].mlp for i in range(2))  # the attention alone
    assert len(got) == len(want) == 6
    for g, w in zip(got, want):
        assert _same_bits(g, w)
    assert got_counts == want_counts  # counted as the GEMMs they ran


def test_experts_of_other_bits_or_with_biases_run_op_by_op() -> None:
    _needs(8, 4)
    model = _model("qwen3-30b-a3b", "q8", seed=4)
    layer = model.layers[1]
    odd = replace(layer.experts[5], down=quantize_weight(np.random.default_rng(5).standard_normal((256, 128))
                                                         .astype(np.float32), bits=4))
    model.layers[1] = replace(layer, experts=layer.experts[:5] + (odd,) + layer.experts[6:])
    got, dec, _ = _run(model, compiled=True)
    assert dec.experts[0] is not None and dec.experts[1] is None  # one expert's down at 4 bits: op by op
    for g, w in zip(got, _run(model, compiled=False)[0]):
        assert _same_bits(g, w)

    # expert biases and the clamped SwiGLU
    gpt_oss = _model("gpt-oss-20b", "q8", seed=6, sliding_window=8, layer_types=("sliding", "full"))
    got, dec, _ = _run(gpt_oss, compiled=True)
    assert not any(dec.experts.values())
    for g, w in zip(got, _run(gpt_oss, compiled=False)[0]):
        assert _same_bits(g, w)


def test_experts_that_cannot_compile_run_op_by_op(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    _needs(8)
    from numba.core.errors import TypingError

    from kestrel_cpu import experts

    def broken(*args: object) -> None:
        raise TypingError("no implementation here")

    monkeypatch.setattr(experts, "_BUILDS", {(8, 8): broken})
    model = _model("qwen1.5-moe-a2.7b", "q8", seed=7)
    got, dec, _ = _run(model, compiled=True)
    for g, w in zip(got, _run(model, compiled=False)[0]):
        assert _same_bits(g, w)
    assert not any(dec.experts.values()) and experts._BUILDS[8, 8] is None
    assert "failed to compile (TypingError: no implementation here)" in caplog.text


def test_weights_the_packed_kernels_do_not_take_run_op_by_op() -> None:
    _needs(8)
    model = _model("qwen1.5-moe-a2.7b", "q8", seed=9)
    offload = cpu_offload()
    device = offload.cpu.device  # as on an AVX2-only CPU: int8 weights have no packed form, the vpmaddwd kernels
    device.packed_bits, device.vnni_arg = (4,), False
    dec = Decoder(model, offload, activations="q8")
    cache = dec.new_cache()
    got = [dec.forward(list(range(5, 14)), cache, all_logits=True), dec.forward([7], cache)]
    assert not any(dec.experts.values()) and not any(dec.dense.values())
    ref = Decoder(model, cpu_offload(layers=False), activations="q8")
    ref_cache = ref.new_cache()
    for g, w in zip(got, [ref.forward(list(range(5, 14)), ref_cache, all_logits=True), ref.forward([7], ref_cache)]):
        assert _same_bits(g, w)
