"""The Python examples of the README and docs/ run as written, and what their comments say of the results holds."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _examples() -> list[Any]:
    """Each Python block that uses kestrel (the OpenAI client's needs a server): one loading a model needs the
    default model, as CI has it."""
    examples = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for i, code in enumerate(BLOCK.findall(doc.read_text(encoding="utf-8"))):
            if "kestrel_core" in code:
                marks = [pytest.mark.default_model] if ".load(" in code else []
                examples.append(pytest.param(code, id=f"{doc.relative_to(ROOT)}:{i}", marks=marks))
    return examples


@pytest.mark.parametrize("code", _examples())
def test_a_python_example_runs_as_written(code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[tuple[Any, dict[str, Any]]] = []
    if "kestrel_core.serve" in code:  # serve() blocks until a signal: what it is given is checked instead
        server = pytest.importorskip("kestrel_core.serve.server")
        monkeypatch.setattr(server, "serve", lambda engines, **options: served.append((engines, options)) or 0)
    names: dict[str, Any] = {"__name__": "__example__"}
    exec(compile(code, "<example>", "exec"), names)
    engine = names.get("engine")
    if served:
        assert served == [(engine, {"host": "127.0.0.1", "port": 8000, "max_batch": 32})]
    if "vectors" in names:  # the README's: "[T, vocab]", "[1, 64] float32, unit length"
        assert names["logits"].shape == (len(names["ids"]), engine.config.vocab_size)
        vectors = names["vectors"]
        assert vectors.shape == (1, 64) and vectors.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
        assert [s.token_id for s in names["scores"]] == names["ids"][1:]
    if engine is not None:
        engine.close()
