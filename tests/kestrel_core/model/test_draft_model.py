"""Speculative decoding with a draft model: answers token for token the greedy ones, a draft kept in step with
its requests, its limits, and the vocabularies it is refused for.

The tiny random models share one tokenizer: tiny-llama drafts for tiny-qwen3 (its guesses are mostly wrong), and a
model drafts for itself (every guess is right, as long as the draft's sequence follows the request's tokens). Their
random weights are sure of no token (a greedy token's probability is about 0.1 to 0.5), so the tests that want every
guess drafted set no probability cutoff (p_min 0), and those of the cutoff find its positions with the draft's own
engine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kestrel_core
from kestrel_core.errors import KestrelError
from kestrel_core.model.draft_model import DraftModel, attach_draft_model, vocabulary_mismatch
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.scheduler import Scheduler
from kestrel_core.model.tokenizer import NoTokenizer, Tokenizer

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
TARGET = FIXTURES / "tiny-qwen3"


def _prompts(engine: kestrel_core.Engine, n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    vocab = engine.config.vocab_size
    return [rng.integers(3, vocab, int(rng.integers(4, 40))).tolist() for _ in range(n)]


def _run(
    engine: kestrel_core.Engine, speculate: int, requests: list[tuple[list[int], SamplingParams]], max_batch: int = 8
) -> tuple[list[list[int]], Scheduler]:
    engine.speculate = speculate
    scheduler = Scheduler(engine, max_batch=max_batch)
    added = [scheduler.add(ids, params) for ids, params in requests]
    while scheduler.has_work:
        scheduler.step()
    engine.speculate = 0
    return [r.output_ids for r in added], scheduler


def _all_free(engine: kestrel_core.Engine) -> bool:
    return engine.pool.free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("draft", ["tiny-llama", "tiny-qwen3"])
def test_a_batch_with_a_draft_model_gives_the_greedy_answers(draft: str) -> None:
    with kestrel_core.load(str(TARGET), backend="cpu") as engine:
        greedy = [(ids, SamplingParams(max_tokens=30, ignore_eos=True)) for ids in _prompts(engine, 5)]
        sampled = (greedy[0][0], SamplingParams(max_tokens=20, temperature=0.9, seed=3))  # no drafts for it
        plain, before = _run(engine, 0, [*greedy, sampled])
        drafter = attach_draft_model(engine, str(FIXTURES / draft), p_min=0)
        for k in (1, 3, 6):
            fast, after = _run(engine, k, [*greedy, sampled])
            assert fast == plain, k
            assert after.drafted > 0
            assert _all_free(engine) and _all_free(drafter.engine)
        if draft == "tiny-qwen3":  # its own draft: every guess right, the answers in fewer steps
            assert after.accepted == after.drafted and after.steps < before.steps


def test_a_model_drafting_for_itself_is_always_right_through_preemptions() -> None:
    """A KV pool too small for every sequence at once: sequences are preempted, their drafts' sequences freed and
    caught up again when they resume; a draft's sequence out of step with its request's tokens would guess wrong."""
    with kestrel_core.load(str(TARGET), backend="cpu", kv_cache_mb=0.15) as engine:
        requests = [(ids, SamplingParams(max_tokens=40, ignore_eos=True)) for ids in _prompts(engine, 6, seed=2)]
        plain, before = _run(engine, 0, requests, max_batch=6)
        drafter = attach_draft_model(engine, str(TARGET), p_min=0)
        fast, after = _run(engine, 4, requests, max_batch=6)
        assert fast == plain and after.preemptions > 0
        assert after.drafted > 0 and after.accepted == after.drafted
        assert _all_free(engine) and _all_free(drafter.engine)


class _CheckedDrafts(DraftModel):
    """A draft model whose sequences are checked after every draft: the request's tokens, then the guesses the
    draft ran, and its guesses those a second engine of it gives from the request's tokens read afresh."""

    def __init__(self, engine: kestrel_core.Engine, vocab_size: int, fresh: kestrel_core.Engine, p_min: float) -> None:
        super().__init__(engine, vocab_size, p_min)
        self.fresh = DraftModel(fresh, vocab_size, p_min)
        self.checked_drafts = 0
        self.cut = 0  # drafts the cutoff ended before k guesses

    def drafts(self, asks):  # type: ignore[no-untyped-def]
        guesses = super().drafts(asks)
        for (request, k), guess in zip(asks, guesses):
            ran = request.draft_seq.seq.tokens  # every guess but the last, or all of a draft the cutoff ended
            assert ran == request.tokens + guess[: len(ran) - len(request.tokens)]
            assert len(request.tokens) + len(guess) - (len(guess) == k) == len(ran)
            self.cut += len(guess) < k
            anew = SimpleNamespace(tokens=request.tokens, prompt_ids=request.prompt_ids, draft_seq=None)
            assert self.fresh.drafts([(anew, k)]) == [guess]
            self.fresh.forget(anew)
            self.checked_drafts += 1
        return guesses


@pytest.mark.parametrize(
    ("kv_cache_mb", "token_budget", "p_min"), [(None, None, 0), (0.15, None, 0), (None, 8, 0), (None, None, 0.1)]
)
def test_a_drafts_sequence_follows_its_requests_tokens(
    kv_cache_mb: float | None, token_budget: int | None, p_min: float
) -> None:
    """A GPTQ checkpoint of tiny-qwen3 guesses most of its tokens, not all: its sequences are rewound past the
    wrong guesses and catch up on what the target kept, also after steps without drafts (a small token budget that
    prompts take), and are freed when their requests are preempted (then caught up from the start) or end. With a
    cutoff near its greedy tokens' probabilities, drafts end early, and the sequences then hold every guess."""
    with (
        kestrel_core.load(str(TARGET), backend="cpu", kv_cache_mb=kv_cache_mb) as engine,
        kestrel_core.load(str(FIXTURES / "tiny-qwen3-gptq"), backend="cpu") as draft_engine,
        kestrel_core.load(str(FIXTURES / "tiny-qwen3-gptq"), backend="cpu") as fresh,
    ):
        requests = [(ids, SamplingParams(max_tokens=40, ignore_eos=True)) for ids in _prompts(engine, 6, seed=2)]
        plain, _ = _run(engine, 0, requests, max_batch=6)
        engine.draft_model = drafter = _CheckedDrafts(draft_engine, engine.config.vocab_size, fresh, p_min)
        engine.speculate = 3
        scheduler = Scheduler(engine, max_batch=3 if token_budget else 6, token_budget=token_budget)
        added = [scheduler.add(ids, params) for ids, params in requests]
        while scheduler.has_work:
            scheduler.step()
            assert all(r.draft_seq is None for r in added if r.seq is None)  # waiting again, or ended
        assert [r.output_ids for r in added] == plain
        assert drafter.checked_drafts > 0 and 0 < scheduler.accepted <= scheduler.drafted
        if p_min:  # drafts the cutoff ended, whose sequences hold every guess
            assert drafter.cut > 0
        else:  # guesses the target did not keep, which the sequences are rewound past
            assert scheduler.accepted < scheduler.drafted
        assert (scheduler.preemptions > 0) == (kv_cache_mb is not None)
        assert _all_free(draft_engine)


def _greedy_with_probabilities(engine: kestrel_core.Engine, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """``engine``'s model's greedy continuation of ``prompt``, a token a step as a draft decodes, and each token's
    probability (the softmax of its row of logits, in float64)."""
    seq = engine.new_sequence(len(prompt))
    assert engine.pool.reserve(seq.cache, len(prompt) + n)
    tokens: list[int] = []
    probabilities: list[float] = []
    row = engine.run_batch([(seq, prompt, 1)])[0][-1].astype(np.float64)
    for _ in range(n):
        shares = np.exp(row - row.max())
        tokens.append(int(np.argmax(row)))
        probabilities.append(float(shares.max() / shares.sum()))
        row = engine.run_batch([(seq, tokens[-1:], 1)])[0][-1].astype(np.float64)
    engine.release(seq)
    return tokens, probabilities


def _asked(prompt: list[int]) -> SimpleNamespace:
    return SimpleNamespace(tokens=prompt, prompt_ids=prompt, draft_seq=None)


def _a_cutoff(engine: kestrel_core.Engine, k: int) -> tuple[list[int], list[int], int, float]:
    """A prompt, ``engine``'s greedy k tokens after it, a position j >= 2 among them, and a cutoff between the
    probability of its guess and the lowest of those before it (where the draft of that cutoff ends)."""
    for prompt in _prompts(engine, 20, seed=7):
        tokens, probabilities = _greedy_with_probabilities(engine, prompt, k)
        # a position from 2 on whose guess is less sure than every one before it
        stops = [j for j in range(2, k) if probabilities[j] < min(probabilities[:j])]
        if stops:
            j = stops[0]
            return prompt, tokens, j, (probabilities[j] + min(probabilities[:j])) / 2
    raise AssertionError("no prompt whose draft's probabilities fall to a new low after two guesses")


def test_a_draft_stops_at_the_first_guess_below_p_min() -> None:
    """A cutoff between a guess's probability and the lowest of those before it: the draft is the greedy tokens up
    to that guess; without a cutoff, all k of them."""
    k = 6
    with kestrel_core.load(str(FIXTURES / "tiny-llama"), backend="cpu") as engine:
        prompt, tokens, j, cutoff = _a_cutoff(engine, k)
        for p_min, expected in ((0, tokens), (cutoff, tokens[:j])):
            drafter = DraftModel(engine, engine.config.vocab_size, p_min)
            request = _asked(prompt)
            assert drafter.drafts([(request, k)]) == [expected], p_min
            drafter.forget(request)
        assert _all_free(engine)


def test_a_draft_of_fewer_guesses_than_n_min_is_dropped() -> None:
    """The draft a cutoff ends after j greedy tokens: kept with n_min j, dropped with n_min j + 1; one asked for fewer
    guesses than n_min is not drafted at all (the request gets no sequence in the draft model)."""
    k = 6
    with kestrel_core.load(str(FIXTURES / "tiny-llama"), backend="cpu") as engine:
        prompt, tokens, j, cutoff = _a_cutoff(engine, k)
        for n_min, expected in ((0, tokens[:j]), (j, tokens[:j]), (j + 1, [])):
            drafter = DraftModel(engine, engine.config.vocab_size, cutoff, n_min)
            request = _asked(prompt)
            assert drafter.drafts([(request, k)]) == [expected], n_min
            drafter.forget(request)
        drafter = DraftModel(engine, engine.config.vocab_size, 0, n_min=k)
        short, full = _asked(prompt), _asked(prompt)
        assert drafter.drafts([(short, k - 1), (full, k)]) == [[], tokens]
        assert short.draft_seq is None
        drafter.forget(full)
        assert _all_free(engine)


def _checked_drafts(scheduler: Scheduler) -> list[int]:
    """The number of guesses of each draft ``scheduler``'s steps check, recorded as they are checked."""
    lengths: list[int] = []
    take = scheduler._take_draft

    def recording(request, out):  # type: ignore[no-untyped-def]
        lengths.append(len(request.draft))
        return take(request, out)

    scheduler._take_draft = recording  # type: ignore[method-assign]
    return lengths


@pytest.mark.parametrize(("p_min", "token_budget"), [(0.1, None), (0, 8)])
def test_the_steps_check_no_draft_of_fewer_guesses_than_n_min(p_min: float, token_budget: int | None) -> None:
    """tiny-qwen3 drafting for itself (every guess right), its drafts cut short by the probability cutoff, or by a
    token budget the step's rows share: with n_min 0 the steps check drafts of fewer than 3 guesses; with n_min 3
    none, those steps decode without them, and the answers are the greedy ones."""
    with (
        kestrel_core.load(str(TARGET), backend="cpu") as engine,
        kestrel_core.load(str(TARGET), backend="cpu") as draft_engine,
    ):
        requests = [(ids, SamplingParams(max_tokens=30, ignore_eos=True)) for ids in _prompts(engine, 4, seed=5)]
        plain, _ = _run(engine, 0, requests)
        checked = {}
        for n_min in (0, 3):
            engine.draft_model = DraftModel(draft_engine, engine.config.vocab_size, p_min, n_min)
            engine.speculate = 4
            scheduler = Scheduler(engine, max_batch=4, token_budget=token_budget)
            checked[n_min] = lengths = _checked_drafts(scheduler)
            added = [scheduler.add(ids, params) for ids, params in requests]
            while scheduler.has_work:
                scheduler.step()
            engine.speculate = 0
            assert [r.output_ids for r in added] == plain, n_min
            assert scheduler.accepted == scheduler.drafted == sum(lengths)
            assert _all_free(engine) and _all_free(draft_engine)
        assert min(checked[0]) < 3 and min(checked[3]) == 3


def test_an_n_min_below_0_is_one_line() -> None:
    with kestrel_core.load(str(TARGET), backend="cpu") as engine:
        for n_min in (-1, 1.5, True):
            with pytest.raises(KestrelError, match=r"n_min must be an integer >= 0"):
                DraftModel(engine, engine.config.vocab_size, n_min=n_min)  # type: ignore[arg-type]
            with pytest.raises(KestrelError, match=r"n_min must be an integer >= 0"):
                attach_draft_model(engine, str(TARGET), n_min=n_min)  # type: ignore[arg-type]
        assert engine.draft_model is None


def test_a_draft_model_sure_of_nothing_guesses_nothing() -> None:
    with kestrel_core.load(str(TARGET), backend="cpu") as engine:
        requests = [(ids, SamplingParams(max_tokens=20, ignore_eos=True)) for ids in _prompts(engine, 3)]
        plain, _ = _run(engine, 0, requests)
        drafter = attach_draft_model(engine, str(TARGET), p_min=0.999)
        fast, after = _run(engine, 4, requests)
        assert fast == plain and after.drafted == 0
        assert _all_free(drafter.engine)


@pytest.mark.parametrize("p_min", [0.0, 0.1, 0.2, 0.3, 0.75, 1.0])
@pytest.mark.parametrize("draft", ["tiny-llama", "tiny-qwen3"])
def test_the_answers_are_the_greedy_ones_for_any_p_min(draft: str, p_min: float) -> None:
    with kestrel_core.load(str(TARGET), backend="cpu") as engine:
        requests = [(ids, SamplingParams(max_tokens=24, ignore_eos=True)) for ids in _prompts(engine, 4, seed=3)]
        plain, _ = _run(engine, 0, requests)
        drafter = attach_draft_model(engine, str(FIXTURES / draft), p_min=p_min)
        fast, after = _run(engine, 4, requests)
        assert fast == plain
        if draft == "tiny-qwen3":  # its own draft: every guess it makes is right
            assert after.accepted == after.drafted
        assert _all_free(engine) and _all_free(drafter.engine)


def test_a_p_min_outside_0_to_1_is_one_line() -> None:
    with kestrel_core.load(str(TARGET), backend="cpu") as engine:
        for p_min in (-0.1, 1.5, float("nan")):
            with pytest.raises(KestrelError, match=r"p_min must be in \[0, 1\]"):
                DraftModel(engine, engine.config.vocab_size, p_min)
            with pytest.raises(KestrelError, match=r"p_min must be in \[0, 1\]"):
                attach_draft_model(engine, str(TARGET), p_min=p_min)
        assert engine.draft_model is None


def test_the_draft_reads_a_greedy_prompt_in_the_step_of_its_last_chunk() -> None:
    """The draft's sequence of a greedy request holds its prompt once the step that ran the prompt's last chunk is
    in (its first draft then runs the next token alone), and none before; a sampled request, and one whose
    max_tokens leaves no room for a draft after its first token, get no sequence."""
    with kestrel_core.load(str(TARGET), backend="cpu") as engine:
        prompt = np.random.default_rng(1).integers(3, engine.config.vocab_size, 40).tolist()  # steps of 16 tokens
        requests = [
            (prompt, SamplingParams(max_tokens=20, ignore_eos=True)),
            (prompt[:10], SamplingParams(max_tokens=20, temperature=0.9, seed=1)),
            (prompt[:12], SamplingParams(max_tokens=2, ignore_eos=True)),
        ]
        plain, _ = _run(engine, 0, requests)
        attach_draft_model(engine, str(FIXTURES / "tiny-llama"), p_min=0)
        engine.speculate = 3
        scheduler = Scheduler(engine, max_batch=3, token_budget=16)
        greedy, sampled, short = [scheduler.add(ids, params) for ids, params in requests]
        while not greedy.output_ids:
            assert greedy.draft_seq is None
            scheduler.step()
            assert sampled.draft_seq is None and short.draft_seq is None
        assert greedy.draft_seq.seq.tokens == greedy.prompt_ids and len(greedy.output_ids) == 1
        while scheduler.has_work:
            scheduler.step()
        engine.speculate = 0
        assert [r.output_ids for r in (greedy, sampled, short)] == plain and scheduler.drafted > 0


def test_a_drafts_sequence_is_freed_when_its_request_is_aborted() -> None:
    with kestrel_core.load(str(TARGET), backend="cpu") as engine:
        drafter = attach_draft_model(engine, str(FIXTURES / "tiny-llama"), p_min=0)
        engine.speculate = 3
        scheduler = Scheduler(engine)
        request = scheduler.add(_prompts(engine, 1)[0], SamplingParams(max_tokens=200, ignore_eos=True))
        for _ in range(5):
            scheduler.step()
        held = drafter.engine.pool.num_blocks - drafter.engine.pool.free_blocks
        assert held == drafter.engine.pool.blocks_for(len(request.draft_seq.seq.tokens))
        scheduler.abort(request.request_id)
        assert request.draft_seq is None and _all_free(drafter.engine)
        scheduler.close()


def test_the_draft_model_closes_with_its_engine_after_what_serves_it() -> None:
    with kestrel_core.load(str(TARGET), backend="cpu") as engine:
        drafter = attach_draft_model(engine, str(FIXTURES / "tiny-llama"))
        seen: list[bool] = []
        engine.on_close(lambda: seen.append(drafter.engine.closed))  # as an AsyncEngine made after it stops
    assert seen == [False] and drafter.engine.closed


def test_drafts_stop_at_the_draft_models_context_and_kv_room() -> None:
    """A draft model of a shorter context, and one whose KV pool holds fewer positions than the requests take:
    the requests it cannot hold decode without its guesses (a draft run past its context would raise)."""
    with kestrel_core.load(str(TARGET), backend="cpu") as engine:
        requests = [(ids, SamplingParams(max_tokens=60, ignore_eos=True)) for ids in _prompts(engine, 3, seed=4)]
        plain, _ = _run(engine, 0, requests)
        for options in ({"max_model_len": 48}, {"kv_cache_mb": 0.05}):
            with kestrel_core.load(str(TARGET), backend="cpu", **options) as draft_engine:
                drafter = DraftModel(draft_engine, engine.config.vocab_size, p_min=0)
                engine.draft_model = drafter
                fast, after = _run(engine, 4, requests)
                engine.draft_model = None
                assert fast == plain, options
                assert 0 < after.drafted and after.accepted == after.drafted
                ends = [len(ids) + 60 for ids, _ in requests]  # the positions each request ends with
                pool = draft_engine.pool
                assert sum(map(pool.blocks_for, ends)) > pool.num_blocks or min(ends) > draft_engine.config.max_position
                assert _all_free(draft_engine)


def _padded_target(path: Path) -> Path:
    """tiny-qwen3 with 88 logits past the draft's 512 (Qwen2.5-7B's 152064 beside 0.5B's 151936), its tokenizer
    the same: those ids have no text, and all but one give a logit of 0; that one is token 445's, a little larger,
    so the model answers it where tiny-qwen3 answers 445."""
    shutil.copytree(TARGET, path)
    config = json.loads((path / "config.json").read_text())
    config["vocab_size"] = PADDED_VOCAB
    (path / "config.json").write_text(json.dumps(config))
    weights = load_file(path / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]
    padding = np.zeros((PADDED_VOCAB - len(embedding), embedding.shape[1]), embedding.dtype)
    padding[PADDED_ANSWER - len(embedding)] = embedding[445] * 1.02
    weights["model.embed_tokens.weight"] = np.concatenate([embedding, padding])
    save_file(weights, path / "model.safetensors")
    return path


PADDED_VOCAB, PADDED_ANSWER = 600, 590


def test_a_token_the_draft_model_has_no_embedding_for_ends_that_requests_drafts(tmp_path: Path) -> None:
    """A target whose vocabulary is padded past the draft's: a request that holds an id past the draft model's
    (in its prompt, or given by the target after some tokens) decodes without guesses from there on, and the others
    with theirs: the draft model never runs an id it has no embedding for."""
    with kestrel_core.load(str(_padded_target(tmp_path / "padded")), backend="cpu") as engine:
        prompts = [[token % 512 for token in ids] for ids in _prompts(engine, 6)]  # the tokenizer's ids
        prompts[1][3] = PADDED_VOCAB - 1
        requests = [(ids, SamplingParams(max_tokens=30, ignore_eos=True)) for ids in prompts]
        plain, _ = _run(engine, 0, requests)
        padded_at = [next((j for j, t in enumerate(out) if t >= 512), None) for out in plain]
        assert any(j is not None and j > 2 for j in padded_at)  # answers that go on to padded ids
        drafter = attach_draft_model(engine, str(TARGET), p_min=0)
        fast, after = _run(engine, 3, requests)
        assert fast == plain and after.drafted > 0
        assert _all_free(engine) and _all_free(drafter.engine)


def test_a_draft_model_that_fails_is_left_and_the_answers_go_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A draft model whose steps fail from its fifth on (as a draft model of NaN weights does): its failure is not
    the requests', which get their greedy answers without guesses from then on (said once in the log), and its
    sequences are freed."""
    with (
        kestrel_core.load(str(TARGET), backend="cpu") as engine,
        kestrel_core.load(str(TARGET), backend="cpu") as draft_engine,
    ):
        requests = [(ids, SamplingParams(max_tokens=30, ignore_eos=True)) for ids in _prompts(engine, 4)]
        plain, _ = _run(engine, 0, requests)
        steps = 0
        run_batch = draft_engine.run_batch

        def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal steps
            steps += 1
            if steps >= 5:
                raise KestrelError("the model produced non-finite logits")
            return run_batch(*args, **kwargs)

        monkeypatch.setattr(draft_engine, "run_batch", failing)
        engine.draft_model = DraftModel(draft_engine, engine.config.vocab_size, p_min=0)
        with caplog.at_level("WARNING", logger="kestrel"):
            fast, after = _run(engine, 3, requests)
        assert fast == plain and after.drafted > 0 and steps == 5
        assert [r.message for r in caplog.records] == [
            "kestrel: the draft model failed (the model produced non-finite logits); decoding goes on without guesses"
        ]
        assert _all_free(engine) and _all_free(draft_engine)


def test_a_draft_model_whose_positions_take_more_memory_holds_what_the_machine_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tiny-qwen3 (1536 bytes a position) drafting for tiny-llama (256) with a 2 MB KV cache, on a machine of 8 MB:
    the draft's pool of as many positions would take 12 MB; it holds what 8 MB do, and drafts within them."""
    from kestrel_core.model import kv_pool

    monkeypatch.setattr(kv_pool, "_memory_bytes", lambda: 8 << 20)
    with kestrel_core.load(str(FIXTURES / "tiny-llama"), backend="cpu", kv_cache_mb=2) as engine:
        requests = [(ids, SamplingParams(max_tokens=30, ignore_eos=True)) for ids in _prompts(engine, 3)]
        plain, _ = _run(engine, 0, requests)
        drafter = attach_draft_model(engine, str(TARGET), p_min=0)
        pool = drafter.engine.pool
        assert pool.num_blocks == (8 << 20) // (kv_pool.bytes_per_position(drafter.engine.config) * pool.block_size)
        fast, after = _run(engine, 3, requests)
        assert fast == plain and after.drafted > 0


def _tokenizer(edit=None, eos: str = "<|im_end|>") -> Tokenizer:  # type: ignore[no-untyped-def]
    data = json.loads((TARGET / "tokenizer.json").read_text())
    if edit is not None:
        edit(data)
    return Tokenizer.from_json_str(json.dumps(data), eos_token=eos)


def _swap_parens(data: dict) -> None:
    vocab = data["model"]["vocab"]
    vocab["("], vocab[")"] = vocab[")"], vocab["("]


def _extra_tokens(n: int):  # type: ignore[no-untyped-def]
    def edit(data: dict) -> None:
        first = len(data["model"]["vocab"])
        data["added_tokens"] += [
            {
                "id": first + i,
                "content": f"<extra_{i}>",
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i in range(n)
        ]

    return edit


def _word_level(data: dict) -> None:
    data["model"] = {"type": "WordLevel", "vocab": data["model"]["vocab"], "unk_token": "<|endoftext|>"}


@pytest.mark.parametrize(
    ("draft", "reason"),
    [
        (_tokenizer(_swap_parens), "its token 10 is ')', the target's '('"),
        (_tokenizer(eos="<|endoftext|>"), "its eos_token is '<|endoftext|>' (id 0), the target's '<|im_end|>' (id 2)"),
        (_tokenizer(_extra_tokens(129)), "its vocabulary has 641 tokens, the target's 512 (at most 128 apart)"),
        (_tokenizer(_word_level), "its vocabulary is WordLevel, the target's BPE"),
        (NoTokenizer("none shipped", 512), "the draft model has no vocabulary to compare"),
        (_tokenizer(_extra_tokens(128)), None),  # a padded vocabulary: its ids past the target's are never drafted
        (_tokenizer(), None),
    ],
)
def test_a_draft_is_compared_with_the_targets_vocabulary(draft: object, reason: str | None) -> None:
    found = vocabulary_mismatch(_tokenizer(), draft)
    assert found == reason if reason is None else found is not None and found.startswith(reason)


def test_a_draft_of_another_vocabulary_is_refused_in_one_line(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from kestrel_core.cli import main

    other = tmp_path / "other-vocab"
    shutil.copytree(TARGET, other)
    data = json.loads((other / "tokenizer.json").read_text())
    _swap_parens(data)
    (other / "tokenizer.json").write_text(json.dumps(data))
    assert main(["run", "--model", str(TARGET), "--draft-model", str(other), "--speculate", "4", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"error: the draft model {other}: it cannot draft for this model: its token 10 is ')', the target's '('"
    )
    assert main(["run", "--model", str(TARGET), "--draft-model", str(TARGET), "x"]) == 2  # no --speculate
    assert capsys.readouterr().err.strip() == (
        "error: --draft-model guesses the --speculate N tokens a step: give --speculate too"
    )
    assert main(["run", "--model", str(TARGET), "--speculate", "4", "--draft-p-min", "0.5", "x"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --draft-p-min is where the --draft-model's guesses stop: give --draft-model too"
    )
    for bad in ("-0.1", "1.5", "nan"):
        command = ["run", "--model", str(TARGET), "--draft-model", str(TARGET), "--speculate", "4"]
        assert main([*command, "--draft-p-min", bad, "x"]) == 2
        assert capsys.readouterr().err.strip() == f"error: --draft-p-min: draft_p_min must be in [0, 1], got {bad}"
    recurrent = FIXTURES / "tiny-qwen3_5"
    assert main(["run", "--model", str(TARGET), "--draft-model", str(recurrent), "--speculate", "4", "x"]) == 2
    assert "its recurrent layers keep a state" in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_cli_option_gives_the_same_answer(capsys) -> None:  # type: ignore[no-untyped-def]
    from kestrel_core.cli import main

    answers = []
    command = ["run", "--model", str(TARGET), "--max-tokens", "24", "--json", "Repeat: the sea, the sea, the sea"]
    for extra in ([], ["--draft-model", str(TARGET), "--speculate", "4", "--draft-p-min", "0"]):
        assert main(command + extra) == 0
        answers.append(json.loads(capsys.readouterr().out))
    assert answers[0]["text"] == answers[1]["text"] and answers[0]["tokens"] == answers[1]["tokens"]
    stats = answers[1]["stats"]
    assert answers[0]["stats"]["drafted"] == 0 and 0 < stats["accepted"] == stats["drafted"]


def test_a_bad_draft_min_is_one_line(capsys) -> None:  # type: ignore[no-untyped-def]
    from kestrel_core.cli import main

    command = ["run", "--model", str(TARGET), "--speculate", "4"]
    for extra, said in (
        (["--draft-min", "2"], "--draft-min is the fewest guesses a --draft-model's draft is checked with: give "
         "--draft-model too"),
        (["--draft-model", str(TARGET), "--draft-min", "-1"], "--draft-min: draft_min must be an integer >= 0, got -1"),
        (["--draft-model", str(TARGET), "--draft-min", "5"], "--draft-min 5 is more than --speculate 4: no draft "
         "would be checked"),
    ):
        assert main([*command, *extra, "x"]) == 2
        assert capsys.readouterr().err.strip() == f"error: {said}"


def test_draft_min_reaches_the_draft_model(capsys) -> None:  # type: ignore[no-untyped-def]
    """The model drafting for itself without a cutoff, every guess right, 4 a step while max_tokens leaves room; with
    --draft-min 4 the steps near the end, which leave room for fewer, are not drafted: 4 guesses a draft."""
    from kestrel_core.cli import main

    command = ["run", "--model", str(TARGET), "--max-tokens", "24", "--json", "--draft-model", str(TARGET),
               "--speculate", "4", "--draft-p-min", "0", "Repeat: the sea, the sea, the sea"]
    answers = []
    for extra in ([], ["--draft-min", "4"]):
        assert main(command + extra) == 0
        answers.append(json.loads(capsys.readouterr().out))
    assert answers[0]["tokens"] == answers[1]["tokens"] and len(answers[1]["tokens"]) == 24
    drafted = [answer["stats"]["drafted"] for answer in answers]
    assert drafted[0] % 4 != 0 and drafted[1] % 4 == 0 and drafted[1] > 0
