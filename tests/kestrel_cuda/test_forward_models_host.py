"""The device forward's host side for the models beyond the Llama family, over the numpy mirrors of its kernels
(as test_forward_host.py): Mistral's sliding window, Gemma 3 (post-norms, GeGLU, a head_dim of 256), Gemma 2's soft
caps, Granite's multipliers, longrope and YaRN, mixtures of experts (routing, expert groups, the residency
window) and gpt-oss (sinks, biases, its clamped SwiGLU), each against the CPU decoder, and each done deliberately
wrong leaving the band."""

from __future__ import annotations

from dataclasses import replace
from unittest.mock import patch

import numpy as np
import pytest

from kestrel_core.model import decoder
from kestrel_core.model.presets import synthetic_model
from kestrel_cuda import plan
from kestrel_cuda.allocator import NumpyAllocator
from kestrel_cuda.forward import DeviceForward, unsupported_reason
from kestrel_cuda.ops_numpy import NumpyOps
from kestrel_cuda.residency import WeightCache

from .forward_check import (
    FIXTURES,
    SMALL_CONFIGS,
    assert_each_change_leaves_the_band,
    assert_in_the_band,
    assert_leaves_the_band,
    cache_source,
    compare,
    cpu_logits,
    device_logits,
    jitter_effect,
    random_tokens,
    router_logits_of,
    routing_ties,
    stepwise_greedy,
)

CONFIGS = SMALL_CONFIGS


@pytest.mark.parametrize("n_prefill", [8, 20])
def test_a_sliding_window_on_the_device_matches_the_cpu(n_prefill: int) -> None:
    """Mistral's window of 12: a prefill within it or past it (the prefill attention's first tile starts at the
    window), then decode steps past it: the CPU decoder's logits, which apply the window, within the band;
    the same without the window leaves it."""
    cfg = replace(CONFIGS["llama"], arch="mistral", sliding_window=12)
    model = synthetic_model(cfg, "q8", seed=3)
    toks = random_tokens(model.config, 40)
    ref = cpu_logits(model, toks, n_prefill)
    fwd = DeviceForward(ops=NumpyOps())
    result = compare(device_logits(fwd, model, toks, n_prefill), ref, jitter_effect(model, toks, n_prefill, ref))
    assert result.ok, str(result)

    class NoWindow(NumpyOps):
        def attention(self, *args, **kw):  # type: ignore[no-untyped-def]
            return super().attention(*args, **{**kw, "window": 0})

    wrong = compare(device_logits(DeviceForward(ops=NoWindow()), model, toks, n_prefill), ref,
                    jitter_effect(model, toks, n_prefill, ref))
    assert not wrong.ok, str(wrong)


class _NoPostNorm(NumpyOps):
    def norm_add(self, x, w, eps, y, ssq_out=None):  # type: ignore[no-untyped-def]
        super().norm_add(x * 0, w, eps, y, ssq_out)  # the projection's output dropped with its norm


class _NoFoldedPostNorm(NumpyOps):
    def gemv(self, lin, x, pro, pw, eps, xoff, y, epi, bias, post=None, **kw):  # type: ignore[no-untyped-def]
        if post is not None and pro == plan.PRO_POSTNORM:  # the decode steps' post-norms: the output dropped
            post = replace(post, out=post.out * 0)
        super().gemv(lin, x, pro, pw, eps, xoff, y, epi, bias, post=post, **kw)


class _NoEmbedScale(NumpyOps):
    def embed(self, codes, scales, group, ids, h, ssq_out=None, mul=1.0):  # type: ignore[no-untyped-def]
        super().embed(codes, scales, group, ids, h, ssq_out)


class _SiluForGelu(NumpyOps):
    def gemv(self, lin, x, pro, pw, eps, xoff, y, epi, bias, **kw):  # type: ignore[no-untyped-def]
        super().gemv(lin, x, plan.PRO_SILU_MUL if pro == plan.PRO_GELU_MUL else pro, pw, eps, xoff, y, epi, bias,
                     **kw)


@pytest.mark.parametrize("wrong", [_NoPostNorm, _NoFoldedPostNorm, _NoEmbedScale, _SiluForGelu],
                         ids=lambda c: c.__name__)
def test_gemma3_done_wrong_on_the_device_leaves_the_band(wrong: type) -> None:
    assert_leaves_the_band(synthetic_model(CONFIGS["gemma3"], "q8", seed=3), wrong())


def test_gemma3_decode_steps_fold_their_post_norms_into_the_gemvs() -> None:
    """At M = 1 no post-norm runs as a kernel of its own: the projection before it leaves its sums and the
    normed GEMV after it applies it (plan.PostNorm); prefill chunks keep norm_add. Within the band."""

    class Counting(NumpyOps):
        def __init__(self) -> None:
            super().__init__()
            self.norm_adds: list[int] = []  # the rows of each norm_add

        def norm_add(self, x, w, eps, y, ssq_out=None):  # type: ignore[no-untyped-def]
            self.norm_adds.append(x.shape[0])
            super().norm_add(x, w, eps, y, ssq_out)

    model = synthetic_model(CONFIGS["gemma3"], "q8", seed=5)
    toks = random_tokens(model.config, 30)
    ref = cpu_logits(model, toks, 12)
    ops = Counting()
    result = compare(device_logits(DeviceForward(ops=ops), model, toks, 12), ref,
                     jitter_effect(model, toks, 12, ref))
    assert result.ok, str(result)
    assert ops.norm_adds and 1 not in ops.norm_adds  # the prompt's, and none of a decode step


def test_a_head_dim_of_256_matches_the_cpu() -> None:
    """Gemma 3 1B-12B's head_dim: one forward and its decode steps, the fused RoPE epilogue off (a head is
    two GEMV column tiles)."""
    model = synthetic_model(replace(CONFIGS["gemma3"], head_dim=256), "q8", seed=4)
    assert unsupported_reason(model) is None
    assert_in_the_band(model, 30, 20)


def test_gemma3_from_its_checkpoint_matches_the_cpu() -> None:
    """tiny-gemma3 as transformers wrote it (sliding window 8, five sliding layers and a full one with their own
    RoPE, query_pre_attn_scalar, tied embedding): a prefill past the window and decode steps, the CPU
    decoder's logits within the band."""
    from kestrel_core.model.loader import load_model

    model = load_model(str(FIXTURES / "tiny-gemma3"), "q8", cache="off").model
    assert unsupported_reason(model) is None
    assert_in_the_band(model, 24, 13)


@pytest.mark.parametrize("fixture", ["tiny-phi3-longrope", "tiny-qwen3-yarn.gguf", "tiny-smollm3",
                                     "tiny-seed-oss.gguf", "tiny-glm4", "tiny-glm4.gguf", "tiny-ernie4_5.gguf"])
def test_rope_variants_from_their_checkpoints_match_the_cpu(fixture: str) -> None:
    """RoPE on part of each head with longrope (Phi-4-mini's), YaRN, and SmolLM3's layers without RoPE: the device
    forward takes the core's RoPE tables, attention factor included, and the q/k rows as reordered at load. The
    fixture's golden ids (its random ones can put a q8 rounding boundary in tiny-smollm3's way, RoPE or not)."""
    from kestrel_core.model.loader import load_model

    model = load_model(str(FIXTURES / fixture), "q8", cache="off").model
    assert unsupported_reason(model) is None
    assert_in_the_band(model, 24, 13, np.load(FIXTURES / fixture.removesuffix(".gguf") / "golden.npz")["ids"])


def test_a_mixture_of_experts_through_the_window_matches_the_resident_forward() -> None:
    """Per-layer fetches of every expert through a WeightCache with keep=1 (each step's expert tables made from
    what the cache holds then): the resident forward's logits, bit for bit."""
    from kestrel_core.model.loader import load_model

    model = load_model(str(FIXTURES / "tiny-qwen2-moe"), "q8", cache="off").model
    toks = random_tokens(model.config, 16)
    cache = WeightCache(NumpyAllocator(1 << 30), budget=1 << 30, keep=1)
    uploads: list[int] = []
    windowed = DeviceForward(cache_source(cache, uploads), cache.on_layer_boundary, ops=NumpyOps())
    a = device_logits(windowed, model, toks, 8)
    b = device_logits(DeviceForward(ops=NumpyOps()), model, toks, 8)
    assert np.array_equal(a, b) and cache.stats()["evictions"] > 0


@pytest.mark.parametrize("fixture", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-qwen2-moe"])
def test_a_mixture_of_experts_from_its_checkpoint_matches_the_cpu(fixture: str) -> None:
    """The routed experts (and Qwen2-MoE's gated shared one), routed on the device: a prefill (each chosen
    expert on its rows) and captured decode steps (the chosen experts' GEMVs) within the band; the pipelined
    greedy decode gives the step-by-step tokens."""
    from kestrel_core.model.loader import load_model

    model = load_model(str(FIXTURES / fixture), "q8", cache="off").model
    assert unsupported_reason(model) is None
    fwd = assert_in_the_band(model, 20, 12)
    assert fwd.counters["graph_captures"] == 1 and fwd.counters["graph_replays"] == 8
    prompt = random_tokens(model.config, 7)
    expect, _ = stepwise_greedy(DeviceForward(ops=NumpyOps()), model, prompt, 6)
    fwd = DeviceForward(ops=NumpyOps())
    fwd.forward(model, 1, prompt, 0, False)
    assert [expect[0]] + list(fwd.greedy(model, 1, expect[0], len(prompt), 6)) == expect


@pytest.mark.parametrize("m,k,e", [(1, 8, 128), (32, 8, 128), (100, 4, 16), (7, 2, 8)])
def test_group_capacity_holds_every_grouping_and_the_mirror_pads_to_it(m: int, k: int, e: int) -> None:
    """The grouped GEMM's grid, group_capacity blocks, takes every grouping of m rows' k of e experts, the
    most groups included (every expert chosen, its count just past a block); the mirror of moe_group fills
    the blocks past the rows' own with (0, 0, 0), the GEMM's sign of a block that does nothing."""
    rng = np.random.default_rng(m + e)
    top = np.sort(np.stack([rng.choice(e, k, replace=False) for _ in range(m)]), axis=1)
    rows = plan.grouped_rows(m * k, e)
    cap = plan.group_capacity(m * k, e, rows)
    source, position, groups = plan.expert_groups(top, rows)
    assert len(groups) <= cap
    for r in (plan.GROUPED_ROWS, plan.GROUPED_ROWS_FEW):
        worst = (e * (r + 1), e)  # pairs and experts for the most groups: e x 2
        assert plan.group_capacity(*worst, r) >= 2 * e
    ops = NumpyOps()
    got = (np.full(m * k, -1, np.int32), np.full(m * k, -1, np.int32), np.full((cap, 3), -1, np.int32))
    ops.moe_group(top, e, *got, rows)
    assert np.array_equal(got[0], source) and np.array_equal(got[1], position)
    assert np.array_equal(got[2][:len(groups)], groups) and not got[2][len(groups):].any()


def test_device_routing_chooses_the_cpu_decoders_experts() -> None:
    """moe_route's mirror against kestrel_core's route: the same experts (in increasing order) and weights,
    with and without renormalising over the k, with a router bias (gpt-oss's), the shared gate's sigmoid last."""
    from kestrel_core.model.config import ModelConfig
    from kestrel_core.model.decoder import rmsnorm, route, shared_expert_scale
    from kestrel_core.model.weights import LayerWeights

    rng = np.random.default_rng(5)
    m, d, e, k = 6, 64, 16, 4
    h = rng.standard_normal((m, d)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    router = rng.standard_normal((e, d)).astype(np.float32)
    gate = rng.standard_normal((1, d)).astype(np.float32)
    bias = rng.standard_normal(e).astype(np.float32)  # gpt-oss's router bias, as large as the logits
    for norm_topk, router_bias in ((True, None), (False, None), (True, bias)):
        sel, wts, xn = np.zeros((m, k), np.int32), np.zeros((m, k + 1), np.float32), np.zeros((m, d), np.float32)
        NumpyOps().moe_route(h, norm, 1e-6, np.concatenate([router, gate]), e, k, norm_topk, xn, None, sel, wts,
                             bias=router_bias)
        x = rmsnorm(h, norm, np.float32(1e-6))
        c = ModelConfig(arch="qwen3_moe", vocab_size=8, hidden_size=d, intermediate_size=8, num_layers=1, num_heads=1,
                        num_kv_heads=1, head_dim=4, num_experts=e, experts_per_token=k, expert_intermediate_size=4,
                        norm_topk_prob=norm_topk)
        top, weights = route(x, LayerWeights(router=router, router_bias=router_bias), c)
        order = np.argsort(top, axis=1)
        assert np.array_equal(sel, np.take_along_axis(top, order, axis=1))
        np.testing.assert_allclose(wts[:, :k], np.take_along_axis(weights, order, axis=1), rtol=1e-5)
        np.testing.assert_allclose(wts[:, k:], shared_expert_scale(x, gate), rtol=1e-5)


def test_a_mixture_of_experts_done_wrong_on_the_device_leaves_the_band() -> None:
    """Each row's experts summed without their router weights: far outside the band."""
    from kestrel_core.model.loader import load_model

    class Unweighted(NumpyOps):
        def moe_combine(self, y, k, wts, h, *args):  # type: ignore[no-untyped-def]
            super().moe_combine(y, k, np.ones_like(wts), h, *args)

    assert_leaves_the_band(load_model(str(FIXTURES / "tiny-qwen3-moe"), "q8", cache="off").model, Unweighted(),
                            n_tokens=20, n_prefill=12)


def test_a_mixture_of_experts_decoded_with_the_wrong_experts_leaves_the_band() -> None:
    """The decode steps' GEMVs or the prefill's grouped GEMMs taking the expert after each chosen one: far
    outside the band."""
    from kestrel_core.model.loader import load_model

    class NextExpert(NumpyOps):
        def gemv(self, lin, x, *args, experts=None, **kw):  # type: ignore[no-untyped-def]
            if experts is not None:
                table, sel, slots = experts
                experts = (table, (sel + 1) % len(table), slots)
            super().gemv(lin, x, *args, experts=experts, **kw)

    class NextGroup(NumpyOps):
        def experts_gemm(self, lin, x, pro, xoff, y, table, groups, blocks, rows, **kw):  # type: ignore[no-untyped-def]
            shifted = groups.copy()
            shifted[:, 0] = (shifted[:, 0] + 1) % len(table)
            super().experts_gemm(lin, x, pro, xoff, y, table, shifted, blocks, rows, **kw)

    model = load_model(str(FIXTURES / "tiny-qwen3-moe"), "q8", cache="off").model
    for wrong in (NextExpert(), NextGroup()):
        assert_leaves_the_band(model, wrong, n_tokens=20, n_prefill=12)


@pytest.mark.parametrize(("fixture", "why"), [("tiny-olmo2", "architecture 'olmo2'"),
                                              ("tiny-exaone4.gguf", "architecture 'exaone4'"),
                                              ("tiny-cohere", "architecture 'cohere'"),
                                              ("tiny-cohere2.gguf", "architecture 'cohere2'")])
def test_device_forward_names_what_it_cannot_run(fixture: str, why: str) -> None:
    """OLMo 2 (norms after the blocks), EXAONE 4 and Cohere's (LayerNorms, parallel blocks, scaled logits) go
    through the GEMM hooks; the reason names the architecture."""
    from kestrel_core.model.loader import load_model

    model = load_model(str(FIXTURES / fixture), "q8", cache="off").model
    assert unsupported_reason(model) == why


@pytest.mark.parametrize(("change", "why"), [({"residual_scale": 0.5, "post_norms": True},
                                              "a residual multiplier with post-norms"),
                                             ({"residual_scale": 0.5, "num_experts": 8, "experts_per_token": 2,
                                               "expert_intermediate_size": 64}, "a residual multiplier with"),
                                             ({"o_bias": True, "post_norms": True},
                                              "an output projection bias with post-norms"),
                                             ({"activation": "swiglu_oai"}, "the clamped SwiGLU outside routed"),
                                             ({"pre_norms": False, "post_norms": True}, "norms only after each block"),
                                             ({"norm_type": "layer"}, "LayerNorms"),
                                             ({"parallel_block": True}, "parallel"),
                                             ({"qk_norm": True, "qk_norm_heads": True}, "a q/k norm weight a head")])
def test_what_a_known_architecture_cannot_carry_is_declined(change: dict, why: str) -> None:
    """A config the device forward has no kernel for is declined by what it holds, whatever its architecture says
    (a hand-made artifact, say)."""
    model = synthetic_model(CONFIGS["llama"], "q8", seed=1)
    assert unsupported_reason(model) is None
    assert why in (unsupported_reason(replace(model, config=replace(model.config, **change))) or "")


# -- Gemma 2's soft caps and Granite's multipliers --------------------------------------------------------------

CAPS_AND_MULTIPLIERS = {"gemma2": [{"attn_softcap": None}, {"final_softcap": None}],
                        "granite": [{"residual_scale": 1.0}, {"logits_scaling": 1.0}, {"embed_scale": 1.0},
                                    {"query_scale": None}]}
GEMMA2_GRANITE = ["tiny-gemma2", "tiny-gemma2.gguf", "tiny-granite", "tiny-granite.gguf"]


@pytest.mark.parametrize("fixture", GEMMA2_GRANITE)
def test_gemma2_and_granite_run_on_the_device_forward(fixture: str) -> None:
    """Their checkpoints, and the small configs with soft caps and Granite 3's multipliers, are the device
    forward's (kestrel_forward_supports says so at load)."""
    from kestrel_core.model.loader import load_model

    model = load_model(str(FIXTURES / fixture), "q8", cache="off").model
    assert unsupported_reason(model) is None
    for arch in CAPS_AND_MULTIPLIERS:
        assert unsupported_reason(synthetic_model(CONFIGS[arch], "q8", seed=1)) is None


@pytest.mark.parametrize("arch", list(CAPS_AND_MULTIPLIERS))
def test_each_soft_cap_and_multiplier_changes_the_cpus_logits(arch: str) -> None:
    """The small configs' caps and multipliers each move the CPU decoder's logits far outside its band, so a
    device forward within the band (test_forward_host's mirror, test_forward.py's GPU) has each of them right."""
    assert_each_change_leaves_the_band(synthetic_model(CONFIGS[arch], "q8", seed=3), CAPS_AND_MULTIPLIERS[arch])


@pytest.mark.parametrize("fixture", GEMMA2_GRANITE)
def test_gemma2_and_granite_from_their_checkpoints_match_the_cpu(fixture: str) -> None:
    """tiny-gemma2 (soft caps 5 and 8, a window of 8 on every other layer) and tiny-granite (its four
    multipliers) as transformers and llama.cpp wrote them: a prefill past the window and captured decode steps
    within the band; the pipelined greedy decode (lm_finish on the finished logits) gives the step-by-step
    tokens."""
    from kestrel_core.model.loader import load_model

    model = load_model(str(FIXTURES / fixture), "q8", cache="off").model
    assert_in_the_band(model, 24, 13)
    prompt = random_tokens(model.config, 7)
    expect, _ = stepwise_greedy(DeviceForward(ops=NumpyOps()), model, prompt, 6)
    fwd = DeviceForward(ops=NumpyOps())
    fwd.forward(model, 1, prompt, 0, False)
    assert [expect[0]] + list(fwd.greedy(model, 1, expect[0], len(prompt), 6)) == expect


class _NoAttentionCap(NumpyOps):
    def attention(self, *args, **kw):  # type: ignore[no-untyped-def]
        return super().attention(*args, **{**kw, "softcap": 0.0})


class _NoFinalCap(NumpyOps):
    def finish_logits(self, logits, div, cap):  # type: ignore[no-untyped-def]
        super().finish_logits(logits, div, 0.0)


class _NoResidualScale(NumpyOps):
    def gemv(self, *args, **kw):  # type: ignore[no-untyped-def]
        super().gemv(*args, **{**kw, "add_scale": 1.0})


class _NoLogitsDivisor(NumpyOps):
    def finish_logits(self, logits, div, cap):  # type: ignore[no-untyped-def]
        super().finish_logits(logits, 1.0, cap)


@pytest.mark.parametrize(("arch", "wrong"), [("gemma2", _NoAttentionCap), ("gemma2", _NoFinalCap),
                                             ("granite", _NoResidualScale), ("granite", _NoLogitsDivisor)],
                         ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_gemma2_and_granite_done_wrong_on_the_device_leave_the_band(arch: str, wrong: type) -> None:
    assert_leaves_the_band(synthetic_model(CONFIGS[arch], "q8", seed=3), wrong())


def test_gemma2_decode_attention_keeps_its_kernel_where_it_would_fold() -> None:
    """With the q|k|v GEMV's K splits as clusters (hidden 1024, head_dim 128) decode attention would fold into
    that GEMV, whose instances have no soft cap: Gemma 2's decode steps launch their attention (which caps the
    scores) in every layer instead, within the band."""
    model = synthetic_model(replace(CONFIGS["gemma2"], hidden_size=1024), "q8", seed=31)
    ops = NumpyOps(cluster=True)
    caps: list[float] = []
    ops.attention = lambda *a, **k: caps.append(k["softcap"]) or NumpyOps.attention(ops, *a, **k)  # type: ignore[method-assign]
    fwd = DeviceForward(ops=ops)
    toks = random_tokens(model.config, 12)
    ref = cpu_logits(model, toks, 6)
    result = compare(device_logits(fwd, model, toks, 6), ref, jitter_effect(model, toks, 6, ref))
    assert result.ok, str(result)
    assert ops.attend_folds(fwd.projections.layer(model, 0).qkv[0], 1024)  # it would fold without the cap
    assert caps == [1.0] * model.config.num_layers * 2  # the prefill's and the captured decode step's


# -- gpt-oss ----------------------------------------------------------------------------------------------------

def test_gpt_oss_from_its_checkpoint_matches_the_cpu() -> None:
    """tiny-gpt-oss as transformers wrote it (sinks, biases on q/k/v, o, the router and the experts, the clamped
    SwiGLU crossing its clamp, a window of 8 on every other layer, YaRN): a prefill past the window (the grouped
    expert GEMMs) and captured decode steps (the routed GEMVs) within the band; the pipelined greedy decode gives
    the step-by-step tokens. (Its MXFP4 and GGUF twins load to the same layers; their weights put some token
    sequences' activations within float rounding of a Q8 or float16 rounding boundary, which the device's sums,
    in another order, cross: the golden ids' row 2 flips one code of layer 0's q|k|v input.)"""
    from kestrel_core.model.loader import load_model

    model = load_model(str(FIXTURES / "tiny-gpt-oss"), "q8", cache="off").model
    assert unsupported_reason(model) is None
    fwd = assert_in_the_band(model, 24, 13)
    assert fwd.counters["graph_captures"] == 1 and fwd.counters["graph_replays"] == 11
    prompt = random_tokens(model.config, 7)
    expect, _ = stepwise_greedy(DeviceForward(ops=NumpyOps()), model, prompt, 6)
    fwd = DeviceForward(ops=NumpyOps())
    fwd.forward(model, 1, prompt, 0, False)
    assert [expect[0]] + list(fwd.greedy(model, 1, expect[0], len(prompt), 6)) == expect


class _NoSinks(NumpyOps):
    def attention(self, *args, **kw):  # type: ignore[no-untyped-def]
        return super().attention(*args, **{**kw, "sinks": None})


class _NoOutputBias(NumpyOps):
    def gemv(self, lin, x, pro, pw, eps, xoff, y, epi, bias, **kw):  # type: ignore[no-untyped-def]
        super().gemv(lin, x, pro, pw, eps, xoff, y, epi, None if epi == plan.EPI_ADD else bias, **kw)


class _NoRouterBias(NumpyOps):
    def moe_route(self, *args, **kw):  # type: ignore[no-untyped-def]
        super().moe_route(*args, **{**kw, "bias": None})


class _NoExpertBiases(NumpyOps):
    def gemv(self, lin, x, pro, pw, eps, xoff, y, epi, bias, experts=None, **kw):  # type: ignore[no-untyped-def]
        super().gemv(lin, x, pro, pw, eps, xoff, y, epi, None if experts is not None else bias, experts=experts, **kw)

    def expert_bias(self, y, groups, bias):  # type: ignore[no-untyped-def]
        pass


class _SiluForSwiglu(NumpyOps):
    def gemv(self, lin, x, pro, *args, **kw):  # type: ignore[no-untyped-def]
        super().gemv(lin, x, plan.PRO_SILU_MUL if pro == plan.PRO_SWIGLU_OAI else pro, *args, **kw)

    def experts_gemm(self, lin, x, pro, *args, **kw):  # type: ignore[no-untyped-def]
        super().experts_gemm(lin, x, plan.PRO_SILU_MUL if pro == plan.PRO_SWIGLU_OAI else pro, *args, **kw)


class _Unclamped(NumpyOps):
    def gemv(self, *args, swiglu=plan.NO_SWIGLU, **kw):  # type: ignore[no-untyped-def]
        super().gemv(*args, swiglu=(np.inf, swiglu[1]), **kw)

    def experts_gemm(self, *args, swiglu=plan.NO_SWIGLU, **kw):  # type: ignore[no-untyped-def]
        super().experts_gemm(*args, swiglu=(np.inf, swiglu[1]), **kw)


GPT_OSS_WRONG = [_NoSinks, _NoOutputBias, _NoRouterBias, _NoExpertBiases, _SiluForSwiglu, _Unclamped]


@pytest.mark.parametrize("wrong", GPT_OSS_WRONG, ids=lambda c: c.__name__)
def test_gpt_oss_done_wrong_on_the_device_leaves_the_band(wrong: type) -> None:
    """Each of gpt-oss's pieces left out of the mirrors (the sinks, o's bias, the router's, the experts', the
    clamped SwiGLU for plain SiLU or without its clamp), in the prefill and the decode steps: far outside the band
    of the small config's logits (test_forward_host runs it right in every quant mode)."""
    assert_leaves_the_band(synthetic_model(CONFIGS["gpt_oss"], "q8", seed=3), wrong())


def _logits_routed_otherwise(model, toks, n_prefill, layer, row):  # type: ignore[no-untyped-def]
    """The CPU's logits with layer ``layer``'s router taking its (k+1)-th expert for its k-th at row ``row``."""
    k, calls = model.config.experts_per_token, []
    real = decoder.router_logits
    layers = model.config.num_layers  # every layer of the config routes

    def swapped(x, lw):  # type: ignore[no-untyped-def]
        out, call = real(x, lw), len(calls)
        calls.append(None)
        at = layer if row < n_prefill else (1 + row - n_prefill) * layers + layer
        if call == at:
            r = row if row < n_prefill else 0
            first, second = np.argsort(-out[r], kind="stable")[k - 1:k + 1]
            out[r, [first, second]] = out[r, [second, first]]
        return out

    with patch.object(decoder, "router_logits", swapped):
        return cpu_logits(model, toks, n_prefill)


def test_a_routing_tie_may_go_either_way_and_only_a_tie() -> None:
    """A row whose router ranks two experts within the nudge's reach (routing_ties) may take either: the other
    choice there moves that row's logits far outside the band, and the comparison leaves the row out. The same
    swap at a row the nudge cannot reorder stays a failure."""
    model = synthetic_model(CONFIGS["gpt_oss"], "q8", seed=3)
    assert not model.config.dense_layers
    toks = random_tokens(model.config, 40)
    ref = cpu_logits(model, toks, 24)
    jitter = jitter_effect(model, toks, 24, ref)
    ties = routing_ties(model, toks, 24)
    assert ties is not None and 0 < ties.sum() <= len(toks) // 4
    k = model.config.experts_per_token
    ranked = -np.sort(-router_logits_of(model, toks, 24, None), axis=2)
    gaps = ranked[..., k - 1] - ranked[..., k]  # [L, T]
    tied_layer, tied_row = np.unravel_index(np.argmin(np.where(ties, gaps, np.inf)), gaps.shape)
    wide_layer, wide_row = np.unravel_index(np.argmax(gaps), gaps.shape)
    assert not ties[wide_row]
    tie_taken = _logits_routed_otherwise(model, toks, 24, tied_layer, tied_row)
    assert not compare(tie_taken, ref, jitter).ok
    assert compare(tie_taken, ref, jitter, ties).ok
    other_taken = _logits_routed_otherwise(model, toks, 24, wide_layer, wide_row)
    assert not compare(other_taken, ref, jitter, ties).ok
