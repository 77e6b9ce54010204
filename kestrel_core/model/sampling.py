"""Next-token choice from logits: per-request parameters, penalties, temperature / top-k / top-p, logprobs.

``SamplingParams`` is what a request asks for (the OpenAI fields); ``Sampler`` holds one request's state (its
seeded generator and the counts of the tokens it generated, for the penalties) and picks each token.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kestrel_core.errors import InvalidRequest

MAX_TOP_LOGPROBS = 5


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops. ``check()`` names the first bad field."""

    max_tokens: int = 128
    temperature: float = 0.0  # 0: greedy (the first largest logit)
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = 0  # None: a fresh random seed
    stop: tuple[str, ...] = ()  # generation ends before the first of these strings
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # times the number of times it was generated
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token, 0..MAX_TOP_LOGPROBS
    ignore_eos: bool = False

    def check(self) -> SamplingParams:
        def bad(name: str, why: str) -> InvalidRequest:
            return InvalidRequest(f"{name} {why}", param=name)

        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise bad("max_tokens", f"must be an integer >= 0, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= 100:
            raise bad("temperature", f"must be a number in [0, 100], got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2 ** 63):
            raise bad("seed", f"must be an integer in [0, 2^63), got {self.seed!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if len(self.stop) > 4:
            raise bad("stop", f"allows at most 4 strings, got {len(self.stop)}")
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be token ids >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, f"must be a number in [-2, 2], got {value!r}")
        if not isinstance(self.logprobs, bool):
            raise bad("logprobs", f"must be a boolean, got {self.logprobs!r}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0


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
    """Picks one token id from a row of logits [vocab]; the same seed gives the same tokens."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params.check()
        seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy % 2 ** 63)
        self.rng = np.random.default_rng(seed)
        self.counts: Counter[int] = Counter()  # generated token -> times, for the penalties

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def __call__(self, logits: np.ndarray) -> int:
        """The next token; counted for the penalties."""
        z = self.processed(logits)
        if self.greedy:
            token = int(np.argmax(z))  # the first maximum: deterministic
        else:
            ids, probs = self.distribution(z)
            # inverse CDF with one uniform draw; the clip guards the last bucket against rounding
            idx = int(np.searchsorted(np.cumsum(probs), self.rng.random() * probs.sum(), side="right"))
            token = int(ids[min(idx, len(ids) - 1)])
        self.counts[token] += 1
        return token

    def processed(self, logits: np.ndarray) -> np.ndarray:
        """The logits [vocab] after the presence and frequency penalties (float32; a copy only if penalized)."""
        z = np.asarray(logits, dtype=np.float32).reshape(-1)
        p = self.params
        if not p.penalized or not self.counts:
            return z
        ids = np.fromiter(self.counts.keys(), np.int64, len(self.counts))
        times = np.fromiter(self.counts.values(), np.float32, len(self.counts))
        z = z.copy()
        z[ids] -= np.float32(p.presence_penalty) + np.float32(p.frequency_penalty) * times
        return z

    def distribution(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(candidate ids, their probabilities) of processed logits after temperature, top-k and top-p."""
        p = self.params
        z = np.asarray(z, dtype=np.float64).reshape(-1) / p.temperature
        if 0 < p.top_k < len(z):
            ids = np.argpartition(-z, p.top_k - 1)[:p.top_k]
        else:
            ids = np.arange(len(z))
        if p.top_p < 1:  # nucleus: sort (only then), most likely first
            ids = ids[np.argsort(-z[ids], kind="stable")]
        probs = np.exp(z[ids] - z[ids].max())
        probs /= probs.sum()
        if p.top_p < 1:
            # the smallest prefix whose mass reaches top_p (at least one token)
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p, side="left")) + 1
            ids, probs = ids[:keep], probs[:keep] / probs[:keep].sum()
        return ids, probs


def logprobs_of(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """log-softmax of the model's logits [vocab] (before penalties and temperature, as OpenAI reports them)."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1)
    shifted = z - z.max()
    lse = math.log(float(np.exp(shifted).sum()))
    best: Sequence[int] = ()
    if top:
        part = np.argpartition(-shifted, top - 1)[:top]
        best = part[np.argsort(-shifted[part], kind="stable")].tolist()
    return TokenLogprob(int(token), float(shifted[token] - lse), [(int(i), float(shifted[i] - lse)) for i in best])
