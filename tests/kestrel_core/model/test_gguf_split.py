"""A GGUF split into parts (llama.cpp's gguf-split, convert_hf_to_gguf.py --split-max-size): read from its first
part, every part found by name, the same logits as the whole file; a later part, a missing one and a part that is
not what its name says are one-line errors. The parts are written by gguf-py's own writer and copier."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

import kestrel_core
from kestrel_core.errors import KestrelError
from kestrel_core.model.cache import gguf_key

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
WHOLE = FIXTURES / "tiny-qwen3-moe.gguf"


def split(src: Path, dst: Path, tensors_a_part: int) -> list[Path]:
    """``src`` rewritten as parts of at most ``tensors_a_part`` tensors, named as llama.cpp names them."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch=reader.fields["general.architecture"].contents(),
                             split_max_tensors=tensors_a_part)
    copy_with_new_metadata(reader, writer, {}, [])
    return sorted(dst.parent.glob(f"{dst.stem}-*-of-*.gguf"))


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = split(WHOLE, tmp_path_factory.mktemp("split") / "tiny-qwen3-moe-Q8_0.gguf", 10)
    assert [p.name[-20:] for p in out] == ["-00001-of-00003.gguf", "-00002-of-00003.gguf", "-00003-of-00003.gguf"]
    return out


def test_a_split_gguf_gives_the_logits_of_the_whole_file(parts: list[Path]) -> None:
    ids = np.load(FIXTURES / "tiny-qwen3-moe" / "golden.npz")["ids"]
    with kestrel_core.load(str(parts[0]), backend="cpu") as split_engine, \
            kestrel_core.load(str(WHOLE), backend="cpu") as whole:
        assert np.array_equal(split_engine.logits(ids), whole.logits(ids))
        assert split_engine.model.config == whole.model.config


def test_a_directory_holding_a_split_gguf_a_folder_down_loads_it(parts: list[Path], tmp_path: Path) -> None:
    """As a Hub repository holds a large model's parts: in a folder named by the quant, no config.json."""
    from kestrel_core.model.loader import load_model

    folder = tmp_path / "model" / "Q8_0"
    folder.mkdir(parents=True)
    for p in parts:
        shutil.copy(p, folder / p.name)
    (tmp_path / "model" / "README.md").write_text("a model")
    loaded = load_model(tmp_path / "model", quant="q8", cache="off")
    assert loaded.source == str(folder / parts[0].name)
    whole = load_model(WHOLE, quant="q8", cache="off")
    assert loaded.model.config == whole.model.config
    np.testing.assert_array_equal(loaded.model.layers[1].q.codes, whole.model.layers[1].q.codes)


def test_the_cache_key_covers_every_part(parts: list[Path], tmp_path: Path) -> None:
    copies = [Path(shutil.copy(p, tmp_path / p.name)) for p in parts]
    key = gguf_key(copies[0], "q8")
    with open(copies[2], "r+b") as f:  # the last part's header changes: a tensor's name
        data = bytearray(f.read())
        at = data.index(b"blk.1.")
        data[at:at + 6] = b"blk.9."
        f.seek(0)
        f.write(data)
    assert gguf_key(copies[0], "q8") != key


def test_a_later_part_names_the_first(parts: list[Path]) -> None:
    with pytest.raises(KestrelError, match=r"part 2 of 3 of a split GGUF; give its first part, "
                                           r"tiny-qwen3-moe-Q8_0-00001-of-00003\.gguf"):
        kestrel_core.load(str(parts[1]), backend="cpu")


def test_a_missing_part_is_named(parts: list[Path], tmp_path: Path) -> None:
    for p in parts[:2]:
        shutil.copy(p, tmp_path / p.name)
    with pytest.raises(KestrelError, match=r"part 3 of 3 of this split GGUF is missing \(.*-00003-of-00003\.gguf\)"):
        kestrel_core.load(str(tmp_path / parts[0].name), backend="cpu")


def test_a_part_of_another_split_is_refused(parts: list[Path], tmp_path: Path) -> None:
    """Part 2's place taken by part 3 (its split.no says 2): refused, not read as if it were part 2."""
    for p in parts:
        shutil.copy(p, tmp_path / p.name)
    shutil.copy(parts[2], tmp_path / parts[1].name)
    with pytest.raises(KestrelError, match=r"not part 2 of 3 of tiny-qwen3-moe-Q8_0-00001-of-00003\.gguf"):
        kestrel_core.load(str(tmp_path / parts[0].name), backend="cpu")


def test_a_first_part_renamed_is_refused(parts: list[Path], tmp_path: Path) -> None:
    """Its other parts are found by its name: a first part under another name cannot find them."""
    shutil.copy(parts[0], tmp_path / "renamed.gguf")
    with pytest.raises(KestrelError, match=r"must be named NAME-00001-of-00003\.gguf"):
        kestrel_core.load(str(tmp_path / "renamed.gguf"), backend="cpu")
