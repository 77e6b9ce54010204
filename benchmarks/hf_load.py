"""Time to the first token from a Hugging Face BF16 checkpoint: uncached, building the cache, a cache hit.

    python benchmarks/hf_load.py --dir /tmp/hf8b --backend cuda          # Llama-3-8B shapes, 16 GB of BF16
    python benchmarks/hf_load.py --dir /tmp/hf --layers 2 --backend cpu  # a small smoke run

Writes a synthetic BF16 Llama directory (``quantize_speed.write_checkpoint``, tied embeddings), then times
``kestrel_core.load(dir, backend=B)`` plus one generated token in fresh processes: with the artifact cache off
(``KESTREL_MODEL_CACHE=0``: read and quantize every tensor), the first cached load (quantize, write the entry,
read it back) and a cache hit. Each child reports the load, the first token and its peak resident memory
(VmHWM: ru_maxrss would carry over the parent's peak across the exec), and the parent the child's whole run
(a cache entry written on a thread ends before the process does). ``--reuse`` keeps a checkpoint already in
``--dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quantize_speed import write_checkpoint  # the synthetic BF16 Llama directory (benchmarks/ is on sys.path)

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import kestrel_core
engine = kestrel_core.load(sys.argv[1], backend=sys.argv[2])
t1 = time.perf_counter()
token = list(engine.generate([1, 2, 3, 4], max_tokens=1, stop_at_eos=False))
t2 = time.perf_counter()
hwm_kb = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
print(json.dumps({"load_s": t1 - t0, "first_token_s": t2 - t0, "backend": engine.backend_name,
                  "peak_rss_gb": hwm_kb * 1024 / 1e9}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "kestrel-hf-load")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--reuse", action="store_true", help="keep the checkpoint a previous run wrote in --dir")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.reuse and (args.dir / "model" / "model.safetensors").is_file():
        params = int(json.loads((args.dir / "params.json").read_text()))
    else:
        params = write_checkpoint(args.dir / "model", args.hidden, args.intermediate, args.layers, args.vocab, 32, 8)
        (args.dir / "params.json").write_text(json.dumps(params))
        print(f"wrote {params / 1e9:.2f} B parameters of BF16 in {time.perf_counter() - t0:.1f} s", flush=True)
    home = args.dir / "home"
    shutil.rmtree(home, ignore_errors=True)  # the first cached load writes its entry anew
    out: dict[str, object] = {"params": params, "backend": args.backend}
    for label, env in (("uncached", {"KESTREL_MODEL_CACHE": "0"}), ("first cached", {}), ("cache hit", {})):
        run_env = {**os.environ, "KESTREL_HOME": str(home), **env}
        t1 = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", CHILD, str(args.dir / "model"), args.backend],
                              capture_output=True, text=True, env=run_env)
        if done.returncode:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
        fig = json.loads(done.stdout.strip().splitlines()[-1])
        fig["process_s"] = time.perf_counter() - t1
        out[label] = fig
        print(f"{label:>13}: load {fig['load_s']:.1f} s, first token at {fig['first_token_s']:.1f} s "
              f"({fig['backend']}), process {fig['process_s']:.1f} s, peak RSS {fig['peak_rss_gb']:.1f} GB",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
