"""The quantize command, in process: what it writes, what it refuses before loading, and what it never overwrites."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

from kestrel_core import artifact_write
from kestrel_core.cli import main

from ..waits import HANG_GUARD_S

TINY_LLAMA = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-llama"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_quantize_refuses_to_overwrite(capsys, tmp_path) -> None:
    target = tmp_path / "model.kst"
    target.write_bytes(b"precious")
    code, _, err = _run(capsys, "quantize", str(tmp_path / "missing"), "-o", str(target))
    assert code == 2 and "--force" in err and target.read_bytes() == b"precious"


def test_quantize_refuses_an_output_it_cannot_write_before_loading(capsys, tmp_path) -> None:
    """A missing directory, or a file where the directory should be, is said before the model is read: the
    model here does not exist, so the load never started."""
    (tmp_path / "notes.txt").write_text("x")
    for out, says in ((tmp_path / "nowhere" / "x.kst", f"directory {tmp_path / 'nowhere'} does not exist"),
                      (tmp_path / "notes.txt" / "x.kst", f"{tmp_path / 'notes.txt'} is not a directory")):
        code, _, err = _run(capsys, "quantize", str(tmp_path / "missing"), "-o", str(out))
        assert code == 2 and err.strip() == f"error: cannot write {out}: {says}", err


def test_quantize_refuses_a_directory_it_may_not_write_in_before_loading(tmp_path, unprivileged) -> None:

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    done = subprocess.run([*unprivileged, sys.executable, "-m", "kestrel_core.entry", "quantize",
                           str(tmp_path / "missing"), "-o", str(locked / "x.kst")], capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: cannot write {locked / 'x.kst'}: no permission to write in {locked}"


def test_quantize_writes_only_what_loads_and_never_into_the_model(capsys, tmp_path) -> None:
    """An output named otherwise than ``.kst`` would not load as an artifact; one inside the model's directory
    (with --force) would overwrite the checkpoint being read."""

    model = tmp_path / "model"
    shutil.copytree(TINY_LLAMA, model)
    before = {f.name: f.read_bytes() for f in model.iterdir()}
    for out, says in ((tmp_path / "noext", "ends in .kst"), (tmp_path / "out.gguf", "ends in .kst"),
                      (model / "model.kst", "or inside it")):
        code, _, err = _run(capsys, "quantize", str(model), "-o", str(out), "--force")
        assert code == 2 and says in err and not out.exists(), err
    assert {f.name: f.read_bytes() for f in model.iterdir()} == before


def test_quantize_then_run_the_artifact_gives_the_checkpoints_tokens(capsys, tmp_path) -> None:
    artifact = tmp_path / "tiny.kst"
    code, _, err = _run(capsys, "quantize", str(TINY_LLAMA), "-o", str(artifact), "--quant", "q4")
    assert code == 0 and artifact.is_file() and "wrote" in err
    runs = []
    for model in (str(artifact), str(TINY_LLAMA)):
        code, out, _ = _run(capsys, "run", "hello there", "--model", model, "--quant", "q4", "--no-chat",
                            "--json", "-n", "8", "--backend", "cpu")
        assert code == 0
        runs.append(json.loads(out))
    assert runs[0]["tokens"] == runs[1]["tokens"] and len(runs[0]["tokens"]) > 0
    assert runs[0]["prompt_tokens"] == runs[1]["prompt_tokens"] > 0
    code, _, err = _run(capsys, "quantize", str(TINY_LLAMA), "-o", str(artifact), "--force")
    assert code == 0


def test_a_quantize_that_cannot_write_names_its_output_and_keeps_the_old_file(tmp_path: Path, monkeypatch,
                                                                              capsys) -> None:
    """A full disk while the artifact is written: one line naming the output, and the file --force would have
    replaced is as it was, with no temp file left beside it."""

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(artifact_write, "_write_safetensors", full)
    model = TINY_LLAMA.with_name("tiny-qwen3")
    old = tmp_path / "old.kst"
    old.write_text("the user's")
    assert main(["quantize", str(model), "-o", str(old), "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: cannot write {old}: no space left on device", err
    assert old.read_text() == "the user's" and sorted(tmp_path.iterdir()) == [old]


def test_an_artifact_is_not_re_quantized(capsys, tmp_path) -> None:
    """Another --quant of an artifact is an error naming the way (its source model), not a copy at its own quant
    under a name that says otherwise; its own quant copies it."""
    artifact, copy = tmp_path / "tiny.q4.kst", tmp_path / "tiny.q8.kst"
    assert _run(capsys, "quantize", str(TINY_LLAMA), "-o", str(artifact), "--quant", "q4")[0] == 0
    code, _, err = _run(capsys, "quantize", str(artifact), "-o", str(copy), "--quant", "q8")
    assert code == 2 and not copy.exists()
    assert err.strip() == (f"error: {artifact} holds q4 weights and an artifact is not re-quantized: quantize the "
                           "model it was built from with --quant q8")
    assert _run(capsys, "quantize", str(artifact), "-o", str(copy), "--quant", "q4")[0] == 0 and copy.is_file()
