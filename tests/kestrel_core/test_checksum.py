"""XXH64 as the artifact checksum: xxHash's published values, chunked streams, unaligned buffers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kestrel_core import checksum
from kestrel_core.artifact import read_meta
from kestrel_core.artifact_load import load_artifact
from kestrel_core.artifact_write import save_artifact
from kestrel_core.checksum import XXH64, xxh64
from kestrel_core.model.quantize import quantize_model

# XXH64 with seed 0, as xxHash (and the xxhash package) computes it
KNOWN = {b"": 0xEF46DB3751D8E999, b"a": 0xD24EC4F1A98C6E5B, b"abc": 0x44BC2CF5AD770999,
         b"message digest": 0x066ED728FCEEB3BE, b"abcdefghijklmnopqrstuvwxyz": 0xCFE1F278FA89835C,
         b"Nobody inspects the spammish repetition": 0xFBCEA83C8A378BF1, b"1234567890" * 8: 0xE04A477F19EE145D}


@pytest.mark.parametrize("data", list(KNOWN))
def test_published_values(data: bytes) -> None:
    assert xxh64(data) == KNOWN[data]
    assert XXH64().hexdigest() == "ef46db3751d8e999"


def test_compiled_equals_the_definition_on_any_length_chunking_and_alignment() -> None:
    assert checksum.fast()
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=3000, dtype=np.uint8)

    def reference(buf: np.ndarray) -> int:
        h = XXH64()
        h.kernel = checksum._py_stripes
        h.update(buf)
        return h.intdigest()

    for n in [*range(0, 130), 1000, 2999]:
        want = reference(data[:n])
        assert xxh64(data[:n]) == want, n
        h, i = XXH64(), 0
        while i < n:  # odd chunk sizes carry partial stripes from update to update
            k = int(rng.integers(1, 80))
            h.update(data[i:min(n, i + k)])
            i += k
        assert h.intdigest() == want, n
    for offset in range(8):  # an int8 tensor in a mapped file starts at any byte
        assert xxh64(data[offset:]) == reference(data[offset:])
    floats = rng.standard_normal(100).astype(np.float32)
    assert xxh64(floats) == xxh64(floats.tobytes())


def test_the_xxhash_package_agrees() -> None:
    xxhash = pytest.importorskip("xxhash")
    data = np.random.default_rng(1).integers(0, 256, size=1 << 20, dtype=np.uint8)
    assert xxh64(data) == xxhash.xxh64(data.tobytes()).intdigest()


def test_without_compiled_hashing_artifacts_carry_and_need_no_checksums(tmp_path: Path, synth_source,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    model = quantize_model(synth_source("llama"), "q8")
    with_sums = save_artifact(tmp_path / "a.kst", model, quant="q8")
    monkeypatch.setitem(checksum._COMPILED, "stripes", None)  # as where numba is unusable
    assert not checksum.fast()
    without = save_artifact(tmp_path / "b.kst", model, quant="q8")
    assert read_meta(without).checksums is None and read_meta(with_sums).checksums
    for path in (with_sums, without):
        loaded, _ = load_artifact(path, require_checksums=True)  # nothing to verify them with
        np.testing.assert_array_equal(loaded.layers[1].down.codes, model.layers[1].down.codes)
