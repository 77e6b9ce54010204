"""The conformance suite: every GEMM hook and the batched whole step a backend implements, against the CPU.

Any backend, ours or a third party's, is run with ``kestrel selftest --backend NAME``. A GEMM case passes
when every output element is within a float-rounding bound of the reference: integer block sums are exact in
every correct implementation, so only the order of the float accumulation over blocks may differ.

A whole step cannot be held to a fixed bound: every linear quantizes its input to int8 (and the KV cache
rounds keys and values to float16), so a value within rounding of a boundary rounds the other way in another
(correct) implementation, and later layers amplify that. The batched-step cases therefore measure their band:
the CPU decoder is run a second time with every linear's input and output nudged by a few ulps (``JITTER``),
and the backend may differ from the CPU by ``JITTER_FACTOR`` times what the nudge alone changes. On the small
random models here that band is 1-3 % (relative L2 of the logits), so these cases catch what a wrong kernel
does (a bad index, a missing bias, the rows of another sequence: tens of %), while the GEMM cases above catch
subtle errors in the arithmetic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kestrel_core.batch import BatchEntry, greedy_token
from kestrel_core.contract import (
    BITS,
    CODE_RANGE,
    GROUP_SIZES,
    StripCache,
    quantize_activations,
    reference_gemm_f32,
    reference_gemm_q8,
)
from kestrel_core.dispatch import Offload, check_arrays, check_batch, read_only
from kestrel_core.errors import KestrelError, safe_text
from kestrel_core.registry import Backend, Registry
from kestrel_core.wkey import PROJ_GROUPS

GEMM_HOOKS = ("kestrel_gemm_q8", "kestrel_gemm_f32", "kestrel_gemm_fused_q8")
FORWARD_BATCH = "kestrel_forward_batch"
JITTER = 2.0 ** -21  # relative nudge of linear inputs and outputs: 4 float32 ulps
JITTER_FACTOR = 3.0  # a backend may differ by this many times the nudge's effect (relative L2 of the logits)
JITTER_FLOOR = 1e-5  # relative, for when the nudge changes no code at all
EPS32 = float(np.finfo(np.float32).eps)


@dataclass(frozen=True)
class SelfTestCase:
    """One GEMM check: ``ns`` holds one N, or several for the fused hook (all sharing K)."""

    hook: str
    m: int
    ns: tuple[int, ...]
    k: int
    group_size: int
    bits: int
    seed: int

    @property
    def name(self) -> str:
        n = "+".join(map(str, self.ns))
        hook = self.hook.removeprefix("kestrel_")
        return f"{hook} int{self.bits} G{self.group_size} M{self.m} N{n} K{self.k} s{self.seed}"


@dataclass
class CaseResult:
    name: str
    hook: str
    passed: bool
    max_err: float = 0.0
    tolerance: float = 0.0
    declined: bool = False
    detail: str = ""


@dataclass
class SelfTestReport:
    backend: str
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def passed(self) -> int:
        return sum(c.passed for c in self.cases)

    @property
    def failed(self) -> int:
        return len(self.cases) - self.passed

    @property
    def ok(self) -> bool:
        return bool(self.cases) and self.failed == 0

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "passed": self.passed, "failed": self.failed, "ok": self.ok,
                "cases": [asdict(c) for c in self.cases]}


def default_cases(seeds: int = 2) -> list[SelfTestCase]:
    cases = []
    for seed in range(seeds):
        for bits in (8, 4):
            for g in (32, 256):
                k = 512 if g == 256 else 96
                for m in (1, 3, 64):
                    for hook in ("kestrel_gemm_q8", "kestrel_gemm_f32"):
                        cases.append(SelfTestCase(hook, m, (37 if m == 3 else 64,), k, g, bits, seed))
                cases.append(SelfTestCase("kestrel_gemm_fused_q8", 5, (64, 32, 32), k, g, bits, seed))
                cases.append(SelfTestCase("kestrel_gemm_fused_q8", 1, (36, 17), k, g, bits, seed))
    return cases


def random_strip_cache(rng: np.random.Generator, n: int, k: int, group_size: int, bits: int) -> StripCache:
    lo, hi = CODE_RANGE[bits]
    codes = rng.integers(lo, hi + 1, size=(n, k), dtype=np.int8)
    # Signed scales, as real Q4_0 weights have (d = x_max / -8 is negative for a positive extreme).
    scales = (rng.uniform(1e-3, 2e-2, size=(n, k // group_size)) * rng.choice([-1, 1], size=(n, k // group_size)))
    scales = scales.astype(np.float32)
    return StripCache(codes, scales, group_size, bits)


@dataclass(frozen=True)
class Comparison:
    """A GEMM result against the reference: the worst element's error and its tolerance."""

    ok: bool
    max_err: float
    tolerance: float
    detail: str = ""


def _sum_abs_terms(a_abs: np.ndarray, w: StripCache) -> np.ndarray:
    """Sum of |terms| per output element: the scale of the rounding error any order can make."""
    g = w.group_size
    m = a_abs.shape[0]
    a = a_abs.reshape(m, -1, g).transpose(1, 0, 2).astype(np.float64)                      # [ng, M, G]
    b = np.abs(w.codes.astype(np.float64)).reshape(w.n, -1, g).transpose(1, 2, 0)          # [ng, G, N]
    return (np.matmul(a, b) * np.abs(w.scales).T[:, None, :]).sum(axis=0)                  # [M, N]


def _compare(got: Any, ref: np.ndarray, abs_terms: np.ndarray, ngroups: int) -> Comparison:
    if not isinstance(got, np.ndarray) or got.dtype != np.float32 or got.shape != ref.shape:
        what = f"{got.dtype} {list(got.shape)}" if isinstance(got, np.ndarray) else type(got).__name__
        return Comparison(False, float("inf"), 0.0, f"bad result {what}, expected float32 {list(ref.shape)}")
    tol = (4 * (ngroups + 8) * EPS32) * abs_terms + 1e-30
    if not np.all(np.isfinite(got)):
        return Comparison(False, float("inf"), float(tol.max()), "non-finite output")
    err = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    worst = int(np.argmax(err / tol))
    ok = bool(np.all(err <= tol))
    detail = "" if ok else f"error {err.flat[worst]:.3g} > tolerance {tol.flat[worst]:.3g} at {worst}"
    return Comparison(ok, float(err.flat[worst]), float(tol.flat[worst]), detail)


def compare_gemm_q8(got: Any, a_codes: np.ndarray, a_scales: np.ndarray, w: StripCache) -> Comparison:
    """``got`` against reference_gemm_q8, within a few float32 roundings per K-block."""
    a_abs = np.abs(a_codes.astype(np.float32)) * np.repeat(a_scales, w.group_size, axis=1)
    return _compare(got, reference_gemm_q8(a_codes, a_scales, w), _sum_abs_terms(a_abs, w), w.ngroups)


def compare_gemm_f32(got: Any, a: np.ndarray, w: StripCache) -> Comparison:
    """``got`` against reference_gemm_f32, within a few float32 roundings per K-block."""
    return _compare(got, reference_gemm_f32(a, w), _sum_abs_terms(np.abs(a), w), w.ngroups)


def run_case(backend: Backend, case: SelfTestCase, layer: int) -> CaseResult:
    """Run one case; ``layer`` makes its wkeys unique, since backends may cache weights by wkey."""
    rng = np.random.default_rng([case.seed, case.m, case.k, case.group_size, case.bits, *case.ns])
    weights = [random_strip_cache(rng, n, case.k, case.group_size, case.bits) for n in case.ns]
    x = rng.standard_normal((case.m, case.k)).astype(np.float32)
    a_codes, a_scales = quantize_activations(x, case.group_size)
    qkv = PROJ_GROUPS[0]  # a fused case is offered as a layer's Q|K|V would be
    keys = list(qkv.keys(layer))[: len(weights)]
    hook = getattr(backend.hook, case.hook)

    def call(x: np.ndarray, a_codes: np.ndarray, a_scales: np.ndarray) -> Any:  # read-only, as the engine's
        if case.hook == "kestrel_gemm_q8":
            return [hook(device=backend.device, wkey=keys[0], **read_only(
                {"a_codes": a_codes, "a_scales": a_scales, "weight": weights[0]}))]
        if case.hook == "kestrel_gemm_f32":
            return [hook(device=backend.device, wkey=keys[0], **read_only({"a": x, "weight": weights[0]}))]
        return hook(device=backend.device, wkeys=keys, fused_wkey=qkv.fused_key(layer),
                    **read_only({"a_codes": a_codes, "a_scales": a_scales, "weights": weights}))

    def failed(detail: str) -> CaseResult:
        return CaseResult(case.name, case.hook, False, float("inf"), detail=detail)

    try:
        got = call(x, a_codes, a_scales)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a plugin's sys.exit fails its case, not the suite
        return failed(f"raised {type(exc).__name__}: {safe_text(exc)}")
    if got is None or (isinstance(got, list) and any(g is None for g in got)):
        return CaseResult(case.name, case.hook, True, declined=True, detail="declined")
    if not isinstance(got, (list, tuple)) or len(got) != len(weights):
        return failed(f"{len(weights)} outputs expected")
    checks = [compare_gemm_f32(out, x, w) if case.hook == "kestrel_gemm_f32"
              else compare_gemm_q8(out, a_codes, a_scales, w) for out, w in zip(got, weights)]
    worst = max(checks, key=lambda c: (not c.ok, c.max_err / max(c.tolerance, 1e-30)))
    if not all(c.ok for c in checks):
        return CaseResult(case.name, case.hook, False, worst.max_err, worst.tolerance, detail=worst.detail)
    unusable = check_arrays(got, [(case.m, n) for n in case.ns], [x, a_codes, a_scales])
    if unusable:
        return failed(f"the engine would decline it: {unusable}")
    kept = [np.array(g) for g in got]
    try:  # another call of the same shapes must leave these results as they are (no buffer handed out twice)
        call(-x, -a_codes, a_scales)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return failed(f"a second call raised {type(exc).__name__}: {safe_text(exc)}")
    if not all(np.array_equal(k, g) for k, g in zip(kept, got)):
        return failed("a second call changed the first call's results (a buffer handed out twice)")
    return CaseResult(case.name, case.hook, True, worst.max_err, worst.tolerance, detail=worst.detail)


class JitterOffload(Offload):
    """The CPU offload with every linear's input and output multiplied by (1 +- JITTER), seeded signs: a
    backend's GEMMs sum in another order, so its outputs differ by float rounding, and so may every rounding
    after them (the next linear's int8 codes, the float16 keys and values of the cache)."""

    def __init__(self, cpu: Backend, seed: int) -> None:
        super().__init__(cpu, cpu)
        self.rng = np.random.default_rng(seed)

    def _nudge(self, x: np.ndarray) -> np.ndarray:
        signs = self.rng.choice(np.array([-1.0, 1.0], np.float32), size=x.shape)
        return (x * (np.float32(1) + np.float32(JITTER) * signs)).astype(np.float32)

    def linear(self, x: np.ndarray, weight: StripCache, wkey: int) -> np.ndarray:
        return self._nudge(super().linear(self._nudge(x), weight, wkey))

    def linear_fused(self, x: np.ndarray, weights: Any, wkeys: Any, fused_wkey: int) -> list[np.ndarray]:
        return [self._nudge(y) for y in super().linear_fused(self._nudge(x), weights, wkeys, fused_wkey)]

    def host_dense_layer(self, wkeys: Any, strips: Any) -> None:
        return None  # the layers op by op, through the nudged linears

    def host_experts(self, wkeys: Any, strips: Any, shared: bool) -> None:
        return None  # and the experts


# Steps of the batched-step cases: (sequence, new tokens, logit rows) each. Sequences join late, prompts
# arrive in chunks beside decode rows, one chunk asks for no logits and one for several.
BATCH_SCRIPT = (
    ((0, 9, 1), (1, 5, 5)),
    ((0, 1, 1), (1, 1, 1), (2, 7, 0)),
    ((0, 1, 1), (2, 4, 2), (1, 1, 1)),
    ((2, 1, 1), (0, 1, 1)),
)
BATCH_MODELS = (("llama", "q8"), ("qwen3", "q4"))
BATCH_NUDGES = 3  # the band is the largest effect of this many nudges: one alone changed 5e-7 to 7e-3 of the logits
# relative L2 of logits whose tokens ran in other chunks against the same tokens run straight: a shared prefix's
# (the CUDA backend 2e-7 to 2.2e-3, an H100; its numpy mirrors the same bits; a prefix not read from the pool 1.1-1.4)
# and a rewound draft's (the CUDA backend 1.5e-7 to 2.4e-7, an H100; a draft not taken back 0.21-0.92)
CHUNKED_TOL = 0.05


def _batch_config(arch: str) -> Any:
    from kestrel_core.model.config import ModelConfig

    return ModelConfig(arch=arch, vocab_size=509, hidden_size=256, intermediate_size=512, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=64, max_position=256, qk_norm=arch == "qwen3",
                       rope_theta=10000.0 if arch == "llama" else 1e6)


def _rerun_argmax_only(backend: Backend, model: Any, first_seq: int, script_toks: list[list[np.ndarray]],
                       caches: dict[int, Any], pool: Any, got: list[np.ndarray]) -> str:
    """BATCH_SCRIPT again, on fresh sequences (the first run's released, its blocks reused), every entry
    marked argmax_only: token ids returned must be the argmax of the logits the first run returned. What is
    wrong, or ""."""
    _release(backend, (), range(first_seq, first_seq + 3))
    starts = dict.fromkeys(range(3), 0)
    at = 0
    for step, toks in zip(BATCH_SCRIPT, script_toks):
        batch = [BatchEntry(first_seq + 3 + s, t, starts[s], rows, tuple(caches[s].blocks), pool.block_size,
                            pool.num_blocks, argmax_only=True) for (s, _, rows), t in zip(step, toks)]
        try:
            out = _batch_step(backend, model, batch)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            return f"argmax_only step: {_raised(exc)}"
        if out is None:
            return ""  # declined: nothing to compare
        for r in out:
            logits = got[at]
            at += 1
            if r.ndim == 1:  # token ids (int64, as the engine's checks ask)
                want = [int(np.argmax(row)) for row in logits]
                if r.tolist() != want:
                    return f"argmax_only ids {r.tolist()}, the logits' argmax is {want}"
        for s, n, _ in step:
            starts[s] += n
    return ""


def _fed_steps(backend: Backend, model: Any, first_seq: int, caches: dict[int, Any], pool: Any) -> str:
    """Two prompts in one step (argmax_only), then, before its results are taken, a step whose entries are
    ``fed`` (API 1.4): its tokens must be those the same two steps give with the first one's tokens written out
    (fresh sequences, the same blocks). What is wrong, or "" (also for a backend that answers at once, which is
    never offered fed entries, or that declines them)."""
    rng = np.random.default_rng(first_seq)
    prompts = [rng.integers(0, model.config.vocab_size, n) for n in (9, 5)]

    def entry(seq: int, i: int, tokens: np.ndarray, start: int, fed: bool = False) -> BatchEntry:
        return BatchEntry(seq, tokens, start, 1, tuple(caches[i].blocks), pool.block_size, pool.num_blocks, True, fed)

    def offer(batch: list[BatchEntry]) -> tuple[list[BatchEntry], Any]:
        return batch, backend.hook.kestrel_forward_batch(device=backend.device, model=model, batch=batch)

    def done(offered: tuple[list[BatchEntry], Any]) -> list[int] | None:
        batch, out = offered
        out = _usable(out() if callable(out) else out, batch, model.config.vocab_size)
        return None if out is None else [greedy_token(o) for o in out]

    _release(backend, (), range(first_seq, first_seq + 6))
    fed_seq, ref_seq = first_seq + 6, first_seq + 8
    first = offer([entry(fed_seq + i, i, p, 0) for i, p in enumerate(prompts)])
    if not callable(first[1]):
        return ""
    second = offer([entry(fed_seq + i, i, np.array([-1]), len(p), True) for i, p in enumerate(prompts)])
    got_first = done(first)
    got_second = done(second) if second[1] is not None else None
    _release(backend, (), range(fed_seq, fed_seq + 2))
    if got_second is None or got_first is None:
        return ""
    want_first = done(offer([entry(ref_seq + i, i, p, 0) for i, p in enumerate(prompts)]))
    want_second = None if want_first is None else done(
        offer([entry(ref_seq + i, i, np.array([t]), len(p)) for i, (p, t) in enumerate(zip(prompts, want_first))]))
    _release(backend, (), range(ref_seq, ref_seq + 2))
    if want_second is None:
        return ""
    if got_first != want_first or got_second != want_second:
        return (f"fed step: tokens {got_first} then {got_second}, with the tokens written out {want_first} then "
                f"{want_second}")
    return ""


def _shared_prefix_steps(backend: Backend, model: Any, first_seq: int, pool: Any) -> str:
    """A prompt of two whole blocks and more, alone, with those blocks to ``publish`` (API 1.5); then another
    sequence, new to the backend, whose page table starts with them (``shared``) and whose own tokens run from
    their end: its logits must be those of the whole prompt run from position 0 in blocks of its own, within
    CHUNKED_TOL (its rows ran in other chunks; a prefix not read from the blocks is off by far more).
    What is wrong, or "" (also for a backend that declines)."""
    bs = pool.block_size
    rng = np.random.default_rng([first_seq, 15])
    prefix, rest, own = (rng.integers(0, model.config.vocab_size, n) for n in (2 * bs, 5, 7))
    seqs = [pool.new_sequence() for _ in range(3)]
    publisher, sharer, whole = (first_seq + 10 + i for i in range(3))
    try:
        if not (pool.reserve(seqs[0], 2 * bs + len(rest)) and pool.reserve(seqs[1], bs)
                and pool.reserve(seqs[2], 2 * bs + len(own))):
            return ""
        first = np.concatenate([prefix, rest])
        shared_blocks = (*seqs[0].blocks[:2], *seqs[1].blocks)

        def step(seq: int, tokens: np.ndarray, start: int, blocks: tuple[int, ...], shared: int = 0) -> Any:
            return _batch_step(backend, model, [BatchEntry(seq, tokens, start, len(own), blocks, bs, pool.num_blocks,
                                                           shared=shared, publish=2 * bs)])

        if step(publisher, first, 0, tuple(seqs[0].blocks)) is None:
            return ""
        got = step(sharer, own, 2 * bs, shared_blocks, shared=2 * bs)
        want = step(whole, np.concatenate([prefix, own]), 0, tuple(seqs[2].blocks))
    except Exception as exc:
        return f"shared prefix: {_raised(exc)}"
    finally:
        _release(backend, seqs, range(first_seq + 10, first_seq + 13))
    return _off_straight("shared prefix", "the logits after a prefix from the pool are {} off those of the whole "
                         "prompt", got, want)


def _rewind_steps(backend: Backend, model: Any, first_seq: int, pool: Any) -> str:
    """A prompt, a draft of five tokens run after it, then three tokens from the draft's second position (API
    1.6: the backend computes the positions from ``start`` on again, as after guesses the model did not
    confirm): their logits must be those of the same tokens run straight in another sequence, within
    CHUNKED_TOL. What is wrong, or "" (also for a backend that declines)."""
    rng = np.random.default_rng([first_seq, 16])
    prompt, draft, fix = (rng.integers(0, model.config.vocab_size, n) for n in (9, 5, 3))
    caches = [pool.new_sequence() for _ in range(2)]
    guessing, straight = first_seq + 13, first_seq + 14
    n = len(prompt)

    def step(seq: int, cache: Any, tokens: np.ndarray, start: int, rows: int) -> Any:
        return _batch_step(backend, model, [BatchEntry(seq, tokens, start, rows, tuple(cache.blocks), pool.block_size,
                                                       pool.num_blocks)])

    try:
        if not (pool.reserve(caches[0], n + len(draft)) and pool.reserve(caches[1], n + 1 + len(fix))):
            return ""
        if step(guessing, caches[0], prompt, 0, 1) is None or step(guessing, caches[0], draft, n, len(draft)) is None:
            return ""
        got = step(guessing, caches[0], fix, n + 1, len(fix))
        want = step(straight, caches[1], np.concatenate([prompt, draft[:1], fix]), 0, len(fix))
    except Exception as exc:
        return f"rewind: {_raised(exc)}"
    finally:
        _release(backend, caches, (guessing, straight))
    return _off_straight("rewind", "the logits of tokens run from an earlier start are {} off those of the same "
                         "tokens run straight", got, want)


def _release(backend: Backend, caches: Sequence[Any], seq_ids: Iterable[int]) -> None:
    """A check's page tables back to the reference's pool, and its sequences released on the backend."""
    for cache in caches:
        cache.release()
    if backend.implements("kestrel_release_sequence"):
        for seq in seq_ids:
            backend.hook.kestrel_release_sequence(device=backend.device, seq_id=seq)


def _off_straight(what: str, off: str, got: Any, want: Any) -> str:
    """What is wrong with a step's logits (``got``) against the same tokens' run straight (``want``; both checked by
    ``_batch_step``) beyond CHUNKED_TOL: "" where they agree, or where either step was declined."""
    if got is None or want is None:
        return ""
    g, w = (np.asarray(x[0], np.float64) for x in (got, want))
    err = float(np.linalg.norm(g - w)) / (float(np.linalg.norm(w)) or 1.0)
    if err > CHUNKED_TOL:
        return f"{what}: {off.format(f'{err:.3g}')} (at most {CHUNKED_TOL})"
    return ""


class Unusable(Exception):
    """A step's result the engine would decline: the reason of its own checks (``dispatch.check_batch``)."""


def _raised(exc: BaseException) -> str:
    """A case's detail for what its step raised: the engine's reason for a result it would decline."""
    return safe_text(exc) if isinstance(exc, Unusable) else f"raised {type(exc).__name__}: {safe_text(exc)}"


def _usable(out: Any, batch: list[BatchEntry], vocab: int) -> Any:
    """``out``, a batched step's result (None: declined), if the engine would take it; else Unusable."""
    bad = None if out is None else check_batch(out, batch, vocab)
    if bad:
        raise Unusable(f"the engine would decline it: {bad}")
    return out


def _batch_step(backend: Backend, model: Any, batch: list[BatchEntry]) -> Any:
    """The batched hook's result, checked as the engine checks it (``_usable``); a step still running on the device
    (a call, since API 1.3) is waited for."""
    out = backend.hook.kestrel_forward_batch(device=backend.device, model=model, batch=batch)
    return _usable(out() if callable(out) else out, batch, model.config.vocab_size)


def run_forward_batch_case(backend: Backend, cpu: Backend, arch: str, quant: str, seed: int,
                           first_seq: int) -> CaseResult:
    """The backend's batched steps of BATCH_SCRIPT against the CPU decoder, within the measured band; then
    with every entry argmax_only, whose token ids must be the argmax of the same steps' logits; then fed steps
    (API 1.4), which must give the tokens written-out ones give, a shared prefix (API 1.5) and a rewind (API 1.6)."""
    from kestrel_core.model.decoder import Decoder
    from kestrel_core.model.kv_pool import KVPool
    from kestrel_core.model.presets import synthetic_model
    from kestrel_core.model.weights import read_only_model

    name = _batch_case_name(arch, quant, seed)
    own = synthetic_model(_batch_config(arch), quant, seed=seed)
    host = Decoder(own, Offload(cpu, cpu), KVPool.for_budget(own.config, 1))  # a pool of a few blocks
    nudges = [Decoder(own, JitterOffload(cpu, seed + 100 * i)) for i in range(BATCH_NUDGES)]
    model = read_only_model(own)  # what the backend is handed, as in the engine
    rng = np.random.default_rng([seed, 7])
    caches = {s: host.new_cache() for s in range(3)}
    nudged_caches = [{s: nudged.new_cache() for s in range(3)} for nudged in nudges]
    starts = dict.fromkeys(range(3), 0)
    got_all: list[np.ndarray] = []
    ref_all: list[np.ndarray] = []
    nudged_all: list[list[np.ndarray]] = [[] for _ in nudges]
    script_toks: list[list[np.ndarray]] = []
    try:
        for step in BATCH_SCRIPT:
            toks = [rng.integers(0, model.config.vocab_size, n) for _, n, _ in step]
            script_toks.append(toks)
            pool = host.pool  # the page tables come from the reference's pool, as the engine's from its own
            for s, n, _ in step:
                pool.reserve(caches[s], starts[s] + n)
            batch = [BatchEntry(first_seq + s, t, starts[s], rows, tuple(caches[s].blocks), pool.block_size,
                                pool.num_blocks) for (s, _, rows), t in zip(step, toks)]
            try:
                got = _batch_step(backend, model, batch)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:
                return CaseResult(name, FORWARD_BATCH, False, float("inf"), detail=_raised(exc))
            if got is None:
                return CaseResult(name, FORWARD_BATCH, True, declined=True, detail="declined")
            ref = host.forward_batch([(caches[s], t, rows) for (s, _, rows), t in zip(step, toks)])
            jits = [nudged.forward_batch([(caches_n[s], t, rows) for (s, _, rows), t in zip(step, toks)])
                    for nudged, caches_n in zip(nudges, nudged_caches)]
            for i, (out, r) in enumerate(zip(got, ref)):  # float32 [rows, vocab] each: the engine's checks passed
                got_all.append(out)
                ref_all.append(r)
                for acc, jit in zip(nudged_all, jits):
                    acc.append(jit[i])
            for s, n, _ in step:
                starts[s] += n
        bad_ids = _rerun_argmax_only(backend, model, first_seq, script_toks, caches, host.pool, got_all)
        if not bad_ids and tuple(backend.info.api_version) >= (1, 4):
            bad_ids = _fed_steps(backend, model, first_seq, caches, host.pool)
        if not bad_ids and tuple(backend.info.api_version) >= (1, 5):
            bad_ids = _shared_prefix_steps(backend, model, first_seq, host.pool)
        if not bad_ids and tuple(backend.info.api_version) >= (1, 6):
            bad_ids = _rewind_steps(backend, model, first_seq, host.pool)
        if bad_ids:
            return CaseResult(name, FORWARD_BATCH, False, float("inf"), detail=bad_ids)
    finally:
        _release(backend, (), range(first_seq, first_seq + 10))
    got_v, ref_v = (np.concatenate([a.ravel() for a in x]).astype(np.float64) for x in (got_all, ref_all))
    if not np.all(np.isfinite(got_v)):
        return CaseResult(name, FORWARD_BATCH, False, float("inf"), detail="non-finite output")
    scale = float(np.linalg.norm(ref_v)) or 1.0
    err = float(np.linalg.norm(got_v - ref_v)) / scale
    effect = max(float(np.linalg.norm(np.concatenate([a.ravel() for a in n]).astype(np.float64) - ref_v))
                 for n in nudged_all) / scale
    tol = max(JITTER_FACTOR * effect, JITTER_FLOOR)
    ok = err <= tol
    return CaseResult(name, FORWARD_BATCH, ok, err, tol,
                      detail="" if ok else f"relative L2 error {err:.3g} > band {tol:.3g}")


def _batch_case_name(arch: str, quant: str, seed: int) -> str:
    return f"forward_batch {arch} {quant} s{seed}"


CASE_HOOKS = ("kestrel_gemm_q8", "kestrel_gemm_f32", "kestrel_gemm_fused_q8")
MAX_CASE_ELEMENTS = 1 << 26  # of a case's activations or of one of its weights


def _case_problem(case: SelfTestCase) -> str | None:
    """Why a backend's own case cannot run (its fields, exact types, within what the references take), or None."""
    if type(case.hook) is not str or case.hook not in CASE_HOOKS:
        return f"hook must be one of {', '.join(CASE_HOOKS)}"
    ints = (case.m, case.k, case.group_size, case.bits, case.seed)
    if any(type(v) is not int for v in ints) or type(case.ns) is not tuple or not case.ns \
            or any(type(n) is not int or n < 1 for n in case.ns):
        return "m, k, group_size, bits and seed must be ints and ns a non-empty tuple of ints >= 1"
    if case.group_size not in GROUP_SIZES or case.bits not in BITS:
        return f"group_size must be one of {GROUP_SIZES} and bits one of {BITS}"
    if case.m < 1 or case.seed < 0 or case.k < 1 or case.k % case.group_size:
        return "m must be >= 1, seed >= 0 and k a positive multiple of group_size"
    if len(case.ns) > 1 and case.hook != "kestrel_gemm_fused_q8":
        return f"{case.hook} takes one N"
    if max(case.m, *case.ns) * case.k > MAX_CASE_ELEMENTS:
        return f"at most {MAX_CASE_ELEMENTS} elements a matrix"
    return None


def _guarded(name: str, hook: str, run: Callable[[], CaseResult]) -> CaseResult:
    """``run()``, or a failed case where the backend's code raised out of it anyway (its sys.exit included, in a
    call the case does not guard itself, or in a result the checks use): never the end of the suite."""
    try:
        return run()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return CaseResult(name, hook, False, float("inf"), detail=_raised(exc))


def run_selftest(name: str = "cpu", seeds: int = 2, registry: Registry | None = None) -> SelfTestReport:
    registry = registry or Registry()
    backend = registry.bind(name)
    if not backend.bound:
        raise KestrelError(f"backend {name!r} is not bound: {backend.reason}")
    cases = [c for c in default_cases(seeds) if backend.implements(c.hook)]
    refused: list[CaseResult] = []
    if backend.implements("kestrel_selftest_cases"):
        try:
            for extra in backend.hook.kestrel_selftest_cases(device=backend.device):
                for c in extra or ():
                    case = c if isinstance(c, SelfTestCase) else SelfTestCase(**c)
                    problem = _case_problem(case)
                    if problem is None:
                        cases.append(case)
                    else:
                        refused.append(CaseResult(f"kestrel_selftest_cases #{len(cases) + len(refused)}",
                                                  "kestrel_selftest_cases", False, detail=problem))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # the backend's own cases are lost, the built-in ones still run
            refused.append(CaseResult("kestrel_selftest_cases", "kestrel_selftest_cases", False,
                                      detail=f"raised {type(exc).__name__}: {safe_text(exc)}"))
    report = SelfTestReport(backend.name, [_guarded(c.name, c.hook, lambda c=c, i=i: run_case(backend, c, i))
                                           for i, c in enumerate(cases)] + refused)
    if backend.implements(FORWARD_BATCH):
        cpu = registry.cpu()
        for seed in range(seeds):
            for i, (arch, quant) in enumerate(BATCH_MODELS):
                first_seq = 1_000_000 + 20 * (seed * len(BATCH_MODELS) + i)  # apart from an engine's ids
                report.cases.append(_guarded(_batch_case_name(arch, quant, seed), FORWARD_BATCH, functools.partial(
                    run_forward_batch_case, backend, cpu, arch, quant, seed, first_seq)))
    for hook in {c.hook for c in report.cases}:
        mine = [c for c in report.cases if c.hook == hook]
        if all(c.declined for c in mine):  # a hook that declines everything checks nothing
            report.cases.append(CaseResult(f"{hook} (any case)", hook, False, detail="declined every case"))
    return report
