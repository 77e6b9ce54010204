"""Artifact load speed: a synthetic Qwen3-8B-shaped .kst loaded by this tree and by an older one, same run.

    git worktree add /tmp/old_load <commit>            # the code to compare against
    python benchmarks/load_speed.py --old /tmp/old_load
    python benchmarks/load_speed.py --layers 8 --runs 2 --json

Writes ``--dir``/qwen3-8b.<quant>.kst (36 layers at q8: 9.2 GB; ``--layers`` for less disk): the embedding,
lm_head and one layer are the ``qwen3-8b`` preset's seeded random strip-caches, and every layer holds the same
bytes (the file stores them once per layer, as a real one does; only the generation is shared, so it takes
1.7 GB of memory instead of 9). Each measurement is a fresh process that times ``load_model(path)`` (artifact to
Model and tokenizer, what ``kestrel_core.load(path)`` does before binding a backend) and reports its RssAnon
(the process's own memory) and RssFile (pages of the page cache it maps: shared with every other process).
Warm: the file in the page cache. Cold-ish: the file's pages dropped first (``posix_fadvise(DONTNEED)``),
then read from disk. Old and new alternate within each round. ``new, no checksums`` is
``load_artifact(path, verify=False)``: the same pass over the data checking code ranges only, so the
difference with ``new`` is what checking the checksums costs.

``--hf-layers N`` also times a Hugging Face directory (a synthetic BF16 Llama of N layers, hidden 2048, from
benchmarks/quantize_speed.py) in fresh processes with a KESTREL_HOME of its own: uncached
(``KESTREL_MODEL_CACHE=0``), the first cached load (quantize, write the entry, read it back), and cache hits.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import kestrel_core
from kestrel_core.model.loader import load_model
t1 = time.perf_counter()
path, mode = sys.argv[1], sys.argv[2]
if mode == "noverify":
    from kestrel_core.artifact_load import load_artifact
    model, _ = load_artifact(path, verify=False)
else:
    model = load_model(path).model
t2 = time.perf_counter()
assert model.layers[-1].down.codes.shape[0] > 0
status = {}
for line in open("/proc/self/status"):
    key, _, value = line.partition(":")
    if key in ("RssAnon", "RssFile", "VmHWM"):
        status[key] = int(value.split()[0]) * 1024
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "module": kestrel_core.__file__, **status}))
"""

WRITE_CHILD = r"""
import json, sys, time
from dataclasses import replace
from kestrel_core.artifact_write import save_artifact
from kestrel_core.model.presets import preset_model
from kestrel_core.model.weights import Model
path, quant, layers = sys.argv[1], sys.argv[2], int(sys.argv[3])
one = preset_model("qwen3-8b", quant, num_layers=1)
model = Model(config=replace(one.config, num_layers=layers), embedding=one.embedding, layers=one.layers * layers,
              final_norm=one.final_norm, lm_head=one.lm_head)
t0 = time.perf_counter()
save_artifact(path, model, quant=quant, force=True)
print(json.dumps({"write_s": time.perf_counter() - t0}))
"""


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def _child(code: str, args: list[str], tree: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=tree,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"child in {tree} failed: {out.stderr.strip()[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    module = result.get("module")
    if module is not None and not Path(module).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"{tree}: imported kestrel_core from {module}")
    return result


def write_artifact(path: Path, quant: str, layers: int) -> float:
    """The synthetic artifact, written with this tree's writer (layer bytes repeated; see the docstring)."""
    from kestrel_core.artifact_write import save_artifact
    from kestrel_core.model.presets import preset_model
    from kestrel_core.model.weights import Model

    one = preset_model("qwen3-8b", quant, num_layers=1)
    model = Model(config=replace(one.config, num_layers=layers), embedding=one.embedding,
                  layers=one.layers * layers, final_norm=one.final_norm, lm_head=one.lm_head)
    t0 = time.perf_counter()
    save_artifact(path, model, quant=quant, force=True)
    return time.perf_counter() - t0


HF_CHILD = r"""
import json, sys, time
from kestrel_core.model.loader import load_model
t0 = time.perf_counter()
load_model(sys.argv[1], quant=sys.argv[2])
print(json.dumps({"load_s": time.perf_counter() - t0}))
"""


def bench_hf(root: Path, layers: int, quant: str, runs: int) -> dict[str, list[float]]:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from quantize_speed import write_checkpoint

    model = root / "hf-model"
    params = write_checkpoint(model, 2048, 5632, layers, 32000, 16, 4)
    print(f"\nHugging Face directory: {params / 1e6:.0f} M params BF16, "
          f"{(model / 'model.safetensors').stat().st_size / 1e9:.2f} GB", flush=True)
    home = root / "hf-home"
    env = {**os.environ, "KESTREL_HOME": str(home)}
    out: dict[str, list[float]] = {}

    def once(name: str, **extra: str) -> None:
        res = subprocess.run([sys.executable, "-c", HF_CHILD, str(model), quant], capture_output=True, text=True,
                             env={**env, **extra}, cwd=REPO, timeout=1800)
        if res.returncode != 0:
            raise RuntimeError(res.stderr.strip()[-2000:])
        out.setdefault(name, []).append(json.loads(res.stdout.strip().splitlines()[-1])["load_s"])
        print(f"{name:28s} {out[name][-1]:6.2f} s", flush=True)

    for _ in range(runs):
        shutil.rmtree(home, ignore_errors=True)
        once("uncached", KESTREL_MODEL_CACHE="0")
        once("first load, writes the cache")
        once("cache hit")
    shutil.rmtree(root / "hf-model")
    shutil.rmtree(home, ignore_errors=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", type=Path, help="a checkout of the code to compare against (git worktree)")
    p.add_argument("--dir", type=Path, default=Path("/tmp/kestrel-load-bench"))
    p.add_argument("--layers", type=int, default=36, help="layers of the artifact (Qwen3-8B has 36)")
    p.add_argument("--quant", default="q8")
    p.add_argument("--runs", type=int, default=3, help="rounds; each runs every variant once, warm and cold")
    p.add_argument("--no-cold", action="store_true")
    p.add_argument("--write", action="store_true", help="also time each tree's writer on the same model")
    p.add_argument("--keep", action="store_true", help="keep the artifact")
    p.add_argument("--hf-layers", type=int, default=0, help="also time a Hugging Face directory of N layers")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / f"qwen3-8b.{args.quant}.kst"
    free = shutil.disk_usage(args.dir).free
    print(f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
          f"{free / 1e9:.0f} GB free in {args.dir}", flush=True)
    write_s = write_artifact(path, args.quant, args.layers)
    size = path.stat().st_size
    print(f"artifact: {path} ({args.layers} layers, {size / 1e9:.2f} GB), written by this tree in {write_s:.1f} s "
          f"({size / write_s / 1e9:.2f} GB/s, fsync included)", flush=True)

    trees: dict[str, Path] = {"new": REPO}
    if args.old is not None:
        trees = {"old": args.old, "new": REPO}
    variants = [(name, tree, "load") for name, tree in trees.items()] + [("new, no checksums", REPO, "noverify")]
    temperatures = ["warm"] + ([] if args.no_cold else ["cold"])
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in range(args.runs):
        order = variants if r % 2 == 0 else variants[::-1]
        for temperature in temperatures:
            for name, tree, mode in order:
                if temperature == "warm":
                    _warm(path)
                else:
                    _drop_from_page_cache(path)
                res = _child(CHILD, [str(path), mode], tree)
                rows.setdefault((name, temperature), []).append(res)
                print(f"round {r + 1} {temperature:4s} {name:18s} load {res['load_s']:6.2f} s  "
                      f"(imports {res['import_s']:.2f} s)  RssAnon {res['RssAnon'] / 1e9:5.2f} GB  "
                      f"RssFile {res['RssFile'] / 1e9:5.2f} GB", flush=True)

    writes: dict[str, float] = {}
    if args.write:
        for name, tree in trees.items():
            out = args.dir / f"write-{name}.kst"
            writes[name] = _child(WRITE_CHILD, [str(out), args.quant, str(args.layers)], tree)["write_s"]
            out.unlink()
            print(f"writer of {name}: {writes[name]:.1f} s", flush=True)

    print(f"\n{'variant':20s} {'page cache':10s} {'load s (median, min-max)':>26s} {'GB/s':>6s} "
          f"{'RssAnon GB':>10s} {'RssFile GB':>10s}")
    summary = []
    for (name, temperature), res in rows.items():
        loads = [x["load_s"] for x in res]
        med = statistics.median(loads)
        row = {"variant": name, "page_cache": temperature, "load_s_median": med, "load_s_min": min(loads),
               "load_s_max": max(loads), "gb_per_s": size / med / 1e9,
               "rss_anon_gb": statistics.median(x["RssAnon"] for x in res) / 1e9,
               "rss_file_gb": statistics.median(x["RssFile"] for x in res) / 1e9, "runs": loads}
        summary.append(row)
        print(f"{name:20s} {temperature:10s} {med:9.2f} ({min(loads):.2f}-{max(loads):.2f}) {row['gb_per_s']:12.2f}"
              f" {row['rss_anon_gb']:10.2f} {row['rss_file_gb']:10.2f}")
    if not args.keep:
        path.unlink()
    hf = bench_hf(args.dir, args.hf_layers, args.quant, args.runs) if args.hf_layers else {}
    if args.json:
        print(json.dumps({"layers": args.layers, "quant": args.quant, "artifact_bytes": size, "write_s": write_s,
                          "writers": writes, "rows": summary, "hf_dir": hf}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
