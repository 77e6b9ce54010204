"""Next-token choice from logits: per-request parameters, penalties, temperature / top-k / top-p / min-p, logprobs.

``SamplingParams`` is what a request asks for (the OpenAI fields); ``Sampler`` holds one request's state (its
seeded generator and the counts of the tokens it generated, for the penalties) and picks each token.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kestrel_core.errors import InvalidRequest, KestrelError, invalid_request
from kestrel_core.model.validate import strict_text

if TYPE_CHECKING:
    from kestrel_core.model.grammar import Constraint

MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit, vLLM's default
MAX_STOP_STRINGS = 64  # OpenAI takes 4; Ollama, Anthropic and vLLM set none, and editors send a dozen
MAX_LOGIT_BIAS = 300  # tokens one logit_bias names, at most (OpenAI's bound)
MAX_STOP_TOKEN_IDS = 1024  # each generated token is looked up among them
MAX_REPETITION_PENALTY = 10.0


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops. ``check()`` names the first bad field."""

    max_tokens: int = 128
    # vLLM's: the end of text and the stop token ids are not sampled, and stop strings do not end the answer,
    # before this many tokens
    min_tokens: int = 0
    temperature: float = 0.0  # 0: greedy (the first largest logit)
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # tokens less likely than min_p times the most likely are dropped (after top-k, top-p)
    seed: int | None = 0  # None: a fresh random seed
    stop: tuple[str, ...] = ()  # generation ends before the first of these strings
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # times the number of times it was generated
    # Hugging Face's (and vLLM's): the logit of every token in the prompt or generated so far is divided by it
    # where positive, multiplied where negative; 1: off
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token, 0..MAX_TOP_LOGPROBS
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit in [-100, 100]), OpenAI's
    grammar: str | None = None  # llguidance grammar text the answer must match (kestrel_core.model.grammar)
    skip_special_tokens: bool = True  # vLLM's: special tokens' text is left out of the answer's text
    include_stop_str_in_output: bool = False  # vLLM's: the text ends with the stop string, not before it

    def check(self) -> SamplingParams:
        def bad(name: str, why: str) -> InvalidRequest:
            return InvalidRequest(f"{name} {why}", param=name)

        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise bad("max_tokens", f"must be an integer >= 0, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens",
                      f"must be an integer in [0, max_tokens ({self.max_tokens})], got {self.min_tokens!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= 100:
            raise bad("temperature", f"must be a number in [0, 100], got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise bad("repetition_penalty",
                      f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2 ** 63):
            raise bad("seed", f"must be an integer in [0, 2^63), got {self.seed!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise bad("stop", f"must be a tuple of non-empty strings, got {self.stop!r}")
        if not all(self.stop):  # vLLM's words: the empty string ends every answer before it begins
            raise bad("stop", "cannot contain an empty string")
        for s in self.stop:  # a lone surrogate is in no decoded text: such a stop string would never match
            try:
                strict_text(s, "stop")
            except KestrelError as exc:
                raise invalid_request(exc, "stop") from None
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"allows at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if isinstance(self.stop_token_ids, tuple) and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"allows at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be a tuple of token ids >= 0, got {self.stop_token_ids!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, f"must be a number in [-2, 2], got {value!r}")
        for name in ("logprobs", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"must be a boolean, got {getattr(self, name)!r}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:  # OpenAI's rule too: they would be left out unsaid
            raise bad("top_logprobs", "needs logprobs=True (the alternatives come with each token's logprob)")
        if not isinstance(self.logit_bias, tuple) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"must hold at most {MAX_LOGIT_BIAS} (token id, bias) pairs")
        for pair in self.logit_bias:
            if not (isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0]) and pair[0] >= 0
                    and _is_number(pair[1])):
                raise bad("logit_bias", f"must map token ids >= 0 to numbers in [-100, 100], got {pair!r}")
            if not -100 <= pair[1] <= 100:
                raise bad("logit_bias", f"values must be in [-100, 100], got {pair[1]:g} for token {pair[0]}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise bad("grammar", f"must be llguidance's grammar text, got {type(self.grammar).__name__}")
        if self.grammar is not None and self.min_tokens:
            raise bad("min_tokens", "cannot be combined with a grammar (a complete answer must be able to end)")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusted(self) -> bool:
        """Whether the logits change before sampling (penalties, a logit bias, a grammar, min_tokens): the device's
        argmax will not do."""
        return self.penalized or bool(self.logit_bias) or self.grammar is not None or self.min_tokens > 0

    @property
    def argmax_only(self) -> bool:
        """Only the greedy token of the logits is needed: a backend may choose it on the device, and greedy steps
        may guess tokens ahead (speculative decoding)."""
        return self.greedy and not self.adjusted and not self.logprobs


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float, np.number)) and not isinstance(x, bool) and math.isfinite(float(x))


@dataclass
class TokenLogprob:
    """The chosen token's log-probability under the model and the most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first


class Sampler:
    """Picks one token id from a row of logits [vocab]; the same seed gives the same tokens. ``constraint``: the
    request's grammar (kestrel_core.model.grammar.Constraint), which every token chosen keeps to; ``prompt_ids``:
    the prompt's tokens, which the repetition penalty counts as seen; ``eos_ids``: the end-of-text tokens, which
    are not sampled before ``min_tokens`` (unless ``ignore_eos``), as the stop token ids are not."""

    def __init__(self, params: SamplingParams, constraint: Constraint | None = None,
                 prompt_ids: Sequence[int] = (), eos_ids: Collection[int] = ()) -> None:
        self.params = params.check()
        self.constraint = constraint
        self.generated = 0
        held = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self._held_back = np.array(sorted(held), np.int64) if params.min_tokens else np.empty(0, np.int64)
        self._prompt_seen = (np.unique(np.asarray(prompt_ids, np.int64)) if params.repetition_penalty != 1
                             else np.empty(0, np.int64))
        seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy % 2 ** 63)
        self.rng = np.random.default_rng(seed)
        self.counts: Counter[int] = Counter()  # generated token -> times, for the penalties
        bias = dict(self.params.logit_bias)  # a token named twice: its last bias, as in a JSON object
        self._bias = (np.fromiter(bias.keys(), np.int64, len(bias)), np.fromiter(bias.values(), np.float32, len(bias)))

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def __call__(self, logits: np.ndarray) -> int:
        """The next token; counted for the penalties."""
        z = self.processed(logits)
        if self.constraint is not None:
            z = self.constraint.allow(z)
        if self.greedy:
            token = int(np.argmax(z))  # the first maximum: deterministic
        else:
            ids, weights = self._candidates(z)
            i = _inverse_cdf(weights, self.rng.random())
            token = i if ids is None else int(ids[i])
        self.count(token)
        return token

    def count(self, token: int) -> None:
        """Record a generated token (for the penalties, min_tokens and the grammar), whoever chose it."""
        self.generated += 1
        self.counts[token] += 1
        if self.constraint is not None:
            self.constraint.accept(token)

    def processed(self, logits: np.ndarray) -> np.ndarray:
        """The logits [vocab] with the logit bias added, then the repetition penalty, then the presence and
        frequency penalties (vLLM's order; float32, a copy only if adjusted)."""
        z = np.asarray(logits, dtype=np.float32).reshape(-1)
        p = self.params
        penalize = p.penalized and (bool(self.counts) or len(self._prompt_seen) > 0)
        hold = self.generated < p.min_tokens
        if not penalize and not p.logit_bias and not hold:
            return z
        z = z.copy()
        if hold:
            held = self._held_back[self._held_back < len(z)]
            z[held] = -np.inf
        if p.logit_bias:
            ids, bias = self._bias
            z[ids] += bias
        if not penalize:
            return z
        ids = np.fromiter(self.counts.keys(), np.int64, len(self.counts))  # [U] generated tokens
        if p.repetition_penalty != 1:
            seen = np.union1d(self._prompt_seen, ids)
            seen = seen[seen < len(z)]  # a prompt may hold ids the logits do not (a row of another width)
            penalty = np.float32(p.repetition_penalty)
            with np.errstate(over="ignore"):  # a tiny penalty: the largest float32, not inf
                z[seen] = np.where(z[seen] > 0, np.minimum(z[seen] / penalty, np.finfo(np.float32).max),
                                   z[seen] * penalty)
        if p.presence_penalty or p.frequency_penalty:
            times = np.fromiter(self.counts.values(), np.float32, len(self.counts))
            z[ids] -= np.float32(p.presence_penalty) + np.float32(p.frequency_penalty) * times
        return z

    def distribution(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(candidate ids, their probabilities) of processed logits after temperature, top-k, top-p and min-p
        (transformers' order): every token in vocabulary order without top-k and top-p (those min-p drops at
        probability 0); else the kept ones, most likely first (ties: the lower id first). top-k keeps the k most
        likely; top-p then the smallest prefix of what is left whose mass reaches top_p (at least one token);
        min-p then those at least min_p times as likely as the most likely."""
        ids, weights = self._candidates(z)
        return (np.arange(len(weights)) if ids is None else ids), weights / weights.sum()

    def _candidates(self, z: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """``distribution``'s, unnormalized; None for every token (the weights then live in this thread's
        scratch array until its next use)."""
        p = self.params
        e = _scratch(z)  # [V] float64, in place from here: a fresh array's page faults cost as much as the work
        e -= e.max()  # before the temperature: a tiny one (1e-310) would make the largest inf, and inf - inf NaN
        with np.errstate(over="ignore"):
            e /= p.temperature
        np.exp(e, out=e)  # the largest 1
        if not 0 < p.top_k < len(e) and p.top_p >= 1:
            if p.min_p > 0:
                e[e < p.min_p] = 0.0
            return None, e
        if 0 < p.top_k < len(e):
            ids = _most_likely_first(_top_k(_top_set(e, lambda cand: len(cand) >= p.top_k), e, p.top_k), e)
            total = e[ids].sum()
        else:
            total = e.sum()
            ids = _most_likely_first(_top_set(e, lambda cand: e[cand].sum() >= p.top_p * total), e)
        probs = e[ids] / total
        if p.top_p < 1:
            # the smallest prefix whose mass reaches top_p (at least one token)
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p, side="left")) + 1
            ids, probs = ids[:keep], probs[:keep] / probs[:keep].sum()
        if p.min_p > 0:  # probs run most likely first: what is kept is a prefix
            keep = int(np.count_nonzero(probs >= p.min_p * probs[0]))
            ids, probs = ids[:keep], probs[:keep] / probs[:keep].sum()
        return ids, probs


_SCRATCH = threading.local()


def _scratch(z: np.ndarray) -> np.ndarray:
    """z as float64 in this thread's scratch array (reused: every row of a batch is the same size)."""
    z = np.asarray(z).reshape(-1)
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) != len(z):
        buf = _SCRATCH.buf = np.empty(len(z))
    np.copyto(buf, z)
    return buf


# weights relative to the largest, tried in turn: every power of ten to 1e-16, then 1e-32 .. 1e-256
TOP_SET_FLOORS = tuple(10.0 ** -i for i in range(1, 17)) + tuple(10.0 ** -(2 ** i) for i in range(5, 9))
LOG_FLOORS = tuple(math.log(f) for f in TOP_SET_FLOORS)  # the same for log-weights (the largest 0)


def _top_set(e: np.ndarray, enough: Callable[[np.ndarray], bool], floors: Sequence[float] = TOP_SET_FLOORS
             ) -> np.ndarray:
    """Ids (ascending) of every token whose weight in ``e`` (the largest 1) is at least the first of
    ``floors`` whose set is ``enough``; every token if none is. A set of all tokens above a floor holds
    the k most likely and any most-likely-first prefix of less mass, ties included, so top-k and top-p
    look at a few hundred tokens, not the vocabulary (a full sort of 151,936 logits took 16 ms)."""
    for floor in floors:
        cand = np.flatnonzero(e >= floor)
        if enough(cand):
            return cand
    return np.arange(len(e))


def _top_k(ids: np.ndarray, e: np.ndarray, k: int) -> np.ndarray:
    """The k of ``ids`` (ascending, at least k) of the largest weights, the lower ids among equal ones."""
    if len(ids) == k:
        return ids
    w = e if len(ids) == len(e) else e[ids]
    kth = np.partition(w, len(w) - k)[len(w) - k]  # the k-th largest weight
    above = ids[w > kth]
    return np.concatenate([above, ids[w == kth][:k - len(above)]])


def _most_likely_first(ids: np.ndarray, e: np.ndarray) -> np.ndarray:
    """``ids`` (ascending) by descending weight, the lower id first among equal weights."""
    return ids[np.argsort(-e[ids], kind="stable")]


INVERSE_CDF_BLOCK = 256


def _inverse_cdf(probs: np.ndarray, u: float) -> int:
    """The index whose cumulative probability interval holds ``u`` (in [0, 1)) times the total: by blocks of
    INVERSE_CDF_BLOCK, then within one, so a draw over the vocabulary adds up 600 block sums and 256
    probabilities instead of all of them (a cumulative sum of 151,936 float64 took 0.5 ms)."""
    n, bs = len(probs), INVERSE_CDF_BLOCK
    full = n // bs
    sums = probs[:full * bs].reshape(full, bs).sum(axis=1)  # [full]; the tail (n % bs) is one more block
    ends = np.cumsum(np.append(sums, probs[full * bs:].sum()) if n % bs else sums)
    r = u * ends[-1]
    b = min(int(np.searchsorted(ends, r, side="right")), len(ends) - 1)
    block = probs[b * bs:(b + 1) * bs]
    i = min(int(np.searchsorted(np.cumsum(block), r - (ends[b - 1] if b else 0.0), side="right")), len(block) - 1)
    at = b * bs + i
    while probs[at] == 0 and at > 0:  # rounding past the last token of weight: back to it
        at -= 1
    return at


def logprobs_of(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """log-softmax of the model's logits [vocab] (before penalties and temperature, as OpenAI reports them)."""
    shifted = _scratch(logits)
    shifted -= shifted.max()
    chosen = float(shifted[token])
    best: list[tuple[int, float]] = []
    if top:  # the most likely first, the lower id among ties (as the sampler's top-k)
        ids = _most_likely_first(_top_k(_top_set(shifted, lambda cand: len(cand) >= top, LOG_FLOORS), shifted,
                                        top), shifted)
        best = [(int(i), float(shifted[i])) for i in ids]
    lse = math.log(float(np.exp(shifted, out=shifted).sum()))
    return TokenLogprob(int(token), chosen - lse, [(i, v - lse) for i, v in best])
