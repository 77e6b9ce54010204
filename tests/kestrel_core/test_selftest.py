"""The conformance suite passes the reference and catches broken backends."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kestrel_core.cli import main
from kestrel_core.errors import KestrelError
from kestrel_core.registry import Registry
from kestrel_core.selftest import default_cases, run_selftest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "backends"


def test_cpu_passes_every_case_and_covers_the_grid() -> None:
    report = run_selftest("cpu", seeds=1)
    assert report.ok and report.failed == 0
    names = {c.name for c in report.cases}
    for needle in ("int8 G32", "int4 G32", "int8 G256", "int4 G256", "M1 ", "M64 ", "N37 "):
        assert any(needle in n for n in names), needle
    assert {c.m for c in default_cases(1)} >= {1, 64}


def test_off_by_one_ulp_level_errors_pass_but_real_errors_fail(tmp_path: Path, monkeypatch) -> None:
    """A backend that perturbs results by 1e-3 relative must fail; one that rounds differently must pass."""
    src = '''
import numpy as np
from kestrel_core import API_VERSION, BackendInfo, hookimpl
from kestrel_core.contract import reference_gemm_q8, reference_gemm_f32
from kestrel_cpu import kestrel_close, kestrel_open  # noqa: F401
SCALE = {scale}

@hookimpl
def kestrel_backend_info():
    return BackendInfo("{name}", "1", API_VERSION, "gpu")

@hookimpl
def kestrel_gemm_q8(device, a_codes, a_scales, weight, wkey):
    return (reference_gemm_q8(a_codes, a_scales, weight).astype(np.float64) * SCALE).astype(np.float32)

@hookimpl
def kestrel_gemm_f32(device, a, weight, wkey):
    return (reference_gemm_f32(a, weight).astype(np.float64) * SCALE).astype(np.float32)
'''
    (tmp_path / "close.py").write_text(src.format(name="close", scale="1 + 2**-22"))
    (tmp_path / "wrong.py").write_text(src.format(name="wrong", scale="1 + 1e-3"))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path))
    assert run_selftest("close", seeds=1).ok
    wrong = run_selftest("wrong", seeds=1)
    assert not wrong.ok and wrong.failed == len(wrong.cases)


def test_a_backend_whose_results_exit_fails_its_cases(tmp_path: Path, monkeypatch) -> None:
    """A result whose __class__ calls sys.exit(0) (the checks look at it) fails its case: the suite neither
    stops nor passes."""
    (tmp_path / "exits.py").write_text('''
import sys
from kestrel_core import API_VERSION, BackendInfo, hookimpl
from kestrel_cpu import kestrel_close, kestrel_gemm_f32, kestrel_open  # noqa: F401

class Result:
    @property
    def __class__(self):
        sys.exit(0)

@hookimpl
def kestrel_backend_info():
    return BackendInfo("exits", "1", API_VERSION, "gpu")

@hookimpl
def kestrel_gemm_q8(device, a_codes, a_scales, weight, wkey):
    return Result()
''')
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path))
    report = run_selftest("exits", seeds=1)
    q8 = [c for c in report.cases if c.hook == "kestrel_gemm_q8"]
    assert not report.ok and q8 and all(not c.passed and "SystemExit" in c.detail for c in q8)


def test_declining_everything_fails(monkeypatch) -> None:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(FIXTURES))
    reg = Registry()
    report = run_selftest("wrong_shape", seeds=1, registry=reg)
    assert not report.ok
    assert all("bad result" in c.detail for c in report.cases)


def test_selftest_of_an_unbound_backend_is_a_one_line_error(monkeypatch, capsys) -> None:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(FIXTURES))
    with pytest.raises(KestrelError, match="not bound: no widget attached"):
        run_selftest("unavailable")
    assert main(["selftest", "--backend", "unavailable"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no widget attached" in err
    assert main(["selftest", "--seeds", "0"]) == 2
    assert "--seeds: seeds must be an integer in [1, 10000], got 0" in capsys.readouterr().err


def test_cli_exit_code_reflects_failures(monkeypatch, capsys) -> None:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(FIXTURES))
    assert main(["selftest", "--backend", "wrong_shape", "--seeds", "1"]) == 1
    assert main(["selftest", "--backend", "cpu", "--seeds", "1"]) == 0
    assert "passed, 0 failed" in capsys.readouterr().out


def test_seeded_fixtures_are_reproducible() -> None:
    from kestrel_core.selftest import random_strip_cache

    a = random_strip_cache(np.random.default_rng(1), 5, 64, 32, 4)
    b = random_strip_cache(np.random.default_rng(1), 5, 64, 32, 4)
    np.testing.assert_array_equal(a.codes, b.codes)
    assert a.codes.min() >= -8 and a.codes.max() <= 7


# A batched whole step on the host decoder with its own caches per sequence; MODE breaks it on purpose.
# "fed" answers with a call (its step "runs" until then) and takes fed entries (the last greedy token of the
# sequence); "wrong_fed" feeds the token after it. A shared prefix is the published one's tokens run into the
# new sequence's cache (what the pool would hold); "unshared" runs zeros there instead. An entry's start below
# the cache's length takes the cache back to it (a rewind); "unrewound" runs the tokens after the length instead.
# "readonly" hands out logits the engine declines (read-only arrays), right as they are.
FORWARD_BATCH_BACKEND = '''
import numpy as np
from kestrel_core import API_VERSION, BackendInfo, hookimpl
from kestrel_core.dispatch import Offload
from kestrel_core.model.decoder import Decoder
from kestrel_core.registry import Registry
from kestrel_cpu import kestrel_close, kestrel_gemm_f32, kestrel_gemm_q8, kestrel_open  # noqa: F401

MODE = "{mode}"
_cpu = Registry().cpu()
STATE = {{}}
RELEASED = []
LAST = {{}}  # each sequence's last greedy token
TOKENS = {{}}  # each sequence's tokens so far
PUBLISHED = {{}}  # the first blocks of a published prefix -> its tokens


@hookimpl
def kestrel_backend_info():
    return BackendInfo("{name}", "1", API_VERSION, "gpu")


@hookimpl
def kestrel_forward_batch(device, model, batch):
    if MODE == "decline":
        return None
    if id(model) not in STATE:
        STATE.clear()
        STATE[id(model)] = (Decoder(model, Offload(_cpu, _cpu)), {{}})
    dec, caches = STATE[id(model)]
    work = []
    for e in batch:
        if e.seq_id not in caches:
            caches[e.seq_id] = dec.new_cache()
            TOKENS[e.seq_id] = []
            if e.shared:
                prefix = PUBLISHED.get(e.blocks[:e.shared // e.block_size])
                if prefix is None:
                    return None
                prefix = prefix[:e.shared] if MODE != "unshared" else [0] * e.shared
                dec.forward_batch([(caches[e.seq_id], np.array(prefix), 0)])
                TOKENS[e.seq_id] = list(prefix)
        cache = caches[e.seq_id]
        if e.start < cache.length and MODE != "unrewound":
            cache.truncate(e.start)
            del TOKENS[e.seq_id][e.start:]
        assert cache.length == e.start or MODE == "unrewound", (cache.length, e.start)
        tokens = e.tokens
        if e.fed:
            tokens = np.array([(LAST[e.seq_id] + int(MODE == "wrong_fed")) % model.config.vocab_size])
        work.append((cache, tokens, e.logit_rows))
    outs = dec.forward_batch(work)
    for e, (_, tokens, _) in zip(batch, work):
        TOKENS[e.seq_id] += [int(t) for t in tokens]
        if e.publish:
            PUBLISHED[e.blocks[:e.publish // e.block_size]] = TOKENS[e.seq_id][:e.publish]
    for e, o in zip(batch, outs):
        if e.logit_rows:
            LAST[e.seq_id] = int(np.argmax(o[-1]))
    if MODE == "scaled":  # a wrong scale: 25 % on every logit
        outs = [o * np.float32(1.25) for o in outs]
    if MODE == "swapped" and len(outs) > 1 and outs[0].shape == outs[1].shape:  # rows of another sequence
        outs = [outs[1], outs[0]] + outs[2:]
    if MODE in ("ids", "wrong_ids"):  # argmax_only entries get token ids; wrong_ids: the next id over
        shift = int(MODE == "wrong_ids")
        outs = [(np.argmax(o, axis=1) + shift) % o.shape[1] if e.argmax_only else o for o, e in zip(outs, batch)]
    if MODE == "readonly":  # logits handed out as a device copy's buffer: the engine declines them
        outs = [np.frombuffer(o.tobytes(), o.dtype).reshape(o.shape) for o in outs]
    if MODE in ("fed", "wrong_fed"):
        return lambda: outs
    return outs


@hookimpl
def kestrel_release_sequence(device, seq_id):
    RELEASED.append(seq_id)
    for _, caches in STATE.values():
        caches.pop(seq_id, None)
'''


@pytest.mark.parametrize("mode, ok", [("right", True), ("ids", True), ("scaled", False), ("swapped", False),
                                      ("wrong_ids", False), ("decline", False), ("fed", True), ("wrong_fed", False),
                                      ("unshared", False), ("unrewound", False), ("readonly", False)])
def test_the_batched_whole_step_is_checked_against_the_cpu(tmp_path: Path, monkeypatch, mode: str,
                                                           ok: bool) -> None:
    (tmp_path / f"fb_{mode}.py").write_text(FORWARD_BATCH_BACKEND.format(mode=mode, name=f"fb_{mode}"))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / f"fb_{mode}.py"))
    registry = Registry()
    report = run_selftest(f"fb_{mode}", seeds=1, registry=registry)
    cases = [c for c in report.cases if c.hook == "kestrel_forward_batch"]
    assert len(cases) >= 2
    assert all(c.passed for c in cases) is ok
    assert report.ok is ok
    if mode == "right":
        assert all(c.max_err == 0 for c in cases if not c.declined)  # the CPU itself: bit for bit
        assert len(set(registry.backends["fb_right"].plugin.RELEASED)) == 15 * 2  # every case's sequences released
    if mode == "wrong_ids":
        assert all("argmax_only ids" in c.detail for c in cases)
    if mode == "wrong_fed":
        assert all("fed step" in c.detail for c in cases)
    if mode == "unshared":
        assert all("shared prefix" in c.detail for c in cases)
    if mode == "unrewound":
        assert all("rewind" in c.detail for c in cases)
    if mode == "readonly":  # judged by the engine's own checks, as the GEMM cases are
        assert all(c.detail == "the engine would decline it: a read-only array" for c in cases)
