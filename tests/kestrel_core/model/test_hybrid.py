"""The hybrid models (Qwen3.5 and Qwen3-Next: linear attention; LFM2: short convolutions; Granite 4.0-H: Mamba-2):
each of their rules is needed to agree with transformers, the hub's nested checkpoint reads as the flat one, and a
sequence's recurrent state behaves (slots, no rewind, no shared prefix, preemption)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import kestrel_core
from kestrel_core.errors import KestrelError
from kestrel_core.model.config import ModelConfig
from kestrel_core.model.kv_pool import KVPool
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.scheduler import Scheduler
from kestrel_core.model.validate import ValidationError

from .parity import CASES, FIXTURES, HYBRID, HYBRID_MOE, HYBRID_NEAR_TIES, Golden, _with_config, measure

DENSE = next(c for c in CASES if c.name == "tiny-qwen3_5")
DENSE_GGUF = next(c for c in CASES if c.name == "tiny-qwen3_5.gguf")
MIXTURE = next(c for c in CASES if c.name == "tiny-qwen3_5-moe")
NEXT = next(c for c in CASES if c.name == "tiny-qwen3-next")
NEXT_GGUF = next(c for c in CASES if c.name == "tiny-qwen3-next.gguf")


def _get_changed(mp, field: str, change) -> None:  # type: ignore[no-untyped-def]
    """HFCheckpoint.get_weight (which get reads through) with ``change`` applied to every checkpoint tensor of
    ``field``, as stored (A_log before kestrel's -exp)."""
    from kestrel_core.contract import BFloat16Bits
    from kestrel_core.model import hf

    real = hf.HFCheckpoint.get_weight

    def changed(self, name):  # type: ignore[no-untyped-def]
        t = real(self, name)
        if name.rsplit(".", 1)[-1] != field:
            return t
        return change(t.to_float32() if isinstance(t, BFloat16Bits) else np.asarray(t, np.float32))

    mp.setattr(hf.HFCheckpoint, "get_weight", changed)


def _split_swapped(role: str):  # type: ignore[no-untyped-def]
    """hybrid_splits with the two parts of ``role`` read the other way round."""
    def swap(mp, module: str) -> None:  # type: ignore[no-untyped-def]
        from kestrel_core.model import quantize

        def swapped(c):  # type: ignore[no-untyped-def]
            splits = quantize.hybrid_splits(c)
            (a, a_rows), (b, b_rows) = splits[role]
            return {**splits, role: ((a, b_rows), (b, a_rows))}

        mp.setattr(f"kestrel_core.model.{module}.hybrid_splits", swapped)
    return swap


def _qkvz_contiguous(mp, module: str) -> None:  # type: ignore[no-untyped-def]
    """Qwen3-Next's in_proj_qkvz read as Qwen3.5's in_proj_qkv then in_proj_z (rows not per key head)."""
    from kestrel_core.model import quantize

    def contiguous(c):  # type: ignore[no-untyped-def]
        splits = quantize.hybrid_splits(c)
        (qkv, qkv_rows), (z, z_rows) = splits["qkvz"]
        return {**splits, "qkvz": ((qkv, np.arange(len(qkv_rows))), (z, len(qkv_rows) + np.arange(len(z_rows))))}

    mp.setattr(f"kestrel_core.model.{module}.hybrid_splits", contiguous)


WRONG = {
    "norms as plain weights, not 1 + w": lambda mp: mp.setattr("kestrel_core.model.hf.ONE_PLUS_NORMS", ()),
    "q_proj's gate rows read as the query": lambda mp: _split_swapped("q_gate")(mp, "hf"),
    "one decay rate for every head (A_log read as 0)": lambda mp: _get_changed(mp, "lin_decay", np.zeros_like),
    "the convolution's taps in reverse": lambda mp: _get_changed(mp, "conv", lambda t: t[..., ::-1].copy()),
    "value heads tiled, not grouped by key head": lambda mp: _get_changed(
        mp, "lin_dt_bias", lambda t: t.reshape(2, 2).T.reshape(-1).copy()),
}


@pytest.mark.parametrize("wrong", WRONG)
def test_qwen3_5_done_wrong_leaves_the_limits(monkeypatch, wrong: str) -> None:  # type: ignore[no-untyped-def]
    """Each of Qwen3.5's rules is needed for tiny-qwen3_5 to agree."""
    WRONG[wrong](monkeypatch)
    fig = measure(DENSE, "q8")
    assert not fig.within(HYBRID), fig


def test_qwen3_5_gguf_with_its_value_heads_left_tiled_leaves_the_limits(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """llama.cpp's converter reorders the value heads of every linear-attention tensor; read as stored, the
    GGUF twin disagrees."""
    monkeypatch.setattr("kestrel_core.model.gguf_reader._TILED_VALUE_HEADS", {})
    fig = measure(DENSE_GGUF, "q8")
    assert not fig.within(HYBRID), fig


@pytest.mark.parametrize("wrong", [{"shared_expert_intermediate_size": 0}, {"num_experts_per_tok": 1}],
                         ids=["no shared expert", "top-1 routing"])
def test_qwen3_5_moe_routed_wrong_leaves_the_limits(monkeypatch, wrong: dict) -> None:  # type: ignore[no-untyped-def]
    """The shared expert and the top-k (measured wrong: medians 0.30 and 0.097 of the range at q8)."""
    _with_config(monkeypatch, lambda c: {**c, **wrong})
    fig = measure(MIXTURE, "q8")
    assert not fig.within(HYBRID_MOE), fig


NEXT_WRONG = {
    "in_proj_qkvz read as q|k|v then z": (NEXT, lambda mp: _qkvz_contiguous(mp, "hf")),
    "in_proj_ba read as alpha, beta": (NEXT, lambda mp: _split_swapped("ba")(mp, "hf")),
    "the GGUF's ssm_ba read as alpha, beta": (NEXT_GGUF, lambda mp: _split_swapped("ba")(mp, "gguf_reader")),
}


@pytest.mark.parametrize("wrong", NEXT_WRONG)
def test_qwen3_next_done_wrong_leaves_the_limits(monkeypatch, wrong: str) -> None:  # type: ignore[no-untyped-def]
    """Qwen3-Next fuses its linear attention's inputs per key head: each split is needed to agree."""
    case, patch = NEXT_WRONG[wrong]
    patch(monkeypatch)
    fig = measure(case, "q8")
    assert not fig.within(HYBRID_NEAR_TIES), fig


def test_the_hubs_nested_checkpoint_reads_as_the_flat_one(tmp_path: Path) -> None:
    """Qwen3_5ForConditionalGeneration nests the language model (text_config, model.language_model.*) beside a
    vision tower and an MTP head, which kestrel leaves; written flat as Qwen3_5ForCausalLM, the same logits."""
    nested = FIXTURES / "tiny-qwen3_5"
    flat = tmp_path / "flat"
    shutil.copytree(nested, flat)
    cfg = json.loads((nested / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    text = {**cfg["text_config"], "architectures": ["Qwen3_5ForCausalLM"],
            "tie_word_embeddings": cfg["tie_word_embeddings"]}
    (flat / "config.json").write_text(json.dumps(text))
    raw = (nested / "model.safetensors").read_bytes()  # bfloat16: renamed in the header, the data as it is
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    assert any(k.startswith("model.visual.") for k in header) and any(k.startswith("mtp.") for k in header)
    renamed = json.dumps({k.replace("model.language_model.", "model."): v for k, v in header.items()}).encode()
    (flat / "model.safetensors").write_bytes(len(renamed).to_bytes(8, "little") + renamed + raw[8 + size:])
    ids = Golden(nested / "golden.npz").ids
    with kestrel_core.load(str(nested), backend="cpu") as a, \
            kestrel_core.load(str(flat), backend="cpu") as b:
        np.testing.assert_array_equal(a.logits(ids), b.logits(ids))


@pytest.fixture
def engine():  # type: ignore[no-untyped-def]
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3_5"), backend="cpu") as engine:
        yield engine


def test_states_are_per_sequence_and_slots_come_back_zeroed(engine) -> None:  # type: ignore[no-untyped-def]
    """Two sequences decoding side by side keep their own states; a released slot, taken again, starts from
    zero: the same prompt gives the same logits as on a fresh engine."""
    dec, ids = engine.decoder, Golden(FIXTURES / "tiny-qwen3_5" / "golden.npz").ids
    first = dec.new_cache()
    alone = dec.forward(ids[:12], first, all_logits=True)
    other = dec.new_cache()
    dec.forward(ids[20:31], other)
    first.release()
    again = dec.new_cache()
    assert again.state == [] and engine.pool.states is not None
    np.testing.assert_array_equal(dec.forward(ids[:12], again, all_logits=True), alone)
    step = [dec.forward(ids[12:13], again), dec.forward(ids[31:32], other)]
    whole = dec.new_cache()
    np.testing.assert_array_equal(dec.forward(ids[:13], whole), step[0])


def test_a_recurrent_state_is_not_rewound_or_guessed_ahead(engine) -> None:  # type: ignore[no-untyped-def]
    """The state holds every position: truncate refuses, the engine drafts nothing, and --speculate's greedy
    answer is the same as without it."""
    assert not engine.rewinds
    cache = engine.decoder.new_cache()
    engine.decoder.forward([5, 6, 7], cache)
    with pytest.raises(KestrelError, match="its state holds every position"):
        cache.truncate(1)
    prompt = [9, 10, 11, 9, 10, 11, 9, 10, 11, 9, 10]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = list(engine.generate(prompt, params=params))
    engine.speculate = 4
    scheduler = Scheduler(engine, max_batch=2)
    request = scheduler.add(prompt, params)
    while scheduler.has_work:
        scheduler.step()
    assert request.output_ids == plain and scheduler.drafted == 0


def _served(engine, prompts, params, token_budget=None) -> list[list[tuple[int, float]]]:  # type: ignore[no-untyped-def]
    """Each prompt through the scheduler in turn: its tokens and their log-probabilities (with ``logprobs``)."""
    out = []
    for prompt in prompts:
        scheduler = Scheduler(engine, max_batch=4, token_budget=token_budget)
        scheduler.add(prompt, params)
        got = []
        while scheduler.has_work:
            got.extend((t, lp.logprob) for o in scheduler.step() for t, lp in zip(o.new_token_ids, o.logprobs))
        out.append(got)
    return out


@pytest.mark.parametrize("name", ["tiny-qwen3_5", "tiny-lfm2", "tiny-granite4-h"])
def test_a_conversation_sent_again_starts_from_the_state_its_prompt_left(name: str) -> None:
    """A prompt, then the conversation with its answer and one more turn: the second attaches the first
    prompt's whole blocks and the recurrent state kept at their end, computes only the rest, and generates the
    very tokens (and log-probabilities, to the bit) it generates without the prefix cache; a prompt whose chain
    has no kept state attaches nothing."""
    rng = np.random.default_rng(11)
    first = rng.integers(3, 512, 70).tolist()
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True)
    with kestrel_core.load(str(FIXTURES / name), backend="cpu") as engine:
        assert engine.prefix_cache and not engine.rewinds
        answer = [t for t, _ in _served(engine, [first], params)[0]]
        prompts = [first, first + answer + rng.integers(3, 512, 30).tolist(), first[:40] + [7] * 40]
        got = {}
        for cached in (False, True):
            engine.prefix_cache = cached
            engine.pool = engine.decoder.pool = KVPool(engine.config, engine.pool.num_blocks)
            got[cached] = _served(engine, prompts, params)
        hits, states = engine.pool.prefix_hit_tokens, engine.pool.cached_states
    assert got[True] == got[False]
    assert hits == 64  # the second prompt: two blocks, to the first prompt's last whole block short of its end
    assert states == 3  # one a prompt, each at its last whole block


@pytest.mark.parametrize(("budget", "kept"), [(64, 4), (50, 6)])
def test_a_long_system_prompt_is_shared_from_its_last_chunks_end(budget: int, kept: int) -> None:
    """Steps of ``budget`` tokens: prompts of one 150-token system prompt and different questions keep states
    where their chunks end, on whole blocks (64 and 128; 32, 64, 96 and 128 where steps of 50 are cut to whole
    blocks), and at their last whole block (160); the second attaches the system prompt as far as its last
    chunk's end, 128, and generates the bits it generates without the prefix cache."""
    rng = np.random.default_rng(12)
    system = rng.integers(3, 512, 150).tolist()
    prompts = [system + rng.integers(3, 512, 20).tolist() for _ in range(2)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True)
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3_5"), backend="cpu") as engine:
        got = {}
        for cached in (False, True):
            engine.prefix_cache = cached
            engine.pool = engine.decoder.pool = KVPool(engine.config, engine.pool.num_blocks)
            got[cached] = _served(engine, prompts, params, token_budget=budget)
        hits, states = engine.pool.prefix_hit_tokens, engine.pool.cached_states
    assert got[True] == got[False]
    assert hits == 128 and states == kept  # the first's, and 160 of the second


def test_preempted_hybrid_sequences_are_recomputed_with_the_same_tokens() -> None:
    """A cache too small for every sequence preempts some; recomputed from their tokens (a fresh state), they
    give each request's tokens alone."""
    path = str(FIXTURES / "tiny-qwen3_5")
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 512, int(rng.integers(2, 40))).tolist() for _ in range(5)]
    params = SamplingParams(max_tokens=60, temperature=0.8, seed=3, ignore_eos=True)
    with kestrel_core.load(path, backend="cpu") as roomy:
        alone = [list(roomy.generate(p, params=params)) for p in prompts]
    # 512 bytes a position (one attention layer of four): 0.125 MB is 8 blocks of 32 for five sequences of 3
    with kestrel_core.load(path, backend="cpu", kv_cache_mb=0.0625) as tight:
        assert tight.pool.num_blocks == 8
        scheduler = Scheduler(tight, max_batch=5, token_budget=64)
        requests = [scheduler.add(p, params) for p in prompts]
        while scheduler.has_work:
            scheduler.step()
        assert scheduler.preemptions > 0
        assert [r.output_ids for r in requests] == alone
        assert tight.pool.states is not None and len(tight.pool.states._free) == tight.pool.states.slots


@pytest.mark.parametrize(("fields", "error"), [
    ({"linear_key_heads": 2}, "needs linear layers"),
    ({"layer_types": ("linear", "full"), "linear_key_heads": 2, "linear_key_dim": 16, "linear_value_heads": 3,
      "linear_value_dim": 16, "linear_conv_kernel": 4}, "multiple of linear_key_heads"),
    ({"layer_types": ("linear", "full"), "linear_key_heads": 2, "linear_key_dim": 16, "linear_value_heads": 4,
      "linear_value_dim": 16}, "linear_conv_kernel"),
])
def test_linear_attention_config_is_checked(fields: dict, error: str) -> None:
    base = dict(arch="qwen3_5", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=2,
                num_kv_heads=1, head_dim=32)
    with pytest.raises(ValidationError, match=error):
        ModelConfig(**{**base, **fields})


def test_grouped_value_heads_undo_llamacpps_tiling() -> None:
    """llama.cpp's converter turns [key head, value head of it, dim] into [value head of it, key head, dim]
    (_LinearAttentionVReorderBase); kestrel reads it back, along rows or columns, past a q|k prefix."""
    from kestrel_core.model.gguf_reader import grouped_value_heads

    key_heads, per_key, dim, lead = 2, 3, 4, 5
    hf = np.arange(lead + key_heads * per_key * dim, dtype=np.float32)[:, None] * np.ones((1, 7), np.float32)
    heads = hf[lead:].reshape(key_heads, per_key, dim, 7)
    tiled = np.concatenate([hf[:lead], heads.transpose(1, 0, 2, 3).reshape(-1, 7)])
    assert not np.array_equal(tiled, hf)
    np.testing.assert_array_equal(grouped_value_heads(tiled, 0, key_heads, key_heads * per_key, dim), hf)
    np.testing.assert_array_equal(grouped_value_heads(tiled.T[:, lead:], 1, key_heads, key_heads * per_key, dim),
                                  hf.T[:, lead:])


LFM2 = next(c for c in CASES if c.name == "tiny-lfm2")
LFM2_WRONG = {
    "B and C swapped": lambda mp: _get_changed(mp, "conv_in", lambda t: np.concatenate(np.split(t, 3)[1::-1] +
                                                                                        [np.split(t, 3)[2]])),
    "the convolution's taps in reverse": lambda mp: _get_changed(mp, "conv", lambda t: t[..., ::-1].copy()),
}


@pytest.mark.parametrize("wrong", LFM2_WRONG)
def test_lfm2_done_wrong_leaves_the_limits(monkeypatch, wrong: str) -> None:  # type: ignore[no-untyped-def]
    """LFM2's short convolution: C * conv(B * x), its taps oldest first (measured wrong: medians 0.69)."""
    LFM2_WRONG[wrong](monkeypatch)
    fig = measure(LFM2, "q8")
    assert not fig.within(LFM2.limits("q8")), fig


GRANITE = next(c for c in CASES if c.name == "tiny-granite4-h")
GRANITE_WRONG = {
    "RoPE on its attention layer": lambda mp: _with_config(mp, lambda c: {**c, "position_embedding_type": "rope"}),
    "no skip (D left out)": lambda mp: _get_changed(mp, "ssm_d", np.zeros_like),
    "the convolution without its bias": lambda mp: _get_changed(mp, "conv_bias", np.zeros_like),
    # in_proj's rows: z [0, 128), x [128, 256), B [256, 288), C [288, 320), dt [320, 324)
    "the scan's B and C swapped": lambda mp: _get_changed(mp, "mamba_in", lambda t: np.concatenate(
        [t[:256], t[288:320], t[256:288], t[320:]])),
}


@pytest.mark.parametrize("wrong", GRANITE_WRONG)
def test_granite4_h_done_wrong_leaves_the_limits(monkeypatch, wrong: str) -> None:  # type: ignore[no-untyped-def]
    """Granite 4.0-H's attention without RoPE and its Mamba-2 scan: the skip, the convolution's bias, B and C."""
    GRANITE_WRONG[wrong](monkeypatch)
    fig = measure(GRANITE, "q8")
    assert not fig.within(GRANITE.limits("q8")), fig
