"""Loading a Hugging Face directory or a GGUF file caches its strip-cache as an artifact in KESTREL_HOME/cache."""

from __future__ import annotations

import gc
import json
import logging
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kestrel_core import artifact_write
from kestrel_core.artifact import model_tensors, read_meta
from kestrel_core.contract import StripCache
from kestrel_core.errors import KestrelError
from kestrel_core.model import loader
from kestrel_core.model.cache import MODEL_CACHE_ENV, hf_key
from kestrel_core.model.hf import HFCheckpoint
from kestrel_core.model.loader import load_model
from kestrel_core.model.quantize import quantize_model
from kestrel_core.temps import HELD_SUFFIX

from ..waits import HANG_GUARD_S

TEMPLATE = "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
REAL_WRITER = artifact_write._write_safetensors

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KESTREL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(MODEL_CACHE_ENV, "1")
    return tmp_path / "home"


@pytest.fixture
def hf(tmp_path: Path, synth_source, fmt):
    tk = fmt.train_bpe("gpt2")
    src = synth_source("qwen2", seed=4, vocab_size=tk.get_vocab_size(), eos_token_ids=(2,))
    root = fmt.write_hf_dir(tmp_path / "Qwen-tiny", src, dtype="bf16", shards=2)
    (root / "tokenizer.json").write_text(tk.to_str())
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<|im_start|>",
                                                            "eos_token": "<|im_end|>"}))
    return root, src


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The quantizations the loader runs (a cache hit runs none)."""
    calls: list[str] = []

    def counting(source, quant, progress=None):
        calls.append(str(quant))
        return quantize_model(source, quant, progress)

    monkeypatch.setattr(loader, "quantize_model", counting)
    return calls


def _entries(home: Path) -> list[Path]:
    return sorted((home / "cache").glob("*.kst"))


def _same(a, b) -> None:
    ta, tb = model_tensors(a), model_tensors(b)
    assert a.config == b.config and ta.keys() == tb.keys()
    for name, va in ta.items():
        if isinstance(va, StripCache):
            np.testing.assert_array_equal(va.codes, tb[name].codes)
            np.testing.assert_array_equal(va.scales, tb[name].scales)
        else:
            np.testing.assert_array_equal(va, tb[name])


def _fresh(root: Path, mode: str):
    """The checkpoint quantized now, without the loader (whose quantize_model the tests count)."""
    return quantize_model(HFCheckpoint(root), mode)


def _mapped(a: np.ndarray) -> bool:
    while a.base is not None and isinstance(a.base, np.ndarray):
        a = a.base
    return isinstance(a.base, memoryview) and isinstance(a.base.obj, mmap.mmap)


def test_the_second_load_is_a_cache_hit(home: Path, hf, builds: list[str]) -> None:
    root, _ = hf
    first = load_model(root, quant="q4")
    assert builds == ["q4"] and len(_entries(home)) == 1
    entry = _entries(home)[0]
    assert entry.name.startswith("hf-Qwen-tiny.") and ".q4.v1.kestrel-" in entry.name
    second = load_model(root, quant="q4")
    assert builds == ["q4"]  # nothing quantized
    _same(first.model, second.model)
    _same(second.model, _fresh(root, "q4"))
    assert _mapped(second.model.layers[0].q.codes) and _mapped(first.model.layers[0].q.codes)  # read back
    assert second.source == first.source == str(root) and second.quant == "q4"
    for tok in (first.tokenizer, second.tokenizer):
        assert tok.eos_token_ids == (2,) and tok.bos_token == "<|im_start|>"
    assert second.tokenizer.apply_chat_template(MESSAGES) == first.tokenizer.apply_chat_template(MESSAGES)
    assert second.tokenizer.encode("hello world") == first.tokenizer.encode("hello world")
    meta = read_meta(entry)
    assert meta.extra["cache_key"] == hf_key(root, "q4") and meta.checksums


def test_a_changed_config_weight_file_or_quant_mode_rebuilds(home: Path, hf, builds: list[str]) -> None:
    root, _ = hf
    load_model(root, quant="q8")
    old_entry = _entries(home)[0]
    cfg = json.loads((root / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3
    (root / "config.json").write_text(json.dumps(cfg))
    changed = load_model(root, quant="q8")
    assert builds == ["q8", "q8"] and changed.model.config.rms_norm_eps == 1e-3
    assert len(_entries(home)) == 1 and not old_entry.exists()  # the slot's stale entry is gone
    load_model(root, quant="q8")
    assert len(builds) == 2
    shard = root / "model-00001-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data)  # same bytes, a new mtime: the key cannot know they are the same
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    load_model(root, quant="q8")
    assert len(builds) == 3
    load_model(root, quant="q4-g256")
    assert builds[-1] == "q4-g256" and len(_entries(home)) == 2  # one entry per mode
    load_model(root, quant="q8")
    load_model(root, quant="q4-g256")
    assert len(builds) == 4
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    assert load_model(root, quant="q8").tokenizer.eos_token_ids == (2, 3)
    assert len(builds) == 5


def test_a_writer_that_fails_leaves_no_temp_and_no_entry(home: Path, hf, builds: list[str], monkeypatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    root, _ = hf

    def dies(f, *args, **kwargs):
        f.write(b"half an artifact")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(artifact_write, "_write_safetensors", dies)
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        loaded = load_model(root, quant="q8")  # a cache that cannot be written only costs speed
    _same(loaded.model, _fresh(root, "q8"))
    assert "could not cache the quantized model" in caplog.text and "no space left" in caplog.text
    assert list((home / "cache").iterdir()) == []

    def interrupted(f, *args, **kwargs):
        f.write(b"half an artifact")
        raise KeyboardInterrupt

    monkeypatch.setattr(artifact_write, "_write_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_model(root, quant="q8")
    assert list((home / "cache").iterdir()) == []
    monkeypatch.setattr(artifact_write, "_write_safetensors", REAL_WRITER)
    load_model(root, quant="q8")
    assert len(_entries(home)) == 1 and [p.name for p in (home / "cache").iterdir() if p.suffix == ".tmp"] == []


@pytest.fixture
def gated_writer(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every entry written on a thread (whatever its size), each writer held until the returned event is set."""
    go = threading.Event()

    def held(*args, **kwargs):
        assert go.wait(HANG_GUARD_S)
        return REAL_WRITER(*args, **kwargs)

    monkeypatch.setattr(loader, "BACKGROUND_WRITE_BYTES", 0)
    monkeypatch.setattr(artifact_write, "_write_safetensors", held)
    yield go
    go.set()
    loader.finish_cache_writes(cancel=True)


def _temps(home: Path) -> list[str]:
    return [p.name for p in (home / "cache").iterdir() if p.suffix in (".tmp", HELD_SUFFIX)]


def test_a_large_entry_is_written_on_a_thread_while_the_load_goes_on(home: Path, hf, builds: list[str],
                                                                     gated_writer: threading.Event) -> None:
    root, _ = hf
    first = load_model(root, quant="q8")  # returns while its entry is still being written
    assert builds == ["q8"] and _entries(home) == [] and not _mapped(first.model.layers[0].q.codes)
    _same(first.model, _fresh(root, "q8"))
    gated_writer.set()
    loader.finish_cache_writes()
    assert len(_entries(home)) == 1 and _temps(home) == []
    second = load_model(root, quant="q8")
    assert builds == ["q8"] and _mapped(second.model.layers[0].q.codes)  # a cache hit
    _same(second.model, first.model)


def test_a_load_of_an_entry_being_written_waits_for_it(home: Path, hf, builds: list[str],
                                                       gated_writer: threading.Event) -> None:
    root, _ = hf
    load_model(root, quant="q8")
    threading.Timer(0.2, gated_writer.set).start()
    again = load_model(root, quant="q8")  # not a second build of the same entry
    assert builds == ["q8"] and _mapped(again.model.layers[0].q.codes)


def test_a_cancelled_or_failed_write_on_a_thread_leaves_no_entry_and_no_temp(
        home: Path, hf, builds: list[str], gated_writer: threading.Event, monkeypatch,
        caplog: pytest.LogCaptureFixture) -> None:
    root, _ = hf
    load_model(root, quant="q8")
    threading.Timer(0.2, gated_writer.set).start()
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        loader.finish_cache_writes(cancel=True)
    assert list((home / "cache").iterdir()) == [] and "could not cache" not in caplog.text

    def dies(f, *args, **kwargs):
        f.write(b"half an artifact")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(artifact_write, "_write_safetensors", dies)
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        load_model(root, quant="q8")
        loader.finish_cache_writes()
    assert "could not cache the quantized model" in caplog.text and "no space left" in caplog.text
    assert list((home / "cache").iterdir()) == [] and builds == ["q8", "q8"]

    def bug(f, *args, **kwargs):
        raise ZeroDivisionError("a bug in the writer")

    monkeypatch.setattr(artifact_write, "_write_safetensors", bug)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        load_model(root, quant="q8")
        loader.finish_cache_writes()
    assert "ZeroDivisionError: a bug in the writer" in caplog.text  # a warning, the thread ends quietly
    assert list((home / "cache").iterdir()) == []


def test_a_corrupt_entry_is_rebuilt_with_a_warning(home: Path, hf, builds: list[str],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    root, _ = hf
    load_model(root, quant="q8")
    gc.collect()  # nothing maps the entry now (a flip in place would show in a live map)
    entry = _entries(home)[0]
    data = bytearray(entry.read_bytes())
    data[-100] ^= 0x01  # the last tensor's bytes
    entry.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        again = load_model(root, quant="q8")
    assert len(builds) == 2
    assert "rebuilding the cached strip-cache" in caplog.text and "is corrupt: its XXH64" in caplog.text
    assert len([r for r in caplog.records if "rebuilding" in r.getMessage()]) == 1
    assert all("\n" not in r.getMessage() for r in caplog.records)
    _same(again.model, _fresh(root, "q8"))
    load_model(root, quant="q8")
    assert len(builds) == 2  # the rebuilt entry is good
    entry.write_bytes(b"garbage")
    load_model(root, quant="q8")
    assert len(builds) == 3


def test_an_entry_with_a_flipped_bit_in_its_metadata_or_without_its_checksum_is_rebuilt(
        home: Path, hf, builds: list[str], caplog: pytest.LogCaptureFixture) -> None:
    """The config, tokenizer and chat template live in the entry's header: a flipped bit there is caught as one in
    a tensor is; an entry that records no checksum of its metadata (an earlier kestrel's) is rebuilt once."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    root, _ = hf
    load_model(root, quant="q8")
    gc.collect()
    entry = _entries(home)[0]
    data = bytearray(entry.read_bytes())
    at = data.index(b'rms_norm_eps\\": ')  # the config inside the header's JSON
    data[at + len(b'rms_norm_eps\\": ')] ^= 0x02  # its first digit, 1 <-> 3: still valid JSON
    entry.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        again = load_model(root, quant="q8")
    assert len(builds) == 2 and "the metadata is corrupt" in caplog.text
    _same(again.model, _fresh(root, "q8"))
    gc.collect()
    with safe_open(str(entry), framework="numpy") as f:
        meta = dict(f.metadata())
    sums = json.loads(meta.pop("checksums"))
    del sums["metadata"]
    meta.pop("integrity")
    save_file(load_file(str(entry)), str(entry), metadata={**meta, "checksums": json.dumps(sums)})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        load_model(root, quant="q8")
        load_model(root, quant="q8")
    assert len(builds) == 3 and "carries no checksum of its metadata" in caplog.text


@pytest.mark.parametrize("kind", ["directory", "symlink", "fifo"])
def test_something_else_in_place_of_the_entry(home: Path, hf, builds: list[str], tmp_path: Path, kind: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    root, _ = hf
    load_model(root, quant="q8")
    entry = _entries(home)[0]
    entry.unlink()
    target = tmp_path / "elsewhere.kst"
    target.write_bytes(b"not ours")
    if kind == "directory":
        entry.mkdir()
        (entry / "inside").write_bytes(b"x")
    elif kind == "symlink":
        entry.symlink_to(target)
    else:
        os.mkfifo(entry)
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        load_model(root, quant="q8")
    assert len(builds) == 2 and "not a regular file" in caplog.text
    assert entry.is_file() and not entry.is_symlink() and read_meta(entry).quant == "q8"
    assert target.read_bytes() == b"not ours"  # a symlink's target is never touched


def test_an_entry_of_another_checkpoint_is_not_used(home: Path, hf, builds: list[str],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    root, _ = hf
    load_model(root, quant="q8")
    entry = _entries(home)[0]
    cfg = json.loads((root / "config.json").read_text())
    cfg["rope_theta"] = 12345.0
    (root / "config.json").write_text(json.dumps(cfg))
    key = hf_key(root, "q8")
    impostor = entry.with_name(entry.name.replace(entry.name.split(".")[2], key[:16]))
    entry.rename(impostor)  # the old build under the new key's name
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        loaded = load_model(root, quant="q8")
    assert len(builds) == 2 and loaded.model.config.rope_theta == 12345.0
    assert "built from another checkpoint" in caplog.text


def test_stale_temps_go_and_the_cache_can_be_off_or_read_only(home: Path, hf, builds: list[str],
                                                               monkeypatch) -> None:
    root, _ = hf
    cache = home / "cache"
    cache.mkdir(parents=True)
    stale, live = cache / ".dead.kst.x1y2z3w4.tmp", cache / ".live.kst.x2y3z4w5.tmp"  # mkstemp's names
    stale.write_bytes(b"killed writer")
    live.write_bytes(b"writing now")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    load_model(root, quant="q8", cache="read")  # reads only: writes nothing, removes nothing
    assert stale.exists() and _entries(home) == []
    load_model(root, quant="q8")
    assert not stale.exists() and live.exists() and len(_entries(home)) == 1
    load_model(root, quant="q8", cache="read")
    assert len(builds) == 2  # read mode uses a valid entry
    monkeypatch.setenv(MODEL_CACHE_ENV, "0")
    load_model(root, quant="q4")
    assert len(builds) == 3 and len(_entries(home)) == 1
    load_model(root, quant="q4", cache="off")
    assert len(builds) == 4


def test_a_cache_directory_that_cannot_be_made_costs_only_speed(home: Path, hf, builds: list[str],
                                                                caplog: pytest.LogCaptureFixture) -> None:
    root, _ = hf
    home.mkdir(parents=True)
    (home / "cache").write_bytes(b"a file where the cache directory should be")
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        loaded = load_model(root, quant="q8")
    _same(loaded.model, _fresh(root, "q8"))
    assert "could not cache" in caplog.text


def test_a_broken_directory_is_still_a_one_line_error(home: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(Exception, match="no config.json"):
        load_model(tmp_path / "empty")
    assert not (home / "cache").exists()


def test_no_progress_output_when_stderr_is_not_a_terminal(home: Path, hf, capsys) -> None:
    root, _ = hf
    load_model(root, quant="q8")
    load_model(root, quant="q8")
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


GGUF_FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-qwen3-moe.gguf"


def test_a_gguf_file_is_cached_and_rebuilt_when_it_changes(home: Path, tmp_path: Path, builds: list[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF file's strip-cache is cached like a directory's: the second load maps the artifact (the very
    tensors and tokenizer), a new mtime or other bytes in the header rebuild it, the off switches write none."""
    from kestrel_core.model.cache import gguf_key
    from kestrel_core.model.gguf_reader import GGUFCheckpoint

    path = tmp_path / "moe.gguf"
    path.write_bytes(GGUF_FIXTURE.read_bytes())
    first = load_model(path, quant="q8")
    assert builds == ["q8"] and len(_entries(home)) == 1
    entry = _entries(home)[0]
    assert entry.name.startswith("gguf-moe_gguf.") and read_meta(entry).extra["cache_key"] == gguf_key(path, "q8")
    second = load_model(path, quant="q8")
    assert builds == ["q8"] and second.source == str(path)
    _same(second.model, first.model)
    _same(second.model, quantize_model(GGUFCheckpoint(path), "q8"))
    assert _mapped(second.model.layers[1].experts[3].down.codes)
    assert second.tokenizer.encode("hello world") == first.tokenizer.encode("hello world")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    load_model(path, quant="q8")
    assert len(builds) == 2 and len(_entries(home)) == 1  # the slot's stale entry replaced
    data = bytearray(path.read_bytes())
    at = data.index(b"tiny-qwen3-moe")  # general.name, in the header
    data[at:at + 4] = b"TINY"
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the previous mtime: the header tells
    load_model(path, quant="q8")
    assert len(builds) == 3
    load_model(path, quant="q8", cache="off")
    monkeypatch.setenv(MODEL_CACHE_ENV, "0")
    load_model(path, quant="q4")
    assert len(builds) == 5 and len(_entries(home)) == 1


def test_the_former_cache_variable_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, hf) -> None:
    from kestrel_core.errors import KestrelError

    monkeypatch.setenv("KESTREL_HF_CACHE", "0")
    with pytest.raises(KestrelError, match="KESTREL_HF_CACHE was renamed KESTREL_MODEL_CACHE"):
        load_model(hf[0], quant="q8")


def test_a_kestrel_command_waits_for_the_entry_it_left_writing(home: Path, hf, builds: list[str],
                                                               gated_writer: threading.Event, monkeypatch,
                                                               capsys) -> None:
    """``kestrel run`` of a checkpoint whose entry is written on a thread ends once the entry is whole."""
    from kestrel_core import cli

    root, _ = hf
    waiting = loader.finish_cache_writes

    def opens_the_gate(**kwargs):  # type: ignore[no-untyped-def]
        gated_writer.set()  # the write goes on only once the command waits for it
        waiting(**kwargs)

    monkeypatch.setattr(loader, "finish_cache_writes", opens_the_gate)
    assert cli.main(["run", "hi", "--model", str(root), "--max-tokens", "2", "--backend", "cpu", "--no-chat"]) == 0
    assert len(_entries(home)) == 1 and _temps(home) == [] and not loader._writes


@pytest.mark.parametrize("folder", ["1_Pooling", "pool"])
def test_an_edited_pooling_config_rebuilds_wherever_modules_json_puts_it(home: Path, tmp_path: Path,
                                                                       folder: str) -> None:
    root = tmp_path / "embed"
    shutil.copytree(FIXTURES / "tiny-qwen3-embed", root)
    if folder != "1_Pooling":
        (root / "1_Pooling").rename(root / folder)
        modules = json.loads((root / "modules.json").read_text())
        modules = [{**m, "path": folder} if m["path"] == "1_Pooling" else m for m in modules]
        (root / "modules.json").write_text(json.dumps(modules))
    assert load_model(root).model.config.pooling == "last"
    cfg = json.loads((root / folder / "config.json").read_text())
    cfg.update({k: False for k in cfg if k.startswith("pooling_mode")}, pooling_mode_mean_tokens=True)
    (root / folder / "config.json").write_text(json.dumps(cfg))
    assert load_model(root).model.config.pooling == "mean"


def test_a_folder_named_in_any_bytes_linux_allows_is_cached(home: Path, hf, builds: list[str]) -> None:
    """A Latin-1 folder name is no UTF-8: the slot's name is hashed from the path's own bytes."""
    root, _ = hf
    latin = root.with_name(os.fsdecode(b"mod\xe8le"))
    root.rename(latin)
    load_model(latin, quant="q8")
    load_model(latin, quant="q8")
    assert len(builds) == 1 and len(_entries(home)) == 1


def test_a_fifo_or_device_among_the_key_files_does_not_hang_the_key(hf) -> None:
    """modules.json as a FIFO would block its read for ever, a link to /dev/zero read without end: the key
    counts them absent (loading the directory then says what they are)."""
    root, _ = hf
    before = hf_key(root, "q8")
    os.mkfifo(root / "modules.json")
    (root / "generation_config.json").symlink_to("/dev/zero")
    done: list[str] = []
    reader = threading.Thread(target=lambda: done.append(hf_key(root, "q8")), daemon=True)
    reader.start()
    reader.join(HANG_GUARD_S)
    assert done == [before]


def test_a_missing_tokenizer_is_named_by_the_model_not_the_cache_entry(home: Path, hf, builds: list[str]) -> None:
    root, _ = hf
    (root / "tokenizer.json").unlink()
    for _ in range(2):  # built, then a hit
        with pytest.raises(KestrelError, match="this model has no tokenizer") as info:
            load_model(root, quant="q8").tokenizer.encode("hi")
        assert str(root) in str(info.value) and "cache" not in str(info.value)
    assert len(builds) == 1


def test_the_cache_lists_its_entries_and_prunes_those_whose_model_is_gone(home: Path, hf, tmp_path: Path,
                                                                         capsys) -> None:
    """An entry records what it was built from; `kestrel cache --prune` removes it once that is gone (a Hub
    snapshot replaced by a new revision, a folder deleted), and leaves the others."""
    from kestrel_core.cli import main
    from kestrel_core.model.cache import cache_entries

    root, _ = hf
    other = shutil.copytree(root, tmp_path / "Qwen-copy")
    load_model(root, quant="q8")
    load_model(other, quant="q8")
    assert {e.sources for e in cache_entries()} == {(str(root.resolve()),), (str(other.resolve()),)}
    assert not any(e.orphaned for e in cache_entries())
    shutil.rmtree(other)
    (home / "cache" / "junk.kst").write_bytes(b"not an artifact")  # unreadable: a load would rebuild it anyway
    assert main(["cache", "--json"]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted((e["sources"], e["orphaned"]) for e in listed) == [([], True), ([str(other.resolve())], True),
                                                                      ([str(root.resolve())], False)]
    assert main(["cache", "--prune"]) == 0
    assert [e.sources for e in cache_entries()] == [(str(root.resolve()),)]
    assert main(["cache", "--clear"]) == 0 and cache_entries() == []


def _kestrel(prefix: list[str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, sys.executable, "-m", "kestrel_core.entry", *argv], capture_output=True,
                          text=True, timeout=HANG_GUARD_S)


def test_a_cache_directory_that_cannot_be_read_is_an_error_naming_it(home: Path, unprivileged: list[str]) -> None:
    """Not an empty cache: `kestrel cache` and `kestrel cache --clear` say the directory cannot be read (exit 2),
    and what it holds stays."""
    cache = home / "cache"
    cache.mkdir(parents=True)
    entry = cache / "model.0123.q8.v1.kestrel-0.kst"
    entry.write_bytes(b"an entry")
    cache.chmod(0)
    try:
        for argv in (["cache"], ["cache", "--json"], ["cache", "--clear"], ["cache", "--prune"]):
            done = _kestrel(unprivileged, *argv)
            err = done.stderr.strip()
            assert done.returncode == 2 and done.stdout == "", (argv, done.returncode, done.stdout, err)
            assert err == f"error: cannot read the model cache {cache}: permission denied", argv
    finally:
        cache.chmod(0o755)
    assert entry.read_bytes() == b"an entry"


def test_a_cache_path_that_is_not_a_directory_is_an_error_naming_it(home: Path, capsys) -> None:
    from kestrel_core.cli import main

    home.mkdir()
    (home / "cache").write_text("my notes")
    for argv in (["cache"], ["cache", "--clear"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: cannot read the model cache {home / 'cache'}: not a directory"
    assert (home / "cache").read_text() == "my notes"



def test_a_processors_chat_template_is_in_the_key_where_there_is_one(hf) -> None:
    """Where the tokenizer has no template the processor's chat_template.json gives it, so it is in the key; a
    directory without one keeps the key it had (its entries are not rebuilt)."""
    root, _ = hf
    before = hf_key(root, "q8")
    (root / "chat_template.json").write_text(json.dumps({"chat_template": "P"}))
    first = hf_key(root, "q8")
    (root / "chat_template.json").write_text(json.dumps({"chat_template": "Q"}))
    assert len({before, first, hf_key(root, "q8")}) == 3
    (root / "chat_template.json").unlink()
    assert hf_key(root, "q8") == before
