"""CPython's full (generation 2) garbage collections in a `kestrel serve` process, and what they do to other
clients' streams while large request bodies come in.

    python benchmarks/serve_gc.py [--runs 2] [--streams 2] [--tokens 60] [--body prompts:1000000] [--model PATH]
                                  [--modes unfrozen,frozen]

Each run starts a real ``kestrel serve`` (the default model on the CPU, ``--port 0``) in a process of its own,
alternately as it is (``frozen``: its startup heap frozen, server.frozen_heap) and with that freeze left out
(``unfrozen``; ``--modes frozen``: the server as it is only). Once it listens, one client process streams
``--streams`` greedy completions of ``--tokens`` tokens (serve_load.py's streams) while another posts one large body
after another until they end: ``prompts:N``, a completions request of N one-token prompts (4 MB for a million; the
server parses and validates it, millions of Python objects, then refuses it: at most 128 prompts), or
``messages:N``, a chat request of N short messages (3 MB for 100,000; refused once rendered and tokenized: longer
than the model's context); ``none``: no such body. The server's process records each collection it runs
(gc.callbacks: its start and end, the CPU time of the thread it ran in, its generation); the figures are the full
collections from the streams' start to the end of the body that was running when they ended (their CPU times too:
the wall times grow with whatever else the machine runs), the gaps between streamed chunks, and the objects the
collector tracked once the models were loaded and warmed up and the app built.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

SERVER = '''
import contextlib, gc, json, sys, time
mode, record = sys.argv[1], sys.argv[2]
sys.argv = ["kestrel", *sys.argv[3:]]
collections, started, heap = [], [0.0, 0.0], {}

def on_gc(phase, info):  # a collection runs in the thread that set it off: its CPU time is the thread's
    if phase == "start":
        started[:] = time.perf_counter(), time.thread_time()
    else:
        collections.append((started[0], time.perf_counter() - started[0], time.thread_time() - started[1],
                            info["generation"]))

from kestrel_core.serve import server
frozen_heap = server.frozen_heap

@contextlib.contextmanager
def counted():
    with frozen_heap() if mode == "frozen" else contextlib.nullcontext():
        heap.update(tracked=len(gc.get_objects()) + gc.get_freeze_count(), frozen=gc.get_freeze_count())
        gc.callbacks.append(on_gc)
        yield

server.frozen_heap = counted
from kestrel_core.entry import main
try:
    status = main()
finally:
    with open(record, "w") as f:
        json.dump({"collections": collections, **heap}, f)
sys.exit(status)
'''


def _body(spec: str) -> tuple[str, bytes]:
    """``--body``'s route and JSON body."""
    kind, _, count = spec.partition(":")
    n = int(count or 0)
    if kind == "prompts":
        return "/v1/completions", _json({"model": "bench", "prompt": [[1]] * n, "max_tokens": 1})
    if kind == "messages":
        return "/v1/chat/completions", _json({"model": "bench", "messages": [{"role": "user", "content": "hi"}] * n,
                                              "max_tokens": 1})
    if kind == "none":
        return "", b""
    raise SystemExit(f"--body: prompts:N, messages:N or none, not {spec!r}")


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _bodies(port: int, path: str, body: bytes, start_at: float, stop: Any, answers: Any) -> None:
    """Posts ``body`` to ``path``, one request after another, from ``start_at`` until ``stop`` is set (times on
    perf_counter's clock, which every process of the machine shares); puts the answers' statuses and when the last
    one came on ``answers``."""
    import httpx

    time.sleep(max(0.0, start_at - time.perf_counter()))
    statuses = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        while not stop.is_set():
            statuses.append(client.post(path, content=body, headers={"content-type": "application/json"}).status_code)
    answers.put((statuses, time.perf_counter()))


def _start(mode: str, record: str, model: str | None) -> tuple[subprocess.Popen[str], int]:
    """A `kestrel serve` process in ``mode`` and the port it listens on."""
    cmd = [sys.executable, "-c", SERVER, mode, record, "serve", "--port", "0", "--backend", "cpu",
           "--served-model-name", "bench", *(["--model", model] if model else [])]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        if found:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # the rest, so the pipe never fills
            return proc, int(found.group(1))
    raise SystemExit(f"kestrel serve ({mode}) ended before it listened: status {proc.wait()}")


def run(mode: str, args: argparse.Namespace, clients: Any) -> dict[str, Any]:
    from serve_load import _client

    path, body = _body(args.body)
    spawn = multiprocessing.get_context("spawn")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 10000, 16).tolist() for _ in range(args.streams)]
    with tempfile.TemporaryDirectory() as tmp:
        record = str(Path(tmp) / "gc.json")
        proc, port = _start(mode, record, args.model)
        try:
            clients.submit(_client, "streams", port, "bench", prompts[:1], 4, 0.0).result()  # warm: client, server
            stop, answers = spawn.Event(), spawn.Queue()
            start = time.perf_counter() + 2.0  # the sender's process is up
            if body:
                spawn.Process(target=_bodies, args=(port, path, body, start, stop, answers), daemon=True).start()
            streams = clients.submit(_client, "streams", port, "bench", prompts, args.tokens, start).result()
            end = time.perf_counter()
            stop.set()
            statuses, last = answers.get(timeout=600) if body else ([], end)
            end = max(end, last)  # the collections of whole bodies
        finally:
            proc.terminate()
            proc.wait(120)
        with open(record) as f:
            rec = json.load(f)
    gaps = np.concatenate([np.diff(s) for _, s, _ in streams["results"] if len(s) > 1]) * 1e3
    full = [(d * 1e3, c * 1e3) for t, d, c, g in rec["collections"] if g == 2 and start <= t <= end]
    young = [d * 1e3 for t, d, _, g in rec["collections"] if g < 2 and start <= t <= end]
    return {"mode": mode, "tracked": rec["tracked"], "frozen": rec["frozen"], "bodies": len(statuses),
            "statuses": sorted(set(statuses)), "seconds": end - start, "full": len(full),
            "full_ms_total": sum(d for d, _ in full), "full_ms_max": max((d for d, _ in full), default=0.0),
            "full_cpu_ms_total": sum(c for _, c in full), "full_cpu_ms_max": max((c for _, c in full), default=0.0),
            "young_ms_max": max(young, default=0.0),
            "gap_ms_p50": float(np.percentile(gaps, 50)), "gap_ms_p99": float(np.percentile(gaps, 99)),
            "gap_ms_max": float(gaps.max())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="the model served (default: kestrel's default model)")
    p.add_argument("--runs", type=int, default=2, help="runs of each mode, alternating")
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--tokens", type=int, default=60)
    p.add_argument("--body", default="prompts:1000000", help="prompts:N, messages:N or none")
    p.add_argument("--modes", default="unfrozen,frozen", help="the servers each run alternates between")
    p.add_argument("--json", default=None, help="write the figures here too")
    args = p.parse_args()
    _body(args.body)
    modes = args.modes.split(",")
    if not modes or set(modes) - {"unfrozen", "frozen"}:
        raise SystemExit(f"--modes: unfrozen, frozen or both, not {args.modes!r}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    out = []
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
        for i in range(len(modes) * args.runs):
            fig = run(modes[i % len(modes)], args, clients)
            out.append(fig)
            per = max(fig["bodies"], 1)
            print(f"{fig['mode']:>8}: {fig['tracked']} objects tracked at startup ({fig['frozen']} frozen); "
                  f"{fig['bodies']} bodies in {fig['seconds']:.0f} s (answered {fig['statuses']}); "
                  f"{fig['full']} full collections, {fig['full_cpu_ms_total'] / per:.0f} ms CPU a body "
                  f"({fig['full_ms_total'] / per:.0f} ms wall), the longest {fig['full_cpu_ms_max']:.0f} ms CPU "
                  f"({fig['full_ms_max']:.0f} wall; young: {fig['young_ms_max']:.0f}); gaps between chunks p50 "
                  f"{fig['gap_ms_p50']:.0f}, p99 {fig['gap_ms_p99']:.0f}, max {fig['gap_ms_max']:.0f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
