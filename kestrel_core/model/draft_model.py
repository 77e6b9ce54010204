"""Speculative decoding with a draft model (``--draft-model``, llama.cpp's ``-md``, vLLM's draft-model
speculative_config): a smaller model of the same vocabulary guesses a greedy request's next tokens, which the
target model checks in one step as it checks prompt lookup's (kestrel_core.model.speculate), so the answer is the
target's greedy answer whatever the draft guesses.

The draft model is an ``Engine`` of its own on the target's backend, with the target's activations and KV cache
type, and a KV pool of as many positions as the target's, as far as the machine's memory holds them (a small one for
a small model; its pages are only touched as they are used). Each request has a sequence in it
(``Request.draft_seq``) kept in step with the request's tokens: it reads a greedy request's prompt in the scheduler
step that runs the prompt's last chunk (``prefill``), and when the scheduler asks for drafts, it is rewound to where
it agrees with the tokens (past the guesses the target did not keep) and runs the rest (the tokens the target kept,
and its next one) as one chunk, whose last row's argmax is the first guess; each further guess is a decode step. A
draft ends at the first guess whose probability under the draft model (the softmax of its logits) is below
``p_min``, as llama.cpp's ``--draft-p-min`` ends it: a guess the draft is unsure of is seldom the target's, and each
costs the draft a step and the target a row. A draft of fewer than ``n_min`` guesses is dropped, the step decoding
without it, and one asked for fewer than ``n_min`` is not drafted at all, as llama.cpp's ``--draft-min`` drops it
(for its draft model only: its n-gram drafts have minima of their own, as prompt lookup here has MIN_NGRAM, not
``n_min``). The requests of a scheduler step draft together: one batched step of
the draft model at a time. A request's sequence is freed when it ends or is preempted. A request whose tokens hold
an id past the draft model's vocabulary (the target's may be padded further) drafts no more from there on: the draft
model has no embedding for it. A draft model whose step fails is left, with a warning: its failure is not the
requests', which decode without guesses from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kestrel_core.batch import greedy_probability, greedy_token
from kestrel_core.errors import KestrelError
from kestrel_core.model.engine import Engine, SeqState
from kestrel_core.model.kv_pool import KVPool
from kestrel_core.model.speculate import DRAFT_MIN, DRAFT_P_MIN, Guesser
from kestrel_core.model.validate import is_int
from kestrel_core.model.weights import PREFILL_CHUNK

if TYPE_CHECKING:
    from kestrel_core.model.request import Request

log = logging.getLogger("kestrel")

# llama.cpp's checks of a draft's vocabulary (common/speculative.cpp): sizes at most this far apart (a padded
# vocabulary), and the same text for every token id from CHECKED_FROM on (the first few are special tokens that may
# be named otherwise)
MAX_VOCAB_DIFFERENCE = 128
CHECKED_FROM = 5


@dataclass
class DraftSequence:
    """A request's sequence in the draft model's engine."""

    seq: SeqState
    known: int = 0  # its first positions, which hold the request's own tokens; the draft's guesses come after
    # False once the request's tokens hold an id the draft model has no embedding for (a target's vocabulary padded
    # past the draft's, as Qwen2.5-7B's 152064 ids are past 0.5B's 151936): it drafts no more
    readable: bool = True


class DraftModel(Guesser):
    """Drafts by a draft model's greedy decoding (see the module docstring): ``engine`` is the draft model's,
    ``vocab_size`` the target's (a guess past it, a padded vocabulary's id, ends the draft), ``p_min`` the
    probability under the draft model below which a guess ends the draft (0: none does; every guess is then only
    the device's argmax, without its logits), ``n_min`` the fewest guesses a draft is checked with (0: any)."""

    def __init__(self, engine: Engine, vocab_size: int, p_min: float = DRAFT_P_MIN, n_min: int = DRAFT_MIN) -> None:
        self.engine = engine
        self.vocab_size = vocab_size
        self.p_min = checked_p_min(p_min)
        self.n_min = checked_n_min(n_min)
        self.failed = False  # its step failed: it drafts no more (``_left_if_it_fails``)

    def offers(self, request: Request) -> bool:
        """Whether the draft model holds ``request``'s tokens: its context and KV pool, and their ids."""
        n = len(request.tokens)
        return (
            not self.failed
            and n <= self.engine.config.max_position
            and self.engine.pool.blocks_for(n) <= self.engine.pool.num_blocks
            and (request.draft_seq is None or request.draft_seq.readable)
        )

    def forget(self, request: Request) -> None:
        if request.draft_seq is not None:
            self.engine.release(request.draft_seq.seq)
            request.draft_seq = None

    def prefill(self, asks: Sequence[tuple[Request, int]]) -> None:
        """Each request's sequence caught up with all its tokens (no logits), batched over the requests, so that
        its first draft runs only the next token; none for a request the draft model cannot hold with that draft
        (its KV blocks taken now, for it)."""
        if self.failed:
            return
        with self._left_if_it_fails():
            engine = self.engine
            runs: list[tuple[SeqState, list[int]]] = []
            for request, k in asks:
                tokens = request.tokens
                if self.offers(request):
                    seq = self._in_step(request, len(tokens))
                    rest = tokens[len(seq.tokens) :]
                    # the positions of its first draft: the tokens, the next one, k - 1 guesses, within the context
                    if self._reads(request.draft_seq, rest) and engine.pool.reserve(
                        seq.cache, len(tokens) + min(k, engine.config.max_position - len(tokens))
                    ):
                        runs.append((seq, rest))
            last = [(seq, rest, 0) for (seq, _), rest in zip(runs, self._run_long(runs)) if rest]
            if last:
                engine.run_batch(last)

    def drafts(self, asks: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """Each request's guesses: its sequence caught up with its tokens, then greedy decode steps, batched over
        the requests, up to the first the draft model is less sure of than ``p_min``; none for a request whose
        draft would pass the draft model's context or KV pool, or that holds an id it has no embedding for, and none
        of fewer than ``n_min`` guesses (not drafted at all where fewer are asked for)."""
        guesses: list[list[int]] = [[] for _ in asks]
        if self.failed:
            return guesses
        with self._left_if_it_fails():
            engine = self.engine
            runs: list[tuple[int, SeqState, list[int], int]] = []  # (ask, sequence, tokens to run, guesses wanted)
            for i, (request, k) in enumerate(asks):
                tokens = request.tokens
                k = min(k, engine.config.max_position - len(tokens) + 1)  # it runs the tokens, then k - 1 guesses
                if k <= 0 or k < self.n_min:
                    continue
                seq = self._in_step(request, len(tokens) - 1)
                rest = tokens[len(seq.tokens) :]
                if self._reads(request.draft_seq, rest) and engine.pool.reserve(seq.cache, len(tokens) + k - 1):
                    runs.append((i, seq, rest, k))
            rests = self._run_long([(seq, rest) for _, seq, rest, _ in runs])
            steps = [(i, seq, rest, k) for (i, seq, _, k), rest in zip(runs, rests)]
            argmax_only = self.p_min == 0  # no cutoff: a backend may choose the argmax on its device, without logits
            while steps:
                outs = engine.run_batch([(seq, rest, 1) for _, seq, rest, _ in steps], [argmax_only] * len(steps))
                going = []
                for (i, seq, _, k), out in zip(steps, outs):
                    token = greedy_token(out)
                    if token >= self.vocab_size or not argmax_only and greedy_probability(out) < self.p_min:
                        continue
                    guesses[i].append(token)
                    if len(guesses[i]) < k:
                        going.append((i, seq, [token], k))
                steps = going
        # the sequences keep a dropped draft's guesses: the next draft rewinds them as any it ran
        return [guess if len(guess) >= self.n_min else [] for guess in guesses]

    @contextmanager
    def _left_if_it_fails(self) -> Iterator[None]:
        """A failure of the draft model's steps (the non-finite logits of broken weights, its backend's error) is not
        the requests': it is said once, and the draft model is left (``failed``), each request decoding without
        guesses from then on (its sequence freed as it ends)."""
        try:
            yield
        except Exception as exc:
            log.warning("kestrel: the draft model failed (%s); decoding goes on without guesses", exc)
            self.failed = True

    def _reads(self, state: DraftSequence, rest: Sequence[int]) -> bool:
        """Whether the draft model has an embedding for every id of ``rest``, the tokens its sequence is to run next
        (each of a request's tokens is checked once so, as it is run); ``state`` no longer ``readable`` where not."""
        if state.readable and rest and max(rest) >= self.engine.config.vocab_size:
            state.readable = False
        return state.readable

    def _run_long(self, runs: list[tuple[SeqState, list[int]]]) -> list[list[int]]:
        """The tokens of each (sequence, tokens) run a prefill chunk a step, batched, while more than a chunk of
        them is left (a request's first catch-up); each one's last chunk, not run, returned."""
        rests = [rest for _, rest in runs]
        while True:
            long = [j for j, rest in enumerate(rests) if len(rest) > PREFILL_CHUNK]
            if not long:
                return rests
            self.engine.run_batch([(runs[j][0], rests[j][:PREFILL_CHUNK], 0) for j in long])
            for j in long:
                rests[j] = rests[j][PREFILL_CHUNK:]

    def _in_step(self, request: Request, upto: int) -> SeqState:
        """``request``'s sequence (a new one on its first draft: a cached prefix of its prompt attached), rewound to
        the tokens it shares with the request's first ``upto`` (short of its last for a draft, whose row gives the
        first guess)."""
        tokens = request.tokens
        state = request.draft_seq
        if state is None:
            seq = self.engine.new_sequence(len(request.prompt_ids), tokens)
            state = request.draft_seq = DraftSequence(seq, len(seq.tokens))
        seq = state.seq
        same = min(state.known, len(seq.tokens), upto)
        end = min(len(seq.tokens), upto)
        while same < end and seq.tokens[same] == tokens[same]:
            same += 1
        if same < len(seq.tokens):
            self.engine.rewind(seq, same)
        state.known = len(tokens)  # once its tokens are run, as they are before any guess
        return seq


def checked_p_min(p_min: float) -> float:
    """A draft's probability cutoff, or a KestrelError (one line) for one outside [0, 1] (NaN too)."""
    if not 0.0 <= p_min <= 1.0:
        raise KestrelError(f"the draft model's p_min must be in [0, 1], got {p_min!r}")
    return p_min


def checked_n_min(n_min: int) -> int:
    """The fewest guesses a draft is checked with, or a KestrelError (one line) for one that is not an integer >= 0."""
    if not is_int(n_min) or n_min < 0:
        raise KestrelError(f"the draft model's n_min must be an integer >= 0, got {n_min!r}")
    return int(n_min)


def vocabulary_mismatch(target: Any, draft: Any) -> str | None:
    """How a draft model's tokenizer differs from the target's, as llama.cpp's common_speculative_are_compatible
    compares them: the kind of vocabulary (BPE, Unigram...), the beginning- and end-of-text tokens, the sizes
    (MAX_VOCAB_DIFFERENCE apart at most) and each token's text from CHECKED_FROM on; None where they agree."""
    vocabularies = []
    for tokenizer, whose in ((target, "the target model"), (draft, "the draft model")):
        backend = getattr(tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "get_vocab"):
            return f"{whose} has no vocabulary to compare (a tokenizer.json or a GGUF's)"
        vocabularies.append(backend)
    target_vocab, draft_vocab = vocabularies
    kinds = type(target_vocab.model).__name__, type(draft_vocab.model).__name__
    if kinds[0] != kinds[1]:
        return f"its vocabulary is {kinds[1]}, the target's {kinds[0]}"
    for name in ("bos_token", "eos_token"):
        tokens = [getattr(t, name, None) for t in (target, draft)]
        ids = [None if t is None else v.token_to_id(t) for t, v in zip(tokens, vocabularies)]
        if (tokens[0], ids[0]) != (tokens[1], ids[1]):
            return f"its {name} is {tokens[1]!r} (id {ids[1]}), the target's {tokens[0]!r} (id {ids[0]})"
    sizes = target_vocab.get_vocab_size(with_added_tokens=True), draft_vocab.get_vocab_size(with_added_tokens=True)
    if abs(sizes[0] - sizes[1]) > MAX_VOCAB_DIFFERENCE:
        return f"its vocabulary has {sizes[1]} tokens, the target's {sizes[0]} (at most {MAX_VOCAB_DIFFERENCE} apart)"
    texts = [{i: text for text, i in v.get_vocab(with_added_tokens=True).items()} for v in vocabularies]
    for i in range(CHECKED_FROM, min(sizes)):
        if texts[0].get(i) != texts[1].get(i):
            return f"its token {i} is {texts[1].get(i)!r}, the target's {texts[0].get(i)!r}"
    return None


def attach_draft_model(
    target: Engine, source: str, quant: str | None = None, p_min: float = DRAFT_P_MIN, n_min: int = DRAFT_MIN
) -> DraftModel:
    """The draft model at ``source`` (what ``load`` takes: a Hugging Face directory or Hub name, a .gguf, a .kst),
    loaded at ``quant`` on ``target``'s backend with its activations, drafting up to a guess it gives less
    probability than ``p_min``, its drafts of fewer than ``n_min`` guesses dropped, set as ``target.draft_model``
    and closed with it. A KestrelError (one line) where it cannot draft for ``target``: another vocabulary, an
    embedding model, or one whose guesses cannot be taken back (recurrent layers, a backend's KV cache that does
    not rewind)."""
    from kestrel_core.model.engine_load import load
    from kestrel_core.model.loader import load_model

    checked_p_min(p_min)  # before the model loads
    checked_n_min(n_min)
    try:
        loaded = load_model(source, quant=quant)
        config = loaded.model.config
        unfit = vocabulary_mismatch(target.tokenizer, loaded.tokenizer)
        if unfit is None and config.pooling is not None:
            unfit = "it is an embedding model, which gives no tokens"
        if unfit is None and config.state_layers:
            unfit = "its recurrent layers keep a state, which cannot take back the guesses the target does not keep"
        if unfit is not None:
            raise KestrelError(f"it cannot draft for this model: {unfit}")
        pool = target.pool
        engine = load(
            loaded,
            backend=target.backend_name,
            # as many positions as the target's pool, where the machine's memory holds them (a draft whose positions
            # take more bytes than the target's may not); a request past them decodes without guesses
            kv_cache_mb=KVPool.budget_for(config, pool.capacity, pool.kv_type),
            activations=target.activations,
            backend_options=target.registry.options if target.registry is not None else None,
            kv_cache_type=pool.kv_type,
        )
        if not engine.rewinds:
            engine.close()
            raise KestrelError(
                f"it cannot draft for this model: the {engine.backend_name} backend keeps its KV cache, which "
                "cannot take back the guesses the target does not keep (that takes API 1.6's kestrel_forward_batch)"
            )
    except KestrelError as exc:
        raise KestrelError(f"the draft model {source}: {exc}") from None
    draft = DraftModel(engine, target.config.vocab_size, p_min, n_min)
    target.draft_model = draft
    target.on_close(engine.close)
    return draft
