"""The device forward's batched steps on the CPU: several sequences' rows over the paged pool (paged.py),
with the numpy mirrors of the kernels, checked against each sequence run alone and against the CPU decoder.
test_forward_batch.py runs the same scenarios on the GPU through its own ``make_fwd``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kestrel_core.batch import BatchEntry
from kestrel_core.model.kv_pool import BLOCK_SIZE
from kestrel_core.model.presets import synthetic_model
from kestrel_cuda import paged
from kestrel_cuda.config import CudaConfig
from kestrel_cuda.forward import DeviceForward
from kestrel_cuda.ops_numpy import NumpyOps

from .forward_check import DECLINING_BACKEND, FIXTURES, SMALL_CONFIGS, compare, cpu_logits, jitter_effect

POOL = 64  # blocks of the engine's pool in these tests


@pytest.fixture
def make_fwd():  # type: ignore[no-untyped-def]
    """DeviceForward(**kwargs) over the numpy mirrors."""
    return lambda **kw: DeviceForward(ops=NumpyOps(), **kw)


def host(a) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.asarray(a.get() if hasattr(a, "get") else a)


class Pages:
    """The engine's side: blocks handed out from a shuffled free list, so page tables are not contiguous."""

    def __init__(self, seed: int = 0) -> None:
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(POOL)]
        self.tables: dict[int, list[int]] = {}

    def entry(self, seq: int, tokens: np.ndarray, start: int, logit_rows: int) -> BatchEntry:
        blocks = self.tables.setdefault(seq, [])
        while len(blocks) * BLOCK_SIZE < start + len(tokens):
            blocks.append(self.free.pop())
        return BatchEntry(seq, np.asarray(tokens, np.int64), start, logit_rows, tuple(blocks), BLOCK_SIZE, POOL)


def _model(arch: str = "qwen3", quant: str = "q8", seed: int = 3):  # type: ignore[no-untyped-def]
    """A small config's synthetic model, or a fixture's checkpoint (``tiny-...``)."""
    if arch.startswith("tiny-"):
        from kestrel_core.model.loader import load_model

        return load_model(str(FIXTURES / arch), quant, cache="off").model
    return synthetic_model(SMALL_CONFIGS[arch], quant, seed=seed)


def _prompts(model, lengths, seed=1):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, model.config.vocab_size, n) for n in lengths]


def _assert_like_cpu(model, tokens, got: np.ndarray) -> None:  # type: ignore[no-untyped-def]
    """``got``: the device's logits of the last rows of ``tokens``, within the CPU decoder's jitter band."""
    tokens = np.asarray(tokens)
    ref = cpu_logits(model, tokens, len(tokens))
    result = compare(got, ref[len(ref) - len(got):], jitter_effect(model, tokens, len(tokens), ref))
    assert result.ok, str(result)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "gemma2", "granite", "gpt_oss", "tiny-gemma2",
                                  "tiny-granite", "tiny-gpt-oss"])
def test_every_batched_row_is_the_cpu_decoders_within_the_band(arch: str, make_fwd) -> None:  # type: ignore[no-untyped-def]
    """Prompts of different lengths prefilled together, then decoded together (the captured bucket graph):
    every row is the CPU decoder's for that sequence, within the jitter band (tiny-gemma2: soft caps over its
    windows of 8; gpt-oss: sinks in the pooled attention, its experts' biases after the grouped GEMMs)."""
    model = _model(arch)
    prompts = _prompts(model, (5, 37, 12))
    pages, fwd = Pages(), make_fwd()
    outs = fwd.forward_batch(model, [pages.entry(i, p, 0, 1) for i, p in enumerate(prompts)])
    seqs, rows = [list(p) for p in prompts], [[o] for o in outs]
    for _ in range(4):
        toks = [int(np.argmax(o[-1])) for o in outs]
        outs = fwd.forward_batch(model, [pages.entry(i, np.array([t]), len(seqs[i]), 1) for i, t in enumerate(toks)])
        for i, t in enumerate(toks):
            seqs[i].append(t)
            rows[i].append(outs[i])
    for s, r in zip(seqs, rows):
        _assert_like_cpu(model, s, np.concatenate(r))  # logits at positions len(p) - 1 .. len(s) - 1
    assert fwd.counters["batch_graph_replays"] == 4 and fwd.counters["graph_captures"] == 1  # bucket 4


def test_mixed_batch_of_decode_rows_and_prompt_chunks(make_fwd) -> None:  # type: ignore[no-untyped-def]
    """One sequence decodes while another's prompt arrives in chunks (the last with several logit rows, a
    middle one with none): every returned row equals the CPU decoder's at that position."""
    model = _model("qwen2", "q4")
    a, b = _prompts(model, (20, 45), seed=2)
    pages, fwd = Pages(1), make_fwd()
    (out_a,) = fwd.forward_batch(model, [pages.entry(1, a, 0, 1)])
    seq_a = list(a) + [int(np.argmax(out_a[-1]))]
    chunks = [(b[:16], 0), (b[16:30], 0), (b[30:], 3)]
    done = 0
    for chunk, rows in chunks:
        out_a, out_b = fwd.forward_batch(model, [pages.entry(1, np.array(seq_a[-1:]), len(seq_a) - 1, 1),
                                                 pages.entry(2, chunk, done, rows)])
        done += len(chunk)
        _assert_like_cpu(model, seq_a, out_a)
        assert out_b.shape == (rows, model.config.vocab_size)
        seq_a.append(int(np.argmax(out_a[0])))
    _assert_like_cpu(model, b, out_b)
    assert fwd.counters["pool_moves"] == 1  # sequence 1's own cache joined the pool


def test_a_sequence_moves_between_its_own_cache_and_the_pool(make_fwd) -> None:  # type: ignore[no-untyped-def]
    """Alone (own cache, captured step), then batched (pool), then alone again, then the pipelined greedy
    decode: the same tokens as a sequence that ran alone throughout."""
    model = _model()
    (p,) = _prompts(model, (33,))
    (other,) = _prompts(model, (7,), seed=5)
    ref = make_fwd()
    want = [int(np.argmax(ref.forward(model, 1, p, 0, False)[-1]))]
    for i in range(9):
        want.append(int(np.argmax(ref.forward(model, 1, np.array(want[-1:]), len(p) + i, False)[-1])))
    pages, fwd = Pages(3), make_fwd()
    got = [int(np.argmax(fwd.forward_batch(model, [pages.entry(1, p, 0, 1)])[0][-1]))]
    fwd.forward_batch(model, [pages.entry(2, other, 0, 1)])
    for i in range(3):  # together
        out, _ = fwd.forward_batch(model, [pages.entry(1, np.array(got[-1:]), len(p) + i, 1),
                                           pages.entry(2, np.array([1]), len(other) + i, 1)])
        got.append(int(np.argmax(out[-1])))
    fwd.release(2)
    for i in range(3, 5):  # alone again: back in its own cache
        (out,) = fwd.forward_batch(model, [pages.entry(1, np.array(got[-1:]), len(p) + i, 1)])
        got.append(int(np.argmax(out[-1])))
    got.extend(fwd.greedy(model, 1, got[-1], len(p) + 5, 4))
    assert got == want
    assert fwd.counters["pool_moves"] == 3  # 1 and 2 into the pool, 1 back out


def test_a_move_copies_only_what_the_other_side_lacks_and_never_a_stale_position(make_fwd) -> None:  # type: ignore[no-untyped-def]
    """A sequence alone (70 positions), in the pool (where a step goes back to position 50 with 16 other tokens),
    alone again, then in a pool made anew: each move copies only the blocks the other side lacks, yet every
    result is the CPU decoder's for the tokens the sequence holds: its own cache's positions 50..65 are not kept
    on the way out, and nothing is taken for in a new pool."""
    model = _model()
    (p,) = _prompts(model, (70,))
    (other, third) = _prompts(model, (7, 9), seed=5)
    fix = np.arange(3, 19)
    pages, fwd = Pages(4), make_fwd()
    tokens = list(p)
    fwd.forward_batch(model, [pages.entry(1, p, 0, 1)])  # alone: its own cache
    fwd.forward_batch(model, [pages.entry(2, other, 0, 1), pages.entry(1, np.array([5]), 70, 1)])  # joins at 70
    tokens.append(5)
    out, _ = fwd.forward_batch(model, [pages.entry(1, fix, 50, 4), pages.entry(2, np.array([2]), 7, 1)])
    tokens[50:] = fix.tolist()  # taken back to 50 in the pool
    _assert_like_cpu(model, tokens, out)
    moved = fwd.counters["pool_move_positions"]
    (out,) = fwd.forward_batch(model, [pages.entry(1, np.array([6]), 66, 1)])  # alone again
    tokens.append(6)
    _assert_like_cpu(model, tokens, out)
    assert fwd.counters["pool_move_positions"] - moved == 66 - 32  # from the block holding position 50
    fwd.reset_pool()
    out, _ = fwd.forward_batch(model, [pages.entry(1, np.array([7]), 67, 1), pages.entry(3, third, 0, 1)])
    tokens.append(7)
    _assert_like_cpu(model, tokens, out)


def test_padding_rows_of_a_bucket_touch_no_sequence(make_fwd) -> None:  # type: ignore[no-untyped-def]
    """Three decode rows run as the captured bucket of four: the padding row writes only the scratch block,
    so another sequence's blocks keep their keys and values."""
    model = _model()
    prompts = _prompts(model, (9, 9, 9, 40), seed=4)
    pages, fwd = Pages(2), make_fwd()
    fwd.forward_batch(model, [pages.entry(i, p, 0, 1) for i, p in enumerate(prompts)])
    pool = fwd._pool
    assert pool is not None
    kept = [host(pool.kv[:, :, :, b * BLOCK_SIZE:(b + 1) * BLOCK_SIZE]) for b in pages.tables[3]]
    fwd.forward_batch(model, [pages.entry(i, np.array([1]), 9, 1) for i in range(3)])
    assert fwd.counters["batch_graph_replays"] == 1
    for b, before in zip(pages.tables[3], kept):
        assert np.array_equal(host(pool.kv[:, :, :, b * BLOCK_SIZE:(b + 1) * BLOCK_SIZE]), before)


def test_eager_and_captured_batches_agree_bitwise(make_fwd) -> None:  # type: ignore[no-untyped-def]
    model = _model("llama", "q4")
    prompts = _prompts(model, (6, 11))
    runs = []
    for graph in (True, False):
        pages, fwd = Pages(), make_fwd(config=CudaConfig(graph=graph))
        outs = fwd.forward_batch(model, [pages.entry(i, p, 0, 1) for i, p in enumerate(prompts)])
        for step in range(3):
            outs = fwd.forward_batch(model, [pages.entry(i, np.array([7]), len(p) + step, 1)
                                             for i, p in enumerate(prompts)])
        runs.append(np.concatenate(outs))
    assert np.array_equal(runs[0], runs[1])


def test_argmax_only_steps_return_the_greedy_tokens_of_the_same_logits(make_fwd) -> None:  # type: ignore[no-untyped-def]
    """Entries marked argmax_only get int64 ids, each numpy's argmax of the logits the same step returns
    without the mark (a prompt chunk step and captured decode steps), and -1 for a row with a NaN."""
    model = _model("qwen2")
    prompts = _prompts(model, (8, 21, 3), seed=6)
    runs = []
    for argmax in (False, True):
        pages, fwd = Pages(5), make_fwd()
        steps = [[replace(pages.entry(i, p, 0, 2), argmax_only=argmax) for i, p in enumerate(prompts)]]
        for step in range(3):
            steps.append([replace(pages.entry(i, np.array([5 + step]), len(p) + step, 1), argmax_only=argmax)
                          for i, p in enumerate(prompts)])
        runs.append([fwd.forward_batch(model, batch) for batch in steps])
        assert fwd.counters["batch_argmax_steps"] == (4 if argmax else 0)
    for logits_step, ids_step in zip(*runs):
        for logits, ids in zip(logits_step, ids_step):
            assert ids.dtype == np.int64 and ids.shape == (len(logits),)
            assert ids.tolist() == [int(np.argmax(row)) for row in logits]
    fwd = make_fwd()
    st = fwd._state(model)
    bad = np.zeros((3, model.config.vocab_size), np.float32)
    bad[0, 7], bad[1, 9], bad[2, 4] = 2.0, np.nan, -np.inf
    logits = fwd.ops.upload(bad)
    assert host(fwd.ops.download(fwd.ops.argmax_rows(logits, 3, st.argmax), 3)).tolist() == [7, -1, -1]


def test_a_lone_sequence_marked_argmax_only_gets_the_greedy_tokens_of_the_same_logits(make_fwd) -> None:  # type: ignore[no-untyped-def]
    """A batch of one (the lone-sequence path: its own cache) marked argmax_only: int64 ids, each numpy's argmax of
    the logits the same steps return without the mark: a prompt's last rows, a draft's rows (after a rewind) and
    a decode row from the captured step."""
    model = _model("qwen2")
    (prompt,) = _prompts(model, (11,), seed=4)
    steps = [(prompt, 0, 3), (np.array([5, 9, 2, 7]), 11, 4), (np.array([9, 4]), 12, 2), (np.array([3]), 14, 1)]
    runs = []
    for argmax in (False, True):
        pages, fwd = Pages(2), make_fwd()
        runs.append([fwd.forward_batch(model, [replace(pages.entry(0, toks, start, rows), argmax_only=argmax)])[0]
                     for toks, start, rows in steps])
        assert fwd.counters["rewound_positions"] == 3 and fwd.counters["graph_replays"] == 1
    for logits, ids in zip(*runs):
        assert ids.dtype == np.int64 and ids.shape == (len(logits),)
        assert ids.tolist() == [int(np.argmax(row)) for row in logits]


def test_a_mixed_batch_gets_ids_where_they_do_and_logits_where_they_are_needed(make_fwd) -> None:  # type: ignore[no-untyped-def]
    """Greedy entries beside sampled ones: the greedy get their argmax, the others their logits (only those
    rows cross the bus), each the same as the step with every entry's logits; a step of prompt chunks that
    are not due any logits returns empty results of each kind."""
    model = _model("llama")
    prompts = _prompts(model, (9, 14, 6, 30), seed=8)
    runs = []
    for mixed in (False, True):
        pages, fwd = Pages(7), make_fwd()
        steps = [[replace(pages.entry(i, p[:5], 0, 0), argmax_only=mixed and i % 2 == 0)
                  for i, p in enumerate(prompts)]]
        steps.append([replace(pages.entry(i, p[5:], 5, 1 + i % 2), argmax_only=mixed and i % 2 == 0)
                      for i, p in enumerate(prompts)])
        for step in range(2):
            steps.append([replace(pages.entry(i, np.array([3 + step]), len(p) + step, 1), argmax_only=mixed and i < 2)
                          for i, p in enumerate(prompts)])
        runs.append([fwd.forward_batch(model, batch) for batch in steps])
    plain, mixed_run = runs
    for step, (want, got) in enumerate(zip(plain, mixed_run)):
        for i, (w, g) in enumerate(zip(want, got)):
            ids_expected = (i % 2 == 0) if step < 2 else (i < 2)
            if ids_expected:
                assert g.dtype == np.int64 and g.tolist() == [int(np.argmax(row)) for row in w]
            else:
                assert g.dtype == np.float32 and np.array_equal(g, w)
    assert all(len(r) == 0 for r in mixed_run[0]) and mixed_run[0][0].dtype == np.int64


def test_a_mixed_batch_over_two_passes(make_fwd) -> None:  # type: ignore[no-untyped-def]
    """A batch of more rows than a pass holds (PASS_ROWS), a prompt's logit rows on both sides of the
    boundary and a greedy decode row after them: the prompt's rows are its logits, the decode row its argmax,
    the same as the step with every entry's logits."""
    from kestrel_cuda.plan import PASS_ROWS

    model = _model("qwen2")
    long, short = _prompts(model, (PASS_ROWS + 8, 6), seed=9)
    results = []
    for mixed in (False, True):
        pages, fwd = Pages(11), make_fwd()
        fwd.forward_batch(model, [pages.entry(2, short, 0, 1)])
        fwd.forward_batch(model, [pages.entry(3, short[:2], 0, 1)])  # a second sequence: the pool path
        batch = [pages.entry(1, long, 0, 10), replace(pages.entry(2, np.array([4]), len(short), 1), argmax_only=mixed)]
        results.append(fwd.forward_batch(model, batch))
    (want_long, want_short), (got_long, got_short) = results
    assert got_long.dtype == np.float32 and np.array_equal(got_long, want_long)
    assert got_short.dtype == np.int64 and got_short.tolist() == [int(np.argmax(want_short[0]))]


def test_fed_rows_on_both_sides_of_a_pass_boundary(make_fwd) -> None:  # type: ignore[no-untyped-def]
    """A step started before the one it follows is in, its greedy rows fed from that step's ids on the device,
    one before a long prompt and one after it in the second pass: both take the tokens the step before chose
    (the first pass's results, fetched before the second pass runs, are not where the second pass reads them)."""
    from kestrel_cuda.plan import PASS_ROWS

    model = _model("qwen3")
    a, b, long = _prompts(model, (9, 13, PASS_ROWS + 40), seed=1)
    results = []
    for fed in (False, True):
        pages, fwd = Pages(3), make_fwd()
        first = fwd.forward_batch(model, [replace(pages.entry(1, a, 0, 1), argmax_only=True),
                                          replace(pages.entry(2, b, 0, 1), argmax_only=True)])
        ta, tb = (int(x[-1]) for x in first)
        step = fwd.start_batch(model, [replace(pages.entry(1, [ta], len(a), 1), argmax_only=True),
                                       replace(pages.entry(2, [tb], len(b), 1), argmax_only=True)])
        na, nb = (-1, -1) if fed else (int(x[-1]) for x in step())
        out = fwd.forward_batch(model, [
            replace(pages.entry(2, [nb], len(b) + 1, 1), argmax_only=True, fed=fed), pages.entry(3, long, 0, 0),
            replace(pages.entry(1, [na], len(a) + 1, 1), argmax_only=True, fed=fed)])
        if fed:
            na, nb = (int(x[-1]) for x in step())
        results.append(((na, nb), (int(out[0][-1]), int(out[2][-1])), fwd.counters["fed_rows"]))
    (want_step, want_next, _), (got_step, got_next, fed_rows) = results
    assert got_step == want_step and got_next == want_next and fed_rows == 2


def test_one_upload_serves_every_sequence_of_a_windowed_batch() -> None:
    """The residency window under a batched step (keep = 1 over a real WeightCache): three sequences decode
    together, each step walks the layers once, so each step uploads every streamed weight once whatever the
    batch size, and the rows are bitwise those of the window off."""
    from kestrel_cuda.allocator import NumpyAllocator
    from kestrel_cuda.residency import WeightCache

    from .forward_check import cache_source

    model = _model("qwen3", "q4")
    prompts = _prompts(model, (9, 21, 14))

    def run(fwd):  # type: ignore[no-untyped-def]
        pages = Pages(4)
        outs = fwd.forward_batch(model, [pages.entry(i, p, 0, 1) for i, p in enumerate(prompts)])
        seqs, got, marks = [list(p) for p in prompts], [outs], []
        for _ in range(3):
            marks.append(len(uploads))
            toks = [int(np.argmax(o[-1])) for o in outs]
            outs = fwd.forward_batch(model, [pages.entry(i, np.array([t]), len(seqs[i]), 1)
                                             for i, t in enumerate(toks)])
            for i, t in enumerate(toks):
                seqs[i].append(t)
            got.append(outs)
        return got, np.diff(marks + [len(uploads)])

    uploads: list[int] = []
    cache = WeightCache(NumpyAllocator(1 << 30), budget=1 << 30, keep=1)
    windowed, per_step = run(DeviceForward(cache_source(cache, uploads), cache.on_layer_boundary, ops=NumpyOps()))
    plain, _ = run(DeviceForward(ops=NumpyOps()))
    weights_per_layer = 4  # q|k|v, o, gate|up, down
    # keep = 1: a step re-uploads every layer but the last (still resident from the step before) once
    assert list(per_step) == [weights_per_layer * (model.config.num_layers - 1)] * 3, per_step
    for w, p in zip(windowed, plain):
        assert all(np.array_equal(a, b) for a, b in zip(w, p))


def test_declines_what_the_pool_cannot_run(make_fwd) -> None:  # type: ignore[no-untyped-def]
    model = _model()
    a, b = _prompts(model, (10, 10))
    fwd, pages = make_fwd(), Pages()
    ok = [pages.entry(1, a, 0, 1), pages.entry(2, b, 0, 1)]
    bare = [BatchEntry(1, a, 0, 1), BatchEntry(2, b, 0, 1)]
    assert fwd.forward_batch(model, bare) is None and "page table" in fwd.last_decline
    short = [BatchEntry(1, a, 0, 1, (0,), BLOCK_SIZE, POOL), BatchEntry(2, np.arange(40), 0, 1, (1,), BLOCK_SIZE,
                                                                         POOL)]
    assert fwd.forward_batch(model, short) is None and "cover" in fwd.last_decline
    outside = [ok[0], BatchEntry(2, b, 0, 1, (POOL,), BLOCK_SIZE, POOL)]
    assert fwd.forward_batch(model, outside) is None and "outside" in fwd.last_decline
    behind = [ok[0], pages.entry(2, b[:1], 5, 1)]
    assert fwd.forward_batch(model, behind) is None and "behind" in fwd.last_decline
    vocab = [ok[0], pages.entry(2, np.array([model.config.vocab_size]), 0, 1)]
    assert fwd.forward_batch(model, vocab) is None and "vocabulary" in fwd.last_decline
    for bad in (np.array([-1]), np.array([3, -1, 4])):  # one token, several
        assert fwd.forward_batch(model, [ok[0], pages.entry(2, bad, 0, 1)]) is None
        assert "vocabulary" in fwd.last_decline
    assert fwd.forward_batch(model, [ok[0], ok[0]]) is None and "twice" in fwd.last_decline
    assert paged.check(ok, model.config.vocab_size, 256, 1) == "2 sequences in one step (at most 1)"
    assert fwd.forward_batch(model, ok) is not None


def test_row_map_pads_to_the_scratch_table_and_splits_passes() -> None:
    pages = Pages()
    batch = [pages.entry(1, np.arange(3), 0, 1), pages.entry(2, np.array([9]), 40, 1)]
    tokens, rows, tables = paged.row_map(batch, 1, 3, 4, POOL, 8)
    assert tokens.tolist() == [1, 2, 9, 0]
    assert rows.tolist() == [[1, 0], [2, 0], [40, 1], [0, 2]]
    assert tables[2].tolist() == [POOL] * 8 and tables[1, :2].tolist() == pages.tables[2][:2]
    tokens, rows, _ = paged.row_map(batch, 2, 2, 2, POOL, 8)  # one row of each: the longer entry's last
    assert tokens.tolist() == [2, 9] and rows.tolist() == [[2, 0], [40, 1]]
    assert paged.bucket(3) == 4 and paged.bucket(256) == 256 and paged.bucket(257) is None


def serve_all(engine, prompts: list[list[int]], params) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Every prompt submitted at once to a scheduler over ``engine``, run to the end: each one's tokens."""
    from kestrel_core.model.scheduler import Scheduler

    sched = Scheduler(engine)
    ids = [sched.add(p, params).request_id for p in prompts]
    got: dict[str, list[int]] = {i: [] for i in ids}
    while sched.has_work:
        for out in sched.step():
            got[out.request_id].extend(out.new_token_ids)
    return [got[i] for i in ids]


def serve_alone(engine, prompts: list[list[int]], params) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Each prompt run to the end on its own (a batch of one: the backend's lone-sequence path)."""
    return [serve_all(engine, [p], params)[0] for p in prompts]


def _bind_batch_backend(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The backend ``fwdcuda``: BATCH_BACKEND over the numpy mirrors, bound through KESTREL_BACKEND_PATH."""
    make = "lambda: DeviceForward(ops=__import__('kestrel_cuda.ops_numpy').ops_numpy.NumpyOps())"
    path = tmp_path / "fwdcuda.py"
    path.write_text(BATCH_BACKEND.format(decline=set(), make=make, greedy=None))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(path))


BATCH_BACKEND = DECLINING_BACKEND + '''

@hookimpl
def kestrel_forward_batch(device, model, batch):
    if not FWD:
        FWD.append(MAKE())
    return FWD[0].start_batch(model, batch)  # as the CUDA hook does: a one-pass step's results come later
'''


def test_a_mixture_of_experts_serves_concurrent_requests_on_the_device(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Qwen2-MoE (routed and shared experts) in batched steps over the pool, the decode steps replaying their
    bucket's graph (the rows grouped by expert on the device): each request's greedy tokens are the ones it
    generates alone on the CPU."""
    import kestrel_core
    from kestrel_core.model.loader import load_model
    from kestrel_core.model.sampling import SamplingParams

    model = load_model(str(Path(__file__).resolve().parents[1] / "fixtures" / "models" / "tiny-qwen2-moe"), "q8",
                       cache="off").model
    prompts = [p.tolist() for p in _prompts(model, (4, 30, 11), seed=6)]
    _bind_batch_backend(tmp_path, monkeypatch)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    with kestrel_core.load(model, backend="cpu", activations="q8") as cpu:
        want = [list(cpu.generate(p, params=params)) for p in prompts]
    with kestrel_core.load(model, backend="fwdcuda") as engine:
        got = serve_all(engine, prompts, params)
        fwd = engine.backend.plugin.FWD[0]
    assert got == want
    assert fwd.counters["batch_steps"] >= 4 and fwd.counters["batch_graph_replays"] >= 2


@pytest.mark.parametrize("logprobs", [False, True])
def test_engine_serves_concurrent_requests_through_the_batched_hook(tmp_path, monkeypatch, logprobs: bool) -> None:  # type: ignore[no-untyped-def]
    """The scheduler's batched steps go to kestrel_forward_batch with the engine's page tables; each request's
    greedy tokens equal what it generates alone on the same backend. Greedy requests get the device's argmax
    (ids, not logits) unless they ask for logprobs."""
    import kestrel_core
    from kestrel_core.model.sampling import SamplingParams

    model = _model("qwen3", "q8", seed=9)
    prompts = [p.tolist() for p in _prompts(model, (4, 30, 11, 17), seed=6)]
    _bind_batch_backend(tmp_path, monkeypatch)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=logprobs)
    with kestrel_core.load(model, backend="fwdcuda") as engine:
        want = serve_alone(engine, prompts, params)
        got = serve_all(engine, prompts, params)
        offload = engine.stats["offload"]
        fwd = engine.backend.plugin.FWD[0]
    assert got == want
    assert offload["kestrel_forward_batch"]["accepted"] >= 6
    assert fwd.counters["batch_rows"] >= sum(len(p) for p in prompts)
    assert fwd.counters["batch_argmax_steps"] == (0 if logprobs else fwd.counters["batch_steps"])
    # greedy requests' decode rows run the tokens the device chose, each step started before the last is in
    assert (fwd.counters["fed_rows"] > 0) == (not logprobs)


def test_steps_start_before_the_last_ones_are_reported_and_change_nothing(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The pool's steps come back as calls that wait for them (``start_batch``): the scheduler starts the next
    step first and reports while it runs. Requests that stop strings end while their row is in the running
    step (its token dropped), one that max_tokens ends and one aborted midway give what they give alone on the
    same backend; every sequence is freed, on the device and in the engine's pool."""
    import kestrel_core
    from kestrel_core.model.sampling import SamplingParams
    from kestrel_core.model.scheduler import Scheduler

    model = _model("qwen3", "q8", seed=9)
    prompts = [p.tolist() for p in _prompts(model, (4, 30, 11, 17, 9), seed=6)]
    _bind_batch_backend(tmp_path, monkeypatch)
    free = SamplingParams(max_tokens=12, ignore_eos=True)

    def alone(engine, prompt, params):  # type: ignore[no-untyped-def]
        outs = list(engine.stream(prompt, params))
        return ([t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs), outs[-1].finish_reason)

    engine = kestrel_core.load(model, backend="fwdcuda")
    params = []
    for i, p in enumerate(prompts):
        texts = [o.new_text for o in engine.stream(p, free)]
        stop = next((t[0] for t in texts[3:] if t), None) if i < 3 else None
        params.append(free if stop is None else SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,)))
    want = [alone(engine, p, s) for p, s in zip(prompts, params)]
    assert sum(reason == "stop" for _, _, reason in want) >= 2  # stop strings really end requests early
    reported_while_running: list[bool] = []
    original = Scheduler._report

    def report(self, request, token):  # type: ignore[no-untyped-def]
        reported_while_running.append(self.step_running)
        return original(self, request, token)

    held: list[int] = []  # sequences freed only once the step that still used them was in
    release = Scheduler._release_held

    def release_held(self):  # type: ignore[no-untyped-def]
        held.append(len(self._held))
        release(self)

    monkeypatch.setattr(Scheduler, "_report", report)
    monkeypatch.setattr(Scheduler, "_release_held", release_held)
    with engine:
        sched = Scheduler(engine)
        requests = [sched.add(p, s) for p, s in zip(prompts, params)]
        got: dict[str, list] = {r.request_id: [[], "", None] for r in requests}
        steps = 0
        while sched.has_work:
            for out in sched.step():
                g = got[out.request_id]
                g[0].extend(out.new_token_ids)
                g[1] += out.new_text
                g[2] = out.finish_reason
            steps += 1
            if steps == 6:
                sched.abort(requests[4].request_id)  # its row is in the running step
        fwd = engine.backend.plugin.FWD[0]
        assert [tuple(got[r.request_id]) for r in requests[:4]] == want[:4]
        aborted = got[requests[4].request_id]
        assert aborted[0] == want[4][0][:len(aborted[0])] and 0 < len(aborted[0]) < 12
        assert sum(reported_while_running) > len(reported_while_running) // 2 and sum(held) >= 3
        assert engine.pool.free_blocks == engine.pool.num_blocks and not fwd._pool.held


def test_the_async_engine_over_steps_that_run_ahead(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The AsyncEngine over the deferred hook: concurrent requests get what they get alone on the same backend,
    one whose caller leaves midway is aborted and freed, a ``run_sync`` call between steps finds the engine free
    (the running step drained), and at the end every block and device sequence is released."""
    import asyncio

    import kestrel_core
    from kestrel_core.model.async_engine import AsyncEngine
    from kestrel_core.model.sampling import SamplingParams

    model = _model("qwen3", "q8", seed=9)
    prompts = [p.tolist() for p in _prompts(model, (4, 30, 11, 17), seed=6)]
    _bind_batch_backend(tmp_path, monkeypatch)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with kestrel_core.load(model, backend="fwdcuda") as engine:
        want = serve_alone(engine, prompts, params)
        ae = AsyncEngine(engine)
        seen_running: list[bool] = []

        async def consume(prompt, leave_after=None, call_after=None):  # type: ignore[no-untyped-def]
            got: list[int] = []
            gen = ae.generate(prompt, params)
            async for out in gen:
                got.extend(out.new_token_ids)
                if len(got) == call_after:  # the others still decode: a step is in flight
                    seen_running.append(await ae.call(lambda: ae.scheduler.step_running))
                if leave_after is not None and len(got) >= leave_after:
                    await gen.aclose()  # the caller leaves: the request is aborted
                    break
            return got

        async def main():  # type: ignore[no-untyped-def]
            ae.start()
            tasks = [asyncio.create_task(consume(p, 3 if i == 3 else None, 2 if i == 0 else None))
                     for i, p in enumerate(prompts)]
            got = await asyncio.gather(*tasks)
            await ae.shutdown(grace_s=5)
            return got

        got = asyncio.run(main())
        fwd = engine.backend.plugin.FWD[0]
        assert got[:3] == want[:3] and got[3] == want[3][:len(got[3])] and 3 <= len(got[3]) < 8
        assert seen_running == [False]  # a call runs only once the step in flight is in
        assert engine.pool.free_blocks == engine.pool.num_blocks and not fwd._pool.held
        assert engine.stats["offload"]["kestrel_forward_batch"]["accepted"] >= 6
