"""The .kst reader maps the file (no copies), checks every offset against the file, and verifies checksums."""

from __future__ import annotations

import json
import mmap
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from kestrel_core import artifact_load
from kestrel_core.artifact import model_tensors, read_meta
from kestrel_core.artifact_load import load_artifact
from kestrel_core.artifact_write import save_artifact
from kestrel_core.cli import main
from kestrel_core.contract import StripCache
from kestrel_core.errors import ContractError, KestrelError
from kestrel_core.model.loader import load_model
from kestrel_core.model.quantize import quantize_model

from .waits import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]


def _save(tmp_path: Path, synth_source, arch: str = "qwen2", mode: str = "q8", name: str = "m.kst") -> Path:
    return save_artifact(tmp_path / name, quantize_model(synth_source(arch, seed=7), mode), quant=mode)


def _header(path: Path) -> tuple[int, dict]:
    """(data start, header) as a safetensors file has them."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def _write_raw(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _mapped_by(a: np.ndarray) -> object:
    """What the ``.base`` chain of ``a`` ends in (a memoryview's exporter, for np.frombuffer views)."""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a.obj if isinstance(a, memoryview) else a


def _error(path: Path, **kw) -> str:
    with pytest.raises(KestrelError) as exc:
        load_artifact(path, **kw)
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_tensors_are_views_of_one_map_equal_to_what_safetensors_reads(tmp_path: Path, synth_source) -> None:
    path = _save(tmp_path, synth_source)
    model, meta = load_artifact(path)
    reference = load_file(str(path))  # what the reader before the map returned: copies, via safetensors
    maps = set()
    for name, value in model_tensors(model).items():
        arrays = {f"{name}.codes": value.codes, f"{name}.scales": value.scales} if isinstance(value, StripCache) \
            else {name: value}
        for key, arr in arrays.items():
            np.testing.assert_array_equal(arr, reference[key])
            assert arr.dtype == reference[key].dtype and arr.flags.c_contiguous
            owner = _mapped_by(arr)
            assert isinstance(owner, mmap.mmap), f"{key} is not a view of the file's map"
            maps.add(id(owner))
            assert np.shares_memory(arr, np.frombuffer(owner, np.uint8))
    assert len(maps) == 1  # one map for the whole file
    assert meta.checksums is not None and set(meta.checksums) == set(reference)


def test_a_write_into_a_loaded_weight_stays_in_this_process(tmp_path: Path, synth_source) -> None:
    """The map is copy-on-write: the page is copied for the writer; the file and other loads are untouched."""
    path = _save(tmp_path, synth_source)
    before = path.read_bytes()
    model, _ = load_artifact(path)
    original = int(model.layers[0].q.codes[0, 0])
    model.layers[0].q.codes[0, 0] = 5 if original != 5 else 6
    assert path.read_bytes() == before
    again, _ = load_artifact(path)  # checksums still match: the file never saw the write
    assert int(again.layers[0].q.codes[0, 0]) == original


def test_files_written_here_read_with_the_safetensors_library(tmp_path: Path, synth_source) -> None:
    """The format is still plain safetensors: other tools (and older kestrels) read it."""
    path = _save(tmp_path, synth_source, mode="q4-g256")
    model, _ = load_artifact(path)
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata()["format"] == "kestrel-strip-cache"
        np.testing.assert_array_equal(f.get_tensor("layers.1.down.codes"), model.layers[1].down.codes)
        np.testing.assert_array_equal(f.get_tensor("final_norm"), model.final_norm)


def test_an_artifact_without_checksums_loads_unless_they_are_required(tmp_path: Path, synth_source) -> None:
    """Artifacts written before checksums (by safetensors' own writer) still load, unverified."""
    path = _save(tmp_path, synth_source)
    with safe_open(str(path), framework="numpy") as f:
        meta = {k: v for k, v in f.metadata().items() if k not in ("checksums", "integrity")}
    tensors = load_file(str(path))
    old = tmp_path / "old.kst"
    save_file(tensors, str(old), metadata=meta)
    model, loaded_meta = load_artifact(old)
    assert loaded_meta.checksums is None
    np.testing.assert_array_equal(model.layers[1].v.codes, tensors["layers.1.v.codes"])
    assert "carries no checksums" in _error(old, require_checksums=True)
    save_file(tensors, str(old), metadata={**meta, "integrity": "xxh64"})  # says it has them: its entry is lost
    assert "the header is corrupt: its 'integrity' entry says it carries checksums, but it has no checksums" \
        in _error(old)
    load_artifact(old, verify=False)  # the escape for a post-mortem
    save_file(tensors, str(old), metadata={**meta, "checksums": json.dumps({"algorithm": "md5", "tensors": {}})})
    assert "checksums use 'md5'" in _error(old)


def _flip_in_header(path: Path, needle: bytes, mask: int = 0x01) -> None:
    """Flip ``mask`` in the last byte of ``needle`` (found once in the header), in place: the JSON stays valid."""
    start, _ = _header(path)
    data = bytearray(path.read_bytes())
    at = data.index(needle, 0, start)
    assert data.find(needle, at + 1, start) == -1
    data[at + len(needle) - 1] ^= mask
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("needle,mask", [(b'rope_theta\\": 1', 0x02), (b'"eos_token":"</', 0x01),
                                         (b"<{{ m['ro", 0x01), (b"\\u0120wor", 0x01)])
def test_a_flipped_bit_in_the_metadata_is_refused_by_path(tmp_path: Path, synth_source, needle: bytes, mask: int,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A config value, the special tokens, the chat template, the tokenizer's vocabulary: one flipped bit in the
    header's metadata changes every answer without touching a tensor, so the metadata has an XXH64 too."""
    import xxhash

    path = save_artifact(tmp_path / "m.kst", quantize_model(synth_source("llama", seed=7), "q8"), quant="q8",
                         tokenizer_json=json.dumps({"model": {"vocab": {"\u0120world": 5}}}), eos_token="</s>",
                         chat_template="{% for m in messages %}<{{ m['role'] }}>{% endfor %}")
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
    load_artifact(path)
    _flip_in_header(path, needle, mask)
    msg = _error(path)
    assert "the metadata is corrupt: its XXH64 is" in msg and "re-create or re-download" in msg
    capsys.readouterr()
    assert main(["run", "--model", str(path), "--backend", "cpu", "--no-chat", "-n", "1", "hi"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {msg}"  # one line, no traceback
    load_artifact(path, verify=False)  # the escape for a post-mortem
    rest = json.dumps({k: v for k, v in meta.items() if k != "checksums"}, sort_keys=True, separators=(",", ":"))
    assert json.loads(meta["checksums"])["metadata"] == xxhash.xxh64(rest.encode()).hexdigest()  # as documented


@pytest.mark.parametrize("key", [b'"checksums"', b'\\"metadata\\"', b'"integrity"'])
def test_no_flipped_bit_in_a_checksum_key_passes_the_file_off_as_one_without_checksums(tmp_path: Path, synth_source,
                                                                                       key: bytes) -> None:
    """The name of the checksums entry, of the metadata's checksum in it, and of the entry that says the file
    carries both: each bit of each flipped in turn, every file is refused (loaded unverified, a corrupt tensor
    or config would pass)."""
    path = _save(tmp_path, synth_source)
    clean = path.read_bytes()
    start, _ = _header(path)
    at = clean.index(key, 0, start)
    assert clean.find(key, at + 1, start) == -1
    first = at + key.index(b'"') + 1
    for i in range(first, at + len(key) - key[::-1].index(b'"') - 1):
        for bit in range(8):
            data = bytearray(clean)
            data[i] ^= 1 << bit
            path.write_bytes(bytes(data))
            try:
                _error(path)
            except pytest.fail.Exception:
                pytest.fail(f"bit {bit} of byte {i - first} of {key!r} flipped: the file loaded")


def test_flipped_bits_in_the_names_of_both_checksum_entries_do_not_pass_the_file_off_as_unchecked(
        tmp_path: Path, synth_source) -> None:
    """One flipped bit in the name of the checksums entry and one in the name of the entry that says the file
    carries them: the header reads as one written without checksums, and a corrupt tensor would load. Each bit
    of each byte, in both names at once: every file is refused."""
    path = _save(tmp_path, synth_source)
    start, header = _header(path)
    lo, _ = header["final_norm"]["data_offsets"]
    corrupt = bytearray(path.read_bytes())
    corrupt[start + lo] ^= 0x04  # a float the range check passes: only its checksum tells
    names = [corrupt.index(key, 0, start) + 1 for key in (b'"checksums"', b'"integrity"')]
    for i in range(len("checksums")):
        for bit in range(8):
            data = bytearray(corrupt)
            for at in names:
                data[at + i] ^= 1 << bit
            path.write_bytes(bytes(data))
            try:
                _error(path)
            except pytest.fail.Exception:
                pytest.fail(f"bit {bit} of byte {i} of both names flipped: the file loaded")
    data = bytearray(corrupt)
    for at in names:
        data[at] ^= 0x02  # "ahecksums", "kntegrity"
    path.write_bytes(bytes(data))
    assert "entry 'kntegrity' holds the value of 'integrity'" in _error(path)
    load_artifact(path, verify=False)  # the escape for a post-mortem


def test_an_artifact_without_a_metadata_checksum_loads_unless_it_is_required(tmp_path: Path, synth_source) -> None:
    """What a kestrel that recorded tensor checksums only wrote: given by path it loads (its tensors verified);
    a cache entry requires both."""
    path = _save(tmp_path, synth_source)
    with safe_open(str(path), framework="numpy") as f:
        meta = dict(f.metadata())
    sums = json.loads(meta.pop("checksums"))
    del sums["metadata"]
    meta.pop("integrity")
    old = tmp_path / "old.kst"
    save_file(load_file(str(path)), str(old), metadata={**meta, "checksums": json.dumps(sums)})
    _, loaded_meta = load_artifact(old)
    assert loaded_meta.metadata_checksum is None and loaded_meta.checksums
    assert "carries no checksum of its metadata" in _error(old, require_checksums=True)
    save_file(load_file(str(path)), str(old), metadata={**meta, "checksums": json.dumps(sums), "integrity": "xxh64"})
    assert "says it carries checksums, but it has no checksum of its metadata" in _error(old)


@pytest.mark.parametrize("tensor", ["layers.1.gate.codes", "layers.0.k.scales", "final_norm", "embedding.codes"])
def test_a_flipped_bit_is_a_checksum_error_naming_the_tensor(tmp_path: Path, synth_source, tensor: str) -> None:
    path = _save(tmp_path, synth_source)
    start, header = _header(path)
    lo, hi = header[tensor]["data_offsets"]
    data = bytearray(path.read_bytes())
    data[start + (lo + hi) // 2] ^= 0x04
    path.write_bytes(bytes(data))
    msg = _error(path)
    assert f"tensor {tensor!r} is corrupt: its XXH64" in msg
    model, _ = load_artifact(path, verify=False)  # the escape for a post-mortem: no checksums compared
    assert model.config.num_layers == 2


def test_the_threaded_pass_finds_corruption_too(tmp_path: Path, synth_source, monkeypatch) -> None:
    monkeypatch.setattr(artifact_load, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(artifact_load, "CHUNK_BYTES", 1024)  # several chunks per tensor
    path = _save(tmp_path, synth_source)
    load_artifact(path)
    start, header = _header(path)
    lo, _ = header["layers.1.up.codes"]["data_offsets"]
    data = bytearray(path.read_bytes())
    data[start + lo + 3000] ^= 0x80
    path.write_bytes(bytes(data))
    assert "tensor 'layers.1.up.codes' is corrupt" in _error(path)


def test_progress_reaches_the_total(tmp_path: Path, synth_source) -> None:
    path = tmp_path / "m.kst"
    seen: list[tuple[int, int]] = []
    save_artifact(path, quantize_model(synth_source("llama"), "q8"), quant="q8",
                  progress=lambda d, t: seen.append((d, t)))
    assert seen and seen[-1][0] == seen[-1][1] == path.stat().st_size - _header(path)[0]
    seen.clear()
    load_artifact(path, progress=lambda d, t: seen.append((d, t)))
    assert seen and seen[-1][0] == seen[-1][1] > 0


def test_truncation_by_one_byte_or_a_grown_file(tmp_path: Path, synth_source) -> None:
    path = _save(tmp_path, synth_source)
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    assert "truncated or corrupt" in _error(path)
    path.write_bytes(data + b"\0")
    assert "truncated or corrupt" in _error(path)


def test_a_header_that_lies_is_refused_without_allocating(tmp_path: Path, synth_source,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every offset and length is checked against the file's size before anything is read or mapped: nothing past
    the header is read, nothing mapped, and the most allocated meanwhile is less than the tensors' data."""
    path = _save(tmp_path, synth_source, arch="llama")
    start, header = _header(path)
    data = path.read_bytes()[start:]
    bad = tmp_path / "bad.kst"
    huge = 1 << 50
    pread, real_mmap = os.pread, mmap.mmap
    reads: list[tuple[int, int]] = []
    maps: list[object] = []
    monkeypatch.setattr(os, "pread", lambda fd, n, at: reads.append((at, n)) or pread(fd, n, at))
    monkeypatch.setattr(mmap, "mmap", lambda *args, **kwargs: maps.append(args) or real_mmap(*args, **kwargs))

    def lie(name: str, **entry: object) -> str:
        h = json.loads(json.dumps(header))
        h[name].update(entry)
        _write_raw(bad, h, data)
        reads.clear()
        tracemalloc.start()
        try:
            msg = _error(bad)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        data_start = 8 + len(json.dumps(h).encode())
        assert reads and all(at + n <= data_start for at, n in reads), (reads, data_start)
        assert not maps and peak < len(data), peak
        return msg

    assert "spans bytes" in lie("layers.0.q.codes", data_offsets=[0, huge], shape=[huge])
    assert "has 4096 bytes for I8" in lie("layers.0.q.codes", shape=[huge, huge])
    assert "bad data_offsets" in lie("layers.0.q.codes", data_offsets=[-8, 0])
    assert "bad data_offsets" in lie("layers.0.q.codes", data_offsets=[0])
    assert "bad shape" in lie("layers.0.q.codes", shape=[64, True])
    assert "bad shape" in lie("layers.0.q.codes", shape="64x64")
    assert "unknown dtype" in lie("layers.0.q.codes", dtype="I4")
    lo, _ = header["layers.0.k.codes"]["data_offsets"]
    qlo, qhi = header["layers.0.q.codes"]["data_offsets"]
    assert "expected" in lie("layers.0.q.codes", data_offsets=[lo, lo + qhi - qlo])  # overlaps k, leaves a gap
    # the header's own length
    for n in (huge, len(data) + 10**6, 1 << 63):
        bad.write_bytes(struct.pack("<Q", n) + b"{}" + data[:100])
        assert "header claims" in _error(bad)
    text = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}'
    bad.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 4)
    assert "duplicate keys" in _error(bad)
    for text in (b"[1, 2]", b"\xff\xfe", b'{"__metadata__": {"format": 1}}'):
        bad.write_bytes(struct.pack("<Q", len(text)) + text)
        assert "truncated or corrupt" in _error(bad)


def test_a_fifo_or_a_directory_is_not_an_artifact(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.kst"
    os.mkfifo(fifo)
    assert "not a regular file" in _error(fifo)  # and did not block opening it
    (tmp_path / "dir.kst").mkdir()
    assert "not a regular file" in _error(tmp_path / "dir.kst")
    with pytest.raises(KestrelError, match="not a regular file"):
        read_meta(fifo)
    with pytest.raises(KestrelError, match="is a FIFO"):
        load_model(fifo)


def test_strip_cache_can_skip_its_range_scan() -> None:
    codes = np.full((4, 32), -128, np.int8)
    with pytest.raises(ContractError, match=r"int8 codes must lie in \[-127, 127\]"):
        StripCache(codes, np.ones((4, 1), np.float32), 32, 8)
    assert StripCache(codes, np.ones((4, 1), np.float32), 32, 8, check_range=False).n == 4
    with pytest.raises(ContractError, match="C-contiguous"):  # the O(1) checks still run
        StripCache(np.zeros((4, 64), np.int8)[:, ::2], np.ones((4, 1), np.float32), 32, 8, check_range=False)


def test_stale_temp_files_go_on_the_next_write(tmp_path: Path, synth_source) -> None:
    model = quantize_model(synth_source("llama"), "q8")
    old, fresh, other = (tmp_path / name for name in (".m.kst.abc12345.tmp", ".m.kst.def12345.tmp",
                                                      ".n.kst.ghi12345.tmp"))  # mkstemp's names
    for p in (old, fresh, other):
        p.write_bytes(b"partial")
    hour_ago = time.time() - 2 * 3600
    os.utime(old, (hour_ago, hour_ago))
    os.utime(other, (hour_ago, hour_ago))
    save_artifact(tmp_path / "m.kst", model, quant="q8")
    assert not old.exists() and fresh.exists()  # a live writer's temp is left alone
    assert other.exists()  # another destination's temp is not this write's business


SLOW_WRITE = """
import os, sys, time
from kestrel_core import artifact_write

def slow(f, *args, **kwargs):
    f.write(b"partial data")
    f.flush()
    print("writing", flush=True)
    while True:
        time.sleep(0.01)

artifact_write._write_safetensors = slow
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])  # SIGHUP: the terminal was closed
def test_an_ending_signal_while_writing_leaves_nothing(tmp_path: Path, sig: signal.Signals) -> None:
    """These kill without running finally blocks; the writer's handler removes its temp first."""
    code = SLOW_WRITE + textwrap.dedent(f"""
        from kestrel_core.model.presets import preset_model
        model = preset_model("smollm2-135m", num_layers=1, vocab_size=512)
        artifact_write.save_artifact({str(tmp_path / "m.kst")!r}, model, quant="q8")
    """)
    _killed_while_writing(code, tmp_path, tmp_path, sig)
    assert list(tmp_path.iterdir()) == []


def test_sigterm_while_a_cache_entry_is_written_on_a_thread_leaves_no_temp(tmp_path: Path) -> None:
    """A large entry is written on a thread (which cannot install a handler) while the load goes on."""
    code = SLOW_WRITE + textwrap.dedent(f"""
        from kestrel_core.model import loader
        loader.BACKGROUND_WRITE_BYTES = 0
        os.environ.update(KESTREL_HOME={str(tmp_path / "home")!r}, KESTREL_MODEL_CACHE="1")
        loader.load_model({str(REPO / "tests" / "fixtures" / "models" / "tiny-llama")!r}, quant="q8")
        time.sleep(60)
    """)
    cache = tmp_path / "home" / "cache"
    _killed_while_writing(code, tmp_path, cache, signal.SIGTERM)
    assert [p.name for p in cache.iterdir()] == []


def _killed_while_writing(code: str, cwd: Path, directory: Path, sig: signal.Signals) -> None:
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        assert any(p.name.endswith(".writing") for p in directory.iterdir())
        proc.send_signal(sig)
        assert proc.wait(timeout=HANG_GUARD_S) == -sig  # still killed by the signal, as without the handler
    finally:
        proc.kill()
