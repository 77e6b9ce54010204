"""The package's public names: each imported on first use, and the same names type checkers see."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import kestrel_core


def test_every_export_imports_and_type_checkers_see_the_same_names() -> None:
    tree = ast.parse(Path(kestrel_core.__file__).read_text())
    checked = next(node for node in tree.body if isinstance(node, ast.If)
                   and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    seen = {(imp.module, alias.name) for imp in checked.body if isinstance(imp, ast.ImportFrom)
            for alias in imp.names if alias.asname == alias.name}
    assert seen == {(module, name) for name, module in kestrel_core._EXPORTS.items()}
    for name in kestrel_core.__all__:
        assert getattr(kestrel_core, name) is not None
    assert (Path(kestrel_core.__file__).parent / "py.typed").is_file()
    assert kestrel_core.TokenLogprob is importlib.import_module("kestrel_core.model.sampling").TokenLogprob
