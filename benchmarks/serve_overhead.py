"""The server's own host cost per streamed token: a real `kestrel serve` server (HTTP, server-sent events,
the AsyncEngine's scheduler thread) over a backend whose batched step only waits, as a device step does.

    python benchmarks/serve_overhead.py [--streams 32] [--tokens 200] [--step-ms 6] [--runs 3]

The stub backend is written to a temporary directory and bound through KESTREL_BACKEND_PATH, like any third
party backend; it sleeps ``--step-ms`` a step (the interpreter is free meanwhile, as while a GPU step runs)
and hands over greedy ids, as the CUDA backend does. The server runs in this process and the ``openai``
client in a process of its own (``serve_load.py``'s level run); the figure is this process's CPU time (user
+ system) per generated token over each run, the client's excluded. The preset keeps its vocabulary but one
layer, since no weight is read.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

STUB = '''
import os
import time

import numpy as np
from kestrel_core import API_VERSION, BackendInfo, hookimpl
from kestrel_cpu import kestrel_close, kestrel_gemm_f32, kestrel_gemm_q8, kestrel_open  # noqa: F401

STEP_S = float(os.environ["KESTREL_STUB_STEP_MS"]) / 1e3


@hookimpl
def kestrel_backend_info():
    return BackendInfo("stub_step", "1", API_VERSION, "gpu")


FREE_AT = [0.0]  # when the device finishes the steps queued on it


@hookimpl
def kestrel_forward_batch(device, model, batch):
    done = FREE_AT[0] = max(time.perf_counter(), FREE_AT[0]) + STEP_S  # queued behind the running step
    outs = [np.full(e.logit_rows, 7, np.int64) if e.argmax_only
            else np.zeros((e.logit_rows, model.config.vocab_size), np.float32) for e in batch]

    def wait():
        time.sleep(max(0.0, done - time.perf_counter()))
        return outs
    return wait
'''


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--step-ms", type=float, default=6.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--clients", type=int, default=1, help="client processes that read the streams")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import numpy as np
    from serve_load import run_level

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "stub_step.py").write_text(STUB, encoding="utf-8")
        os.environ["KESTREL_BACKEND_PATH"] = tmp
        os.environ["KESTREL_STUB_STEP_MS"] = str(args.step_ms)
        from kestrel_core.model.async_engine import AsyncEngine
        from kestrel_core.model.engine_load import load_preset
        from kestrel_core.serve.server import build_server

        engine = load_preset(args.preset, backend="stub_step", quant="q8", num_layers=1)
        front = AsyncEngine(engine, max_batch=args.streams, max_waiting=args.streams)
        server = build_server({"bench": front}, host="127.0.0.1", port=0)
        thread = threading.Thread(target=server.run_forever, daemon=True)
        thread.start()
        assert server.wait_started(120)
        rng = np.random.default_rng(0)
        clients = concurrent.futures.ProcessPoolExecutor(args.clients, mp_context=multiprocessing.get_context("spawn"))
        try:
            def level(n: int, tokens: int) -> dict:  # type: ignore[type-arg]
                prompts = [rng.integers(0, 1000, args.prompt_tokens).tolist() for _ in range(n)]
                return run_level(clients, args.clients, server.port, "bench", prompts, tokens)

            level(2 * args.clients, 8)  # warm-up: the client processes, the server's first requests
            for run in range(args.runs):
                c0, t0 = os.times(), time.perf_counter()
                fig = level(args.streams, args.tokens)
                c1, t1 = os.times(), time.perf_counter()
                cpu = (c1.user - c0.user) + (c1.system - c0.system)
                print(f"run {run + 1}: {args.streams} streams x {args.tokens} tokens, server CPU {cpu:.2f} s over "
                      f"{t1 - t0:.2f} s: {cpu / (args.streams * args.tokens) * 1e6:.0f} us a token; decode "
                      f"{fig['decode_tok_s']:.0f} tok/s (the busiest client {fig['client_busy']:.0%} busy)", flush=True)
        finally:
            clients.shutdown()
            server.request_shutdown()
            thread.join(60)
            engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
