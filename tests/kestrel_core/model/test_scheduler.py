"""Continuous batching: batched results equal each request alone, chunked prefill, preemption, stops, aborts."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kestrel_core
from kestrel_core.errors import InvalidRequest, KestrelError, Overloaded
from kestrel_core.model.presets import synthetic_model
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.scheduler import Scheduler
from kestrel_core.model.weights import PREFILL_CHUNK


def _prompts(n: int, vocab: int, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(2, 40))).tolist() for _ in range(n)]


def _alone(engine, prompt: list[int], params: SamplingParams) -> list[int]:
    return list(engine.generate(prompt, params=params))


def _run_all(scheduler: Scheduler, requests: list) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while scheduler.has_work:
        for out in scheduler.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


def _count_rows(engine, monkeypatch) -> list[int]:
    """Rows of every engine step, recorded."""
    rows: list[int] = []
    original = type(engine).start_batch

    def recording(self, work, argmax_only=()):
        rows.append(len(work))
        return original(self, work, argmax_only)

    monkeypatch.setattr(type(engine), "start_batch", recording)
    return rows


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_tokens_equal_each_request_alone(engine, monkeypatch, temperature: float) -> None:
    prompts = _prompts(6, engine.config.vocab_size)
    params = [SamplingParams(max_tokens=12 + 3 * i, temperature=temperature, seed=40 + i, top_k=20 * (i % 2),
                             ignore_eos=True) for i in range(6)]
    alone = [_alone(engine, p, s) for p, s in zip(prompts, params)]
    rows = _count_rows(engine, monkeypatch)
    scheduler = Scheduler(engine, max_batch=6, token_budget=16)  # prompts split into chunks beside decodes
    requests = [scheduler.add(p, s) for p, s in zip(prompts, params)]
    got = _run_all(scheduler, requests)
    assert [got[r.request_id] for r in requests] == alone
    assert max(rows) >= 5  # really batched
    assert engine.pool.free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("fixture", ["tiny-gemma3", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-qwen3_5",
                                     "tiny-qwen3_5-moe", "tiny-lfm2", "tiny-granite4-h-moe", "tiny-deepseek-v3"])
def test_batched_tokens_equal_alone_with_windows_and_experts(monkeypatch, fixture: str) -> None:
    """Gemma 3's per-layer windows and RoPE, the routing of a mixture of experts (rows grouped by expert),
    Qwen3.5's recurrent states (more sequences than the state pool's first slots) and a latent attention's absorbed
    projections keep a row's result independent of its batch: batched, chunked tokens are each request's alone."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "fixtures" / "models" / fixture
    with kestrel_core.load(str(path), backend="cpu") as engine:
        prompts = _prompts(5, engine.config.vocab_size, seed=8)
        params = [SamplingParams(max_tokens=10 + 2 * i, temperature=0.7, seed=i, ignore_eos=True) for i in range(5)]
        alone = [_alone(engine, p, s) for p, s in zip(prompts, params)]
        rows = _count_rows(engine, monkeypatch)
        scheduler = Scheduler(engine, max_batch=5, token_budget=12)
        requests = [scheduler.add(p, s) for p, s in zip(prompts, params)]
        got = _run_all(scheduler, requests)
    assert [got[r.request_id] for r in requests] == alone
    assert max(rows) >= 4


def test_requests_join_and_leave_at_any_step(engine) -> None:
    prompts = _prompts(5, engine.config.vocab_size, seed=4)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    alone = [_alone(engine, p, params) for p in prompts]
    scheduler = Scheduler(engine, max_batch=3, token_budget=8)
    requests, tokens = [], {}
    for step in range(200):
        if step % 4 == 0 and len(requests) < len(prompts):
            requests.append(scheduler.add(prompts[len(requests)], params))
            tokens[requests[-1].request_id] = []
        for out in scheduler.step():
            tokens[out.request_id].extend(out.new_token_ids)
        if len(requests) == len(prompts) and not scheduler.has_work:
            break
    assert [tokens[r.request_id] for r in requests] == alone


@pytest.mark.parametrize("budget", [None, PREFILL_CHUNK])
def test_default_budget_takes_a_whole_prompt_chunk_beside_a_full_batch(tiny_config, budget: int | None) -> None:
    """A prompt of PREFILL_CHUNK tokens that arrives while max_batch - 1 requests decode gets its first token
    from one step under the default budget; a budget of PREFILL_CHUNK alone needs a second step."""
    model = synthetic_model(tiny_config("qwen3", max_position=PREFILL_CHUNK + 64), "q8", seed=22)
    with kestrel_core.load(model, backend="cpu") as engine:
        scheduler = Scheduler(engine, max_batch=4, token_budget=budget)
        decoding = [scheduler.add(p, SamplingParams(max_tokens=30, ignore_eos=True))
                    for p in _prompts(3, model.config.vocab_size, seed=8)]
        while any(not r.output_ids for r in decoding):
            scheduler.step()
        rng = np.random.default_rng(9)
        probe = scheduler.add(rng.integers(0, model.config.vocab_size, PREFILL_CHUNK).tolist(),
                              SamplingParams(max_tokens=1))
        steps = 1
        while not any(o.request_id == probe.request_id for o in scheduler.step()):
            steps += 1
        assert steps == (1 if budget is None else 2)
        assert all(not r.finished for r in decoding)
        scheduler.close()


def test_preempted_sequences_are_recomputed_with_the_same_tokens(model) -> None:
    prompts = _prompts(5, model.config.vocab_size, seed=5)
    params = SamplingParams(max_tokens=60, temperature=0.7, seed=9, ignore_eos=True)
    with kestrel_core.load(model, backend="cpu") as roomy:
        alone = [_alone(roomy, p, params) for p in prompts]
    # 1 KiB a position here: 0.25 MB is 8 blocks of 32, for five sequences that need 3 blocks each
    with kestrel_core.load(model, backend="cpu", kv_cache_mb=0.125) as tight:
        assert tight.pool.num_blocks == 8
        scheduler = Scheduler(tight, max_batch=5, token_budget=64)
        requests = [scheduler.add(p, params) for p in prompts]
        got = _run_all(scheduler, requests)
        assert scheduler.preemptions > 0
        assert [got[r.request_id] for r in requests] == alone
        assert tight.pool.free_blocks == tight.pool.num_blocks


def test_a_preempted_request_attaching_its_own_blocks_again_is_no_prefix_cache_hit(model) -> None:
    """Prompts that share nothing have no prefix-cache hit, however often they are preempted and find their own
    blocks again (vLLM counts a request's hits on its first admission only)."""
    prompts = [[(7 * i + j) % model.config.vocab_size for j in range(40)] for i in range(4)]  # a block and a part
    params = SamplingParams(max_tokens=100, temperature=0.7, seed=9, ignore_eos=True)
    with kestrel_core.load(model, backend="cpu", kv_cache_mb=0.125) as tight:  # 8 blocks of 32, as above
        scheduler = Scheduler(tight, max_batch=4, token_budget=64)
        attached: list[int] = []
        admit = tight.new_sequence

        def counting(*args):  # type: ignore[no-untyped-def]
            seq = admit(*args)
            attached.append(len(seq.tokens))
            return seq

        tight.new_sequence = counting
        _run_all(scheduler, [scheduler.add(p, params) for p in prompts])
        assert scheduler.preemptions > 0 and sum(attached) > 0  # preempted requests found their blocks again
        assert tight.pool.prefix_hit_tokens == 0


class _Letters:
    """Each id decodes to one letter: readable text from a random model."""

    eos_token_ids = ()

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


def test_stop_strings_stop_tokens_and_max_tokens(engine) -> None:
    engine.tokenizer = _Letters()
    prompt = _prompts(1, engine.config.vocab_size, seed=6)[0]
    free = list(engine.stream(prompt, SamplingParams(max_tokens=20, ignore_eos=True)))
    text = "".join(o.new_text for o in free)
    ids = [t for o in free for t in o.new_token_ids]
    assert free[-1].finish_reason == "length" and len(ids) == 20
    start = next(i for i in range(3, 15) if text.index(text[i:i + 3]) == i)
    stop = text[start:start + 3]
    outs = list(engine.stream(prompt, SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,))))
    assert "".join(o.new_text for o in outs) == text[:start] and outs[-1].finish_reason == "stop"
    assert sum(len(o.new_token_ids) for o in outs) == start + 3  # it ended on the stop string's last token
    outs = list(engine.stream(prompt, SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(ids[7],))))
    got = [t for o in outs for t in o.new_token_ids]
    assert got == ids[:ids.index(ids[7]) + 1] and outs[-1].finish_reason == "stop"
    # the stop token is counted, its text is not the answer's (vLLM's)
    assert "".join(o.new_text for o in outs) == engine.tokenizer.decode(got[:-1])


def test_min_tokens_holds_back_the_end_stop_tokens_and_stop_strings(engine) -> None:
    """vLLM's min_tokens: the end of text and the stop token ids are not sampled, and a stop string does not end
    the answer, before the min_tokens-th token; after it, each stops the answer again."""
    engine.tokenizer = _Letters()
    prompt = _prompts(1, engine.config.vocab_size, seed=6)[0]
    ids = list(engine.generate(prompt, params=SamplingParams(max_tokens=20, ignore_eos=True)))
    first = ids[0]
    stopped = list(engine.generate(prompt, params=SamplingParams(max_tokens=20, stop_token_ids=(first,))))
    assert stopped == [first]
    held = list(engine.generate(prompt, params=SamplingParams(max_tokens=20, min_tokens=6, stop_token_ids=(first,))))
    assert first not in held[:5] and len(held) >= 6 and (held[-1] == first or len(held) == 20)
    eos = sorted(engine.eos_token_ids)[0]
    no_end = list(engine.generate(prompt, params=SamplingParams(max_tokens=12, min_tokens=12, stop_token_ids=(eos,))))
    assert len(no_end) == 12 and eos not in no_end[:11]
    text = "".join(_Letters().decode([t]) for t in ids)
    stop = text[0:2]  # at the very start: without min_tokens the answer is empty
    outs = list(engine.stream(prompt, SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,))))
    assert "".join(o.new_text for o in outs) == ""
    outs = list(engine.stream(prompt, SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,), min_tokens=3)))
    later = text.find(stop, 2)
    want = text[:later] if 0 <= later < 20 else text
    assert "".join(o.new_text for o in outs) == want


def test_logprobs_come_with_each_token(engine) -> None:
    prompt = _prompts(1, engine.config.vocab_size, seed=7)[0]
    outs = list(engine.stream(prompt, SamplingParams(max_tokens=4, logprobs=True, top_logprobs=3, ignore_eos=True)))
    for out in outs:
        (lp,) = out.logprobs
        assert lp.token_id == out.new_token_ids[0] and len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id and lp.top[0][1] == lp.logprob <= 0  # greedy: the most likely
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_an_aborted_request_frees_its_sequence_and_the_others_go_on(engine) -> None:
    prompts = _prompts(2, engine.config.vocab_size, seed=8)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    alone = _alone(engine, prompts[1], params)
    scheduler = Scheduler(engine, max_batch=2)
    first, second = scheduler.add(prompts[0], params), scheduler.add(prompts[1], params)
    tokens: list[int] = []
    for _ in range(3):
        tokens += [t for o in scheduler.step() if o.request_id == second.request_id for t in o.new_token_ids]
    scheduler.abort(first.request_id)
    assert first.finished and first.finish_reason == "abort" and scheduler.num_running == 1
    outputs = scheduler.step()  # the next step says the aborted request ended
    ended = [o for o in outputs if o.request_id == first.request_id]
    assert len(ended) == 1 and ended[0].finished and ended[0].finish_reason == "abort"
    tokens += [t for o in outputs if o.request_id == second.request_id for t in o.new_token_ids]
    tokens += _run_all(scheduler, [second])[second.request_id]
    assert tokens == alone
    assert engine.pool.free_blocks == engine.pool.num_blocks


def test_choices_of_one_prompt_compute_it_once(model, engine, monkeypatch) -> None:
    """n requests of one prompt: the first computes it, the others wait for it and attach its full blocks."""
    prompt = _prompts(1, engine.config.vocab_size)[0][:8] * 10  # 80 tokens: two full blocks and a part
    params = [SamplingParams(max_tokens=6, temperature=0.9, seed=3 + i, ignore_eos=True) for i in range(3)]
    with kestrel_core.load(model, backend="cpu") as other:  # its own cache: nothing published in this one's
        alone = [_alone(other, prompt, p) for p in params]
    hits = engine.pool.prefix_hit_tokens
    computed: list[int] = []
    original = type(engine).start_batch

    def counting(self, work, argmax_only=()):  # prompt positions each step computes
        computed.append(sum(len(toks) for _, toks, _ in work if toks is not None and len(toks) > 1))
        return original(self, work, argmax_only)

    monkeypatch.setattr(type(engine), "start_batch", counting)
    scheduler = Scheduler(engine, max_batch=4)
    requests = [scheduler.add(prompt, p) for p in params]
    got = _run_all(scheduler, requests)
    assert [got[r.request_id] for r in requests] == alone
    assert engine.pool.prefix_hit_tokens - hits == 2 * 64
    assert sum(computed) == 80 + 2 * 16  # the prompt once, then each twin's last part block


def test_a_logit_bias_steers_greedy_tokens_and_keeps_them_off_the_device_argmax(engine) -> None:
    prompt = _prompts(1, engine.config.vocab_size)[0]
    free = _alone(engine, prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    forced = SamplingParams(max_tokens=4, ignore_eos=True, logit_bias=((7, 100.0),))
    assert _alone(engine, prompt, forced) == [7, 7, 7, 7] != free
    barred = _alone(engine, prompt, SamplingParams(max_tokens=4, ignore_eos=True, logit_bias=((free[0], -100.0),)))
    assert barred[0] != free[0]
    scheduler = Scheduler(engine)
    assert not scheduler.add(prompt, forced).argmax_only and scheduler.add(prompt, SamplingParams()).argmax_only
    for request in list(scheduler.requests.values()):
        scheduler.abort(request.request_id)
    scheduler.step()


def test_requests_that_cannot_run_are_refused_and_a_full_queue_is_overloaded(model) -> None:
    with kestrel_core.load(model, backend="cpu", kv_cache_mb=0.0625) as engine:  # 4 blocks: 128 positions
        scheduler = Scheduler(engine, max_batch=1, max_waiting=1)
        with pytest.raises(InvalidRequest, match="KV cache holds 128") as info:
            scheduler.add(list(range(150)), SamplingParams())
        assert info.value.param == "prompt"
        with pytest.raises(InvalidRequest, match="context is 160"):
            scheduler.add([1] * 161, SamplingParams())
        with pytest.raises(InvalidRequest, match="top_p"):
            scheduler.add([1, 2], SamplingParams(top_p=0))
        with pytest.raises(InvalidRequest, match="outside the vocabulary") as info:
            scheduler.add([1, 2], SamplingParams(logit_bias=((engine.config.vocab_size, 1.0),)))
        assert info.value.param == "logit_bias"
        scheduler.add([1, 2], SamplingParams(max_tokens=3))
        scheduler.step()  # the first runs
        scheduler.add([3, 4], SamplingParams(max_tokens=3))  # the second waits
        with pytest.raises(Overloaded, match="capacity"):
            scheduler.add([5, 6], SamplingParams())


def test_a_scheduler_of_a_bad_size_is_a_one_line_error(model) -> None:
    """Its sizes are integers (a str was a TypeError of a comparison, 2.5 a batch taken), and so an AsyncEngine's."""
    with kestrel_core.load(model, backend="cpu") as engine:
        for kwargs, says in (({"max_batch": "4"}, "max_batch must be an integer, got '4'"),
                             ({"max_batch": 2.5}, "max_batch must be an integer, got 2.5"),
                             ({"max_batch": 0}, "max_batch must be an integer in [1, 4096], got 0"),
                             ({"max_batch": 4097}, "max_batch must be an integer in [1, 4096], got 4097"),
                             ({"max_waiting": -1}, "max_waiting must be an integer in [0, 65536], got -1"),
                             ({"max_waiting": 65537}, "max_waiting must be an integer in [0, 65536], got 65537"),
                             ({"max_waiting": None}, "max_waiting must be an integer, got None"),
                             ({"token_budget": "64"}, "token_budget must be an integer, got '64'"),
                             ({"token_budget": 0}, "token_budget must be an integer in [1, 65536], got 0"),
                             ({"token_budget": 65537}, "token_budget must be an integer in [1, 65536], got 65537")):
            for make in (Scheduler, kestrel_core.AsyncEngine):
                with pytest.raises(KestrelError, match=re.escape(says)):
                    make(engine, **kwargs)
        assert Scheduler(engine, max_batch=np.int64(3), token_budget=None).token_budget == 3 + PREFILL_CHUNK


def test_a_sequence_that_outgrows_the_whole_cache_ends_with_length(model) -> None:
    with kestrel_core.load(model, backend="cpu", kv_cache_mb=0.03125) as engine:  # 2 blocks: 64 positions
        outs = list(engine.stream([1, 2, 3], SamplingParams(max_tokens=100, ignore_eos=True)))
        assert outs[-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in outs) == 64 - 3 + 1
        assert engine.pool.free_blocks == engine.pool.num_blocks


def test_requests_taken_in_by_on_start_run_in_that_step(engine) -> None:
    """``on_start`` (the AsyncEngine's inbox) runs before each step is scheduled: what it adds or aborts then
    is part of that very step."""
    first, second = _prompts(2, engine.config.vocab_size, seed=5)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    scheduler = Scheduler(engine)
    running = scheduler.add(first, params)
    late: list = []

    def on_start() -> None:
        if not late:
            late.append(scheduler.add(second, params))
        elif len(late) == 1:
            scheduler.abort(running.request_id)
            late.append(None)

    scheduler.on_start = on_start
    outs = scheduler.step()
    assert {o.request_id for o in outs} == {running.request_id, late[0].request_id}  # both prompts ran
    outs += scheduler.step()
    assert running.finished and running.finish_reason == "abort" and not late[0].finished
    got = [t for o in outs if o.request_id == late[0].request_id for t in o.new_token_ids]
    got += _run_all(scheduler, [late[0]])[late[0].request_id]
    assert got == _alone(engine, second, params)


@pytest.mark.parametrize("embedding_first", [True, False])
def test_an_embedding_holding_the_room_does_not_cut_a_generation_short(embedding_first: bool) -> None:
    """An embedding of a long text takes blocks of the same pool a step at a time, between generation steps (as
    AsyncEngine.embed does: it waits while a generation or another job holds blocks that would come back). A
    generation that fits the pool alone waits for the room (its sequence set back, not ended): every token it
    gives alone, its length reached, whether it came before the embedding or after."""
    from pathlib import Path

    from kestrel_core.model.embed import EmbedJob
    from kestrel_core.model.kv_pool import bytes_per_position

    path = str(Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-qwen3")
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    prompt = list(range(10, 50))
    with kestrel_core.load(path, backend="cpu") as roomy:
        alone = list(roomy.generate(prompt, params=params))
        mb = 8 * 32 * bytes_per_position(roomy.config) / 2**20  # 8 blocks: 256 positions
    with kestrel_core.load(path, backend="cpu", kv_cache_mb=mb) as engine:
        sched = Scheduler(engine, max_batch=4, token_budget=48)
        job = EmbedJob(engine, [list(range(3, 203))], budget=sched.token_budget)
        if embedding_first:
            for _ in range(3):
                job.step()
        request, got, embedding = sched.add(prompt, params), [], True
        while sched.has_work:
            got += [t for o in sched.step() for t in o.new_token_ids]
            if embedding and not job.done:
                try:
                    job.step()
                except Overloaded:
                    if not sched.num_running:  # given up: its blocks go back
                        job.close()
                        embedding = False
        assert engine.pool.free_blocks == engine.pool.num_blocks
    assert got == alone and request.finish_reason == "length" and request.preemptions >= 1


# A whole-step backend over the host decoder, declaring API {api}, whose pipelined greedy decode runs a step ahead of
# its consumer (as docs/plugins.md allows) and which runs each step's tokens after what it holds of the sequence,
# trusting the engine never to offer it a start below that: every such offer is recorded in BELOW.
RUN_AHEAD_BACKEND = '''
import numpy as np
from kestrel_core import BackendInfo, hookimpl
from kestrel_core.dispatch import Offload
from kestrel_core.model.decoder import Decoder
from kestrel_core.registry import Registry
from kestrel_cpu import kestrel_close, kestrel_gemm_f32, kestrel_gemm_q8, kestrel_open  # noqa: F401

_cpu = Registry().cpu()
STATE = {{}}
BELOW = []  # (hook, seq_id, start, positions held)
RELEASED = []
REFUSE_AT = set()  # the calls of kestrel_forward_batch whose result, once computed, is NaN (the engine refuses it)
CALLS = [0]


@hookimpl
def kestrel_backend_info():
    return BackendInfo("runahead", "1", "{api}", "gpu")


def _cache(model, seq_id, start, hook):
    if STATE.get("model") is not model:
        STATE.clear()
        STATE.update(model=model, decoder=Decoder(model, Offload(_cpu, _cpu)), caches={{}})
    caches = STATE["caches"]
    if seq_id not in caches:
        caches[seq_id] = STATE["decoder"].new_cache()
    if start < caches[seq_id].length:
        BELOW.append((hook, seq_id, start, caches[seq_id].length))
    return STATE["decoder"], caches[seq_id]


@hookimpl
def kestrel_forward_batch(device, model, batch):
    work = []
    for e in batch:
        decoder, cache = _cache(model, e.seq_id, e.start, "forward_batch")
        if e.start > cache.length:
            return None
        work.append((cache, np.asarray(e.tokens), e.logit_rows))
    out = [np.array(o, np.float32) for o in decoder.forward_batch(work)]
    CALLS[0] += 1
    return [np.full_like(o, np.nan) for o in out] if CALLS[0] in REFUSE_AT else out


@hookimpl
def kestrel_decode_greedy(device, model, seq_id, token, start, count):
    decoder, cache = _cache(model, seq_id, start, "decode_greedy")
    if start != cache.length:
        return None

    def run(tok):
        return int(np.argmax(decoder.forward_batch([(cache, np.array([tok], np.int64), 1)])[0][0]))

    def ahead():
        nxt = run(token)
        for i in range(count):
            cur = nxt
            if i + 1 < count:
                nxt = run(cur)
            yield cur
    return ahead()


@hookimpl
def kestrel_release_sequence(device, seq_id):
    RELEASED.append(seq_id)
    cache = STATE.get("caches", {{}}).pop(seq_id, None)
    if cache is not None:
        cache.release()
'''


@pytest.mark.parametrize("api", ["1.2", "1.5"])
def test_a_refused_step_never_rewinds_a_backend_before_1_6(model, tmp_path, monkeypatch, api: str) -> None:
    """The backend ran a batched step and its result was refused (NaN): the host computes that step, and the
    backend, which may hold its positions, forgets the sequences and is offered them from their start again rather
    than a start below what it holds. The request (sampled, so that every step is a batched one) gives the tokens
    it gives on the CPU."""
    (tmp_path / "runahead.py").write_text(RUN_AHEAD_BACKEND.format(api=api))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "runahead.py"))
    (prompt,) = _prompts(1, model.config.vocab_size, seed=9)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.7, seed=3)
    with kestrel_core.load(model, backend="cpu", activations="q8") as cpu:  # a prompt's and a step's alike: the
        want = _alone(cpu, prompt, params)  # host's catch-up after a refusal computes generated positions as a prompt
    with kestrel_core.load(model, backend="runahead", activations="q8") as engine:
        plugin = engine.backend.plugin
        plugin.REFUSE_AT.update({3, 4})
        scheduler = Scheduler(engine)
        request = scheduler.add(prompt, params)
        got = _run_all(scheduler, [request])[request.request_id]
        assert plugin.CALLS[0] > 4 and plugin.RELEASED  # it ran past the refusals, forgetting the sequence
        assert plugin.BELOW == []
        assert got == want
        offload = engine.stats["offload"]["kestrel_forward_batch"]
        assert offload["accepted"] >= 1 and offload["declined"] == 2


@pytest.mark.parametrize("api", ["1.2", "1.5"])
@pytest.mark.parametrize("leave", ["join", "drain"])
def test_a_pipelined_decode_left_behind_never_rewinds_a_backend_before_1_6(model, tmp_path, monkeypatch, api: str,
                                                                            leave: str) -> None:
    """A lone greedy request's decode runs a step ahead on the device; another request joins (or the scheduler is
    drained, as the server does before other work), which leaves it. A backend below API 1.6 was never promised a
    start below what it holds: the sequence is released on it and run again from its first position. Both
    requests give the tokens they give alone on the CPU."""
    (tmp_path / "runahead.py").write_text(RUN_AHEAD_BACKEND.format(api=api))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "runahead.py"))
    first, second = _prompts(2, model.config.vocab_size, seed=8)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with kestrel_core.load(model, backend="cpu") as cpu:
        want = [_alone(cpu, p, params) for p in (first, second)]
    with kestrel_core.load(model, backend="runahead") as engine:
        plugin = engine.backend.plugin
        scheduler = Scheduler(engine)
        lone = scheduler.add(first, params)
        got = {lone.request_id: []}
        while len(got[lone.request_id]) < 8:
            for out in scheduler.step():
                got[out.request_id] += out.new_token_ids
        assert lone._device_tokens is not None  # its decode runs ahead on the device
        if leave == "drain":
            for out in scheduler.drain():
                got[out.request_id] += out.new_token_ids
            assert lone.seq.seq_id in plugin.RELEASED
        joined = scheduler.add(second, params)
        got[joined.request_id] = []
        for request_id, tokens in _run_all(scheduler, [lone, joined]).items():
            got[request_id] += tokens
        assert plugin.BELOW == []
        assert [got[lone.request_id], got[joined.request_id]] == want
        assert engine.stats["offload"]["kestrel_decode_greedy"]["accepted"] >= 1


@pytest.mark.parametrize("fails", ["start", "result"])
def test_a_step_that_fails_ends_its_requests_and_the_scheduler_goes_on(engine, monkeypatch, fails: str) -> None:
    """A step that fails as a whole, as it starts or when its result is taken: the error is raised, its requests
    end ("abort") with their blocks back, and a request that comes after runs as it runs alone."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    alone = _alone(engine, [5, 6, 7], params)
    start_batch = type(engine).start_batch
    failing = [True]

    def broken(self, work, *args, **kwargs):  # type: ignore[no-untyped-def]
        if failing[0] and fails == "start":
            raise RuntimeError("boom")
        step = start_batch(self, work, *args, **kwargs)
        if failing[0]:
            monkeypatch.setattr(step, "result", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
        return step

    monkeypatch.setattr(type(engine), "start_batch", broken)
    scheduler = Scheduler(engine, max_batch=4)
    doomed = [scheduler.add(p, params) for p in _prompts(2, engine.config.vocab_size)]
    with pytest.raises(RuntimeError, match="boom"):
        scheduler.step()
    assert all(r.finished and r.finish_reason == "abort" for r in doomed)
    assert engine.pool.free_blocks == engine.pool.num_blocks and not scheduler.has_work
    failing[0] = False
    request = scheduler.add([5, 6, 7], params)
    assert _run_all(scheduler, [request])[request.request_id] == alone
