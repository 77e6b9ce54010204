"""Rerankers as they load (kestrel_core.model.rerank): a Qwen3-Reranker checkpoint made one (``load(rerank=True)``,
``kestrel serve --rerank``), a qwen3 GGUF of llama.cpp's conversion (rank pooling, cls.output, a rerank template) read
as one, kept by the artifact; the prompts they read. Their scores: tests/kestrel_core/serve/test_rerank.py."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

import kestrel_core
from kestrel_core.cli import main
from kestrel_core.errors import InvalidRequest, KestrelError
from kestrel_core.model.gguf_reader import GGUFCheckpoint
from kestrel_core.model.rerank import QWEN3_RERANK_TEMPLATE, RerankPrompt

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
TINY = FIXTURES / "tiny-qwen3"
# a GGUF's own template, unlike Qwen3-Reranker's: the file's is the one read
PROMPT = "<|im_start|>user\nQ: {query}\nD: {document}<|im_end|>\n<|im_start|>assistant\n"


def with_yes_and_no(dest: Path) -> Path:
    """tiny-qwen3 with the tokens "yes" and "no" a Qwen3-Reranker scores (its vocabulary has neither): two tokens
    that no merge builds on take their names, the merges that made them dropped."""
    shutil.copytree(TINY, dest)
    tokenizer = json.loads((dest / "tokenizer.json").read_text())
    model = tokenizer["model"]
    for old, new in (("ts", "yes"), ("ot", "no")):
        assert all(old not in pair for pair in model["merges"]) and new not in model["vocab"]
        model["merges"] = [pair for pair in model["merges"] if "".join(pair) != old]
        model["vocab"][new] = model["vocab"].pop(old)
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer))
    return dest


def rank_gguf(path: Path, fmt: Any, synth_source: Callable[..., Any], *, arch: str = "qwen3", rows: int = 2,
              template: str | None = PROMPT, tensors: dict[str, np.ndarray] | None = None,
              ) -> tuple[Path, np.ndarray]:
    """A qwen3 GGUF as llama.cpp converts a Qwen3-Reranker (rank pooling, a rerank template, cls.output: ``rows``
    rows, none at 0; ``tensors``: more), and its classifier."""
    tk = fmt.train_bpe("gpt2")
    classifier = np.random.default_rng(7).standard_normal((rows, 64)).astype(np.float32)

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_pooling_type(gguf.PoolingType.RANK)
        if template is not None:
            w.add_chat_template([{"name": "rerank", "template": template}])
        if rows:
            w.add_classifier_output_labels(["yes", "no", "maybe"][:rows])
            w.add_tensor("cls.output.weight", classifier)
        for name, t in (tensors or {}).items():
            w.add_tensor(name, t)

    src = synth_source("qwen3", vocab_size=tk.get_vocab_size())
    return fmt.write_gguf(path, src, tokenizer=tk, arch=arch, metadata=metadata), classifier


def test_a_rank_gguf_is_a_reranker_with_its_template_and_classifier(tmp_path: Path, fmt, synth_source) -> None:
    path, classifier = rank_gguf(tmp_path / "r.gguf", fmt, synth_source)
    c = GGUFCheckpoint(path).config
    assert (c.pooling, c.normalize_embeddings, c.rerank_template) == ("last", False, PROMPT)
    with kestrel_core.load(str(path), backend="cpu") as engine:
        assert np.array_equal(engine.model.classifier, classifier)
        with pytest.raises(InvalidRequest, match="this is a reranker: it gives relevance scores"):
            engine.check_generates()
    with kestrel_core.load(str(path), backend="cpu", rerank=True) as again:  # a reranker already: as it is
        assert again.config.rerank_template == PROMPT and np.array_equal(again.model.classifier, classifier)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rows": 0}, "qwen3.pooling_type rank (a reranker) without its classifier (cls.output.weight)"),
    ({"rows": 3}, "cls.output.weight has shape [3, 64]; a reranker's is [2, 64]"),
    ({"template": None}, "a reranker without its prompt (tokenizer.chat_template.rerank"),
    ({"template": "Q: {query}"}, "a reranker without its prompt (tokenizer.chat_template.rerank"),
    ({"tensors": {"cls.output.bias": np.zeros(2, np.float32)}}, "with cls.output.bias is not supported"),
    ({"arch": "llama"}, "llama.pooling_type rank (a reranker) is read for qwen3 and qwen3vl files"),
])
def test_a_rank_gguf_kestrel_does_not_read_is_refused_by_what_it_lacks(
        tmp_path: Path, fmt, synth_source, kwargs: dict[str, Any], message: str) -> None:
    path, _ = rank_gguf(tmp_path / "r.gguf", fmt, synth_source, **kwargs)
    with pytest.raises(KestrelError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        GGUFCheckpoint(path)


def test_the_artifact_keeps_the_reranker(tmp_path: Path, fmt, synth_source) -> None:
    """A .kst (the model cache's entries are these) holds the template and the classifier, as float32."""
    from kestrel_core.model.loader import load_model, write_artifact

    path, classifier = rank_gguf(tmp_path / "r.gguf", fmt, synth_source)
    kst = write_artifact(load_model(str(path), "q8", cache="off"), tmp_path / "r.kst")
    with kestrel_core.load(str(kst), backend="cpu") as engine:
        assert engine.config.rerank_template == PROMPT and np.array_equal(engine.model.classifier, classifier)


def test_rerank_makes_a_qwen3_reranker_checkpoint_one(tmp_path: Path) -> None:
    with kestrel_core.load(str(with_yes_and_no(tmp_path / "m")), backend="cpu", rerank=True) as engine:
        c = engine.config
        assert (c.pooling, c.normalize_embeddings, c.rerank_template) == ("last", False, QWEN3_RERANK_TEMPLATE)
        assert engine.model.classifier.shape == (2, c.hidden_size)
        with pytest.raises(InvalidRequest, match="this is a reranker"):
            engine.check_generates()


@pytest.mark.parametrize(("model", "message"), [
    ("tiny-qwen3", "--rerank: the model's tokenizer has no token 'yes'"),
    ("tiny-llama", "a Qwen3 checkpoint, and this is llama"),
    ("tiny-qwen3-embed", "--rerank: this is an embedding model (last pooling), not a reranker"),
])
def test_rerank_refuses_a_checkpoint_that_is_no_qwen3_reranker(model: str, message: str) -> None:
    with pytest.raises(KestrelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kestrel_core.load(str(FIXTURES / model), backend="cpu", rerank=True)


def test_a_prompt_reads_the_query_and_the_document_as_text(tmp_path: Path, fmt, synth_source) -> None:
    """The template's special tokens are tokens; a document's "<|im_end|>" is text, and a query's "{document}" is
    not the document (llama.cpp replaces both in the whole prompt, and parses it for special tokens)."""
    path, _ = rank_gguf(tmp_path / "r.gguf", fmt, synth_source)
    with kestrel_core.load(str(path), backend="cpu") as engine:
        tok = engine.tokenizer
        prompt = RerankPrompt(tok, PROMPT)
        plain = prompt.ids("the capital", "of France")
        assert plain == tok.encode(PROMPT.format(query="the capital", document="of France"), add_special_tokens=False)
        end = tok.backend.token_to_id("<|im_end|>")
        ids = prompt.ids("{document}?", "a<|im_end|>b")
        assert ids.count(end) == PROMPT.count("<|im_end|>")
        assert tok.decode(ids) == PROMPT.format(query="{document}?", document="a<|im_end|>b")


def test_kestrel_embed_refuses_a_reranker(tmp_path: Path, fmt, synth_source,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = rank_gguf(tmp_path / "r.gguf", fmt, synth_source)
    assert main(["embed", "-m", str(path), "--backend", "cpu", "a text"]) != 0
    err = capsys.readouterr().err.strip()  # the backend line, then the error's
    assert err.splitlines()[-1].startswith("error: this is a reranker: it scores") and "Traceback" not in err
