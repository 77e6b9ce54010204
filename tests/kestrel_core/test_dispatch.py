"""The dispatcher's fused and model-level paths, with backends written to files like a developer's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kestrel_core import BatchEntry, Deferred, Offload, Proj, Registry, quantize_weight, wkey
from kestrel_core.contract import quantize_activations, reference_gemm_q8
from kestrel_core.wkey import fused_wkey

BACKEND = '''
import numpy as np
from kestrel_core import API_VERSION, BackendInfo, hookimpl
from kestrel_core.contract import reference_gemm_q8
from kestrel_cpu import kestrel_close, kestrel_gemm_f32, kestrel_gemm_q8, kestrel_open  # noqa: F401
SEEN = []

@hookimpl
def kestrel_backend_info():
    return BackendInfo("fusing", "1", API_VERSION, "gpu")

@hookimpl
def kestrel_gemm_fused_q8(a_codes, a_scales, weights, wkeys, fused_wkey):  # fewer arguments than the spec
    SEEN.append((tuple(wkeys), fused_wkey))
    outs = [reference_gemm_q8(a_codes, a_scales, w) for w in weights]
    return outs[:{keep}]

@hookimpl
def kestrel_forward(device, model, seq_id, tokens, start, all_logits):
    SEEN.append(("forward", seq_id, start))
    return np.zeros(({rows}, 11), np.float32)

@hookimpl
def kestrel_layer_boundary(layer):
    SEEN.append(("layer", layer))

GREEDY = []  # what kestrel_decode_greedy returns: a list of tokens (one may be an exception), or "none"/"list"

@hookimpl
def kestrel_decode_greedy(device, model, seq_id, token, start, count):
    SEEN.append(("greedy", token, start, count))
    if GREEDY == ["none"]:
        return None
    if GREEDY == ["list"]:
        return [1, 2]
    if GREEDY == ["iter"]:
        return iter([1, 2])
    def tokens():
        for t in GREEDY:
            if isinstance(t, Exception):
                raise t
            if (yield t) is False:  # the next one, then stop
                SEEN.append(("stop",))
    return tokens()
'''


def _registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep: str = "None", rows: str = "len(tokens)"):
    (tmp_path / "fusing.py").write_text(BACKEND.format(keep=keep, rows=rows))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "fusing.py"))
    reg = Registry()
    backend = reg.select("fusing")
    return Offload(backend, reg.cpu()), backend.plugin


def _weights(seed: int = 0):
    rng = np.random.default_rng(seed)
    ws = [quantize_weight(rng.standard_normal((n, 64)).astype(np.float32)) for n in (32, 16, 16)]
    return rng.standard_normal((3, 64)).astype(np.float32), ws


def test_fused_hook_gets_the_keys_and_results_match_the_reference(tmp_path, monkeypatch) -> None:
    offload, plugin = _registry(tmp_path, monkeypatch)
    x, ws = _weights()
    keys = [wkey(4, p) for p in (Proj.Q, Proj.K, Proj.V)]
    outs = offload.linear_fused(x, ws, keys, fused_wkey(4, Proj.QKV))
    a_codes, a_scales = quantize_activations(x, 32)
    for out, w in zip(outs, ws):
        np.testing.assert_array_equal(out, reference_gemm_q8(a_codes, a_scales, w))
    assert plugin.SEEN == [(tuple(keys), fused_wkey(4, Proj.QKV))]
    assert offload.stats()["kestrel_gemm_fused_q8"]["accepted"] == 1


def test_a_short_fused_result_is_rejected_and_recomputed(tmp_path, monkeypatch) -> None:
    offload, _ = _registry(tmp_path, monkeypatch, keep="2")
    x, ws = _weights(1)
    outs = offload.linear_fused(x, ws, [wkey(0, p) for p in (Proj.Q, Proj.K, Proj.V)], fused_wkey(0, Proj.QKV))
    cpu = Registry().cpu()
    assert len(outs) == 3
    np.testing.assert_array_equal(outs[2], Offload(cpu, cpu).linear(x, ws[2], wkey(0, Proj.V)))
    stats = offload.stats()
    assert stats["kestrel_gemm_fused_q8"]["declined_reasons"] == {"bad result: expected a list of 3 arrays": 1}
    assert stats["kestrel_gemm_q8"]["offered"] == 3  # one by one instead


def test_forward_result_shape_is_checked(tmp_path, monkeypatch) -> None:
    offload, plugin = _registry(tmp_path, monkeypatch)
    tokens = np.arange(4, dtype=np.int32)
    assert offload.forward(None, 7, tokens, 0, True, 11).shape == (4, 11)
    assert offload.forward(None, 7, tokens, 4, False, 11) is None  # 4 rows where 1 was asked for
    assert offload.stats()["kestrel_forward"]["declined_reasons"] == {"bad result: shape [4, 11], expected [1, 11]": 1}
    offload.layer_boundary(3)
    assert ("layer", 3) in plugin.SEEN and ("forward", 7, 0) in plugin.SEEN


def test_on_cpu_nothing_is_offered_but_gemms_are_counted() -> None:
    reg = Registry()
    offload = Offload(reg.cpu(), reg.cpu())
    x, ws = _weights(2)
    offload.linear_fused(x, ws, [1, 2, 3], fused_wkey(0, Proj.QKV))
    assert offload.forward(None, 1, np.zeros(2, np.int32), 0, True, 11) is None
    stats = offload.stats()
    assert "kestrel_gemm_fused_q8" not in stats and stats["kestrel_gemm_q8"]["accepted"] == 3


def test_decode_greedy_passes_a_stop_on_to_the_backends_generator(tmp_path, monkeypatch) -> None:
    """``send(False)`` to the checked iterator goes to the backend's generator, whose answer is checked too; an
    iterator that is no generator cannot take it, and stops."""
    offload, plugin = _registry(tmp_path, monkeypatch)
    plugin.GREEDY[:] = [3, 4, 5, 6]
    tokens = offload.decode_greedy(None, 1, 7, 10, 4, vocab=11)
    assert next(tokens) == 3 and tokens.send(False) == 4 and plugin.SEEN[-1] == ("stop",)
    plugin.GREEDY[:] = [3, 12]
    tokens = offload.decode_greedy(None, 1, 7, 10, 2, vocab=11)
    assert next(tokens) == 3
    with pytest.raises(StopIteration):
        tokens.send(False)  # 12 is outside the vocabulary
    plugin.GREEDY[:] = ["iter"]
    tokens = offload.decode_greedy(None, 1, 7, 10, 2, vocab=11)
    assert next(tokens) == 1
    with pytest.raises(StopIteration):
        tokens.send(False)


def test_decode_greedy_checks_every_token_and_stops_on_an_error(tmp_path, monkeypatch, caplog) -> None:
    """The pipelined greedy decode's iterator ends (reported once) at a device error or a token outside the
    vocabulary; a declined call or a result that is not an iterator is None (counted); the CPU never has it."""
    offload, plugin = _registry(tmp_path, monkeypatch)
    plugin.GREEDY[:] = [3, np.int64(4), RuntimeError("device fell over"), 5]
    assert list(offload.decode_greedy(None, 1, 7, 10, 4, vocab=11)) == [3, 4]
    assert plugin.SEEN[-1] == ("greedy", 7, 10, 4) and "device fell over" in caplog.text
    plugin.GREEDY[:] = [3, 11, 2]
    assert list(offload.decode_greedy(None, 1, 7, 10, 3, vocab=11)) == [3]
    assert "outside [0, 11)" in caplog.text
    plugin.GREEDY[:] = ["none"]
    assert offload.decode_greedy(None, 1, 7, 10, 3, vocab=11) is None
    plugin.GREEDY[:] = ["list"]
    assert offload.decode_greedy(None, 1, 7, 10, 3, vocab=11) is None
    counters = offload.stats()["kestrel_decode_greedy"]
    assert counters["accepted"] == 2 and counters["declined"] == 4  # the two that ended midway count too
    assert counters["declined_reasons"] == {"error: RuntimeError": 1, "bad result: token 11 outside [0, 11)": 1,
                                            "declined by backend": 1, "bad result: list, not an iterator": 1}
    assert "the engine runs and samples each step itself" in caplog.text
    monkeypatch.setenv("KESTREL_FORCE_CPU", "1")
    assert offload.decode_greedy(None, 1, 7, 10, 3, vocab=11) is None
    cpu = Registry().cpu()
    assert Offload(cpu, cpu).decode_greedy(None, 1, 7, 10, 3, vocab=11) is None


NONFINITE = Path(__file__).resolve().parents[1] / "fixtures" / "backends" / "authors" / "nonfinite.py"
NONFINITE_REASON = "bad result: non-finite values"


@pytest.fixture
def nonfinite(monkeypatch):
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(NONFINITE))
    reg = Registry()
    backend = reg.select("nonfinite")
    backend.plugin.BAD.clear()
    yield Offload(backend, reg.cpu()), backend.plugin, reg.cpu()
    reg.close()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), "one"])
@pytest.mark.parametrize("hook", ["kestrel_gemm_q8", "kestrel_gemm_f32"])
def test_non_finite_gemm_results_are_declined_and_recomputed(nonfinite, hook: str, value) -> None:
    offload, plugin, cpu = nonfinite
    x, ws = _weights(3)
    on_cpu = Offload(cpu, cpu)
    plugin.BAD[hook] = value
    if hook == "kestrel_gemm_q8":
        got, want = offload.linear(x, ws[0], 1), on_cpu.linear(x, ws[0], 1)
    else:
        got, want = offload.gemm_f32(x, ws[0], 1), on_cpu.gemm_f32(x, ws[0], 1)
    np.testing.assert_array_equal(got, want)
    assert offload.stats()[hook]["declined_reasons"] == {NONFINITE_REASON: 1}


def test_a_non_finite_fused_result_is_declined_and_each_weight_offered_alone(nonfinite) -> None:
    offload, plugin, cpu = nonfinite
    plugin.BAD["kestrel_gemm_fused_q8"] = float("nan")
    x, ws = _weights(4)
    keys = [wkey(0, p) for p in (Proj.Q, Proj.K, Proj.V)]
    outs = offload.linear_fused(x, ws, keys, fused_wkey(0, Proj.QKV))
    a_codes, a_scales = quantize_activations(x, 32)
    for out, w in zip(outs, ws):
        np.testing.assert_array_equal(out, reference_gemm_q8(a_codes, a_scales, w))
    stats = offload.stats()
    assert stats["kestrel_gemm_fused_q8"]["declined_reasons"] == {NONFINITE_REASON: 1}
    assert stats["kestrel_gemm_q8"]["accepted"] == 3  # the fallback: the same backend's gemm_q8, one by one


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_whole_step_logits_are_declined(nonfinite, value) -> None:
    offload, plugin, _ = nonfinite
    tokens = np.arange(3, dtype=np.int64)
    assert offload.forward(None, 1, tokens, 0, True, 11) is not None
    plugin.BAD["kestrel_forward"] = value
    assert offload.forward(None, 1, tokens, 0, True, 11) is None
    batch = [BatchEntry(1, tokens, 0, 1), BatchEntry(2, tokens[:1], 0, 1)]
    assert offload.forward_batch(None, batch, 11) is not None
    plugin.BAD["kestrel_forward_batch"] = value
    assert offload.forward_batch(None, batch, 11) is None  # one bad entry declines the whole step
    stats = offload.stats()
    for hook in ("kestrel_forward", "kestrel_forward_batch"):
        assert stats[hook]["accepted"] == 1 and stats[hook]["declined_reasons"] == {NONFINITE_REASON: 1}


def test_argmax_only_entries_may_get_token_ids_which_are_checked(nonfinite) -> None:
    """An argmax_only entry accepts int64 ids [logit_rows] in [0, vocab) (or logits); -1 (non-finite logits), a
    bad id, dtype or shape, and ids for an entry that wants logits decline the step."""
    offload, _, _ = nonfinite
    tokens = np.arange(3, dtype=np.int64)
    batch = [BatchEntry(1, tokens, 0, 2, argmax_only=True), BatchEntry(2, tokens[:1], 0, 1)]
    logits = np.zeros((1, 11), np.float32)
    results = {
        "ok": [np.array([4, 10]), logits],
        "non-finite values": [np.array([4, -1]), logits],
        "token ids outside [0, 11)": [np.array([4, 11]), logits],
        "token ids of dtype int32, expected int64": [np.array([4, 5], np.int32), logits],
        "token ids of shape [1], expected [2]": [np.array([4]), logits],
        "dtype int64, expected float32": [np.zeros((2, 11), np.float32), np.array([3])],
    }
    for want, result in results.items():
        offload._callers[("nonfinite", "kestrel_forward_batch")] = lambda result=result, **kw: result
        got = offload.forward_batch(None, batch, 11)
        if want == "ok":
            assert got is not None and got[0].tolist() == [4, 10]
        else:
            assert got is None
    reasons = offload.stats()["kestrel_forward_batch"]["declined_reasons"]
    assert sorted(reasons) == sorted(f"bad result: {w}" for w in results if w != "ok")


def test_a_step_still_running_is_checked_when_its_results_are_taken(nonfinite) -> None:
    """A batched hook may return a call that waits for its step (API 1.3): a Deferred, counted and checked when
    resolved, once; a bad result, None or an exception then is a decline with its reason."""
    offload, _, _ = nonfinite
    batch = [BatchEntry(1, np.arange(3, dtype=np.int64), 0, 1, argmax_only=True)]

    def boom():
        raise RuntimeError("device lost")

    cases = [("ok", lambda: [np.array([7])]), ("bad", lambda: [np.array([11])]), ("none", lambda: None),
             ("raises", boom)]
    for want, later in cases:
        offload._callers[("nonfinite", "kestrel_forward_batch")] = lambda later=later, **kw: later
        pending = offload.forward_batch(None, batch, 11)
        assert isinstance(pending, Deferred)
        got = pending.result()
        assert (got is not None and got[0].tolist() == [7]) if want == "ok" else got is None, want
        with pytest.raises(RuntimeError, match="once"):
            pending.result()
    stats = offload.stats()["kestrel_forward_batch"]
    assert stats["offered"] == 4 and stats["accepted"] == 1
    assert stats["declined_reasons"] == {"bad result: token ids outside [0, 11)": 1, "declined by backend": 1,
                                         "error: RuntimeError": 1}


def test_one_row_token_ids_are_checked_the_same_way(nonfinite) -> None:
    """A decode row's single id (read as a Python int, not through numpy's reductions): the same checks."""
    offload, _, _ = nonfinite
    batch = [BatchEntry(1, np.arange(3, dtype=np.int64), 0, 1, argmax_only=True)]
    results = [("ok", 10), ("non-finite values", -1), ("outside", 11), ("outside", -2)]
    for want, id_ in results:
        ids = np.array([id_])
        offload._callers[("nonfinite", "kestrel_forward_batch")] = lambda ids=ids, **kw: [ids]
        got = offload.forward_batch(None, batch, 11)
        assert (got is not None and got[0].tolist() == [10]) if want == "ok" else got is None, want
    reasons = offload.stats()["kestrel_forward_batch"]["declined_reasons"]
    assert reasons == {"bad result: non-finite values": 1, "bad result: token ids outside [0, 11)": 2}


def test_a_plugins_base_exceptions_are_declines_but_ctrl_c_passes(tmp_path, monkeypatch) -> None:
    """sys.exit or a BaseException of its own inside a hook is a decline with its reason; a KeyboardInterrupt
    (the user's Ctrl-C) is not swallowed."""
    offload, plugin = _registry(tmp_path, monkeypatch)
    x, ws = _weights(5)
    keys = [wkey(1, p) for p in (Proj.Q, Proj.K, Proj.V)]

    class Panic(BaseException):
        pass

    for exc in (SystemExit(3), Panic("driver")):
        def raising(*args, exc=exc, **kwargs):
            raise exc

        offload._callers[("fusing", "kestrel_gemm_fused_q8")] = raising
        assert len(offload.linear_fused(x, ws, keys, fused_wkey(1, Proj.QKV))) == 3
    assert offload.stats()["kestrel_gemm_fused_q8"]["declined_reasons"] == {"error: SystemExit": 1, "error: Panic": 1}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    offload._callers[("fusing", "kestrel_gemm_fused_q8")] = interrupted
    with pytest.raises(KeyboardInterrupt):
        offload.linear_fused(x, ws, keys, fused_wkey(1, Proj.QKV))


class _LenExits(list):  # type: ignore[type-arg]
    def __len__(self) -> int:
        raise SystemExit(3)


class _LyingIds(np.ndarray):
    def min(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return 0

    def max(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return 0


class _ClassExits:
    @property
    def __class__(self):  # type: ignore[no-untyped-def]
        raise SystemExit(4)


def test_results_are_taken_only_as_plain_types(nonfinite) -> None:
    """A result is checked as what it is, and only plain lists and numpy arrays are taken: a list whose len
    exits, ids whose min and max lie, an object whose __class__ exits, one array for two entries, are declines
    (no code of the result's runs in the checks), never an exit or a bad id taken."""
    offload, _, _ = nonfinite
    tokens = np.arange(3, dtype=np.int64)
    batch = [BatchEntry(1, tokens, 0, 1, argmax_only=True), BatchEntry(2, tokens[:1], 0, 1)]
    logits = np.zeros((1, 11), np.float32)
    ids = np.array([10**9]).view(_LyingIds)
    results = {
        "expected a list of 2 arrays": [_LenExits([np.array([4]), logits]), _ClassExits()],
        "got _LyingIds, expected a numpy.ndarray": [[ids, logits]],
        "got _ClassExits, expected a numpy.ndarray": [[np.array([4]), _ClassExits()]],
        "logits sharing memory with another entry's": [[logits, logits]],
    }
    for cases in results.values():
        for result in cases:
            offload._callers[("nonfinite", "kestrel_forward_batch")] = lambda result=result, **kw: result
            assert offload.forward_batch(None, batch, 11) is None
    assert offload.stats()["kestrel_forward_batch"]["declined_reasons"] == {
        f"bad result: {w}": len(c) for w, c in results.items()}


def test_decoded_tokens_are_taken_only_as_plain_integers(nonfinite) -> None:
    """A token that is an int subclass (whatever its __int__ or comparisons say) or a bool ends the decode."""
    offload, _, _ = nonfinite

    class Sly(int):
        def __int__(self) -> int:
            return 10**9

    for bad in (Sly(3), True, _ClassExits()):
        offload._callers[("nonfinite", "kestrel_decode_greedy")] = lambda bad=bad, **kw: iter([np.int64(2), bad, 5])
        assert list(offload.decode_greedy(None, 1, 7, 10, 3, vocab=11)) == [2]
    reasons = offload.stats()["kestrel_decode_greedy"]["declined_reasons"]
    assert reasons == {"bad result: a token of type Sly": 1, "bad result: a token of type bool": 1,
                       "bad result: a token of type _ClassExits": 1}


def test_every_numpy_integer_type_is_a_token(nonfinite) -> None:
    """numpy's integer scalars are tokens whatever their type's name (np.longlong is a type of its own beside
    np.int64 on Linux, np.intc beside np.int32); a subclass of one is not."""
    offload, _, _ = nonfinite

    class Sly(np.int64):
        def __int__(self) -> int:
            return 10**9

    tokens = [t(i) for i, t in enumerate((np.longlong, np.ulonglong, np.intc, np.uintc, np.int8, np.uint16, np.intp))]
    offload._callers[("nonfinite", "kestrel_decode_greedy")] = lambda **kw: iter([*tokens, Sly(3)])
    assert list(offload.decode_greedy(None, 1, 7, 10, len(tokens) + 1, vocab=11)) == list(range(len(tokens)))
    assert offload.stats()["kestrel_decode_greedy"]["declined_reasons"] == {"bad result: a token of type Sly": 1}


# Writes into what it is handed ("silencing a warning": flags.writeable = True, then zeros), then declines: the
# CPU computes from the same arrays. Each refusal numpy gives is recorded in REFUSED, each model it sees in MODELS.
SCRIBBLER = '''
from kestrel_core import API_VERSION, BackendInfo, hookimpl
from kestrel_cpu import kestrel_close, kestrel_open  # noqa: F401
REFUSED, MODELS = [], []


@hookimpl
def kestrel_backend_info():
    return BackendInfo("scribbler", "1", API_VERSION, "gpu")


def scribble(*arrays):
    for a in arrays:
        try:
            a.flags.writeable = True
            a[...] = 0
        except ValueError as exc:
            REFUSED.append(str(exc))


@hookimpl
def kestrel_gemm_q8(a_codes, a_scales, weight):
    scribble(a_codes, a_scales, weight.codes, weight.scales)


@hookimpl
def kestrel_gemm_f32(a, weight):
    scribble(a, weight.codes, weight.scales)


def scribble_model(model):
    MODELS.append(model)
    layer = model.layers[0]
    scribble(model.final_norm, layer.attn_norm, layer.mlp_norm, model.embedding.codes, layer.q.scales)


@hookimpl
def kestrel_preload(model):
    scribble_model(model)


@hookimpl
def kestrel_forward_batch(model, batch):
    scribble_model(model)
'''


def _scribbler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "scribbler.py").write_text(SCRIBBLER)
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "scribbler.py"))


def test_gemm_inputs_and_weights_cannot_be_made_writable(tmp_path, monkeypatch) -> None:
    """The read-only views a GEMM hook gets refuse ``flags.writeable = True``: the CPU computes the declined GEMM
    from the very inputs and weights (numpy's reference result), and the weights stay as they were."""
    _scribbler(tmp_path, monkeypatch)
    reg = Registry()
    offload = Offload(reg.select("scribbler"), reg.cpu())
    x, ws = _weights(5)
    w = ws[0]
    codes, scales, x_before = w.codes.copy(), w.scales.copy(), x.copy()
    a_codes, a_scales = quantize_activations(x, 32)
    want = reference_gemm_q8(a_codes, a_scales, w)
    np.testing.assert_array_equal(offload.gemm_q8(a_codes, a_scales, w, 1), want)
    np.testing.assert_array_equal(offload.gemm_f32(x, w, 1), Offload(reg.cpu(), reg.cpu()).gemm_f32(x_before, w, 1))
    assert np.array_equal(w.codes, codes) and np.array_equal(w.scales, scales) and np.array_equal(x, x_before)
    assert np.array_equal(a_codes, quantize_activations(x_before, 32)[0])
    assert len(reg.backends["scribbler"].plugin.REFUSED) == 4 + 3  # every write refused
    reg.close()


def test_the_model_the_whole_step_hooks_get_is_read_only_and_shares_the_engines_memory(tmp_path, monkeypatch) -> None:
    """``kestrel_preload`` and ``kestrel_forward_batch`` get one model, the engine's read-only twin: a backend that
    writes into its norms or weights, then declines every step, leaves the engine's answer the CPU's. The twin's
    arrays are views of the engine's (no weight is copied), its weights the GEMM hooks' objects."""
    from kestrel_core import engine_weights, load
    from kestrel_core.contract import read_only_strip
    from kestrel_core.model.presets import synthetic_model

    from .model.conftest import make_tiny_config

    _scribbler(tmp_path, monkeypatch)
    model = synthetic_model(make_tiny_config("qwen3"), "q8", seed=4)
    norm, codes = model.final_norm.copy(), model.embedding.codes.copy()
    prompt = list(range(5, 17))
    with load(model, backend="cpu", activations="q8") as cpu:
        want = list(cpu.generate(prompt, max_tokens=6))
    with load(model, backend="scribbler") as engine:
        got = list(engine.generate(prompt, max_tokens=6))
        seen = engine.backend.plugin.MODELS
        assert engine.stats["offload"]["kestrel_forward_batch"]["offered"] >= 6
    assert got == want
    assert np.array_equal(model.final_norm, norm) and np.array_equal(model.embedding.codes, codes)
    shown = seen[0]
    assert shown is not model and all(m is shown for m in seen)
    assert np.shares_memory(shown.final_norm, model.final_norm) and not shown.final_norm.flags.writeable
    assert shown.embedding is read_only_strip(model.embedding) is shown.lm_head
    assert all(a is b for (_, x), (_, y) in zip(engine_weights(shown), engine_weights(model)) for a, b in zip(x, y))


@pytest.mark.parametrize("sum_from", [4, 1 << 22])
def test_both_finiteness_checks_find_every_non_finite_value(monkeypatch, sum_from: int) -> None:
    """Below SUM_CHECK_FROM values isfinite's, from it a sum's: each finds a NaN, +inf or -inf anywhere."""
    from kestrel_core import results

    monkeypatch.setattr(results, "SUM_CHECK_FROM", sum_from)
    rows = np.arange(48, dtype=np.float32).reshape(3, 16)
    assert results.all_finite(rows) and results.all_finite(rows[:0])
    for value in (np.nan, np.inf, -np.inf):
        for at in (0, 17, 47):
            bad = rows.copy()
            bad.flat[at] = value
            assert not results.all_finite(bad) and not results.all_finite(bad[:, ::2] if at % 2 == 0 else bad.T)
