"""Embeddings: a text's final hidden states pooled into one vector (``kestrel embed``, ``/v1/embeddings``).

The decoder reads the text as it reads a prompt, on the host path with the backend's GEMMs (the whole-step
hooks give logits, not hidden states). The vector is the final-normed hidden state of the last token ("last":
Qwen3-Embedding, e5-mistral), their mean ("mean") or the first token's ("cls"): the checkpoint's pooling
(``ModelConfig.pooling``; a model that generates pools by "last"), or the caller's. It is cut to its first
``dimensions`` components (Matryoshka) and then, where the model asks for it, scaled to unit length.

An ``EmbedJob`` runs at most ``budget`` tokens a step and holds KV blocks for a text only while it runs, so
``AsyncEngine`` interleaves its steps with the generation steps: a long text delays the streams by a prefill
chunk at a time, not by its whole length. A job holds at most one text part-way (it starts no text while one it
runs waits for blocks), and ``pause`` gives that text's blocks back, to run it again from its start later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from kestrel_core.dispatch import all_finite
from kestrel_core.errors import InvalidRequest, KestrelError, NonFiniteLogits, Overloaded, invalid_request, safe_repr
from kestrel_core.model.config import POOLINGS
from kestrel_core.model.driver import Driver, driving
from kestrel_core.model.validate import is_int
from kestrel_core.model.weights import PREFILL_CHUNK

NORM_EPS = 1e-12  # torch.nn.functional.normalize's, as sentence-transformers' Normalize uses


def finish_vector(v: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """A pooled vector [D] cut to its first ``dimensions`` and, with ``normalize``, scaled to unit length."""
    v = np.asarray(v[:dimensions] if dimensions else v, np.float64)
    if normalize:
        v = v / max(float(np.linalg.norm(v)), NORM_EPS)
    return v.astype(np.float32)


def check_input(engine: Any, ids: Sequence[int], what: str = "input", param: str | None = None) -> list[int]:
    """``ids`` as a list of token ids ``engine`` embeds; InvalidRequest naming ``param`` (default ``what``, the
    input's name in the message) for ids outside the vocabulary, past the context or past the whole KV cache."""
    try:
        ids = engine.check_ids(ids, what)
    except KestrelError as exc:
        raise invalid_request(exc, param or what) from None
    if engine.pool.blocks_for(len(ids)) > engine.pool.num_blocks:
        raise InvalidRequest(f"the {what} has {len(ids)} tokens; the KV cache holds {engine.pool.capacity}",
                             param=param or what)
    return ids


class EmbedJob:
    """The embeddings of several token sequences, computed ``step()`` by ``step()`` (on the engine's thread)."""

    def __init__(self, engine: Any, inputs: Sequence[Sequence[int]], *, pooling: str | None = None,
                 dimensions: int | None = None, budget: int = PREFILL_CHUNK) -> None:
        c = engine.config
        if isinstance(inputs, (str, bytes)) or not isinstance(inputs, (Sequence, np.ndarray)) or len(inputs) == 0:
            raise InvalidRequest("no input to embed: give a sequence of token id sequences", param="input")
        self.inputs = [check_input(engine, ids) for ids in inputs]
        if pooling is not None and not (isinstance(pooling, str) and pooling in POOLINGS):  # only None is the model's
            raise InvalidRequest(f"pooling must be one of {', '.join(POOLINGS)} or None (the model's), got "
                                 f"{safe_repr(pooling)}", param="pooling")
        self.pooling = pooling if pooling is not None else c.pooling or "last"
        if dimensions is not None and (not is_int(dimensions) or not 1 <= dimensions <= c.hidden_size):
            raise InvalidRequest(f"dimensions must be in [1, {c.hidden_size}], got {dimensions!r}", param="dimensions")
        if budget < 1:
            raise KestrelError("an embedding step needs a budget of at least one token")
        self.engine, self.dimensions, self.budget = engine, dimensions, budget
        self.normalize = c.normalize_embeddings
        self.prompt_tokens = sum(len(ids) for ids in self.inputs)
        self._vectors: list[np.ndarray | None] = [None] * len(self.inputs)
        self._running: dict[int, Any] = {}  # input index -> its SeqState, while it runs
        self._sums: dict[int, np.ndarray] = {}  # "mean": each running input's sum of rows so far, float64 [D]
        self._pending = deque(range(len(self.inputs)))  # the inputs not started, in order

    @property
    def driver(self) -> Driver:
        return self.engine.driver  # type: ignore[no-any-return]

    @property
    def done(self) -> bool:
        return not self._pending and not self._running

    @property
    def holding(self) -> bool:
        """Whether the job holds KV blocks (an input it runs)."""
        return bool(self._running)

    def _needed(self, index: int) -> int:
        """Tokens of input ``index`` that its vector depends on: a causal decoder's first row sees one."""
        return 1 if self.pooling == "cls" else len(self.inputs[index])

    @driving
    def step(self) -> None:
        """Run up to ``budget`` tokens: the next chunks of the running inputs, then inputs not started yet.
        Overloaded when the KV cache has no room for any of them now (the job keeps what it has); a KestrelError
        once the engine is closed."""
        engine, pool = self.engine, self.engine.pool
        engine.check_open()
        budget = self.budget
        work: list[tuple[int, Any, list[int], int]] = []  # (index, seq, tokens, rows)
        waiting = False  # a running input lacks blocks: a second one started now could hold what it needs
        for index, seq in list(self._running.items()):
            n = min(self._needed(index) - seq.cache.length, budget)
            if budget and pool.reserve(seq.cache, seq.cache.length + n):
                work.append(self._chunk(index, seq, n))
                budget -= n
            else:
                waiting = True
        while budget and self._pending and not waiting:
            index = self._pending[0]
            seq = engine.new_sequence(len(self.inputs[index]))
            n = min(self._needed(index), budget)
            if not pool.reserve(seq.cache, n):
                engine.release(seq)
                break
            self._running[self._pending.popleft()] = seq
            work.append(self._chunk(index, seq, n))
            budget -= n
        if not work:
            raise Overloaded("the KV cache has no room for the input now; retry later")
        outs = engine.decoder.forward_batch([(seq.cache, np.asarray(toks, np.int64), rows)
                                            for _, seq, toks, rows in work], hidden=True)
        for (index, seq, _, _), out in zip(work, outs):
            if not all_finite(out):
                raise NonFiniteLogits("the model produced non-finite hidden states (NaN or inf)")
            self._take(index, seq, out)

    def _chunk(self, index: int, seq: Any, n: int) -> tuple[int, Any, list[int], int]:
        start = seq.cache.length
        last = start + n == self._needed(index)
        rows = n if self.pooling != "last" else int(last)
        return index, seq, self.inputs[index][start:start + n], rows

    def _take(self, index: int, seq: Any, out: np.ndarray) -> None:
        """One chunk's rows [rows, D] of input ``index``; its vector once its last chunk is in."""
        if self.pooling == "mean" and len(out):
            self._sums[index] = self._sums.get(index, 0) + out.sum(axis=0, dtype=np.float64)
        if seq.cache.length < self._needed(index):
            return
        if self.pooling == "mean":
            pooled = self._sums.pop(index) / len(self.inputs[index])
        else:
            pooled = out[-1] if self.pooling == "last" else out[0]
        self._vectors[index] = finish_vector(pooled, self.dimensions, self.normalize)
        del self._running[index]
        self.engine.release(seq)

    def result(self) -> np.ndarray:
        """The embeddings, float32 [inputs, dimensions or D], once ``done``."""
        if not self.done:
            raise KestrelError("the embeddings are not computed yet")
        return np.stack(self._vectors)  # type: ignore[arg-type]

    @driving
    def pause(self) -> None:
        """Give back the KV blocks of the inputs running: they run again from their start at a later step."""
        self._pending.extendleft(sorted(self._running, reverse=True))
        self.close()

    @driving
    def close(self) -> None:
        """Free the KV blocks of the inputs still running (a job given up halfway)."""
        for seq in self._running.values():
            self.engine.release(seq)
        self._running.clear()
        self._sums.clear()
