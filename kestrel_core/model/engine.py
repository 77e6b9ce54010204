"""The Python API's ``Engine`` (``engine_load.load(model, backend, quant)`` makes one): logits, generation, batched
steps, stats.

Every step is a batch (``Engine.run_batch``): one or many sequences, each with new tokens at its next
positions. The engine first offers the backend's batched whole step (``kestrel_forward_batch``), then its
per-sequence whole step (``kestrel_forward``, its own KV cache) for what that declined, and runs the rest on
the host layer by layer, one GEMM per projection for all of them. The host's KV cache may lag behind the
device's: the host first runs the tokens it is missing, so a fallback at any step gives the same result;
likewise a device that declined earlier is offered the tokens it missed along with the new ones.
``generate`` is the scheduler (``kestrel_core.model.scheduler``) with one request.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kestrel_core.batch import BatchEntry
from kestrel_core.dispatch import Offload, all_finite
from kestrel_core.errors import ContextExceeded, InvalidRequest, KestrelError, NonFiniteLogits, Overloaded, safe_repr
from kestrel_core.model.config import SAMPLING_FIELDS
from kestrel_core.model.decoder import ACTIVATIONS, PREFILL_CHUNK, Decoder
from kestrel_core.model.driver import Driver, driving
from kestrel_core.model.embed import EmbedJob
from kestrel_core.model.grammar import Constraint, grammar_vocab
from kestrel_core.model.harmony import is_harmony
from kestrel_core.model.kv_pool import KVPool, SeqCache
from kestrel_core.model.rerank import gives_no_text
from kestrel_core.model.sampling import SamplingParams, TokenLogprob, logprobs_of
from kestrel_core.model.scoring import check_top
from kestrel_core.model.step import Step, step_tokens, tokens_behind, work_entry
from kestrel_core.model.validate import is_int, is_token_ids
from kestrel_core.model.weights import Model
from kestrel_core.registry import Backend, Registry

if TYPE_CHECKING:
    from kestrel_core.model.request import RequestOutput


@dataclass
class RunStats:
    """Timings of the last generate/logits call."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0  # the tokens decode_s gave: all but the first output's
    drafted: int = 0  # tokens its steps guessed (--speculate)
    accepted: int = 0  # guesses the model confirmed

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class SeqState:
    """One sequence's state in the engine: its tokens so far and where the host and device caches stand."""

    seq_id: int
    cache: SeqCache  # the host KV cache: cache.length positions
    tokens: list[int] = field(default_factory=list)  # every token run so far, position = index
    device_len: int = 0  # positions the device's own KV cache holds
    shared: int = 0  # positions of an attached prefix whose keys and values are in the backend's pool
    owner: object = field(default=None, repr=False, compare=False)  # its engine's mark (Engine.own)


FED = -1  # the placeholder token of a fed BatchEntry


class Engine:
    """A model bound to a backend (the CPU computes whatever the backend declines)."""

    def __init__(self, model: Model, tokenizer: Any, backend: Backend, cpu: Backend, *,
                 registry: Registry | None = None, source: str = "", preload: bool = True,
                 kv_cache_mb: float | None = None, activations: str = "auto", kv_cache_type: str = "f16") -> None:
        self.model = model
        self.config = model.config
        self.tokenizer = tokenizer
        self.backend = backend
        self.registry = registry
        self.source = source
        self.offload = Offload(backend, cpu)
        self.closed = False  # ``close()``: its backends are closed, it takes no more requests
        self.driver = Driver()  # the thread driving it now (kestrel_core.model.driver)
        self._on_close: list[Callable[[], None]] = []
        self.activations = resolve_activations(activations, backend)
        self.forward_supported = self.offload.forward_supports(model)  # whether whole steps are offered at all
        if kv_cache_type != "f16" and not self.steps_on_host:
            raise KestrelError(f"the KV cache type {kv_cache_type} is the host's: the {backend.name} backend runs "
                               "whole steps on a float16 KV cache of its own (--activations f32 or mixed runs the "
                               "steps on the host)")
        self.pool = KVPool.for_budget(model.config, kv_cache_mb, kv_cache_type)
        self.decoder = Decoder(model, self.offload, self.pool, self.activations)
        self.recurrent = bool(self.config.state_layers)  # layers with a state per sequence (read every step)
        # whether the prefix cache's blocks live in the backend's pool: it runs the whole steps, batched, and
        # honours ``BatchEntry.shared`` / ``publish`` (API 1.5), for a model without recurrent layers
        info = backend.info
        self.device_prefixes = (not self.steps_on_host and not self.recurrent and info is not None
                                and tuple(info.api_version) >= (1, 5) and backend.implements("kestrel_forward_batch"))
        # prompts share the KV blocks of a cached prefix (kv_pool): in the host's cache where it runs the steps
        # (with a copy of a recurrent layer's state at a prompt's end), in the backend's pool where that keeps
        # the prefix cache's blocks (device_prefixes)
        self.prefix_cache = self.steps_on_host or self.device_prefixes
        # whether the backend computes a sequence's positions again from an earlier start (API 1.6), so that
        # draft tokens the model did not confirm can be taken back where it runs the steps
        self.device_rewinds = (not self.steps_on_host and info is not None and tuple(info.api_version) >= (1, 6)
                               and backend.implements("kestrel_forward_batch"))
        # draft tokens a greedy request's step may guess, where sequences rewind (0: none), from its context
        # (kestrel_core.model.speculate) or by a draft model; both read by each Scheduler made after they are set
        self.speculate = 0
        self.draft_model: Any = None  # a DraftModel (kestrel_core.model.draft_model); None: prompt lookup
        # what a request's unset sampling fields take (``sampling_params``, the server): the sampling the model
        # recommends (config.sampling); {} ignores it
        self.sampling_defaults: dict[str, float] = dict(model.config.sampling or {})
        self.last = RunStats()
        self._seq_ids = itertools.count(1)  # one next() each: two threads' sequences never share an id
        self._mark = object()  # on each SeqState it makes: another engine's seq_ids and KV blocks are not its own
        self.preload_s = 0.0
        self.load_s = 0.0  # reading/building the model, set by load()
        self._vocabulary: Any = None  # llguidance's view of the vocabulary, built when first asked for
        self._vocabulary_lock = threading.Lock()
        if preload:
            t0 = time.perf_counter()
            self.offload.preload(model)
            self.preload_s = time.perf_counter() - t0

    @property
    def harmony(self) -> bool:
        """Whether the model answers in harmony's channels (gpt-oss; its chat template writes them)."""
        return is_harmony(getattr(self.tokenizer, "chat_template", None))

    # -- lifecycle -----------------------------------------------------------------------------------

    def on_close(self, stop: Callable[[], None]) -> None:
        """Have ``close()`` call ``stop()`` first, the latest given first: an ``AsyncEngine``'s thread, which holds
        this engine, stops before the draft model it drafts with closes (kestrel_core.model.draft_model)."""
        self._on_close.append(stop)

    def close(self) -> None:
        """Stop what serves this engine (``on_close``), then close the backends; every later request, and the next
        step of a stream under way, is a KestrelError (closing again does nothing)."""
        self.closed = True
        stops, self._on_close = self._on_close, []
        for stop in reversed(stops):
            stop()
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

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.config.eos_token_ids) | set(getattr(self.tokenizer, "eos_token_ids", ()) or ())

    def constraint(self, grammar: str) -> Constraint:
        """A request's place in ``grammar`` (SamplingParams.grammar) over this model's vocabulary."""
        return Constraint(self.vocabulary(), grammar)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (decoded alone, a byte-level token may be part of a character's); none for
        an id past the tokenizer's tokens (a padded vocabulary's), as its text is empty (llguidance would give a
        placeholder's)."""
        vocabulary = self.vocabulary()
        if self.tokenizer.token(token_id) is None:
            return b""
        return bytes(vocabulary.decode_bytes([token_id]))

    def vocabulary(self) -> Any:
        """llguidance's view of the model's vocabulary (grammar.grammar_vocab), built once: about a second for
        150K tokens."""
        with self._vocabulary_lock:  # callers on worker threads (AsyncEngine) build it once
            if self._vocabulary is None:
                to_json = getattr(self.tokenizer, "to_json_str", None)  # NoTokenizer's: AttributeErrors
                if to_json is None:
                    raise InvalidRequest("a grammar needs the model's own tokenizer (tokenizer.json or a GGUF "
                                         "vocabulary), and this model has none", param="grammar")
                self._vocabulary = grammar_vocab(to_json(), self.config.vocab_size, sorted(self.eos_token_ids))
        return self._vocabulary

    # -- sequences and steps -------------------------------------------------------------------------

    @property
    def steps_on_host(self) -> bool:
        """Whether the host runs the steps (layer by layer, the backend's GEMMs offered): its KV cache is the
        only one, so its prefixes can be shared and its sequences rewound."""
        return not (self.whole_step and runs_whole_steps(self.backend))

    @property
    def rewinds(self) -> bool:
        """Whether a sequence can go back to an earlier length (draft tokens not confirmed): a model without
        recurrent layers (linear attention, short convolutions), whose states hold every position at once, where
        the host runs the steps or the backend computes positions again from an earlier start (API 1.6)."""
        return (self.steps_on_host or self.device_rewinds) and not self.recurrent

    def state_end(self, prompt_len: int) -> int:
        """How far into a prompt of ``prompt_len`` tokens the prefix cache keeps recurrent states (where a step
        ends on a whole block): to its last whole block short of its last token (0: nowhere; a model without
        recurrent layers needs none)."""
        if not (self.prefix_cache and self.recurrent):
            return 0
        return (prompt_len - 1) // self.pool.block_size * self.pool.block_size

    @property
    def whole_step(self) -> bool:
        """Whether the backend's whole-step hooks are offered: they compute with int8 activations, and the
        backend did not say at load that they cannot run the model (``kestrel_forward_supports``)."""
        return self.activations == "q8" and self.forward_supported

    @driving
    def new_sequence(self, prompt_len: int = 0, tokens: Sequence[int] = (), resumed: bool = False) -> SeqState:
        """A new sequence whose first ``prompt_len`` tokens are its prompt (float32 in "mixed" mode). With ``tokens``
        (the prompt, and those generated before a preemption: ``resumed``), the longest cached prefix of the prompt
        short of its last token is attached (a prefix-cache hit unless ``resumed``): ``seq.tokens`` starts with it."""
        if not is_int(prompt_len) or prompt_len < 0:
            raise KestrelError(f"new_sequence's prompt_len must be a non-negative integer, got {safe_repr(prompt_len)}")
        seq = SeqState(next(self._seq_ids), self.pool.new_sequence(), owner=self._mark)
        seq.cache.prompt_len = int(prompt_len)
        if self.prefix_cache and tokens:
            attached = self.pool.attach_prefix(seq.cache, tokens, prompt_len - 1, resumed)
            seq.tokens = [int(t) for t in tokens[:attached]]
            if self.device_prefixes:  # the backend's pool holds them; the host has computed none
                seq.cache.length = 0
                seq.device_len = seq.shared = attached
        return seq

    @driving
    def rewind(self, seq: SeqState, length: int) -> None:
        """Forget a sequence's positions from ``length`` on (draft tokens the model did not confirm), where
        ``rewinds``: the backend that runs the steps computes them again from its next entry's start."""
        self.own(seq, "rewind")
        if not is_int(length) or not 0 <= length <= len(seq.tokens):
            raise KestrelError(f"a rewind's length must be an integer in [0, {len(seq.tokens)}] (the sequence's "
                               f"positions), got {safe_repr(length)}")
        if length < len(seq.tokens) and not self.rewinds:  # its device or recurrent state would keep them
            raise KestrelError("this engine's sequences cannot rewind (Engine.rewinds): a model with recurrent "
                               "layers, or a backend that runs the steps without recomputing positions (API < 1.6)")
        seq.cache.truncate(length)  # first: it refuses a cut into a shared prefix, the tokens left as they are
        del seq.tokens[length:]
        seq.device_len = min(seq.device_len, length)

    @driving
    def device_ran_ahead(self, seq: SeqState) -> None:
        """The device may hold positions of ``seq`` past ``device_len`` (its pipelined greedy decode was left after
        running ahead, or its step's result was refused). A backend that computes positions again from an earlier
        start (API 1.6) is offered the next step from ``device_len``; any other is never offered a start below what
        it holds: it forgets the sequence, and is offered it again from the end of a prefix it shares (or 0)."""
        info = self.backend.info
        if info is None or tuple(info.api_version) < (1, 6):
            self.offload.release_sequence(seq.seq_id)
            seq.device_len = seq.shared

    @driving
    def release(self, seq: SeqState) -> None:
        """Forget a sequence: its device state and its host KV blocks."""
        self.own(seq, "release")
        self.offload.release_sequence(seq.seq_id)
        seq.cache.release()

    def own(self, seq: object, what: str) -> None:
        """A KestrelError unless ``seq`` is a sequence this engine's ``new_sequence`` made."""
        if not isinstance(seq, SeqState) or seq.owner is not self._mark:
            whose = "another engine's sequence" if isinstance(seq, SeqState) else type(seq).__name__
            raise KestrelError(f"{what} takes a sequence of this engine's new_sequence(), got {whose}")

    def run_batch(self, work: Sequence[tuple[SeqState, Sequence[int], int]],
                  argmax_only: Sequence[bool] = ()) -> list[np.ndarray]:
        """One step: each (sequence, new tokens, logit rows) runs its tokens at its next positions and gets
        float32 logits [logit_rows, vocab] of its last ``logit_rows`` new tokens. A sequence whose
        ``argmax_only`` flag is set may get int64 token ids [logit_rows] instead (each row's argmax), when the
        backend's batched step chose them on the device."""
        return self.start_batch(work, argmax_only).result()

    @property
    def feeds(self) -> bool:
        """Whether a step may start before the one running is taken (``start_batch``'s ``after``): the backend
        runs batched steps on its device and takes fed entries (API 1.4)."""
        info = self.backend.info
        return (self.whole_step and not self.offload.on_cpu and info is not None and tuple(info.api_version) >= (1, 4)
                and self.backend.implements("kestrel_forward_batch"))

    @driving
    def start_batch(self, work: Sequence[tuple[SeqState, Sequence[int] | None, int]],
                    argmax_only: Sequence[bool] = (), after: Step | None = None) -> Step | None:
        """``run_batch``, started: the backend's batched step may still be running on its device when this
        returns (``Step.running``). Nothing else may use the engine until ``Step.result()`` is called, but this:
        with ``after`` (a running step, if ``feeds``), the next step starts first. Its work may then be ``None``
        for a sequence whose last row in ``after`` is chosen on the device: it runs that token (a fed entry).
        Such a step is None if the backend did not take it (nothing ran); it is taken after ``after``."""
        c = self.config
        ahead = after.ends() if after is not None else {}
        runs, fed, bases = [], [], []  # fed: whether each run's token is the device's
        flags = list(argmax_only) or [False] * len(work)
        if len(flags) != len(work):
            raise KestrelError(f"argmax_only has {len(flags)} flags for {len(work)} sequences")
        for entry in work:
            seq, new, rows = work_entry(entry)
            self.own(seq, "a step")
            end_before, added, feedable = ahead.get(seq.seq_id, (seq.device_len, 0, False))
            fed.append(new is None)
            if new is None:
                if not feedable:
                    raise KestrelError("a fed row needs its sequence's argmax in the step before")
                new = np.array([FED], np.int64)
            else:
                new = step_tokens(new, c.vocab_size)
            base = len(seq.tokens) + added  # positions before this step's
            end = base + len(new)
            if end > c.max_position:
                raise KestrelError(f"the sequence needs {end} positions; the model's context is {c.max_position}")
            if not is_int(rows) or not 0 <= rows <= len(new):
                raise KestrelError(f"logit rows {safe_repr(rows)} outside [0, {len(new)}]")
            runs.append((seq, new, rows))
            bases.append((base, end_before if seq.seq_id in ahead else seq.device_len))
        pool = self.pool
        for (seq, new, _), (base, _) in zip(runs, bases):  # the scheduler reserved already; a direct caller here
            pool.reserve(seq.cache, base + len(new))
        on_device, bs = self.prefix_cache and self.device_prefixes, pool.block_size
        entries = [BatchEntry(seq.seq_id, new.copy() if start == base else tokens_behind(seq.tokens, start, new), start,
                              rows, tuple(seq.cache.blocks), bs, pool.num_blocks, flag, is_fed, seq.shared,
                              # the prompt's whole blocks once the step is done, in a step of the prompt
                              min(seq.cache.prompt_len, base + len(new)) // bs * bs
                              if on_device and base < seq.cache.prompt_len else 0)
                   for (seq, new, rows), flag, is_fed, (base, start) in zip(runs, flags, fed, bases)]
        batched = self.offload.forward_batch(self.model, entries, c.vocab_size) if self.whole_step else None
        if after is not None and batched is None:
            return None
        return Step(self, runs, entries, batched, after)

    def _finish_batch(self, runs: list[tuple[SeqState, np.ndarray, int]], entries: list[BatchEntry],
                      batched: list[np.ndarray] | None, device: bool = True) -> list[np.ndarray]:
        """The step's outputs: the batched hook's, else a 1.0 backend's per-sequence step (unless not
        ``device``), and the host's layers for what is still declined; then each sequence's tokens and cache
        lengths move on."""
        c, pool = self.config, self.pool
        outs: list[np.ndarray | None] = [None] * len(runs)
        ran = set(range(len(runs))) if batched is None and self.offload.refused else set()  # results refused
        if batched is not None:
            outs = list(batched)
        elif self.whole_step and device:
            for i, e in enumerate(entries):  # a 1.0 backend's per-sequence whole step
                all_logits = e.logit_rows > 1
                out = self.offload.forward(self.model, e.seq_id, e.tokens, e.start, all_logits, c.vocab_size)
                if out is not None:
                    outs[i] = out[len(out) - e.logit_rows:]
                elif self.offload.refused:
                    ran.add(i)
        host = [i for i, out in enumerate(outs) if out is None]
        for i in ran.intersection(host):  # the backend ran the step: it may hold positions past device_len
            self.device_ran_ahead(runs[i][0])
        for i in host:  # a backend that lost a shared prefix computes the sequence from its start next time
            seq = runs[i][0]
            if seq.shared and seq.device_len == seq.shared:
                seq.shared = seq.device_len = 0
        for i, (seq, _, _) in enumerate(runs):
            if outs[i] is not None:
                seq.device_len = entries[i].end
        if host:
            batch = []
            for i in host:
                seq, new, rows = runs[i]
                batch.append((seq.cache, tokens_behind(seq.tokens, seq.cache.length, new), rows))
            for i, out in zip(host, self.decoder.forward_batch(batch)):
                if not all_finite(out):  # never an empty answer
                    raise NonFiniteLogits("the model produced non-finite logits (NaN or inf) on the CPU path: its "
                                          "weights hold NaN/inf, or its activations overflow float32")
                outs[i] = out
        for seq, new, _ in runs:
            seq.tokens.extend(new.tolist())
        if self.prefix_cache:  # prompt blocks this step completed become reusable: the host's it computed, or
            # the backend's pool's, which its batched step left there (``BatchEntry.publish``)
            on_device = self.device_prefixes
            computed = host if not on_device else range(len(runs)) if batched is not None else ()
            for i in computed:
                seq, new, _ = runs[i]
                if len(seq.tokens) - len(new) < seq.cache.prompt_len:
                    written = seq.device_len if on_device else seq.cache.length
                    pool.publish_prefix(seq.cache, seq.tokens, min(written, seq.cache.prompt_len),
                                        keep_state=written <= self.state_end(seq.cache.prompt_len))
        return outs  # type: ignore[return-value]

    def check_open(self) -> None:
        """A KestrelError once the engine is closed (``close``)."""
        if self.closed:
            raise KestrelError("the engine is closed")

    def check_ids(self, ids: Sequence[int], what: str) -> list[int]:
        """``ids`` as a list of token ids in the vocabulary and the context, for a request on this open engine."""
        self.check_open()
        if not is_token_ids(ids):
            raise KestrelError(f"the {what} must be a sequence of token ids (integers; text goes through "
                               f"engine.tokenizer.encode first), got {type(ids).__name__}")
        ids = [int(i) for i in ids]
        if not ids:
            raise KestrelError(f"the {what} is empty")
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise KestrelError(f"{what} token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        if len(ids) > self.config.max_position:
            raise ContextExceeded(f"the {what} has {len(ids)} tokens; the model's context is "
                                  f"{self.config.max_position}", len(ids), self.config.max_position, what)
        return ids

    # -- API -----------------------------------------------------------------------------------------

    def check_generates(self) -> None:
        """InvalidRequest for a model that pools (an embedding model, a reranker): it gives vectors, not text."""
        if self.config.pooling is not None:
            raise InvalidRequest(gives_no_text(self.config), param="model")

    @driving
    def embed(self, inputs: Sequence[Sequence[int]], *, pooling: str | None = None,
              dimensions: int | None = None) -> np.ndarray:
        """Each token sequence's embedding, float32 [inputs, dimensions or D] (kestrel_core.model.embed): pooled
        by ``pooling`` (last, mean or cls; None: the model's), cut to ``dimensions``, normalized where the model
        says so."""
        job = EmbedJob(self, inputs, pooling=pooling, dimensions=dimensions)
        t0 = time.perf_counter()
        try:
            while not job.done:
                job.step()
        finally:
            job.close()
        self.last = RunStats(prompt_tokens=job.prompt_tokens, prefill_s=time.perf_counter() - t0)
        return job.result()

    @driving
    def logits(self, token_ids: Sequence[int], prompt_len: int | None = None) -> np.ndarray:
        """Teacher-forced logits of the whole sequence: float32 [T, vocab]. In "mixed" mode the first
        ``prompt_len`` tokens (default: all) run as a prompt, the rest as generated tokens would."""
        outs = list(self._chunk_logits(token_ids, prompt_len))
        return np.concatenate(outs) if len(outs) > 1 else outs[0]

    @driving
    def prompt_logprobs(self, token_ids: Sequence[int], top: int = 0) -> list[TokenLogprob]:
        """Each token after the first, scored by the logits before it (a prompt's logprobs, as the sampler
        reports a generated token's: the log-softmax, with the ``top`` likeliest alternatives), a prefill chunk
        of logits at a time (never the whole [T, vocab]). A server scores prompts in its scheduler's steps
        instead, beside other requests (kestrel_core.model.scoring)."""
        check_top(top)
        ids = self.check_ids(token_ids, "input")
        scored: list[TokenLogprob] = []
        done = 0
        for rows in self._chunk_logits(ids):  # rows: [chunk, vocab], the logits after positions done...
            scored += [logprobs_of(row, ids[p + 1], top) for p, row in enumerate(rows, done) if p + 1 < len(ids)]
            done += len(rows)
        return scored

    def _chunk_logits(self, token_ids: Sequence[int], prompt_len: int | None = None) -> Iterator[np.ndarray]:
        """``logits``, a prefill chunk at a time (float32 [chunk, vocab] each)."""
        self.check_generates()
        ids = self.check_ids(token_ids, "input")
        if prompt_len is not None and (not is_int(prompt_len) or not 0 <= prompt_len <= len(ids)):
            raise InvalidRequest(f"prompt_len must be an integer in [0, {len(ids)}] (the input's tokens), got "
                                 f"{prompt_len!r}", param="prompt_len")
        seq = self.new_sequence(len(ids) if prompt_len is None else prompt_len)
        try:
            if self.pool.blocks_for(len(ids)) > self.pool.num_blocks:
                raise KestrelError(f"the input has {len(ids)} tokens; the KV cache holds {self.pool.capacity}")
            if not self.pool.reserve(seq.cache, len(ids)):  # the cache is shared with a scheduler's sequences
                raise Overloaded(f"the KV cache has no room for {len(ids)} positions now; retry later")
            t0 = time.perf_counter()
            for s in range(0, len(ids), PREFILL_CHUNK):
                yield self.run_batch([(seq, ids[s:s + PREFILL_CHUNK], len(ids[s:s + PREFILL_CHUNK]))])[0]
            self.last = RunStats(prompt_tokens=len(ids), prefill_s=time.perf_counter() - t0)
        finally:
            self.release(seq)

    def generate(self, prompt_ids: Sequence[int], max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = 0, stop_at_eos: bool = True,
                 params: SamplingParams | None = None) -> Iterator[int]:
        """Token ids as they are generated (``params`` overrides the keyword arguments)."""
        if params is None:
            if not isinstance(stop_at_eos, bool):  # ``not stop_at_eos`` would take "no" for True
                raise InvalidRequest(f"stop_at_eos must be a boolean, got {stop_at_eos!r}", param="stop_at_eos")
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                    seed=seed, ignore_eos=not stop_at_eos)
        outputs = self.stream(prompt_ids, params)
        return (token for out in outputs for token in out.new_token_ids)

    def sampling_params(self, **fields: Any) -> SamplingParams:
        """SamplingParams of ``fields``; a sampling field (SAMPLING_FIELDS) left out or None takes its value in
        ``sampling_defaults`` (the model's recommendation: its generation_config.json or GGUF metadata), else
        SamplingParams' own default (greedy, no filters)."""
        given = {k: v for k, v in fields.items() if v is not None or k not in SAMPLING_FIELDS}
        return SamplingParams(**{**self.sampling_defaults, **given})

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """One request's outputs (tokens, text, logprobs) step by step: the scheduler with this one request."""
        from kestrel_core.model.scheduler import Scheduler

        scheduler = Scheduler(self, max_batch=1)
        request = scheduler.add(prompt_ids, params)  # checks the prompt and parameters now, not at next()
        return self._stream(scheduler, request)

    def _stream(self, scheduler: Any, request: Any) -> Iterator[RequestOutput]:
        stats = self.last = RunStats(prompt_tokens=len(request.prompt_ids))
        start = t0 = time.perf_counter()
        try:
            while not request.finished or scheduler.has_work:  # its end may come a step later (a failure)
                if self.closed:  # its backends are closed: a step would run on what they released
                    raise KestrelError("the engine was closed while the request ran")
                outputs = scheduler.step()
                t1 = time.perf_counter()
                for out in outputs:
                    if out.error is not None:
                        raise out.error
                    if out.new_token_ids:
                        if stats.generated_tokens == 0:  # a long prompt takes several steps (chunked prefill)
                            stats.prefill_s = t1 - start
                        else:  # a step of several tokens where its guesses were right
                            stats.decode_s += t1 - t0
                            stats.decode_tokens += len(out.new_token_ids)
                        stats.generated_tokens += len(out.new_token_ids)
                    yield out
                t0 = time.perf_counter()
        finally:
            stats.drafted, stats.accepted = scheduler.drafted, scheduler.accepted
            scheduler.close()

    @property
    def stats(self) -> dict[str, Any]:
        """The last call's figures, the backend, and the offload counters so far."""
        s = self.last
        accepted, declined = self.offload.totals()
        return {
            "prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated_tokens,
            "prefill_s": s.prefill_s, "prefill_tok_s": s.prefill_tok_s,
            "decode_s": s.decode_s, "decode_tokens": s.decode_tokens, "decode_tok_s": s.decode_tok_s,
            "drafted": s.drafted, "accepted": s.accepted,
            "backend": self.backend.name, "device": self.backend.device_description,
            "preload_s": self.preload_s,
            "offload_accepted": accepted, "offload_declined": declined,
            "offload": self.offload.stats(), "backend_stats": self.offload.backend_stats(),
            "prefix_cache": self.prefix_cache, "prefix_hit_tokens": self.pool.prefix_hit_tokens,
            "prefix_cached_blocks": self.pool.cached_blocks, "prefix_cached_states": self.pool.cached_states,
        }


def resolve_activations(activations: str, backend: Backend) -> str:
    """``auto``: "mixed" (the prompt read at float32, the cost of a slower prefill only) unless the backend
    runs whole steps on its device, which compute with int8 activations: then "q8"."""
    if activations != "auto":
        if activations not in ACTIVATIONS:
            raise KestrelError(f"activations must be auto or one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        return activations
    return "q8" if runs_whole_steps(backend) else "mixed"


def runs_whole_steps(backend: Backend) -> bool:
    """Whether the backend implements a whole-step hook (it then keeps KV caches on its device)."""
    return any(backend.implements(h) for h in ("kestrel_forward", "kestrel_forward_batch", "kestrel_decode_greedy"))
