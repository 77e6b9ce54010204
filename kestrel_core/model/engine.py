"""The Python API: ``load(model, backend, quant) -> Engine``; logits, generation, stats.

Each step first offers the backend's whole-step forward (``kestrel_forward``, its own KV cache). When it
declines, the host runs the layer-by-layer decoder, whose KV cache may lag behind the device's: the host
first runs the tokens it is missing (one batched pass), so a fallback at any step gives the same result.
Likewise a device that declined earlier is offered the tokens it missed along with the new ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kestrel_core.dispatch import Offload
from kestrel_core.errors import KestrelError
from kestrel_core.model.decoder import Decoder, KVCache
from kestrel_core.model.sampling import Sampler
from kestrel_core.model.weights import Model
from kestrel_core.registry import Backend, Registry


@dataclass
class RunStats:
    """Timings of the last generate/logits call."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class _Sequence:
    seq_id: int
    cache: KVCache
    tokens: list[int] = field(default_factory=list)  # every token run so far, position = index
    device_len: int = 0  # positions the device's own KV cache holds


class Engine:
    """A model bound to a backend (the CPU computes whatever the backend declines)."""

    def __init__(self, model: Model, tokenizer: Any, backend: Backend, cpu: Backend, *,
                 registry: Registry | None = None, source: str = "", preload: bool = True) -> None:
        self.model = model
        self.config = model.config
        self.tokenizer = tokenizer
        self.backend = backend
        self.registry = registry
        self.source = source
        self.offload = Offload(backend, cpu)
        self.decoder = Decoder(model, self.offload)
        self.last = RunStats()
        self._next_seq = 1
        self.preload_s = 0.0
        self.load_s = 0.0  # reading/building the model, set by load()
        if preload:
            t0 = time.perf_counter()
            self.offload.preload(model)
            self.preload_s = time.perf_counter() - t0

    # -- lifecycle -----------------------------------------------------------------------------------

    def close(self) -> None:
        if self.registry is not None:
            self.registry.close()
            self.registry = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def backend_line(self) -> str:
        """One line saying where this engine runs."""
        desc = self.backend.device_description
        kind = f"{self.backend.kind}" + (f", {desc}" if desc and desc != self.backend.kind else "")
        return f"backend: {self.backend.name} ({kind})"

    # -- steps ---------------------------------------------------------------------------------------

    def _new_sequence(self) -> _Sequence:
        seq = _Sequence(self._next_seq, self.decoder.new_cache())
        self._next_seq += 1
        return seq

    def _release(self, seq: _Sequence) -> None:
        self.offload.release_sequence(seq.seq_id)

    def _step(self, seq: _Sequence, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Run ``tokens`` at the next positions; logits [len(tokens), vocab] or [1, vocab] (the last)."""
        new = np.asarray(tokens, dtype=np.int64)
        start = len(seq.tokens)
        if start + len(new) > self.config.max_position:
            raise KestrelError(f"the sequence needs {start + len(new)} positions; the model's context is "
                               f"{self.config.max_position}")
        behind = seq.tokens[seq.device_len:]
        run = np.concatenate([np.asarray(behind, np.int64), new]) if behind else new
        out = self.offload.forward(self.model, seq.seq_id, run, seq.device_len, all_logits,
                                   self.config.vocab_size)
        if out is not None:
            seq.device_len = start + len(new)
        else:
            behind = seq.tokens[seq.cache.length:]
            run = np.concatenate([np.asarray(behind, np.int64), new]) if behind else new
            out = self.decoder.forward(run, seq.cache, all_logits=all_logits)
            assert out is not None
        seq.tokens.extend(int(t) for t in new)
        return out[-len(new):] if all_logits else out

    def _check_ids(self, ids: Sequence[int], what: str) -> list[int]:
        ids = [int(i) for i in ids]
        if not ids:
            raise KestrelError(f"the {what} is empty")
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise KestrelError(f"{what} token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        if len(ids) > self.config.max_position:
            raise KestrelError(f"the {what} has {len(ids)} tokens; the model's context is "
                               f"{self.config.max_position}")
        return ids

    # -- API -----------------------------------------------------------------------------------------

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits of the whole sequence: float32 [T, vocab]."""
        ids = self._check_ids(token_ids, "input")
        seq = self._new_sequence()
        try:
            t0 = time.perf_counter()
            out = self._step(seq, ids, all_logits=True)
            self.last = RunStats(prompt_tokens=len(ids), prefill_s=time.perf_counter() - t0)
            return out
        finally:
            self._release(seq)

    def generate(self, prompt_ids: Sequence[int], max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = 0,
                 stop_at_eos: bool = True) -> Iterator[int]:
        """Token ids as they are generated (prefill, then one decode step per token)."""
        ids = self._check_ids(prompt_ids, "prompt")
        if max_tokens < 0:
            raise KestrelError(f"max tokens must be >= 0, got {max_tokens}")
        sampler = Sampler(temperature, top_k, top_p, seed)
        eos = set(self.config.eos_token_ids) | set(getattr(self.tokenizer, "eos_token_ids", ()) or ())
        return self._generate(ids, max_tokens, sampler, eos if stop_at_eos else set())

    def _generate(self, ids: list[int], max_tokens: int, sampler: Sampler, eos: set[int]) -> Iterator[int]:
        stats = self.last = RunStats(prompt_tokens=len(ids))
        if max_tokens == 0:
            return
        seq = self._new_sequence()
        device_tokens: Iterator[int] | None = None  # the backend's pipelined greedy decode, once offered
        offered = False
        try:
            t0 = time.perf_counter()
            token = sampler(self._step(seq, ids)[-1])
            stats.prefill_s = time.perf_counter() - t0
            while True:
                stats.generated_tokens += 1
                yield token
                if token in eos or stats.generated_tokens >= max_tokens:
                    return
                if len(seq.tokens) >= self.config.max_position:
                    return  # the context is full
                t0 = time.perf_counter()
                if not offered and sampler.greedy and seq.device_len == len(seq.tokens):
                    offered = True
                    steps = min(max_tokens - stats.generated_tokens, self.config.max_position - len(seq.tokens))
                    device_tokens = self.offload.decode_greedy(self.model, seq.seq_id, token, len(seq.tokens),
                                                               steps, self.config.vocab_size)
                nxt = next(device_tokens, None) if device_tokens is not None else None
                if nxt is not None:  # the device ran ``token`` and chose the next one
                    seq.tokens.append(token)
                    seq.device_len = len(seq.tokens)
                    token = nxt
                else:  # not offered, declined, or ended: step by step from here on
                    device_tokens = None
                    token = sampler(self._step(seq, [token])[-1])
                stats.decode_s += time.perf_counter() - t0
                stats.decode_steps += 1
        finally:
            self._release(seq)

    @property
    def stats(self) -> dict[str, Any]:
        """The last call's figures, the backend, and the offload counters so far."""
        s = self.last
        accepted, declined = self.offload.totals()
        return {
            "prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated_tokens,
            "prefill_s": s.prefill_s, "prefill_tok_s": s.prefill_tok_s,
            "decode_s": s.decode_s, "decode_tok_s": s.decode_tok_s,
            "backend": self.backend.name, "device": self.backend.device_description,
            "preload_s": self.preload_s,
            "offload_accepted": accepted, "offload_declined": declined,
            "offload": self.offload.stats(), "backend_stats": self.offload.backend_stats(),
        }


def _resolve_model(model: Any, quant: str | None) -> tuple[Model, Any, str]:
    """(Model, tokenizer, source description) from a path, None (the default model), a Model or a loaded
    model (anything with ``.model`` and ``.tokenizer``)."""
    from kestrel_core.model.presets import ByteTokenizer

    if isinstance(model, Model):
        return model, ByteTokenizer(model.config.vocab_size), "in-memory model"
    if hasattr(model, "model") and hasattr(model, "tokenizer"):
        return model.model, model.tokenizer, str(getattr(model, "source", "in-memory model"))
    if model is None or isinstance(model, str):
        try:
            from kestrel_core.model.loader import load_model
        except ImportError as exc:
            raise KestrelError(f"model loading is not available: {exc}") from None
        loaded = load_model(model, quant=quant)
        return loaded.model, loaded.tokenizer, str(loaded.source)
    raise KestrelError(f"cannot load a model from a {type(model).__name__}")


def _open(resolve: Callable[[], tuple[Model, Any, str]], backend: str) -> Engine:
    """Bind first (a backend that cannot bind fails fast, before any model is read), then load, preload."""
    registry = Registry()
    try:
        chosen = registry.select(backend)  # an explicit backend that did not bind raises with its reason
        cpu = registry.cpu()
        t0 = time.perf_counter()
        model, tokenizer, source = resolve()
        load_s = time.perf_counter() - t0
        engine = Engine(model, tokenizer, chosen, cpu, registry=registry, source=source)
        engine.load_s = load_s
        return engine
    except BaseException:
        registry.close()
        raise


def load(model: str | Model | None = None, backend: str = "auto", quant: str | None = None) -> Engine:
    """An engine for ``model`` (a path, None for the default model, or a Model) on ``backend`` (``auto``:
    the best bound gpu/npu accelerator, else cpu); the model is preloaded onto the backend. ``quant``:
    q8 (None: the default; an artifact keeps its own), q4, q8-g256 or q4-g256."""
    return _open(lambda: _resolve_model(model, quant), backend)


def load_preset(name: str, backend: str = "auto", quant: str | None = None, seed: int = 0,
                **overrides: Any) -> Engine:
    """An engine for a synthetic preset model (random weights of real shapes, byte tokenizer)."""
    quant = quant or "q8"
    from kestrel_core.model.presets import ByteTokenizer, preset_model

    def resolve() -> tuple[Model, Any, str]:
        model = preset_model(name, quant, seed, **overrides)
        return model, ByteTokenizer(model.config.vocab_size), f"preset {name} ({quant}, seed {seed})"

    return _open(resolve, backend)
