"""GGUF files that ask for huge work: every length is checked against the file size before gguf-py reads it.

The decisive cases run in a subprocess under RLIMIT_AS (its address space at start + 512 MiB) and a timeout, so
a reader that allocates for a claimed length (gguf-py builds a list per element: a 49-byte file claiming 2^62
elements grew to 3.7 GB and hung) fails the test instead of taking the machine down.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest

import kestrel_core
from kestrel_core.errors import KestrelError
from kestrel_core.model.gguf_bounds import MAX_ARRAY_ELEMENTS, check_gguf_bounds

from ..waits import HANG_GUARD_S

U32, STRING, ARRAY, F32 = 4, 8, 9, 6


def header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def kv_string(key: str) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode()


def huge_array_gguf() -> bytes:
    """A 49-byte file: one metadata array of uint8 claiming 2^62 elements."""
    data = header(0, 1) + kv_string("a") + struct.pack("<IIQ", ARRAY, 0, 2 ** 62)
    assert len(data) == 49
    return data


CASES = {
    "array of 2^62 uint8": huge_array_gguf(),
    "array of 2^40 strings": header(0, 1) + kv_string("a") + struct.pack("<IIQ", ARRAY, STRING, 2 ** 40),
    "string of 2^62 bytes": header(0, 1) + kv_string("a") + struct.pack("<IQ", STRING, 2 ** 62),
    "key of 2^63 bytes": header(0, 1) + struct.pack("<Q", 2 ** 63),
    "2^60 metadata entries": header(0, 2 ** 60) + kv_string("a") + struct.pack("<II", U32, 1),
    "2^60 tensors": header(2 ** 60, 0) + kv_string("t") + struct.pack("<I", 1) + struct.pack("<Q", 4),
    "tensor of 2^62 floats": header(1, 0) + kv_string("t") + struct.pack("<IQQIQ", 2, 2 ** 31, 2 ** 31, 0, 0),
    "tensor offset past the end": header(1, 0) + kv_string("t") + struct.pack("<IQIQ", 1, 4, 0, 2 ** 40),
    "nested arrays": header(0, 1) + kv_string("a") + struct.pack("<II", ARRAY, ARRAY) + struct.pack("<Q", 1)
    + struct.pack("<IQ", ARRAY, 1) + struct.pack("<IQ", ARRAY, 1) + struct.pack("<IQ", 0, 1) + b"\0",
    "unknown value type": header(0, 1) + kv_string("a") + struct.pack("<II", 99, 0),
    "unknown tensor type": header(1, 0) + kv_string("t") + struct.pack("<IQIQ", 1, 4, 250, 0),
    "five dimensions": header(1, 0) + kv_string("t") + struct.pack("<I5QIQ", 5, 1, 1, 1, 1, 1, 0, 0),
    "big-endian 2^62 array": b"GGUF" + struct.pack(">IQQ", 3, 0, 1) + struct.pack(">Q", 1) + b"a"
    + struct.pack(">IIQ", ARRAY, 0, 2 ** 62),
}


@pytest.mark.parametrize("name", list(CASES))
def test_claimed_lengths_beyond_the_file_are_one_line(tmp_path: Path, name: str) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(CASES[name])
    with pytest.raises(KestrelError) as info:
        check_gguf_bounds(path)  # in-process: the pre-pass reads lengths only (the reader runs in a subprocess below)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_element_cap(tmp_path: Path) -> None:
    n = MAX_ARRAY_ELEMENTS + 1
    path = tmp_path / "m.gguf"
    path.write_bytes(header(0, 1) + kv_string("a") + struct.pack("<IIQ", ARRAY, 0, n) + bytes(n))
    with pytest.raises(KestrelError, match="more than"):
        check_gguf_bounds(path)


def test_bad_alignment(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(header(0, 1) + kv_string("general.alignment") + struct.pack("<II", U32, 3))
    with pytest.raises(KestrelError, match="alignment"):
        check_gguf_bounds(path)


def test_real_files_pass(tmp_path: Path) -> None:
    """gguf-py's writer output passes the pre-pass, with a string array, quantized tensors and alignment 64."""
    path = tmp_path / "ok.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", ""])
    w.add_array("x.nested", [[1, 2], [3]])
    w.add_tensor("t", np.ones((2, 64), np.float32))
    q = gguf.quants.quantize(np.ones((2, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    check_gguf_bounds(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])  # the last tensor (136 bytes, padded to 192) loses its end
    with pytest.raises(KestrelError, match="tensor q needs bytes"):
        check_gguf_bounds(cut)


def three_tensor_gguf(path: Path, alignment: int = 32) -> dict[str, tuple[int, int]]:
    """gguf-py's writer output with tensors a, b (Q8_0) and c; each name -> (where its offset is in the file, the
    offset)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(alignment)
    w.add_tensor("a", np.ones((2, 64), np.float32))
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("b", gguf.quants.quantize(np.ones((3, 64), np.float32), q8), raw_dtype=q8)
    w.add_tensor("c", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fields = {}
    for t in gguf.GGUFReader(path).tensors:
        f = t.field
        fields[t.name] = (f.offset + sum(part.nbytes for part in f.parts[:-1]), int(f.parts[-1][0]))
    return fields


@pytest.mark.parametrize("alignment", [32, 64])
@pytest.mark.parametrize("case", ["overlap", "inside the one before", "gap", "out of order"])
def test_tensors_lie_in_order_without_gaps_or_overlaps(tmp_path: Path, case: str, alignment: int) -> None:
    """llama.cpp (gguf.cpp) refuses a tensor whose offset is not the padded sizes of the tensors before it
    ("tensor 'b' has offset N, expected M"): two tensors read from the same bytes, or bytes left out, are a
    corrupt file."""
    path = tmp_path / "m.gguf"
    at = three_tensor_gguf(path, alignment)
    assert at["a"][1] == 0 and at["b"][1] == alignment * -(-2 * 64 * 4 // alignment)  # as gguf-py writes them
    check_gguf_bounds(path)
    data = bytearray(path.read_bytes())
    moved = {"overlap": {"b": at["a"][1]}, "inside the one before": {"b": at["b"][1] - 32},
             "gap": {"b": at["b"][1] + alignment, "c": at["c"][1] + alignment},
             "out of order": {"b": at["c"][1], "c": at["b"][1]}}[case]
    for name, offset in moved.items():
        struct.pack_into("<Q", data, at[name][0], offset)
    path.write_bytes(data + bytes(2 * alignment))  # room for a gap: the file is long enough either way
    with pytest.raises(KestrelError, match=f"tensor b has offset {moved['b']}, expected {at['b'][1]}") as info:
        check_gguf_bounds(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_big_endian_files_are_refused(tmp_path: Path) -> None:
    """gguf-py's writer with endianess=BIG: llama.cpp refuses such a file on a little-endian host; read with
    little-endian floats, its norm of ones would be 4.6e-41 each."""
    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_block_count(1)
    w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf.GGUFReader(path).endianess == gguf.GGUFEndian.BIG  # the reference reads it as big-endian
    with pytest.raises(KestrelError, match="big-endian GGUF file") as info:
        check_gguf_bounds(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_default_model_passes() -> None:
    from kestrel_core.model.pull import default_model_path

    path = default_model_path()
    if not path.is_file():
        pytest.skip("the default model is not pulled")
    check_gguf_bounds(path)


def same_kestrel_env() -> dict[str, str]:
    """The environment for a child that imports the kestrel_core this test imported (not another install)."""
    root = str(Path(kestrel_core.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


BOUNDED = textwrap.dedent("""
    import resource, sys
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    from kestrel_core.errors import KestrelError
    from kestrel_core.model import gguf_reader
    from kestrel_core.model.gguf_reader import GGUFCheckpoint
    built = []
    reader = gguf_reader.GGUFReader
    gguf_reader.GGUFReader = lambda *args, **kwargs: built.append(1) or reader(*args, **kwargs)
    resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20),) * 2)
    for path in sys.argv[1:]:
        built.clear()
        try:
            GGUFCheckpoint(path)
            result = "loaded"
        except KestrelError as exc:
            result = "KestrelError: " + str(exc)
        except BaseException as exc:
            result = type(exc).__name__
        print("read" if built else "unread", " ".join(result.split()), flush=True)
""")


def test_the_hostile_files_stay_bounded(tmp_path: Path) -> None:
    """GGUFCheckpoint on every case, in a subprocess with 512 MiB of headroom: each is refused before gguf-py's
    reader is built (without the pre-pass the 49-byte file is a MemoryError, or, without the limit, 3.7 GB and a
    hang; the reader's work for a claimed length is what a bound on time would have caught)."""
    paths = []
    for i, data in enumerate(CASES.values()):
        paths.append(tmp_path / f"case{i}.gguf")
        paths[-1].write_bytes(data)
    r = subprocess.run([sys.executable, "-c", BOUNDED, *map(str, paths)], capture_output=True, text=True,
                       timeout=HANG_GUARD_S, env=same_kestrel_env())
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == len(CASES), r.stdout + r.stderr[-2000:]
    for name, line in zip(CASES, lines):
        reader, result = line.split(" ", 1)
        assert result.startswith("KestrelError: ") and "MemoryError" not in result, (name, line)
        assert "SystemError" not in result, (name, line)  # what numpy says when the limit hits it
        assert reader == "unread", (name, line)


def test_names_with_control_bytes_stay_one_line(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(header(0, 1) + kv_string("lla\nma\x01") + struct.pack("<II", 77, 0))
    with pytest.raises(KestrelError) as info:
        check_gguf_bounds(path)
    assert "\n" not in str(info.value) and "unknown value type 77" in str(info.value)


def _fuzz_harness():  # scripts/fuzz.py's seed writer: a small valid llama GGUF with metadata overrides
    import importlib.util

    spec = importlib.util.spec_from_file_location("kestrel_fuzz", Path(__file__).resolve().parents[3] / "scripts"
                                                  / "fuzz.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("key, kind, value, match", [
    ("llama.block_count", "bool", True, "block_count must be an integer"),
    ("llama.block_count", "string", "3", "block_count must be an integer"),
    ("llama.block_count", "float32", 3.5, "block_count must be an integer"),
    ("llama.block_count", "uint32", 0, r"block_count must be an integer in \[1, 4096\], got 0"),
    ("llama.block_count", "uint64", 10**10, r"block_count must be an integer in \[1, 4096\]"),  # before any list
    ("llama.attention.head_count", "int32", -1, r"head_count must be an integer in \[1, 16384\]"),
    ("llama.context_length", "uint64", 2**40, r"context_length must be an integer in \[1, 67108864\]"),
    ("llama.attention.layer_norm_rms_epsilon", "float32", float("nan"), "must be finite"),
    ("llama.attention.layer_norm_rms_epsilon", "float32", -1e-5, "must be > 0"),
    ("llama.rope.freq_base", "float32", 0.0, "must be > 0"),
    ("llama.rope.freq_base", "string", "1e4", "freq_base must be a number"),
    ("llama.attention.head_count_kv", "uint32", 3, "multiple of num_kv_heads"),
    ("tokenizer.ggml.tokens", "array", [1, 2], "must be an array of strings"),
    ("tokenizer.ggml.merges", "array", ["a zz"], "outside the vocabulary"),
    ("tokenizer.ggml.token_type", "array", [1, 1], "one integer per token"),
])
def test_gguf_metadata_types_and_ranges(tmp_path: Path, key: str, kind: str, value: object, match: str) -> None:
    h = _fuzz_harness()
    path = tmp_path / "m.gguf"
    path.write_bytes(h.gguf_bytes(tmp_path, {key: (kind, value)}))
    with pytest.raises(KestrelError, match=match) as info:
        h.check_gguf_file(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_the_valid_seed_loads(tmp_path: Path) -> None:
    h = _fuzz_harness()
    path = tmp_path / "ok.gguf"
    path.write_bytes(h.gguf_bytes(tmp_path))
    h.check_gguf_file(path)  # config, tokenizer, every tensor, the chat template
