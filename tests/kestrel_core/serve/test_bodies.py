"""A long prompts list (completions' prompt, embeddings' input) is validated a piece at a time, returning to the
interpreter between pieces, and is read as pydantic reads the whole union at once: the same value, or the same 400."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import StrictInt, StrictStr, TypeAdapter, ValidationError

from kestrel_core.serve import bodies
from kestrel_core.serve.bodies import Prompts
from kestrel_core.serve.errors import validation_error
from kestrel_core.serve.protocol import CompletionRequest, EmbeddingRequest

WHOLE = TypeAdapter(StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]])  # pydantic's own, at once


def _read(model: Any, field: str, value: Any) -> tuple[str, Any]:
    """("ok", the field's value) or ("400", the API's error) of a body whose ``field`` is ``value``."""
    try:
        return "ok", getattr(model.model_validate({field: value}), field)
    except ValidationError as exc:
        return "400", validation_error(RequestValidationError(exc.errors(include_url=False))).body()


def _reference(model: Any, field: str, value: Any) -> tuple[str, Any]:
    try:
        return "ok", WHOLE.validate_python(value)
    except ValidationError as exc:
        errors = [{**e, "loc": (field, *e["loc"])} for e in exc.errors(include_url=False)]
        return "400", validation_error(RequestValidationError(errors)).body()


ITEMS = [1, 7, "a", "", [1], [], [2, 3], True, None, 1.5, ["a"], [1, "a"], {"a": 1}]
# runs of one item: pieces of one kind each, of several kinds along the list, a bad item here and there
RUNS = st.lists(st.tuples(st.sampled_from(ITEMS), st.integers(1, 7)), max_size=5)


@settings(max_examples=400, deadline=None)
@given(runs=RUNS, field=st.sampled_from([(CompletionRequest, "prompt"), (EmbeddingRequest, "input")]))
def test_prompts_read_in_pieces_as_at_once(runs: list[tuple[Any, int]], field: tuple[Any, str]) -> None:
    """Pieces of 3 items: every list gives pydantic's value, or its 400, message and param alike."""
    items = [item for item, n in runs for _ in range(n)]
    step = bodies.PROMPTS_STEP
    bodies.PROMPTS_STEP = 3
    try:
        assert _read(*field, items) == _reference(*field, items)
    finally:
        bodies.PROMPTS_STEP = step


def test_no_call_of_pydantics_sees_more_than_a_piece() -> None:
    """pydantic's compiled validation holds the GIL, and so the server's event loop, for a whole call: a long list
    is validated in calls of PROMPTS_STEP items at most, the interpreter (which switches threads) between them."""
    value = [[1]] * (3 * bodies.PROMPTS_STEP + 5)
    seen: list[int] = []

    def validate(piece: Any) -> Any:
        seen.append(len(piece))
        return WHOLE.validate_python(piece)

    assert bodies._in_steps(value, validate) == value  # type: ignore[arg-type]
    assert sum(seen) == len(value) and max(seen) <= bodies.PROMPTS_STEP, seen
    assert TypeAdapter(Prompts).validate_python(value) == value
    for model, field in ((CompletionRequest, "prompt"), (EmbeddingRequest, "input")):  # validated so
        assert [m.func for m in model.model_fields[field].metadata] == [bodies._in_steps]


@pytest.mark.parametrize("value", [
    [[1]] * 4096 + [1] * 4096,  # two kinds, each piece valid
    ["a"] * 9000 + [["x"]],
    [1] * 4096 + [True],
])
def test_a_long_bad_prompts_list_is_pydantics_400(value: list[Any]) -> None:
    assert _read(CompletionRequest, "prompt", value) == _reference(CompletionRequest, "prompt", value) \
        == ("400", {"error": {"message": "prompt must be a string, an array of integers, an array of strings or an "
                                         "array of arrays of integers", "type": "invalid_request_error",
                              "param": "prompt", "code": "invalid_value"}})
