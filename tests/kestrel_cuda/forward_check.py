"""How the device forward is checked against the CPU decoder (the test_forward modules on the GPU,
test_forward_host.py and test_forward_models_host.py on the numpy mirrors).

Why not a fixed tolerance: every linear quantizes its input per block to int8 (Q8_0). An activation that
lands within float32 rounding of a rounding boundary gets a code one step (1/127 of its block's maximum)
away from the other implementation's, and the network then amplifies that difference through later
quantizations. Two correct implementations that sum in a different order therefore differ by much more
than float32 rounding, and by an amount that depends on the model. The tolerance is measured instead: the
CPU decoder is run a second time with every linear's input and output nudged by a few ulps
(``selftest.JITTER``; the outputs' nudge reaches the float16 rounding of the keys and values, as the device's
summation order does), and the device may differ from the CPU by ``FACTOR`` times what that nudge alone
changes. A wrong kernel (a bad index, a missing bias, a wrong scale) moves logits by O(1) of their spread, far
above that band. A mixture of experts adds one discrete case: a row whose router ranks two experts within
what the nudge moves its logits may take either on the device, and its logits then differ by O(1); such rows
(``routing_ties``) are left out of the comparison, at most a quarter of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from unittest.mock import patch

import numpy as np

from kestrel_core.dispatch import Offload
from kestrel_core.model import decoder
from kestrel_core.model.config import ModelConfig
from kestrel_core.model.decoder import Decoder
from kestrel_core.model.weights import Model
from kestrel_core.registry import Registry
from kestrel_core.selftest import JITTER_FACTOR, JITTER_FLOOR, JitterOffload
from kestrel_cuda.forward import DeviceForward
from kestrel_cuda.ops_numpy import NumpyOps
from kestrel_cuda.plan import KV_BLOCK, KV_DTYPE

FACTOR, FLOOR = JITTER_FACTOR, JITTER_FLOOR  # the selftest's band: FACTOR times the nudge's effect, at least FLOOR

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
JITTER_SEEDS = (5, 6)  # the effect is the larger over these nudges


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
         "beta_slow": 1.0, "truncate": False, "attention_factor": 0.1 * math.log(4.0) + 1}

# Small models of each family for the checks: llama (tied embedding, llama3 RoPE scaling, odd vocabulary so
# lm_head N % 4 != 0), qwen2 (q/k/v bias; F=320 is not a multiple of 256, so g256 modes fall back to G=32
# for down), qwen3 (q/k norm, head_dim 128 != D/H, one KV head), gemma3 (post-norms, GeGLU, scaled embedding
# and queries, a sliding and a full layer with their own RoPE: the device runs the window's 64 positions), gemma2
# (gemma3's layers without q/k norms, one RoPE, soft caps small enough to change every logit:
# test_forward_models_host checks that each does), granite (Granite 3's multipliers: embeddings x 12, the query
# scale 1/64, the residual adds x 0.22, the logits / 8), gpt_oss (sinks, biases on q/k/v, o, the router and 8
# experts, YaRN, a window of 16 on every other layer, its SwiGLU clamped at 1.5 so that gate and up cross the
# clamp). Every K is a multiple of 256 otherwise.
SMALL_CONFIGS: dict[str, ModelConfig] = {
    "llama": ModelConfig(arch="llama", vocab_size=509, hidden_size=256, intermediate_size=512, num_layers=2,
                         num_heads=8, num_kv_heads=2, head_dim=32, max_position=4096, tie_word_embeddings=True,
                         rope_scaling=_LLAMA3, rope_theta=10000.0),
    "qwen2": ModelConfig(arch="qwen2", vocab_size=512, hidden_size=256, intermediate_size=320, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=64, max_position=4096, qkv_bias=True,
                         rope_theta=1e6),
    "qwen3": ModelConfig(arch="qwen3", vocab_size=512, hidden_size=256, intermediate_size=768, num_layers=2,
                         num_heads=4, num_kv_heads=1, head_dim=128, max_position=4096, qk_norm=True,
                         rope_theta=1e6),
    "gemma3": ModelConfig(arch="gemma3", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=128, max_position=4096, qk_norm=True,
                          tie_word_embeddings=True, sliding_window=64, layer_types=("sliding", "full"),
                          rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 4.0},
                          rope_local_theta=10000.0, query_scale=0.0625, embed_scale=16.0, activation="gelu_tanh",
                          post_norms=True),
    "gemma2": ModelConfig(arch="gemma2", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=128, max_position=4096, tie_word_embeddings=True,
                          sliding_window=64, layer_types=("sliding", "full"), rope_theta=10000.0, query_scale=0.0625,
                          embed_scale=16.0, activation="gelu_tanh", post_norms=True, attn_softcap=1.0,
                          final_softcap=4.0),
    "granite": ModelConfig(arch="granite", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=64, max_position=4096, rope_theta=10000.0,
                           embed_scale=12.0, query_scale=0.015625, residual_scale=0.22, logits_scaling=8.0),
    "gpt_oss": ModelConfig(arch="gpt_oss", vocab_size=512, hidden_size=256, intermediate_size=256, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=64, max_position=4096, rope_theta=150000.0,
                           rope_scaling=_YARN, sliding_window=16, layer_types=("sliding", "full"), qkv_bias=True,
                           o_bias=True, attn_sinks=True, num_experts=8, experts_per_token=2,
                           expert_intermediate_size=256, norm_topk_prob=True, moe_bias=True,
                           activation="swiglu_oai", swiglu_limit=1.5),
}


# A backend module (for KESTREL_BACKEND_PATH) around DeviceForward: CPU GEMMs, and a whole-step forward
# made by MAKE that declines the calls numbered in DECLINE (1-based), recording each call's start. GREEDY:
# None declines the pipelined greedy decode; n >= 0 runs it and fails after n tokens; -1 never fails.
DECLINING_BACKEND = '''
import itertools

from kestrel_core import API_VERSION, BackendInfo, hookimpl
from kestrel_cpu import kestrel_close, kestrel_gemm_f32, kestrel_gemm_q8, kestrel_open  # noqa: F401
from kestrel_cuda.forward import DeviceForward

DECLINE = {decline}
MAKE = {make}
CALLS = []
FWD = []


@hookimpl
def kestrel_backend_info():
    return BackendInfo("fwdcuda", "1", API_VERSION, "gpu")


@hookimpl
def kestrel_forward(device, model, seq_id, tokens, start, all_logits):
    CALLS.append(int(start))
    if len(CALLS) in DECLINE:
        return None
    if not FWD:
        FWD.append(MAKE())
    return FWD[0].forward(model, seq_id, tokens, start, all_logits)


@hookimpl
def kestrel_decode_greedy(device, model, seq_id, token, start, count):
    if GREEDY is None:
        return None
    if not FWD:
        FWD.append(MAKE())
    tokens = FWD[0].greedy(model, seq_id, token, start, count)
    return None if tokens is None else _failing(tokens)


def _failing(tokens):
    sent = None
    for i in itertools.count():
        try:
            tok = tokens.send(sent)  # a stop (send(False)) passed on
        except StopIteration:
            return
        if i == GREEDY:
            raise RuntimeError("simulated device error")
        sent = yield tok


@hookimpl
def kestrel_release_sequence(device, seq_id):
    if FWD:
        FWD[0].release(seq_id)


GREEDY = {greedy}
'''


def cache_source(cache: Any, uploads: list[int]) -> Any:
    """A DeviceForward weight source over a real ``WeightCache`` of numpy buffers: each miss packs the strips as
    the device layout does (``layout.pack_kmajor``) and records its wkey in ``uploads``."""
    from kestrel_cuda.layout import Geometry, pack_kmajor

    def source(key: int, strips: Any) -> Any:
        geo = Geometry.fused(strips, pack_int4=True) if len(strips) > 1 else Geometry.of(strips[0], pack_int4=True)

        def upload(dw: Any) -> None:
            uploads.append(key)
            codes = np.concatenate([s.codes for s in strips])
            scales = np.concatenate([s.scales for s in strips])
            dw.codes[:] = pack_kmajor(codes, strips[0].bits).reshape(-1).view(np.int8)
            sc = np.zeros((geo.ngroups, geo.npad), np.float32)
            sc[:, :codes.shape[0]] = scales.T
            dw.scales[...] = sc
        return cache.get_or_upload(key, geo, upload, source=strips[0])
    return source


def cpu_logits(model: Model, tokens: np.ndarray, n_prefill: int, jitter_seed: int | None = None) -> np.ndarray:
    """Teacher-forced CPU logits [T, vocab]: one prefill of n_prefill tokens (all rows), then one step each."""
    cpu = Registry().cpu()
    off = Offload(cpu, cpu) if jitter_seed is None else JitterOffload(cpu, jitter_seed)
    dec = Decoder(model, off)
    cache = dec.new_cache()
    outs = [dec.forward(tokens[:n_prefill], cache, all_logits=True)]
    for t in tokens[n_prefill:]:
        outs.append(dec.forward(np.array([t]), cache))
    return np.concatenate(outs)


def device_logits(fwd: Any, model: Model, tokens: np.ndarray, n_prefill: int, seq_id: int = 1) -> np.ndarray:
    """The same protocol through ``DeviceForward.forward``."""
    out = fwd.forward(model, seq_id, tokens[:n_prefill], 0, True)
    assert out is not None, f"the device forward declined: {getattr(fwd, 'last_decline', '')}"
    outs = [out]
    for i in range(n_prefill, len(tokens)):
        step = fwd.forward(model, seq_id, tokens[i:i + 1], i, False)
        assert step is not None, f"the device forward declined at position {i}: {fwd.last_decline}"
        outs.append(step)
    return np.concatenate(outs)


def stepwise_greedy(fwd: Any, model: Model, prompt: np.ndarray, steps: int,
                    seq_id: int = 1) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens through ``DeviceForward.forward`` one step at a time (the host's argmax of each row of
    logits), and each decode step's logits [1, vocab]: what the pipelined ``greedy`` must reproduce."""
    tokens = [int(fwd.forward(model, seq_id, prompt, 0, False)[0].argmax())]
    rows = []
    for i in range(steps):
        rows.append(fwd.forward(model, seq_id, np.array(tokens[-1:]), len(prompt) + i, False))
        tokens.append(int(rows[-1][0].argmax()))
    return tokens, rows


def jitter_effect(model: Model, tokens: np.ndarray, n_prefill: int, ref: np.ndarray) -> tuple[float, float]:
    """(relative L2, max abs) change of the CPU logits under the nudge, the larger over JITTER_SEEDS."""
    rel, mx = 0.0, 0.0
    for seed in JITTER_SEEDS:
        jit = cpu_logits(model, tokens, n_prefill, jitter_seed=seed)
        rel = max(rel, float(np.linalg.norm(jit - ref) / np.linalg.norm(ref)))
        mx = max(mx, float(np.abs(jit - ref).max()))
    return rel, mx


def routing_ties(model: Model, tokens: np.ndarray, n_prefill: int) -> np.ndarray | None:
    """Rows [T] where some layer's router ranks its k-th and (k+1)-th experts within FACTOR times what the nudge
    changes that row's router logits (the larger over JITTER_SEEDS). A device whose sums round otherwise may choose
    either expert there, and the row's logits then move by O(1) of their spread: a tie, not a wrong kernel. None
    for a dense model."""
    if not model.config.num_experts:
        return None
    ref = router_logits_of(model, tokens, n_prefill, None)  # [L, T, E]
    change = np.max([np.abs(router_logits_of(model, tokens, n_prefill, seed) - ref).max(axis=2)
                     for seed in JITTER_SEEDS], axis=0)  # [L, T]
    k = model.config.experts_per_token
    ranked = -np.sort(-ref, axis=2)
    return (ranked[..., k - 1] - ranked[..., k] < FACTOR * change).any(axis=0)


def router_logits_of(model: Model, tokens: np.ndarray, n_prefill: int, jitter_seed: int | None) -> np.ndarray:
    """Every routed layer's router logits [L, T, E] in ``cpu_logits``' run."""
    calls: list[np.ndarray] = []
    real = decoder.router_logits

    def record(x: np.ndarray, lw: Any) -> np.ndarray:
        calls.append(real(x, lw))
        return calls[-1]

    with patch.object(decoder, "router_logits", record):
        cpu_logits(model, tokens, n_prefill, jitter_seed)
    layers = len(calls) // (1 + len(tokens) - n_prefill)  # the prefill's calls, then each step's
    runs = [calls[i:i + layers] for i in range(0, len(calls), layers)]
    return np.stack([np.concatenate(layer) for layer in zip(*runs)])


@dataclass
class Comparison:
    rel_err: float  # ||device - cpu|| / ||cpu|| over all logits
    tol: float  # max(FACTOR x jitter effect, FLOOR)
    jitter_rel: float
    max_err: float  # max |device - cpu|
    gap_tol: float  # FACTOR x the nudge's largest logit change: ties within it may go either way
    argmax_same: int  # rows whose argmax is the CPU's
    argmax_mismatch: int  # rows whose argmax the CPU scores more than gap_tol below its own
    tied: int = 0  # rows left out: a routing tie (routing_ties)

    @property
    def ok(self) -> bool:
        return self.rel_err <= self.tol and self.argmax_mismatch == 0

    def __str__(self) -> str:
        return (f"rel L2 err {self.rel_err:.3g} (tol {self.tol:.3g} = max({FACTOR:g} x jitter effect "
                f"{self.jitter_rel:.3g}, {FLOOR:g})), max abs err {self.max_err:.3g}, argmax same in "
                f"{self.argmax_same} rows, {self.argmax_mismatch} worse than a tie within {self.gap_tol:.3g}"
                f"{f', {self.tied} rows of routing ties left out' if self.tied else ''}")


def compare(got: np.ndarray, ref: np.ndarray, jitter: tuple[float, float],
            ties: np.ndarray | None = None) -> Comparison:
    """The device's logits ``got`` [T, V] against the CPU's ``ref``, over the rows not in ``ties`` [T]."""
    tied = 0 if ties is None else int(ties.sum())
    if tied:
        got, ref = got[~ties], ref[~ties]
    jitter_rel, jitter_max = jitter
    tol = max(FACTOR * jitter_rel, FLOOR)
    gap_tol = FACTOR * jitter_max
    pick = got.argmax(1)
    loss = ref.max(1) - ref[np.arange(len(ref)), pick]  # how much worse the device's pick is for the CPU
    same = int((pick == ref.argmax(1)).sum())
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    return Comparison(rel, tol, jitter_rel, float(np.abs(got - ref).max()), gap_tol, same,
                      int((loss > gap_tol).sum()), tied)


def greedy_agrees(device_tokens: list[int], model: Model, prompt: np.ndarray, tol: float) -> list[int]:
    """Steps where the device's greedy token is not the CPU's choice beyond ``tol``.

    The CPU is teacher-forced on the device's tokens; at each step the device's token must be the CPU's
    argmax, or tie with it within ``tol`` (then either choice is correct).
    """
    tokens = np.concatenate([prompt, np.asarray(device_tokens[:-1], np.int64)])
    ref = cpu_logits(model, tokens, len(prompt))[len(prompt) - 1:]
    bad = []
    for i, (row, tok) in enumerate(zip(ref, device_tokens)):
        if row.max() - row[tok] > tol:
            bad.append(i)
    return bad


def cuda_device_count() -> int:
    """CUDA devices CuPy sees (0 without CuPy or a driver): the GPU test files skip on 0."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def paged_rows(rng: np.random.Generator, hd: int, heads: int = 8, kv: int = 2) -> tuple[np.ndarray, ...]:
    """A batch of rows for the attention kernels over the paged pool: q [rows, heads * hd], the keys and values
    [kv, (40 + 1) * KV_BLOCK, hd] (KV_DTYPE), each row's (position, table) [rows, 2] and the tables [rows + 1, 8]
    of scattered pages (the rows end inside and at the end of a page), and the softmax scale."""
    blocks, width = 40, 8
    positions = [0, 31, 32, 100, 255, 17]
    tables = np.stack([rng.permutation(blocks)[:width] for _ in positions]).astype(np.int32)
    tables = np.concatenate([tables, np.zeros((1, width), np.int32)])
    rows = np.array([[p, i] for i, p in enumerate(positions)], np.int32)
    kc = rng.standard_normal((kv, (blocks + 1) * KV_BLOCK, hd)).astype(KV_DTYPE)
    vc = rng.standard_normal(kc.shape).astype(KV_DTYPE)
    q = (3 * rng.standard_normal((len(positions), heads * hd))).astype(np.float32)
    return q, kc, vc, rows, tables, float(np.float32(hd ** -0.5))


def random_tokens(cfg: ModelConfig, n: int, seed: int = 1) -> np.ndarray:
    """``n`` token ids drawn uniformly from the vocabulary."""
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, n)


def assert_in_the_band(model, n_tokens: int, n_prefill: int,  # type: ignore[no-untyped-def]
                       tokens: np.ndarray | None = None) -> DeviceForward:
    """A prefill of ``n_prefill`` tokens and decode steps to ``n_tokens`` over the numpy mirrors: the CPU
    decoder's logits within the band. ``tokens``: these (default: random ones). Returns the forward, for its
    counters."""
    toks = random_tokens(model.config, n_tokens) if tokens is None else np.asarray(tokens[:n_tokens])
    ref = cpu_logits(model, toks, n_prefill)
    fwd = DeviceForward(ops=NumpyOps())
    result = compare(device_logits(fwd, model, toks, n_prefill), ref, jitter_effect(model, toks, n_prefill, ref))
    assert result.ok, str(result)
    return fwd


def assert_each_change_leaves_the_band(model: Model, changes: list[dict[str, Any]], n_tokens: int = 40,
                                       n_prefill: int = 24) -> None:
    """The CPU decoder with each of ``changes`` to ``model``'s config (a soft cap or a multiplier left out, say)
    lands far outside the band of its logits, over twice it: a device forward within the band has each right."""
    toks = random_tokens(model.config, n_tokens)
    ref = cpu_logits(model, toks, n_prefill)
    jitter = jitter_effect(model, toks, n_prefill, ref)
    for change in changes:
        other = replace(model, config=replace(model.config, **change))
        result = compare(cpu_logits(other, toks, n_prefill), ref, jitter)
        assert not result.ok and result.rel_err > 2 * result.tol, f"{change}: {result}"


def assert_leaves_the_band(model, ops, n_tokens: int = 40, n_prefill: int = 24) -> None:  # type: ignore[no-untyped-def]
    """A forward over ``ops`` (a deliberately wrong mirror) lands far outside the CPU's band: over twice it."""
    toks = random_tokens(model.config, n_tokens)
    ref = cpu_logits(model, toks, n_prefill)
    result = compare(device_logits(DeviceForward(ops=ops), model, toks, n_prefill), ref,
                     jitter_effect(model, toks, n_prefill, ref))
    assert not result.ok and result.rel_err > 2 * result.tol, str(result)


def _check(model, toks, n_prefill, got):  # type: ignore[no-untyped-def]
    """The device's logits ``got`` within the CPU's band, their argmax the CPU's at 90% of the positions, rows of
    routing ties left out (at most a quarter of them)."""
    ref = cpu_logits(model, toks, n_prefill)
    ties = routing_ties(model, toks, n_prefill)
    result = compare(got, ref, jitter_effect(model, toks, n_prefill, ref), ties)
    print(f"{model.config.arch}: {result}")
    assert result.ok, str(result)
    assert result.tied <= len(toks) // 4, str(result)
    assert result.argmax_same >= 0.9 * (len(toks) - result.tied), str(result)
    return result
