"""The engine: generation, teacher-forced logits, backend binding, and the device-forward fallback."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import kestrel_core
from kestrel_core.errors import KestrelError, Overloaded
from kestrel_core.model.presets import synthetic_model

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "backends"

# A device with a whole-step forward (its own KV cache per sequence, computed by kestrel's own decoder on
# the CPU) that declines the calls numbered in DECLINE (1-based), and records what it was offered.
FORWARD_BACKEND = '''
from kestrel_core import API_VERSION, BackendInfo, hookimpl
from kestrel_core.dispatch import Offload
from kestrel_core.model.decoder import Decoder
from kestrel_core.registry import Registry
from kestrel_cpu import kestrel_close, kestrel_gemm_f32, kestrel_gemm_q8, kestrel_open  # noqa: F401

DECLINE = {decline}
CALLS = []
RELEASED = []
STATE = {{}}
_cpu = Registry().cpu()


@hookimpl
def kestrel_backend_info():
    return BackendInfo("fwd", "1", API_VERSION, "gpu")


@hookimpl
def kestrel_forward(device, model, seq_id, tokens, start, all_logits):
    CALLS.append((seq_id, int(start), [int(t) for t in tokens]))
    if len(CALLS) in DECLINE or (DECLINE_FROM and len(CALLS) >= DECLINE_FROM):
        return None
    if seq_id not in STATE:
        dec = Decoder(model, Offload(_cpu, _cpu))
        STATE[seq_id] = (dec, dec.new_cache())
    dec, cache = STATE[seq_id]
    if start > cache.length:
        raise AssertionError(f"offered start {{start}} but the device holds {{cache.length}} positions")
    cache.truncate(start)
    return dec.forward(tokens, cache, all_logits=all_logits)


@hookimpl
def kestrel_release_sequence(device, seq_id):
    RELEASED.append(seq_id)
    STATE.pop(seq_id, None)


@hookimpl
def kestrel_forward_supports(device, model):
    if SUPPORTS == "raise":
        raise RuntimeError("cannot tell")
    return SUPPORTS


DECLINE_FROM = {decline_from}
SUPPORTS = {supports!r}
'''


def _forward_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, decline: set[int] | None = None,
                     decline_from: int = 0, supports: bool | str | None = None) -> None:
    (tmp_path / "fwd.py").write_text(FORWARD_BACKEND.format(decline=decline or set(), decline_from=decline_from,
                                                            supports=supports))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "fwd.py"))


@pytest.fixture
def model(tiny_config):
    return synthetic_model(tiny_config("qwen3", max_position=64), "q8", seed=11)


PROMPT = [104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]  # "hello world"


def _cpu_tokens(model, n: int = 10, activations: str = "q8") -> list[int]:
    """The CPU's tokens (by default with int8 activations, what a whole-step device computes)."""
    with kestrel_core.load(model, backend="cpu", activations=activations) as engine:
        return list(engine.generate(PROMPT, max_tokens=n, stop_at_eos=False))


def test_greedy_generation_is_deterministic_and_follows_the_argmax(model) -> None:
    with kestrel_core.load(model, backend="cpu") as engine:
        first = list(engine.generate(PROMPT, max_tokens=12, stop_at_eos=False))
        again = list(engine.generate(PROMPT, max_tokens=12, stop_at_eos=False))
        assert first == again and len(first) == 12
        assert len(set(first)) > 1  # a random model, not a constant
        teacher = engine.logits(PROMPT + first[:-1], prompt_len=len(PROMPT))
    assert teacher.shape == (len(PROMPT) + 11, model.config.vocab_size)
    assert teacher[len(PROMPT) - 1:].argmax(axis=1).tolist() == first


def test_greedy_tokens_are_identical_with_force_cpu(model, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(FIXTURES / "good_gpu.py"))
    with kestrel_core.load(model, backend="auto") as engine:
        assert engine.backend_name == "good_gpu"  # auto picks the bound accelerator
        offloaded = list(engine.generate(PROMPT, max_tokens=10, stop_at_eos=False))
        gemm = engine.stats["offload"]["kestrel_gemm_q8"]
        assert gemm["accepted"] == gemm["offered"] > 0
    monkeypatch.setenv("KESTREL_FORCE_CPU", "1")
    with kestrel_core.load(model, backend="auto") as engine:
        forced = list(engine.generate(PROMPT, max_tokens=10, stop_at_eos=False))
        gemm = engine.stats["offload"]["kestrel_gemm_q8"]
        assert gemm["accepted"] == 0 and gemm["declined_reasons"] == {"KESTREL_FORCE_CPU": gemm["offered"]}
    assert offloaded == forced == _cpu_tokens(model, activations="mixed")  # auto, for a GEMM-only backend


def test_a_device_forward_that_declines_at_step_3_still_gives_the_cpu_tokens(model, tmp_path, monkeypatch) -> None:
    _forward_backend(tmp_path, monkeypatch, decline={3})
    with kestrel_core.load(model, backend="fwd") as engine:
        tokens = list(engine.generate(PROMPT, max_tokens=10, stop_at_eos=False))
        calls = engine.backend.plugin.CALLS
        fwd = engine.stats["offload"]["kestrel_forward"]
    assert tokens == _cpu_tokens(model)
    assert fwd["offered"] == 10 and fwd["accepted"] == 9 and fwd["declined"] == 1
    n = len(PROMPT)
    assert [(start, len(toks)) for _, start, toks in calls[:5]] == [(0, n), (n, 1), (n + 1, 1),
                                                                    # declined: the host ran all n+3
                                                                    (n + 1, 2),  # the device catches up
                                                                    (n + 3, 1)]
    assert calls[3][2] == [tokens[1], tokens[2]]


def test_a_declined_prefill_is_caught_up_on_the_device_later(model, tmp_path, monkeypatch) -> None:
    _forward_backend(tmp_path, monkeypatch, decline={1})
    with kestrel_core.load(model, backend="fwd") as engine:
        tokens = list(engine.generate(PROMPT, max_tokens=6, stop_at_eos=False))
        calls = engine.backend.plugin.CALLS
    assert tokens == _cpu_tokens(model, 6)
    assert calls[1][1:] == (0, PROMPT + tokens[:1])


def test_a_device_that_stops_accepting_hands_over_to_the_host_cache(model, tmp_path, monkeypatch) -> None:
    _forward_backend(tmp_path, monkeypatch, decline_from=4)
    with kestrel_core.load(model, backend="fwd") as engine:
        tokens = list(engine.generate(PROMPT, max_tokens=10, stop_at_eos=False))
        logits = engine.logits(PROMPT)  # declined too: the host computes every row
        fwd = engine.stats["offload"]["kestrel_forward"]
    assert tokens == _cpu_tokens(model)
    assert fwd["accepted"] == 3 and fwd["declined"] == 8
    with kestrel_core.load(model, backend="cpu", activations="q8") as cpu:
        np.testing.assert_array_equal(logits, cpu.logits(PROMPT))


def test_sequences_are_released_even_when_generation_stops_early(model, tmp_path, monkeypatch) -> None:
    _forward_backend(tmp_path, monkeypatch)
    with kestrel_core.load(model, backend="fwd") as engine:
        plugin = engine.backend.plugin
        gen = engine.generate(PROMPT, max_tokens=10)
        next(gen)
        assert plugin.RELEASED == []
        gen.close()
        engine.logits(PROMPT)
        assert len(plugin.RELEASED) == 2 and plugin.STATE == {}


def test_logits_from_the_device_forward_match_the_host(model, tmp_path, monkeypatch) -> None:
    _forward_backend(tmp_path, monkeypatch)
    with kestrel_core.load(model, backend="fwd") as engine:
        device = engine.logits(PROMPT)
        assert engine.stats["offload"]["kestrel_forward"]["accepted"] == 1
    with kestrel_core.load(model, backend="cpu", activations="q8") as engine:
        np.testing.assert_array_equal(device, engine.logits(PROMPT))


def test_generation_stops_at_eos_and_at_the_context(model) -> None:
    free = _cpu_tokens(model, 10)
    eos = free[3]
    with kestrel_core.load(replace(model, config=replace(model.config, eos_token_ids=(eos,))), "cpu",
                           activations="q8") as engine:
        engine.tokenizer.eos_token_ids = ()
        stopped = list(engine.generate(PROMPT, max_tokens=10))
        assert stopped == free[:free.index(eos) + 1]
        assert list(engine.generate(PROMPT, max_tokens=10, stop_at_eos=False)) == free
    with kestrel_core.load(model, "cpu") as engine:
        prompt = list(range(60))
        assert len(list(engine.generate(prompt, max_tokens=100, stop_at_eos=False))) == 64 - 60  # 64 in all


def test_max_model_len_cuts_the_context_and_no_more(model) -> None:
    with kestrel_core.load(model, backend="cpu", max_model_len=32) as engine:
        assert engine.config.max_position == 32 and engine.model.layers is model.layers  # the weights shared
        with pytest.raises(KestrelError, match="33 tokens; the model's context is 32"):
            engine.generate(list(range(33)))
        assert len(list(engine.generate(list(range(30)), max_tokens=100, stop_at_eos=False))) == 32 - 30
        with pytest.raises(KestrelError, match="32 tokens, which leaves no room for an answer"):
            engine.generate(list(range(32)))
    for bad in (0, 65, 2.5):
        with pytest.raises(KestrelError, match=r"max_model_len must be an integer in \[1, 64\]"):
            kestrel_core.load(model, backend="cpu", max_model_len=bad)


def test_a_rope_scaling_stretches_the_context_as_far_as_it_reaches(model) -> None:
    """YaRN over a pretraining context of 32 with factor 4 makes a context of 128, what max_model_len may ask for;
    a scaling kestrel cannot run, or one that does not fit the model, is one line naming it."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    with kestrel_core.load(model, backend="cpu", rope_scaling=yarn) as engine:
        assert engine.config.max_position == 128 and engine.config.rope_scaling["attention_factor"] > 1
        assert len(list(engine.generate(list(range(100)), max_tokens=40, stop_at_eos=False))) == 28
    with kestrel_core.load(model, backend="cpu", rope_scaling=yarn, max_model_len=96) as engine:
        assert engine.config.max_position == 96
    bad = [({**yarn}, 129, r"max_model_len must be an integer in \[1, 128\]"),
           ({"rope_type": "dynamic", "factor": 2.0}, None, "rope scaling type 'dynamic' is not supported"),
           ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, None,
            "rope_scaling: rope_scaling.short_factor must be a list of"),
           ([1, 2], None, "rope_scaling must be an object")]
    for scaling, length, says in bad:
        with pytest.raises(KestrelError, match=says):
            kestrel_core.load(model, backend="cpu", rope_scaling=scaling, max_model_len=length)


def test_bad_requests_are_one_line_errors(model, monkeypatch) -> None:
    with kestrel_core.load(model, backend="cpu") as engine:
        with pytest.raises(KestrelError, match="65 tokens; the model's context is 64"):
            engine.generate(list(range(65)))
        with pytest.raises(KestrelError, match="empty"):
            engine.logits([])
        with pytest.raises(KestrelError, match="outside the vocabulary"):
            engine.generate([model.config.vocab_size])
        with pytest.raises(KestrelError, match="top_p"):
            engine.generate(PROMPT, temperature=1.0, top_p=0.0)
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(FIXTURES / "unavailable.py"))
    with pytest.raises(KestrelError, match="no widget attached"):
        kestrel_core.load(model, backend="unavailable")
    with kestrel_core.load(model, backend="auto") as engine:  # an npu that did not bind: auto takes the cpu
        assert engine.backend_name == "cpu"


def test_stats_report_the_run_and_the_offload_counters(model) -> None:
    with kestrel_core.load(model, backend="cpu", activations="q8") as engine:
        out = list(engine.generate(PROMPT, max_tokens=5, stop_at_eos=False))
        stats = engine.stats
    assert stats["prompt_tokens"] == len(PROMPT) and stats["generated_tokens"] == len(out) == 5
    assert stats["prefill_tok_s"] > 0 and stats["decode_tok_s"] > 0 and stats["backend"] == "cpu"
    layers = model.config.num_layers
    # per step: a QKV and a gate/up fused call (3 + 2 GEMMs on the CPU), o, down per layer, then lm_head
    assert stats["offload"]["kestrel_gemm_q8"]["offered"] == 5 * (7 * layers + 1)


def test_prompt_logprobs_score_each_token_by_the_logits_before_it(model, monkeypatch) -> None:
    from kestrel_core.model import engine as engine_module

    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", 7)  # several chunks: the scores run on across them
    ids = list(range(3, 23))
    with kestrel_core.load(model, "cpu") as engine:
        scored = engine.prompt_logprobs(ids, top=2)
        logits = engine.logits(ids).astype(np.float64)
        assert engine.prompt_logprobs(ids[:1]) == []  # a single token: nothing before it
    ref = logits - logits.max(axis=1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(axis=1, keepdims=True))
    assert [s.token_id for s in scored] == ids[1:]
    np.testing.assert_allclose([s.logprob for s in scored], [ref[t, ids[t + 1]] for t in range(len(ids) - 1)],
                               atol=1e-5)
    assert [s.top[0][0] for s in scored] == [int(np.argmax(ref[t])) for t in range(len(ids) - 1)]
    assert all(len(s.top) == 2 for s in scored)


def test_scoring_with_no_room_in_the_shared_cache_is_overloaded(model) -> None:
    """The pool is a scheduler's too: a prompt scored while its sequences hold the blocks waits its turn."""
    with kestrel_core.load(model, backend="cpu") as engine:
        held = engine.new_sequence()
        assert engine.pool.reserve(held.cache, engine.pool.capacity)
        with pytest.raises(Overloaded, match="no room"):
            engine.prompt_logprobs([1, 2, 3])
        engine.release(held)
        assert len(engine.prompt_logprobs([1, 2, 3])) == 2
        assert engine.pool.free_blocks == engine.pool.num_blocks
    from kestrel_core.model.kv_pool import BLOCK_SIZE, bytes_per_position

    one_block = bytes_per_position(model.config) * BLOCK_SIZE / 2 ** 20
    with kestrel_core.load(model, backend="cpu", kv_cache_mb=one_block) as engine:  # fewer positions than the context
        n = engine.pool.capacity + 1
        assert n <= model.config.max_position
        with pytest.raises(KestrelError, match=f"holds {engine.pool.capacity}") as info:
            engine.logits(list(range(n)))
        assert not isinstance(info.value, Overloaded)  # no retry makes it fit


def test_an_int8_kv_cache_is_the_hosts(model, tmp_path, monkeypatch) -> None:
    """A backend that runs whole steps keeps float16 keys and values of its own: asking it for the host's int8
    cache is an error with that reason; with the steps on the host (float32 activations) the pool holds int8."""
    _forward_backend(tmp_path, monkeypatch)
    with pytest.raises(KestrelError, match="fwd backend runs whole steps on a float16 KV cache of its own"):
        kestrel_core.load(model, backend="fwd", kv_cache_type="q8")
    with kestrel_core.load(model, backend="fwd", kv_cache_type="q8", activations="f32") as engine:
        assert engine.pool.kv_type == "q8" and engine.pool.kt.dtype == np.int8
        tokens = list(engine.generate(PROMPT, max_tokens=6, stop_at_eos=False))
        assert len(tokens) == 6 and "kestrel_forward" not in engine.stats["offload"]


@pytest.mark.parametrize("supports", [False, None, "raise"])
def test_a_backend_that_cannot_run_a_model_whole_is_not_offered_its_steps(model, tmp_path, monkeypatch, caplog,
                                                                          supports) -> None:
    """``kestrel_forward_supports`` False at load: the host runs the steps (the prefix cache, draft tokens and
    the host's int8 KV cache with them) and no step is offered to be declined; None, or an error (reported),
    and the whole steps are offered as before."""
    _forward_backend(tmp_path, monkeypatch, supports=supports)
    with kestrel_core.load(model, backend="fwd") as engine:
        tokens = list(engine.generate(PROMPT, max_tokens=6, stop_at_eos=False))
        offload = engine.stats["offload"]
        state = (engine.whole_step, engine.steps_on_host, engine.prefix_cache, engine.rewinds)
    assert tokens == _cpu_tokens(model, 6)
    if supports is False:
        assert state == (False, True, True, True) and "kestrel_forward" not in offload
        with kestrel_core.load(model, backend="fwd", kv_cache_type="q8") as engine:
            assert engine.pool.kv_type == "q8"
    else:
        assert state[:2] == (True, False) and offload["kestrel_forward"]["accepted"] > 0
        assert ("kestrel_forward_supports error: RuntimeError: cannot tell" in caplog.text) == (supports == "raise")


def test_misuse_of_the_api_is_a_kestrel_error_naming_it(model) -> None:
    """Text where token ids go, a dict for SamplingParams, max_tokens 0, an out-of-range ``top``, bad load
    arguments, and any request after close(): each a KestrelError that says what is wrong."""
    from kestrel_core.model.sampling import SamplingParams

    engine = kestrel_core.load(model, backend="cpu")
    # an iterator would be used up by the check (then "empty"), a set has no order, bytes are text
    for prompt in ("hello", None, [1.5, 2.0], np.array([[1, 2]]), [True], iter(PROMPT), (t for t in PROMPT),
                   set(PROMPT), b"hello", bytearray(b"hello")):
        with pytest.raises(KestrelError, match="must be a sequence of token ids"):
            list(engine.generate(prompt, max_tokens=2))
    for stop_at_eos in ("no", None, 0):  # ``not "no"`` is False: it would stop at the end of text
        with pytest.raises(KestrelError, match="stop_at_eos must be a boolean"):
            list(engine.generate(PROMPT, max_tokens=2, stop_at_eos=stop_at_eos))
    with pytest.raises(KestrelError, match="max_tokens must be at least 1"):
        list(engine.generate(PROMPT, max_tokens=0))
    with pytest.raises(KestrelError, match="params must be a SamplingParams"):
        list(engine.stream(PROMPT, {"max_tokens": 2}))
    for prompt_len in (-1, len(PROMPT) + 1, "a"):
        with pytest.raises(KestrelError, match=r"prompt_len must be an integer in \[0, "):
            engine.logits(PROMPT, prompt_len=prompt_len)
    with pytest.raises(KestrelError, match=r"top must be an integer in \[0, 20\]"):
        engine.prompt_logprobs(PROMPT, top=-1)
    with pytest.raises(KestrelError, match="tuple of non-empty strings"):
        SamplingParams(stop=["x"]).check()
    for ids in (np.array(PROMPT), tuple(PROMPT), range(3, 9)):  # an integer array, any sequence: token ids
        assert len(list(engine.generate(ids, max_tokens=2))) == 2
    engine.close()
    engine.close()
    for use in (lambda: list(engine.generate(PROMPT, max_tokens=2)), lambda: engine.logits(PROMPT),
                lambda: engine.embed([PROMPT])):
        with pytest.raises(KestrelError, match="the engine is closed"):
            use()
    for kwargs, needle in (({"kv_cache_mb": "64"}, "number of MB"), ({"kv_cache_mb": float("inf")}, "number of MB"),
                           ({"kv_cache_mb": True}, "number of MB"), ({"kv_cache_mb": 1e12}, "this machine's memory"),
                           ({"backend_options": ["a=b"]}, "backend_options must map"), ({"lora": 5}, "lora must be")):
        with pytest.raises(KestrelError, match=needle):
            kestrel_core.load(model, backend="cpu", **kwargs)


def test_closing_the_engine_ends_its_streams_under_way(model) -> None:
    """A stream taken before close() ran its next steps on the closed backends (a TypeError from a hook that is
    gone, or tokens from a device that released its memory); it ends with a KestrelError, its blocks freed."""
    from kestrel_core.model.sampling import SamplingParams

    engine = kestrel_core.load(model, backend="cpu")
    running = engine.generate(PROMPT, max_tokens=20, stop_at_eos=False)
    next(running)
    untouched = engine.stream(PROMPT, SamplingParams(max_tokens=4))
    engine.close()
    for stream in (running, untouched):
        with pytest.raises(KestrelError, match="the engine was closed while the request ran"):
            next(stream)
    assert engine.pool.free_blocks == engine.pool.num_blocks


def test_a_model_path_may_be_a_path_object() -> None:
    tiny = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-llama"
    with kestrel_core.load(tiny, backend="cpu") as by_path, kestrel_core.load(str(tiny), backend="cpu") as by_text:
        assert list(by_path.generate([1, 2, 3], max_tokens=4)) == list(by_text.generate([1, 2, 3], max_tokens=4))
    with pytest.raises(KestrelError, match="cannot load a model from bytes"):
        kestrel_core.load(bytes(tiny), backend="cpu")


def test_a_steps_tokens_are_token_ids_in_the_vocabulary(model, tmp_path, monkeypatch) -> None:
    """``run_batch`` cut a float to an integer ([1.5] ran token 1), took a bool for 0 or 1, and failed on text with
    int()'s ValueError; an id past the vocabulary, or logit rows of the wrong type, or fewer argmax_only flags than
    sequences (zip left the rest out), reached the step. Each is a KestrelError before anything runs."""
    with kestrel_core.load(model, backend="cpu", activations="q8") as engine:  # logits' prompt: no float32 rows
        want = engine.logits(PROMPT[:3])[-1]
        for ids in ([1.5], [1.0, 2.0], np.array([1.0]), "ab", b"ab", [True], [PROMPT[0], False], [[1, 2]],
                    np.array([[1, 2]]), {1: 2}):
            seq = engine.new_sequence()
            with pytest.raises(KestrelError, match="a step's new tokens must be a sequence of token ids"):
                engine.run_batch([(seq, ids, 1)])
            assert seq.tokens == [] and seq.cache.length == 0
        for ids in ([-1], [model.config.vocab_size], np.array([2**40])):
            with pytest.raises(KestrelError, match=r"is outside the vocabulary \[0, 320\)"):
                engine.run_batch([(engine.new_sequence(), ids, 1)])
        for rows in (1.5, True, "1", -1, 4):
            with pytest.raises(KestrelError, match=r"logit rows .* outside \[0, 3\]"):
                engine.run_batch([(engine.new_sequence(), PROMPT[:3], rows)])
        with pytest.raises(KestrelError, match="argmax_only has 1 flags for 2 sequences"):
            engine.run_batch([(engine.new_sequence(), PROMPT[:3], 1), (engine.new_sequence(), PROMPT[:3], 1)], [False])
        for ids in (PROMPT[:3], tuple(PROMPT[:3]), np.array(PROMPT[:3], np.int32), [np.int64(t) for t in PROMPT[:3]],
                    np.array(PROMPT[:3], np.uint16)):  # numpy's integers are token ids
            np.testing.assert_array_equal(engine.run_batch([(engine.new_sequence(), ids, 1)])[0][-1], want)
    _forward_backend(tmp_path, monkeypatch)  # a device's whole step is never offered an id past the vocabulary
    with kestrel_core.load(model, backend="fwd", activations="q8") as engine:
        with pytest.raises(KestrelError, match="is outside the vocabulary"):
            engine.run_batch([(engine.new_sequence(), [model.config.vocab_size], 1)])
        assert engine.backend.plugin.CALLS == []


def test_a_rewind_is_to_a_length_the_sequence_has(model, tmp_path, monkeypatch) -> None:
    """``rewind(seq, -1)`` dropped the last token, then said that positions below 0 were a shared prefix; a float
    was a TypeError from a slice. A rewind where sequences cannot rewind left the device's positions behind."""
    with kestrel_core.load(model, backend="cpu", activations="q8") as engine:
        seq = engine.new_sequence()
        engine.run_batch([(seq, PROMPT[:4], 1)])
        for length in (-1, 5, 1.5, "2", True, None):
            with pytest.raises(KestrelError, match=r"a rewind's length must be an integer in \[0, 4\] \(the "):
                engine.rewind(seq, length)
            assert seq.tokens == PROMPT[:4] and seq.cache.length == 4
        engine.rewind(seq, 4)  # nothing to forget
        engine.rewind(seq, np.int64(2))
        again = engine.run_batch([(seq, [PROMPT[5]], 1)])[0][-1]
        np.testing.assert_allclose(again, engine.logits(PROMPT[:2] + [PROMPT[5]])[-1], atol=1e-4)
    _forward_backend(tmp_path, monkeypatch)  # a 1.0 whole step: its device keeps every position it ran
    with kestrel_core.load(model, backend="fwd", activations="q8") as engine:
        assert not engine.rewinds
        seq = engine.new_sequence()
        engine.run_batch([(seq, PROMPT[:4], 1)])
        with pytest.raises(KestrelError, match=r"cannot rewind \(Engine.rewinds\)"):
            engine.rewind(seq, 2)
        assert seq.tokens == PROMPT[:4] and seq.device_len == 4
        engine.rewind(seq, 4)


def test_quant_is_checked_for_every_kind_of_model(model) -> None:
    """A Model in memory ignored any quant (5, [] or "q9"); a path took a falsy one (0, "") for the default."""
    tiny = str(Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-llama")
    for source in (model, tiny, "Qwen/Qwen3-0.6B"):  # a Hub name fails before anything is fetched
        for quant in (5, 0, [], b"q8", 8.0):
            with pytest.raises(KestrelError, match=r"quant must be the name of a quant mode \(q8, q4, "):
                kestrel_core.load(source, backend="cpu", quant=quant)
        for quant in ("", "q9"):
            with pytest.raises(KestrelError, match=r"unknown quant mode '(q9)?': valid modes are q8, q4"):
                kestrel_core.load(source, backend="cpu", quant=quant)
    with kestrel_core.load(model, backend="cpu", quant="Q8") as engine:  # a mode's name in any case
        assert engine.model is model
    from kestrel_core.model.engine_load import load_preset

    for quant in (0, 5):
        with pytest.raises(KestrelError, match="quant must be the name of a quant mode"):
            load_preset("smollm2-135m", backend="cpu", quant=quant, num_layers=1)
    with pytest.raises(KestrelError, match="rerank must be true or false, got 'no'"):
        kestrel_core.load(model, backend="cpu", rerank="no")


def test_a_sequences_prompt_len_is_a_non_negative_integer(model) -> None:
    """``new_sequence(prompt_len=1.5)``, a negative one or a bool were taken as they were (the prompt's float32
    rows and the prefix cache read it)."""
    with kestrel_core.load(model, backend="cpu") as engine:
        for prompt_len in (1.5, -1, True, "3", None):
            with pytest.raises(KestrelError, match=r"new_sequence's prompt_len must be a non-negative integer, got "):
                engine.new_sequence(prompt_len=prompt_len)
        assert engine.new_sequence(prompt_len=np.int64(3)).cache.prompt_len == 3


def test_a_step_runs_at_least_one_token_of_each_sequence(model, tmp_path, monkeypatch) -> None:
    """An empty token list failed on the host ("no tokens to run") but was handed to a device's whole step."""
    _forward_backend(tmp_path, monkeypatch)
    for backend in ("cpu", "fwd"):
        with kestrel_core.load(model, backend=backend, activations="q8") as engine:
            for empty in ([], (), np.array([], np.int64)):
                seq = engine.new_sequence()
                with pytest.raises(KestrelError, match="a step's new tokens are empty: each sequence in a step runs"):
                    engine.run_batch([(seq, empty, 0)])
                assert seq.tokens == [] and seq.cache.length == 0 and seq.device_len == 0
            if backend == "fwd":
                assert engine.backend.plugin.CALLS == []


def test_a_step_takes_triples_of_this_engines_sequences(model) -> None:
    """A work entry of two or four items was a raw unpacking ValueError, and another engine's sequence (its own
    seq_id and KV blocks) ran here, as did its rewind and release."""
    with kestrel_core.load(model, backend="cpu") as engine, kestrel_core.load(model, backend="cpu") as other:
        seq = engine.new_sequence(3)  # a prompt's float32 rows, as logits' are
        for entry in ((seq, PROMPT[:3]), [seq, PROMPT[:3], 1, 0], seq, None):
            with pytest.raises(KestrelError, match=r"a step's work entry must be a \(sequence, new tokens, logit "):
                engine.run_batch([entry])
        stranger = other.new_sequence()
        other.run_batch([(stranger, PROMPT[:3], 1)])
        for use, what in ((lambda: engine.run_batch([(seq, PROMPT[:3], 1), (stranger, [PROMPT[3]], 1)]), "a step"),
                          (lambda: engine.rewind(stranger, 1), "rewind"),
                          (lambda: engine.release(stranger), "release")):
            with pytest.raises(KestrelError, match=f"^{what} takes a sequence of this engine's new_sequence\\(\\), "
                                                   "got another engine's sequence$"):
                use()
        assert seq.tokens == [] and stranger.tokens == PROMPT[:3] and stranger.cache.length == 3
        with pytest.raises(KestrelError, match=r"a step takes a sequence of this engine's new_sequence\(\), got int"):
            engine.run_batch([(3, PROMPT[:3], 1)])
        other.rewind(stranger, 1)
        other.release(stranger)
        np.testing.assert_array_equal(engine.run_batch([(seq, PROMPT[:3], 1)])[0], other.logits(PROMPT[:3])[-1:])


def test_a_quant_a_model_in_memory_does_not_hold_is_a_warning(model, tiny_config, caplog) -> None:
    """``load(model, quant="q4")`` on a q8 Model used its q8 weights without a word (an artifact's load warns)."""
    for quant, warned in (("q4", "in-memory model holds q8 weights; using them (a model in memory is not "
                                 "re-quantized, quant q4 ignored)"), ("Q8", None), ("q8-g256", None)):
        caplog.clear()  # no tensor of the tiny model is 256 wide: q8-g256 gives it q8's blocks
        with caplog.at_level("WARNING", logger="kestrel"), kestrel_core.load(model, backend="cpu", quant=quant):
            pass
        assert [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()] == ([warned] if warned else [])
    wide = synthetic_model(tiny_config("llama", hidden_size=256, intermediate_size=256, head_dim=64), "q8-g256")
    for quant, warned in (("q8", True), ("q8-g256", False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="kestrel"), kestrel_core.load(wide, backend="cpu", quant=quant):
            pass
        assert ("holds q8-g256 weights" in caplog.text) == warned
