"""llama.cpp (llama-cpp-python) versus kestrel's CPU backend on the same GGUF, in one run, side by side.

    pip install llama-cpp-python          # compiles llama.cpp for this machine
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/llamacpp_compare.py [GGUF]

GGUF defaults to the default model (SmolLM2-135M-Instruct Q4_1, fetched by ``kestrel pull``). llama.cpp runs
the file as it is (Q4_1, ``n_threads=2``); kestrel loads it with ``kestrel_core.load(path, backend="cpu",
quant=...)`` (dequantized, re-quantized to the strip-cache, q8 by default). Both see the same random
256-token prompts (a new one each run) and decode 64 tokens greedily; as in ``kestrel bench``, prefill time
includes the first token's logits and argmax, and each decode step is one forward plus argmax. The two engines
alternate run by run (warm-up first, a pause between runs), so load from other processes hits both alike; the
table shows medians, the best run of each and every run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ENV_KNOBS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
             "NUMBA_NUM_THREADS", "NUMBA_THREADING_LAYER")


@dataclass
class Runs:
    name: str
    detail: str = ""
    prefill: list[float] = field(default_factory=list)  # tok/s per run
    decode: list[float] = field(default_factory=list)

    @property
    def prefill_median(self) -> float:
        return statistics.median(self.prefill)

    @property
    def decode_median(self) -> float:
        return statistics.median(self.decode)


class LlamaCpp:
    def __init__(self, path: str, threads: int, context: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=context,
                         n_batch=512, verbose=False)
        self.detail = f"llama-cpp-python {_version('llama_cpp')}, n_threads={threads}, weights as in the GGUF"

    def run(self, prompt: list[int], decode: int) -> tuple[float, float]:
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(decode):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return len(prompt) / prefill_s, decode / (time.perf_counter() - t0)


class Kestrel:
    def __init__(self, path: str, quant: str) -> None:
        import kestrel_core

        t0 = time.perf_counter()
        self.engine = kestrel_core.load(path, backend="cpu", quant=quant)
        self.load_s = time.perf_counter() - t0
        self.detail = (f"kestrel {kestrel_core.__version__}, {self.engine.backend_line}, quant={quant}, "
                       f"{self.engine.model.nbytes / 1e6:.0f} MB of strip-caches, loaded in {self.load_s:.1f} s")

    def run(self, prompt: list[int], decode: int) -> tuple[float, float]:
        eng = self.engine
        n = sum(1 for _ in eng.generate(prompt, max_tokens=decode + 1, stop_at_eos=False))
        assert n == decode + 1 and eng.last.decode_tokens == decode
        return eng.last.prefill_tok_s, eng.last.decode_tok_s


def _version(module: str) -> str:
    try:
        return str(__import__(module).__version__)
    except Exception:
        return "?"


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "python": platform.python_version(),
                            "machine": _cpu(), "numpy": np.__version__, "numba": _version("numba")}
    info["env"] = {k: os.environ.get(k, "(unset)") for k in ENV_KNOBS}
    try:
        from threadpoolctl import threadpool_info

        info["blas"] = [f"{i.get('internal_api')} {i.get('version')} kernel={i.get('architecture')} "
                        f"threads={i.get('num_threads')}" for i in threadpool_info()]
    except ImportError:
        info["blas"] = ["threadpoolctl not installed"]
    try:
        info["loadavg_before"] = os.getloadavg()
    except OSError:
        pass
    return info


def _cpu() -> str:
    model = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} logical CPUs"


def default_gguf() -> str:
    from kestrel_core.model.pull import default_model_path

    path = default_model_path()
    if not Path(path).exists():
        sys.exit(f"the default model is not pulled ({path}): run `kestrel pull` or pass a GGUF path")
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", nargs="?", help="GGUF file (default: the default SmolLM2 model)")
    ap.add_argument("--quant", default="q8", help="kestrel quant mode (default q8)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp n_threads (default 2)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pause", type=float, default=1.0, help="seconds between runs (default 1)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        import llama_cpp  # noqa: F401  (before either model loads)
    except ImportError as exc:
        sys.exit(f"llamacpp_compare.py needs llama-cpp-python ({exc})")
    path = args.gguf or default_gguf()
    env = environment()

    kestrel = Kestrel(path, args.quant)
    llama = LlamaCpp(path, args.threads, context=args.prompt_tokens + args.decode_tokens + 16)
    vocab = kestrel.engine.config.vocab_size
    # a prompt a run, the same for both engines: a prompt read again would be read from kestrel's prefix cache
    prompts = np.random.default_rng(args.seed).integers(0, vocab, (args.warmup + args.runs, args.prompt_tokens))
    results = {"llama.cpp": Runs("llama.cpp", llama.detail), "kestrel": Runs(f"kestrel cpu {args.quant}",
                                                                               kestrel.detail)}
    for i, prompt in enumerate(prompts.tolist()):
        for name, engine in (("llama.cpp", llama), ("kestrel", kestrel)):
            time.sleep(args.pause)  # both keep OpenMP workers spinning a while after a run: let them sleep
            prefill, decode = engine.run(prompt, args.decode_tokens)
            if i >= args.warmup:
                results[name].prefill.append(prefill)
                results[name].decode.append(decode)
    try:
        env["loadavg_after"] = os.getloadavg()
    except OSError:
        pass

    k, ll = results["kestrel"], results["llama.cpp"]
    summary = {"model": path, "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
               "runs": args.runs, "environment": env,
               "results": {n: {**asdict(r), "prefill_median": r.prefill_median, "decode_median": r.decode_median}
                           for n, r in results.items()},
               "kestrel_over_llamacpp": {"prefill": k.prefill_median / ll.prefill_median,
                                         "decode": k.decode_median / ll.decode_median}}
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, Console().width))
    console.print(f"[bold]model[/]: {path}")
    for key in ("date", "machine", "python", "numpy", "numba", "blas", "env", "loadavg_before", "loadavg_after"):
        console.print(f"[bold]{key}[/]: {env.get(key)}")
    for r in results.values():
        console.print(f"[bold]{r.name}[/]: {r.detail}")
    table = Table(title=f"prefill of a {args.prompt_tokens}-token prompt and {args.decode_tokens}-token greedy "
                        f"decode, {args.runs} runs each (tok/s)")
    for col in ("engine", "prefill tok/s", "decode tok/s", "best prefill", "best decode", "prefill runs",
                "decode runs"):
        table.add_column(col, justify="left" if col in ("engine",) else "right")
    for r in results.values():
        table.add_row(r.name, f"{r.prefill_median:.1f}", f"{r.decode_median:.1f}", f"{max(r.prefill):.1f}",
                      f"{max(r.decode):.1f}", " ".join(f"{v:.0f}" for v in r.prefill),
                      " ".join(f"{v:.0f}" for v in r.decode))
    table.add_row("kestrel / llama.cpp", f"{k.prefill_median / ll.prefill_median:.2f}x",
                  f"{k.decode_median / ll.decode_median:.2f}x", f"{max(k.prefill) / max(ll.prefill):.2f}x",
                  f"{max(k.decode) / max(ll.decode):.2f}x", "", "")
    console.print(table)


if __name__ == "__main__":
    main()
