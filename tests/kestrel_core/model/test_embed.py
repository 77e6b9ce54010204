"""Embeddings against sentence-transformers and transformers (golden data: scripts/make_embedding_golden.py).

tiny-qwen3-embed is laid out like Qwen3-Embedding-8B (a headless Qwen3Model, last-token pooling, Normalize, a
tokenizer that appends <|endoftext|>); its GGUF twin is what llama.cpp's converter writes. Each golden vector is
L2-normalized, so agreement is the cosine: q8 and q4 measured >= 0.9995 on every text (docs/parity.md), while
pooling by another mode than the golden's measured 0.23-0.80, below any limit that could pass by accident.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

import kestrel_core
from kestrel_core.errors import InvalidRequest, KestrelError, Overloaded
from kestrel_core.model.embed import EmbedJob
from kestrel_core.model.hf import HFCheckpoint
from kestrel_core.model.sampling import SamplingParams

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
EMBED = FIXTURES / "tiny-qwen3-embed"
GOLDEN = np.load(EMBED / "golden.npz")
IDS = [GOLDEN[f"ids_{i}"].tolist() for i in range(len(GOLDEN["embeddings"]))]
TEXTS = ["What is the capital of France?", "The capital of France is Paris.",
         "Quantization maps each weight to a small integer; the scale brings it back."]
COSINE_MIN = 0.999


@pytest.fixture(scope="module")
def engine() -> kestrel_core.Engine:
    return kestrel_core.load(str(EMBED), backend="cpu")


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.sum(got * want, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)


@pytest.mark.parametrize("source", [EMBED, FIXTURES / "tiny-qwen3-embed.gguf"], ids=["hf", "gguf"])
@pytest.mark.parametrize("quant", ["q8", "q4"])
def test_embeddings_match_sentence_transformers(source: Path, quant: str) -> None:
    engine = kestrel_core.load(str(source), backend="cpu", quant=quant)
    assert engine.config.pooling == "last" and engine.config.normalize_embeddings
    for text, ids in zip(TEXTS, IDS):  # the tokenizer appends <|endoftext|> as transformers' does
        assert engine.tokenizer.encode(text) == ids
    got = engine.embed(IDS)
    assert got.shape == GOLDEN["embeddings"].shape and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    assert cosines(got, GOLDEN["embeddings"]).min() >= COSINE_MIN


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_each_pooling_matches_transformers_and_a_wrong_one_does_not(engine, pooling: str) -> None:
    got = engine.embed(IDS, pooling=pooling)
    assert cosines(got, GOLDEN[pooling]).min() >= COSINE_MIN
    for other in {"mean", "cls", "last"} - {pooling}:
        assert cosines(got, GOLDEN[other]).min() < 0.9, other


def test_chunked_steps_and_batching_change_no_bit(engine) -> None:
    """A job of 7 tokens a step (texts split across steps, several in one step) gives what one text alone does."""
    alone = np.stack([engine.embed([ids])[0] for ids in IDS])
    for pooling in ("last", "mean"):
        job = EmbedJob(engine, IDS, budget=7, pooling=pooling)
        steps = 0
        while not job.done:
            job.step()
            steps += 1
        assert steps >= sum(len(ids) for ids in IDS) // 7
        want = alone if pooling == "last" else engine.embed(IDS, pooling="mean")
        assert np.array_equal(job.result(), want)


def test_a_paused_job_runs_its_inputs_again_and_gives_the_same_vectors(engine) -> None:
    """``pause`` gives every block back; the inputs it held run again from their start, to the same bits."""
    pool = engine.pool
    for pooling in ("last", "mean"):
        want = engine.embed(IDS, pooling=pooling)
        job = EmbedJob(engine, IDS, budget=5, pooling=pooling)
        steps = 0
        while not job.done:
            job.step()
            steps += 1
            if steps in (2, 5) and job.holding:
                job.pause()
                assert not job.holding and pool.free_blocks == pool.num_blocks
        assert np.array_equal(job.result(), want)


def test_an_input_waiting_for_blocks_holds_back_the_next(engine) -> None:
    """A running input the KV cache lacks blocks for stops the job starting another: one more input part-way
    could hold what the first needs (two such jobs would wait on each other for ever)."""
    pool = engine.pool
    long_ids = (IDS[2] * 20)[:200]
    alone = engine.embed([long_ids, IDS[0]])
    job = EmbedJob(engine, [long_ids, IDS[0]], budget=64)
    job.step()  # the long input's first 64 positions: 2 blocks; its next 64 need 2 more
    hog = engine.new_sequence()
    assert pool.reserve(hog.cache, (pool.free_blocks - 1) * pool.block_size)  # one block left: IDS[0]'s room
    try:
        with pytest.raises(Overloaded):
            job.step()
        assert pool.free_blocks == 1
    finally:
        engine.release(hog)
    while not job.done:
        job.step()
    assert np.array_equal(job.result(), alone)


def test_dimensions_keep_the_first_components_renormalized(engine) -> None:
    full = engine.embed(IDS)
    cut = engine.embed(IDS, dimensions=8)
    assert cut.shape == (len(IDS), 8)
    want = full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, want, rtol=1e-5, atol=1e-6)


def test_an_embedding_model_does_not_generate(engine) -> None:
    with pytest.raises(InvalidRequest, match="embedding model"):
        engine.stream(IDS[0], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest, match="embedding model"):
        engine.logits(IDS[0])


def test_a_generative_model_embeds_by_its_last_token() -> None:
    engine = kestrel_core.load(str(FIXTURES / "tiny-qwen3"), backend="cpu")
    assert engine.config.pooling is None
    ids = IDS[0][:-1]
    got = engine.embed([ids, ids + [7]])
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    assert cosines(got[:1], got[1:])[0] < 0.999  # the last token's state, not a constant
    assert list(engine.generate(ids, max_tokens=1))  # and it still generates


def test_bad_inputs_are_invalid_requests(engine) -> None:
    c = engine.config
    cases = [([], {}, "no input"), ([[]], {}, "empty"), ([[c.vocab_size]], {}, "outside the vocabulary"),
             ([[1] * (c.max_position + 1)], {}, "context"), ([[1, 2]], {"dimensions": 0}, "dimensions"),
             ([[1, 2]], {"dimensions": c.hidden_size + 1}, "dimensions"), ([[1, 2]], {"pooling": "max"}, "pooling"),
             ([[1, 2]], {"dimensions": 4.0}, "dimensions"), ([[1, 2]], {"dimensions": "4"}, "got '4'"),
             # an iterator of inputs, or of ids, would be used up by the checks: a sequence is asked for
             ((ids for ids in [[1, 2]]), {}, "no input"), ([iter([1, 2])], {}, "sequence of token ids")]
    # only None is the model's pooling: a falsy value was taken for it, a list holding a mode's name is none
    cases += [([[1, 2]], {"pooling": pooling}, r"pooling must be one of last, mean, cls or None \(the model's\)")
              for pooling in ([], "", 0, False, (), ["last"], np.array(["last"]), b"last")]
    for inputs, options, match in cases:
        with pytest.raises(InvalidRequest, match=match):
            engine.embed(inputs, **options)


def test_blocks_are_freed_and_a_full_cache_is_overloaded(engine) -> None:
    pool = engine.pool
    free = pool.free_blocks
    engine.embed(IDS)
    assert pool.free_blocks == free
    job = EmbedJob(engine, IDS, budget=7)
    job.step()
    assert pool.free_blocks < free
    job.close()
    assert pool.free_blocks == free

    hog = engine.new_sequence(0)
    assert pool.reserve(hog.cache, pool.free_blocks * pool.block_size)
    job = EmbedJob(engine, IDS[:1])
    with pytest.raises(Overloaded):
        job.step()
    engine.release(hog)
    while not job.done:
        job.step()
    assert pool.free_blocks == free


def _copy(tmp_path: Path) -> Path:
    d = tmp_path / "m"
    shutil.copytree(EMBED, d)
    return d


def test_sentence_transformers_layouts_kestrel_cannot_pool_are_refused(tmp_path: Path) -> None:
    d = _copy(tmp_path)
    modules = json.loads((d / "modules.json").read_text())
    (d / "modules.json").write_text(json.dumps(modules + [{"idx": 3, "name": "3", "path": "3_Dense",
                                                          "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(KestrelError, match="module sentence_transformers.models.Dense at '3_Dense' is not supported"):
        HFCheckpoint(d)
    (d / "modules.json").write_text(json.dumps(modules))
    pooling = json.loads((d / "1_Pooling" / "config.json").read_text())
    (d / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "pooling_mode_max_tokens": True}))
    with pytest.raises(KestrelError, match="pooling by pooling_mode_max_tokens is not supported"):
        HFCheckpoint(d)
    (d / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "pooling_mode_lasttoken": False,
                                                             "pooling_mode_mean_tokens": True}))
    assert HFCheckpoint(d).config.pooling == "mean"
    (d / "modules.json").write_text(json.dumps([m for m in modules if "Normalize" not in m["type"]]))
    assert not HFCheckpoint(d).config.normalize_embeddings
    (d / "modules.json").write_text(json.dumps(modules[:1]))
    with pytest.raises(KestrelError, match="no Pooling module"):
        HFCheckpoint(d)
    (d / "modules.json").write_text(json.dumps([{**modules[1], "path": "../../etc"}]))
    with pytest.raises(KestrelError):
        HFCheckpoint(d)
    (d / "modules.json").unlink()
    with pytest.raises(KestrelError, match="no lm_head weight"):  # not an embedding model: it needs its head
        kestrel_core.load(str(d), backend="cpu")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "is_causal": False}))
    with pytest.raises(KestrelError, match="bidirectional attention"):
        HFCheckpoint(d)


@pytest.mark.parametrize(("kind", "pooling"), [(0, None), (1, "mean"), (2, "cls"), (3, "last")])
def test_gguf_pooling_type(tmp_path: Path, synth_source, fmt, kind: int, pooling: str | None) -> None:
    from kestrel_core.model.gguf_reader import GGUFCheckpoint

    path = fmt.write_gguf(tmp_path / "m.gguf", synth_source("qwen3"),
                          metadata=lambda w: w.add_pooling_type(gguf.PoolingType(kind)))
    assert GGUFCheckpoint(path).config.pooling == pooling


def test_a_gguf_reranker_without_its_classifier_and_bidirectional_models_are_refused(tmp_path: Path, synth_source,
                                                                                      fmt) -> None:
    """A reranker's GGUF that is whole: tests/kestrel_core/model/test_rerank.py."""
    from kestrel_core.model.gguf_reader import GGUFCheckpoint

    rank = fmt.write_gguf(tmp_path / "rank.gguf", synth_source("qwen3"),
                          metadata=lambda w: w.add_pooling_type(gguf.PoolingType.RANK))
    with pytest.raises(KestrelError, match="pooling_type rank .* without its classifier"):
        GGUFCheckpoint(rank)
    both = fmt.write_gguf(tmp_path / "both.gguf", synth_source("qwen3"),
                          metadata=lambda w: w.add_causal_attention(False))
    with pytest.raises(KestrelError, match="bidirectional attention"):
        GGUFCheckpoint(both)


def test_the_artifact_keeps_the_pooling_and_the_vectors(tmp_path: Path, engine) -> None:
    from kestrel_core.model.loader import load_model, write_artifact

    kst = write_artifact(load_model(str(EMBED), "q8", cache="off"), tmp_path / "embed.kst")
    with kestrel_core.load(str(kst), backend="cpu") as again:
        assert (again.config.pooling, again.config.normalize_embeddings) == ("last", True)
        assert np.array_equal(again.embed(IDS), engine.embed(IDS))
