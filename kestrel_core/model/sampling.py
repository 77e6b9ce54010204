"""Next-token choice from logits: greedy (temperature 0), temperature, top-k, top-p, seeded."""

from __future__ import annotations

import numpy as np

from kestrel_core.errors import KestrelError


class Sampler:
    """Picks one token id from a row of logits [vocab]; the same seed gives the same tokens."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = 0) -> None:
        if not temperature >= 0:  # also rejects NaN
            raise KestrelError(f"temperature must be >= 0, got {temperature}")
        if top_k < 0:
            raise KestrelError(f"top-k must be >= 0 (0 = off), got {top_k}")
        if not 0 < top_p <= 1:
            raise KestrelError(f"top-p must be in (0, 1], got {top_p}")
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def __call__(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits).reshape(-1)
        if self.greedy:
            return int(np.argmax(logits))  # the first maximum: deterministic
        ids, probs = self.distribution(logits)
        # inverse CDF with one uniform draw; the clip guards the last bucket against rounding
        idx = int(np.searchsorted(np.cumsum(probs), self.rng.random() * probs.sum(), side="right"))
        return int(ids[min(idx, len(ids) - 1)])

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(candidate ids, their probabilities) after temperature, top-k and top-p."""
        z = np.asarray(logits, dtype=np.float64).reshape(-1) / self.temperature
        if 0 < self.top_k < len(z):
            ids = np.argpartition(-z, self.top_k - 1)[:self.top_k]
        else:
            ids = np.arange(len(z))
        if self.top_p < 1:  # nucleus: sort (only then), most likely first
            ids = ids[np.argsort(-z[ids], kind="stable")]
        p = np.exp(z[ids] - z[ids].max())
        p /= p.sum()
        if self.top_p < 1:
            # the smallest prefix whose mass reaches top_p (at least one token)
            keep = int(np.searchsorted(np.cumsum(p), self.top_p, side="left")) + 1
            ids, p = ids[:keep], p[:keep] / p[:keep].sum()
        return ids, p
