"""Speculative decoding with a draft model (``--draft-model``, llama.cpp's ``-md``, vLLM's draft-model
speculative_config): a smaller model of the same vocabulary guesses a greedy request's next tokens, which the
target model checks in one step as it checks prompt lookup's (kestrel_core.model.speculate), so the answer is the
target's greedy answer whatever the draft guesses.

The draft model is an ``Engine`` of its own on the target's backend, with the target's activations and KV cache type,
and a KV pool of as many positions as the target's (a small one for a small model; its pages are only touched as
they are used). Each request has a sequence in it (``Request.draft_seq``) kept in step with the request's tokens:
when the scheduler asks for drafts, the sequence is rewound to where it agrees with them (past the guesses the
target did not keep) and runs the rest (the tokens the target kept, and its next one) as one chunk, whose last row's
argmax is the first guess; each further guess is a decode step. The requests of a scheduler step draft together:
one batched step of the draft model at a time. A request's sequence is freed when it ends or is preempted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kestrel_core.batch import greedy_token
from kestrel_core.errors import KestrelError
from kestrel_core.model.engine import Engine, SeqState
from kestrel_core.model.kv_pool import bytes_per_position
from kestrel_core.model.speculate import Guesser
from kestrel_core.model.weights import PREFILL_CHUNK

if TYPE_CHECKING:
    from kestrel_core.model.request import Request

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


class DraftModel(Guesser):
    """Drafts by a draft model's greedy decoding (see the module docstring): ``engine`` is the draft model's,
    ``vocab_size`` the target's (a guess past it, a padded vocabulary's id, ends the draft)."""

    def __init__(self, engine: Engine, vocab_size: int) -> None:
        self.engine = engine
        self.vocab_size = vocab_size

    def offers(self, request: Request) -> bool:
        """Whether the draft model holds ``request``'s tokens: its context and KV pool."""
        n = len(request.tokens)
        return n <= self.engine.config.max_position and self.engine.pool.blocks_for(n) <= self.engine.pool.num_blocks

    def forget(self, request: Request) -> None:
        if request.draft_seq is not None:
            self.engine.release(request.draft_seq.seq)
            request.draft_seq = None

    def drafts(self, asks: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """Each request's guesses: its sequence caught up with its tokens, then greedy decode steps, batched over
        the requests; none for a request whose draft would pass the draft model's context or KV pool."""
        engine = self.engine
        guesses: list[list[int]] = [[] for _ in asks]
        runs: list[tuple[int, SeqState, list[int], int]] = []  # (ask, sequence, tokens to run, guesses wanted)
        for i, (request, k) in enumerate(asks):
            tokens = request.tokens
            k = min(k, engine.config.max_position - len(tokens) + 1)  # it runs the tokens, then k - 1 guesses
            if k <= 0:
                continue
            seq = self._in_step(request)
            if engine.pool.reserve(seq.cache, len(tokens) + k - 1):
                runs.append((i, seq, tokens[len(seq.tokens) :], k))
        while True:  # a long catch-up (a request's first draft): all but its last prefill chunk, a chunk a step
            long = [j for j, (_, _, rest, _) in enumerate(runs) if len(rest) > PREFILL_CHUNK]
            if not long:
                break
            engine.run_batch([(runs[j][1], runs[j][2][:PREFILL_CHUNK], 0) for j in long])
            for j in long:
                i, seq, rest, k = runs[j]
                runs[j] = (i, seq, rest[PREFILL_CHUNK:], k)
        while runs:
            outs = engine.run_batch([(seq, rest, 1) for _, seq, rest, _ in runs], [True] * len(runs))
            going = []
            for (i, seq, _, k), out in zip(runs, outs):
                token = greedy_token(out)
                if token >= self.vocab_size:
                    continue
                guesses[i].append(token)
                if len(guesses[i]) < k:
                    going.append((i, seq, [token], k))
            runs = going
        return guesses

    def _in_step(self, request: Request) -> SeqState:
        """``request``'s sequence (a new one on its first draft: a cached prefix of its prompt attached), rewound to
        the tokens it shares with the request, short of the request's last (whose row gives the first guess)."""
        tokens = request.tokens
        state = request.draft_seq
        if state is None:
            seq = self.engine.new_sequence(len(request.prompt_ids), tokens)
            state = request.draft_seq = DraftSequence(seq, len(seq.tokens))
        seq = state.seq
        same = min(state.known, len(seq.tokens), len(tokens) - 1)
        end = min(len(seq.tokens), len(tokens) - 1)
        while same < end and seq.tokens[same] == tokens[same]:
            same += 1
        if same < len(seq.tokens):
            self.engine.rewind(seq, same)
        state.known = len(tokens)  # once its tokens are run, as they are before any guess
        return seq


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


def attach_draft_model(target: Engine, source: str, quant: str | None = None) -> DraftModel:
    """The draft model at ``source`` (what ``load`` takes: a Hugging Face directory or Hub name, a .gguf, a .kst),
    loaded at ``quant`` on ``target``'s backend with its activations, set as ``target.draft_model`` and closed with
    it. A KestrelError (one line) where it cannot draft for ``target``: another vocabulary, an embedding model, or
    one whose guesses cannot be taken back (recurrent layers, a backend's KV cache that does not rewind)."""
    from kestrel_core.model.engine_load import load
    from kestrel_core.model.loader import load_model

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
        block_bytes = bytes_per_position(config, pool.kv_type) * pool.block_size
        engine = load(
            loaded,
            backend=target.backend_name,
            kv_cache_mb=(pool.num_blocks + 1) * block_bytes / 2**20,  # a block over, for rounding MB to blocks
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
    draft = DraftModel(engine, target.config.vocab_size)
    target.draft_model = draft
    target.on_close(engine.close)
    return draft
