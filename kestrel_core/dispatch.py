"""The offload dispatcher: the core side of the 0/1 contract, enforced for every backend.

Each offload is offered to the chosen backend; ``None`` means declined and the CPU reference computes the
whole output. The core also declines on its own: ``KESTREL_FORCE_CPU=1`` (the backend stays open), below the
backend's minimum FLOPs, after an exception inside the hook (reported once; any ``BaseException``, a plugin's
``sys.exit`` included: only a ``KeyboardInterrupt`` passes), or for a result of the wrong shape or dtype, or
with non-finite values (NaN or infinity anywhere): the checks of kestrel_core.results. Every decision is counted
per hook with its reason.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kestrel_core.batch import BatchEntry
from kestrel_core.contract import StripCache, gemm_flops, quantize_activations, read_only_strip, read_only_view
from kestrel_core.errors import safe_text
from kestrel_core.guard import plugin_output
from kestrel_core.model.weights import Model, read_only_model
from kestrel_core.registry import FORCE_CPU_ENV, Backend, force_cpu
from kestrel_core.results import NUMPY_INTS, check_array, check_arrays, check_batch, check_iterator, plain_counter
from kestrel_core.results import all_finite as all_finite  # the engine's check of the host's logits too

log = logging.getLogger("kestrel")

DECLINED = "declined by backend"
FORCED = FORCE_CPU_ENV
BELOW_MIN_FLOPS = "below min FLOPs"
NOT_IMPLEMENTED = "hook not implemented"


@dataclass
class HookCounters:
    offered: int = 0
    accepted: int = 0
    declined: Counter = field(default_factory=Counter)  # reason -> count

    def as_dict(self) -> dict[str, Any]:
        return {"offered": self.offered, "accepted": self.accepted,
                "declined": sum(self.declined.values()), "declined_reasons": dict(self.declined)}


_FALLBACK = {
    "kestrel_decode_greedy": "the engine runs and samples each step itself",
    "kestrel_gemm_fused_q8": "each weight is offered to kestrel_gemm_q8, and the CPU computes what that declines",
    "kestrel_forward": "the engine runs the step layer by layer",
    "kestrel_forward_batch": "the engine offers kestrel_forward per sequence, then runs the step layer by layer",
    "kestrel_preload": "weights upload on first use",
    "kestrel_forward_supports": "the whole steps are offered",
    "kestrel_release_sequence": "nothing more is done",
    "kestrel_stats": "no backend counters are shown",
    "kestrel_layer_boundary": "the step goes on",
}


class Deferred:
    """A backend's step still running on its device, over the sequences ``seq_ids``: ``result()`` waits for it and
    gives what the hook would have returned, checked (None: declined). Taken once; ``wait()`` waits for it sooner."""

    def __init__(self, resolve: Callable[[], Any], seq_ids: frozenset[int] = frozenset()) -> None:
        self._resolve: Callable[[], Any] | None = resolve
        self.seq_ids = seq_ids
        self._out: list[Any] | None = None
        self._taken = False

    @property
    def running(self) -> bool:
        return self._resolve is not None

    def wait(self) -> None:
        """Wait for the step now (its result checked, and kept for ``result()``)."""
        resolve, self._resolve = self._resolve, None
        if resolve is not None:
            out = resolve()
            self._out = None if out is None else list(out)

    def result(self) -> Any:
        if self._taken:
            raise RuntimeError("a deferred step is resolved only once")
        self._taken = True
        self.wait()
        return self._out


class Offload:
    """Routes GEMMs and model-level hooks to ``backend``, with ``cpu`` as the always-correct fallback."""

    def __init__(self, backend: Backend, cpu: Backend) -> None:
        self.backend = backend
        self.cpu = cpu
        self.counters: dict[str, HookCounters] = {}
        self._reported: set[tuple[str, str]] = set()
        self._callers: dict[tuple[str, str], Callable[..., Any] | None] = {}
        self._shown: tuple[Model, Model] | None = None  # (the engine's model, the read-only twin backends get)
        self.refused = False  # the last offer's result came and was refused: the backend ran what it was offered
        self._running: list[Deferred] = []  # the backend's steps that may still run on its device

    def _caller(self, backend: Backend, hook: str) -> Callable[..., Any] | None:
        """The backend's implementation of ``hook`` as a plain call, or None if it has none.

        Each backend has its own plugin manager, so a hook has at most one implementation; calling it
        directly (with the arguments it declares, as pluggy would) keeps pluggy's per-call overhead off the
        hot path of ~200 GEMMs per token.
        """
        key = (backend.name, hook)
        if key not in self._callers:
            impls = getattr(backend.hook, hook).get_hookimpls() if backend.pm is not None else []
            if not impls:
                self._callers[key] = None
            else:
                impl = impls[-1]
                fn, names, device = impl.function, impl.argnames, backend.device

                def call(**kwargs: Any) -> Any:
                    kwargs["device"] = device
                    return fn(*[kwargs[n] for n in names])

                self._callers[key] = call
        return self._callers[key]

    @property
    def on_cpu(self) -> bool:
        return self.backend is self.cpu

    # -- the 0/1 protocol ----------------------------------------------------------------------------

    def _offer(self, hook: str, flops: int, call: Callable[[], Any], check: Callable[[Any], str | None],
               deferrable: frozenset[int] | None = None) -> Any:
        """The backend's result, or None when it (or the core on its behalf) declined. With ``deferrable`` (the
        sequences of the step), a callable result is the backend's step still running: a ``Deferred`` that checks it
        once it is called."""
        counters = self.counters.get(hook) or self.counters.setdefault(hook, HookCounters())
        counters.offered += 1
        self.refused = False
        reason = self._core_decline(hook, flops)
        if reason is not None:
            counters.declined[reason] += 1
            return None
        result = self._called(hook, call)
        if deferrable is not None and callable(result):
            pending = Deferred(lambda: self._checked(hook, counters, self._called(hook, result), check), deferrable)
            self._running = [d for d in self._running if d.running] + [pending]
            return pending
        return self._checked(hook, counters, result, check)

    def _called(self, hook: str, call: Callable[[], Any]) -> Any:
        """``call()``, or an exception raised in it (reported once) in its place, as a ``_Raised``."""
        try:
            with plugin_output():
                return call()
        except KeyboardInterrupt:  # the user's Ctrl-C
            raise
        except BaseException as exc:  # the device must never take kestrel down (sys.exit included)
            self._report(hook, f"error: {type(exc).__name__}", exc)
            return _Raised(exc)

    def _checked(self, hook: str, counters: HookCounters, result: Any, check: Callable[[Any], str | None]) -> Any:
        """The result, or None (counted with its reason: an exception, a decline, a bad result). The checks ask
        for exact types (a plain list of plain numpy arrays...), so that no code of the backend's runs in them
        and what is checked is what is used; whatever they raise all the same is a bad result."""
        if type(result) is _Raised:
            reason = f"error: {type(result.exc).__name__}"
        elif result is None:
            reason = DECLINED
        else:
            try:
                bad = check(result)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:
                bad = f"checking it raised {type(exc).__name__}"
            if not bad:
                counters.accepted += 1
                return result
            reason = f"bad result: {bad}"
            self._report(hook, reason, None)
        self.refused = reason != DECLINED
        counters.declined[reason] += 1
        return None

    def _core_decline(self, hook: str, flops: int) -> str | None:
        if self.on_cpu:
            return None
        if self._caller(self.backend, hook) is None:
            return NOT_IMPLEMENTED
        if force_cpu():
            return FORCED
        if flops and flops < self.backend.min_flops:
            return BELOW_MIN_FLOPS
        return None

    def _report(self, hook: str, reason: str, exc: BaseException | None) -> None:
        if (hook, reason) in self._reported:
            return
        self._reported.add((hook, reason))
        text = "" if exc is None else safe_text(exc)
        detail = f": {text}" if text else ""
        fallback = _FALLBACK.get(hook, "the CPU computes it")
        log.warning("backend %s: %s %s%s; %s (reported once)", self.backend.name, hook, reason, detail, fallback,
                    exc_info=exc if log.isEnabledFor(logging.DEBUG) else None)

    # -- GEMMs ---------------------------------------------------------------------------------------

    def gemm_q8(self, a_codes: np.ndarray, a_scales: np.ndarray, weight: StripCache, wkey: int) -> np.ndarray:
        """a_codes: int8 [M, K], a_scales: [M, K/G] -> float32 [M, N]."""
        return self._gemm("kestrel_gemm_q8", (a_codes.shape[0], weight.n),
                          gemm_flops(a_codes.shape[0], weight.n, weight.k),
                          a_codes=a_codes, a_scales=a_scales, weight=weight, wkey=wkey)

    def gemm_f32(self, a: np.ndarray, weight: StripCache, wkey: int) -> np.ndarray:
        """a: float32 [M, K] -> float32 [M, N]."""
        return self._gemm("kestrel_gemm_f32", (a.shape[0], weight.n), gemm_flops(a.shape[0], weight.n, weight.k),
                          a=a, weight=weight, wkey=wkey)

    def _gemm(self, hook: str, shape: tuple[int, int], flops: int, **kwargs: Any) -> np.ndarray:
        if not self.on_cpu:
            out = self._offer(hook, flops, lambda: self._caller(self.backend, hook)(**read_only(kwargs)),
                              lambda r: check_array(r, shape, _arrays(kwargs)))
            if out is not None:
                return out
        else:
            self._count_on_cpu(hook, 1)
        return self._caller(self.cpu, hook)(**kwargs)

    def _count_on_cpu(self, hook: str, calls: int) -> None:
        """On the CPU backend nothing is offered, but its GEMMs are counted as accepted all the same."""
        counters = self.counters.get(hook) or self.counters.setdefault(hook, HookCounters())
        counters.offered += calls
        counters.accepted += calls

    def linear(self, x: np.ndarray, weight: StripCache, wkey: int) -> np.ndarray:
        """The engine's projection: x float32 [M, K] quantized per block (Q8_0), then gemm_q8 -> [M, N]."""
        a_codes, a_scales = quantize_activations(x, weight.group_size)
        return self.gemm_q8(a_codes, a_scales, weight, wkey)

    def linear_fused(self, x: np.ndarray, weights: Sequence[StripCache], wkeys: Sequence[int],
                     fused_wkey: int) -> list[np.ndarray]:
        """Several projections of one input (Q/K/V, gate/up): the fused hook if offered, else one by one."""
        a_codes, a_scales = quantize_activations(x, weights[0].group_size)
        return self.gemm_q8_fused(a_codes, a_scales, weights, wkeys, fused_wkey)

    def gemm_q8_fused(self, a_codes: np.ndarray, a_scales: np.ndarray, weights: Sequence[StripCache],
                      wkeys: Sequence[int], fused_wkey: int) -> list[np.ndarray]:
        """``linear_fused`` on activations already quantized with weights[0]'s group size."""
        group = weights[0].group_size
        m = a_codes.shape[0]
        if self.on_cpu:
            # The CPU's own fused pass (one call, one thread fork/join: ~15% faster decode), counted as the
            # GEMMs it computes, like every CPU GEMM.
            fused = self._caller(self.cpu, "kestrel_gemm_fused_q8")
            outs = None if fused is None else fused(a_codes=a_codes, a_scales=a_scales, weights=list(weights),
                                                    wkeys=list(wkeys), fused_wkey=fused_wkey)
            if outs is not None:
                self._count_on_cpu("kestrel_gemm_q8", len(weights))
                return list(outs)
        elif all(w.group_size == group for w in weights):
            flops = sum(gemm_flops(m, w.n, w.k) for w in weights)
            outs = self._offer("kestrel_gemm_fused_q8", flops,
                               lambda: self._caller(self.backend, "kestrel_gemm_fused_q8")(
                                   **read_only({"a_codes": a_codes, "a_scales": a_scales, "weights": list(weights)}),
                                   wkeys=list(wkeys), fused_wkey=fused_wkey),
                               lambda r: check_arrays(r, [(m, w.n) for w in weights], [a_codes, a_scales]))
            if outs is not None:
                return list(outs)
        return [self.gemm_q8(a_codes, a_scales, w, k) for w, k in zip(weights, wkeys)]

    def host_dense_layer(self, wkeys: list[tuple[int, ...]], strips: tuple[tuple[StripCache, ...], ...]) -> Any:
        """The CPU backend's compiled form of a dense layer (its device's ``dense_layer``: one call runs the layer)
        where the CPU runs every GEMM, else None: another backend is offered the layer's GEMMs one by one."""
        prepare = getattr(self.cpu.device, "dense_layer", None) if self.on_cpu else None
        return prepare(wkeys, strips) if prepare is not None else None

    def host_experts(self, wkeys: list[list[tuple[int, ...]]], strips: list[tuple[tuple[StripCache, ...], ...]],
                     shared: bool) -> Any:
        """The CPU backend's compiled form of a mixture-of-experts layer's experts (its device's ``experts_pass``)
        where the CPU runs every GEMM, else None."""
        prepare = getattr(self.cpu.device, "experts_pass", None) if self.on_cpu else None
        return prepare(wkeys, strips, shared) if prepare is not None else None

    def count_host_gemms(self, calls: int) -> None:
        """GEMMs a compiled host layer or experts pass ran, counted as the CPU's hooks count theirs."""
        self._count_on_cpu("kestrel_gemm_q8", calls)

    # -- model-level hooks ---------------------------------------------------------------------------

    def _model(self, model: Any) -> Any:
        """``model`` as the backend is handed it: its read-only twin (``read_only_model``), one object a model so
        that a backend may know it again."""
        if not isinstance(model, Model):
            return model
        if self._shown is None or self._shown[0] is not model:
            self._shown = (model, read_only_model(model))
        return self._shown[1]

    def layer_boundary(self, layer: int) -> None:
        boundary = None if self.on_cpu else self._caller(self.backend, "kestrel_layer_boundary")
        if boundary is not None:
            self._offer("kestrel_layer_boundary", 0, lambda: boundary(layer=layer) or True, lambda r: None)

    def preload(self, model: Any) -> None:
        """Preload runs even under KESTREL_FORCE_CPU: the device stays initialised, uploads happen."""
        if not self.on_cpu and self.backend.implements("kestrel_preload"):
            self._called("kestrel_preload", lambda: self.backend.hook.kestrel_preload(device=self.backend.device,
                                                                                       model=self._model(model)))

    def forward_supports(self, model: Any) -> bool:
        """Whether the backend's whole steps may be offered ``model`` (``kestrel_forward_supports``): only a
        False answer says no; an error is reported, and the steps offered as if it had not answered."""
        if self.on_cpu or not self.backend.implements("kestrel_forward_supports"):
            return True
        return self._called("kestrel_forward_supports", lambda: self.backend.hook.kestrel_forward_supports(
            device=self.backend.device, model=self._model(model))) is not False

    def forward(self, model: Any, seq_id: int, tokens: np.ndarray, start: int, all_logits: bool,
                vocab: int) -> np.ndarray | None:
        """The backend's whole-step forward, or None: the engine then runs its layer-by-layer path."""
        forward = None if self.on_cpu else self._caller(self.backend, "kestrel_forward")
        if forward is None:
            return None
        rows = len(tokens) if all_logits else 1
        return self._offer("kestrel_forward", 0,
                           lambda: forward(model=self._model(model), seq_id=seq_id, tokens=tokens, start=start,
                                           all_logits=all_logits),
                           lambda r: check_array(r, (rows, vocab)))

    def forward_batch(self, model: Any, batch: Sequence[BatchEntry], vocab: int
                      ) -> list[np.ndarray] | Deferred | None:
        """The backend's batched whole step, or None: one float32 array [logit_rows, vocab] per entry, or int64
        token ids [logit_rows] for an entry marked ``argmax_only``; or a ``Deferred`` of them while the step
        runs on the device (until it is resolved, nothing else may be offered to the backend)."""
        forward = None if self.on_cpu else self._caller(self.backend, "kestrel_forward_batch")
        if forward is None:
            return None
        out = self._offer("kestrel_forward_batch", 0, lambda: forward(model=self._model(model), batch=list(batch)),
                          lambda r: check_batch(r, batch, vocab), deferrable=frozenset(e.seq_id for e in batch))
        if out is None or isinstance(out, Deferred):
            return out
        return list(out)

    def decode_greedy(self, model: Any, seq_id: int, token: int, start: int, count: int,
                      vocab: int) -> Iterator[int] | None:
        """The backend's pipelined greedy decode (an iterator of tokens), or None: the engine samples each
        step itself. An error or a bad token while iterating ends the iterator (reported once)."""
        hook = "kestrel_decode_greedy"
        decode = None if self.on_cpu else self._caller(self.backend, hook)
        if decode is None:
            return None
        tokens = self._offer(hook, 0, lambda: decode(model=self._model(model), seq_id=seq_id, token=token,
                                                     start=start, count=count),
                             check_iterator)
        return None if tokens is None else self._checked_tokens(hook, tokens, vocab)

    def _checked_tokens(self, hook: str, tokens: Iterator[Any], vocab: int) -> Generator[int, Any, None]:
        """``tokens``, each checked; a ``send(False)`` goes on to the backend's generator (an iterator that
        takes none stops)."""
        more = None
        while True:
            try:
                with plugin_output():
                    if more is False:
                        send = getattr(tokens, "send", None)
                        tok = None if send is None else send(False)
                    else:
                        tok = next(tokens, None)
            except StopIteration:
                tok = None
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # the device must never take kestrel down
                self._decline_midway(hook, f"error: {type(exc).__name__}", exc)
                return
            if tok is None:
                return
            if type(tok) is not int and type(tok) not in NUMPY_INTS:
                self._decline_midway(hook, f"bad result: a token of type {type(tok).__name__}", None)
                return
            tok = int(tok)
            if not 0 <= tok < vocab:
                self._decline_midway(hook, f"bad result: token {tok} outside [0, {vocab})", None)
                return
            more = yield tok

    def _decline_midway(self, hook: str, reason: str, exc: BaseException | None) -> None:
        """A pipelined decode that fails after it was accepted: the tokens so far stand, the engine goes on
        step by step, and the failure is counted as a decline with its reason (and reported once)."""
        counters = self.counters.get(hook) or self.counters.setdefault(hook, HookCounters())
        counters.declined[reason] += 1
        self._report(hook, reason, exc)

    def release_sequence(self, seq_id: int) -> None:
        """Forget ``seq_id`` on the device, once no step still running there uses it: a step the engine took no
        result of (refused, while the step after it already ran) is waited for first, so that the backend never
        frees what a running step reads and writes."""
        for pending in self._running:
            if pending.running and seq_id in pending.seq_ids:
                pending.wait()
        if not self.on_cpu and self.backend.implements("kestrel_release_sequence"):
            self._called("kestrel_release_sequence", lambda: self.backend.hook.kestrel_release_sequence(
                device=self.backend.device, seq_id=seq_id))

    # -- reporting -----------------------------------------------------------------------------------

    def backend_stats(self) -> dict[str, Any]:
        """The backend's own counters (``kestrel_stats``), each name a text and each value a plain one
        (``plain_counter``): what shows them (``kestrel run --stats``, ``--json``) runs no code of the backend's."""
        if not self.backend.implements("kestrel_stats"):
            return {}
        merged: dict[Any, Any] = {}
        try:
            with plugin_output():
                for part in self.backend.hook.kestrel_stats(device=self.backend.device):
                    if part is None:
                        continue
                    if not isinstance(part, Mapping):
                        self._report("kestrel_stats", f"bad result: {type(part).__name__}, not a dict", None)
                        continue
                    merged.update(part)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # counters are never worth a crash
            self._report("kestrel_stats", f"error: {type(exc).__name__}", exc)
            return {}
        return {k if type(k) is str else safe_text(k): plain_counter(v) for k, v in merged.items()}

    def stats(self) -> dict[str, Any]:
        return {hook: c.as_dict() for hook, c in sorted(self.counters.items())}

    def totals(self) -> tuple[int, int]:
        """(accepted, declined) over every GEMM hook."""
        accepted = sum(c.accepted for h, c in self.counters.items() if _counted(h))
        declined = sum(sum(c.declined.values()) for h, c in self.counters.items() if _counted(h))
        return accepted, declined


class _Raised:
    """What a hook call raised, in place of its result."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _counted(hook: str) -> bool:
    """Hooks that do model work (GEMMs, whole steps), as opposed to bookkeeping."""
    return "gemm" in hook or hook in ("kestrel_forward", "kestrel_forward_batch", "kestrel_decode_greedy")


def read_only(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A hook call's arguments with each numpy array as a read-only view, and each weight (or list of them) as its
    read-only twin: a backend cannot write into the inputs or the weights the CPU would compute from if it
    declines."""
    out = dict(kwargs)
    for name, value in kwargs.items():
        if isinstance(value, np.ndarray):
            out[name] = read_only_view(value)
        elif isinstance(value, StripCache):
            out[name] = read_only_strip(value)
        elif isinstance(value, list) and value and isinstance(value[0], StripCache):
            out[name] = [read_only_strip(w) for w in value]
    return out


def _arrays(kwargs: Mapping[str, Any]) -> list[np.ndarray]:
    """The numpy arrays among a hook call's arguments (its inputs, which a result must not alias)."""
    return [v for v in kwargs.values() if isinstance(v, np.ndarray)]
