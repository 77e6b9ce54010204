"""Continuous batching through the HTTP server against the engine alone, in one run on one engine.

    python benchmarks/serve_load.py --backend cpu --concurrency 1,8 --prompt-tokens 128 --decode-tokens 64
    python benchmarks/serve_load.py --preset qwen3-8b --backend cuda --quant q8 --concurrency 1,32,64 \\
        --prompt-tokens 512 --decode-tokens 256 --kv-cache-mb 24576 --json $OUT/serve.json

For each concurrency level N: N requests with distinct random token prompts, greedy, EOS ignored, sent at
once. First ``kestrel bench``'s own figures (batch-1 ``run_bench`` and ``run_concurrency_bench``), then the
same load through a real ``kestrel serve`` server on 127.0.0.1 with the official ``openai`` client (streamed
completions, one request per task, in client processes of their own, ``--clients`` of them, so that parsing
the streams competes neither with the server for its interpreter nor with itself: one process reading 64
streams on the H200's host held the server's figure at 5,750-5,790 tok/s, four 8,215-8,222): decode tok/s
while every stream decodes, per-stream tok/s, time to first token. Same definitions as ``kestrel bench
--concurrency``; a chunk counts the tokens it carries, read from its running usage (``continuous_usage_stats``).

``--ttft-under-load N`` adds, through the server, the time to first token of a prompt that arrives while N - 1
other streams decode (three such prompts, one after another, from a client process of their own: the one
reading the N - 1 streams would delay their answers by its own queue).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import statistics
import threading
import time
from typing import Any

import numpy as np

import kestrel_core
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.bench import all_decoding_rate, run_bench, run_concurrency_bench
from kestrel_core.model.engine_load import load_preset


async def _one(client: Any, model: str, prompt: list[int], tokens: int) -> tuple[float, list[float], list[int]]:
    """(send time, chunk arrival times, each chunk's tokens) of one streamed completion: with continuous usage
    every chunk says the completion tokens sent so far, so a chunk's tokens are the rise since the last."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    counts: list[int] = []
    sent = 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is None:
            raise RuntimeError("a chunk without usage: the server does not do continuous_usage_stats")
        if chunk.choices and chunk.usage.completion_tokens > sent:  # a chunk with tokens (not a finish alone)
            stamps.append(now)
            counts.append(chunk.usage.completion_tokens - sent)
        sent = chunk.usage.completion_tokens
    return t0, stamps, counts


async def _streams(port: int, model: str, prompts: list[list[int]], tokens: int, start_at: float
                   ) -> dict[str, Any]:
    """Every prompt's stream from ``start_at`` (a perf_counter time, which every process of the machine shares):
    each one's (send time, chunk stamps, chunk tokens), and this process's CPU seconds over its wall time."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench", max_retries=0,
                                timeout=3600)
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    cpu0, start = time.process_time(), time.perf_counter()
    results = await asyncio.gather(*(_one(client, model, p, tokens) for p in prompts))
    busy = (time.process_time() - cpu0) / (time.perf_counter() - start)
    await client.close()
    return {"results": results, "busy": busy}


def run_level(clients: Any, procs: int, port: int, model: str, prompts: list[list[int]], tokens: int
              ) -> dict[str, float]:
    """One concurrency level through the server: the prompts' streams spread over ``procs`` processes of the
    ``clients`` pool (each parses its streams in Python; one process for 64 streams can be what limits the
    figure), started together. ``client_busy``: the busiest client process's CPU time over its wall time."""
    start_at = time.perf_counter() + 0.5
    jobs = [clients.submit(_client, "streams", port, model, prompts[i::procs], tokens, start_at)
            for i in range(min(procs, len(prompts)))]
    parts = [job.result() for job in jobs]
    end = time.perf_counter()
    results = [r for part in parts for r in part["results"]]
    # each chunk's own count of tokens, from its running usage
    streamed = [(s, c) for _, s, c in results if s]
    per_stream = [(sum(c) - c[0]) / (s[-1] - s[0]) for _, s, c in results if len(s) > 1 and s[-1] > s[0]]
    ttft = np.array([s[0] - t0 for t0, s, _ in results if s])
    return {"concurrency": len(prompts),
            "decode_tok_s": all_decoding_rate([s for s, _ in streamed], [c for _, c in streamed]),
            "output_tok_s": sum(sum(c) for _, _, c in results) / (end - start_at),
            "stream_tok_s": statistics.median(per_stream) if per_stream else 0.0,
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "client_busy": max(part["busy"] for part in parts)}


async def _background(port: int, model: str, prompts: list[list[int]], tokens: int) -> int:
    """Streams ``prompts`` to the end; how many ran their ``tokens`` tokens."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench", max_retries=0,
                                timeout=3600)

    async def stream(prompt: list[int]) -> int:
        response = await client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True})
        used = 0
        async for chunk in response:
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        return int(used == tokens)

    done = sum(await asyncio.gather(*(stream(p) for p in prompts)))
    await client.close()
    return done


async def _probes(port: int, model: str, late: list[list[int]]) -> list[float]:
    """Times to first token of each ``late`` prompt, one after another."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench", max_retries=0,
                                timeout=3600)
    ttfts = []
    for prompt in late:
        t0 = time.perf_counter()
        response = await client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                                   stream=True)
        async for chunk in response:
            if chunk.choices:
                ttfts.append(time.perf_counter() - t0)
                break
        await response.close()
    await client.close()
    return ttfts


def _ttft_under_load(clients: Any, prober: Any, front: AsyncEngine, port: int, background: list[list[int]],
                     late: list[list[int]], tokens: int) -> dict[str, Any]:
    """Times to first token of each ``late`` prompt, sent once every ``background`` stream decodes. The
    background streams are read by one client process (``clients``) and the probes sent by another
    (``prober``, started beforehand), as by different users: a client busy parsing the other streams would
    delay the probe's answer by its own queue."""
    prober.submit(_client, "probes", port, "bench", []).result()  # the process is up, openai imported
    streams = clients.submit(_client, "background", port, "bench", background, tokens)
    while len([r for r in list(front.scheduler.running) if r.output_ids]) < len(background):
        if streams.done():
            raise SystemExit(f"the background streams ended before the probes: {streams.result()}")
        time.sleep(0.01)
    ttfts = prober.submit(_client, "probes", port, "bench", late).result()
    decoding = len(front.scheduler.running)
    done = streams.result()
    return {"background": len(background), "still_decoding": decoding, "background_completed": done,
            "ttft_ms": [round(t * 1e3, 1) for t in ttfts], "ttft_median_ms": round(statistics.median(ttfts) * 1e3, 1)}


def _client(job: str, *args: Any) -> dict[str, Any]:
    """One client run (``_streams``, ``_background`` or ``_probes``), in a client process."""
    return asyncio.run({"streams": _streams, "background": _background, "probes": _probes}[job](*args))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default=None)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--quant", default=None)
    ap.add_argument("--activations", default="auto")
    ap.add_argument("--kv-cache-mb", type=float, default=None, help="the engine's KV pool (every sequence's blocks)")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=None, help="tokens per batched step (the scheduler's default)")
    ap.add_argument("--ttft-under-load", type=int, default=0, metavar="N",
                    help="also: the time to first token of a prompt arriving while N - 1 streams decode")
    ap.add_argument("--clients", type=int, default=4, help="client processes that read a level's streams")
    ap.add_argument("--json", default=None, help="write the figures here too")
    args = ap.parse_args()
    from kestrel_core.serve.server import build_server

    levels = [int(x) for x in args.concurrency.split(",")]
    if args.preset:
        engine = load_preset(args.preset, backend=args.backend, quant=args.quant, activations=args.activations,
                             kv_cache_mb=args.kv_cache_mb)
    else:
        engine = kestrel_core.load(args.model, backend=args.backend, quant=args.quant, activations=args.activations,
                                   kv_cache_mb=args.kv_cache_mb)
    out: dict[str, Any] = {"model": engine.source, "backend": engine.backend_name, "activations": engine.activations,
                           "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens}
    # every engine call on the scheduler's thread, as in the server (AsyncEngine.run_sync says why)
    most = max(levels + [args.ttft_under_load])
    budget = {} if args.token_budget is None else {"token_budget": args.token_budget}
    front = AsyncEngine(engine, max_batch=most, max_waiting=most, **budget)
    single = front.run_sync(lambda: run_bench(engine, prompt_tokens=args.prompt_tokens,
                                              decode_tokens=args.decode_tokens, runs=3))
    out["bench_batch1_decode_tok_s"] = single.decode_tok_s
    bench = front.run_sync(lambda: run_concurrency_bench(engine, levels, prompt_tokens=args.prompt_tokens,
                                                         decode_tokens=args.decode_tokens, **budget))
    out["bench"] = [vars(r) for r in bench.levels]
    server = build_server({"bench": front}, host="127.0.0.1", port=0)
    thread = threading.Thread(target=server.run_forever, daemon=True)
    thread.start()
    assert server.wait_started(120)
    rng = np.random.default_rng(1)
    vocab = engine.config.vocab_size
    clients = concurrent.futures.ProcessPoolExecutor(args.clients, mp_context=multiprocessing.get_context("spawn"))
    prober = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        def level(n: int, tokens: int) -> dict[str, float]:
            prompts = [rng.integers(0, vocab, args.prompt_tokens).tolist() for _ in range(n)]
            return run_level(clients, args.clients, server.port, "bench", prompts, tokens)

        level(args.clients, 4)  # warm-up: every client process up, openai imported
        out["server"] = [level(n, args.decode_tokens) for n in levels]
        if args.ttft_under_load > 1:
            prompts = [rng.integers(0, vocab, args.prompt_tokens).tolist() for _ in range(args.ttft_under_load + 2)]
            out["ttft_under_load"] = _ttft_under_load(clients, prober, front, server.port,
                                                      prompts[:args.ttft_under_load - 1],
                                                      prompts[args.ttft_under_load - 1:], args.decode_tokens)
    finally:
        clients.shutdown()
        prober.shutdown()
        server.request_shutdown()
        thread.join(60)
        engine.close()
    print(f"{out['model']} on {out['backend']} ({out['activations']} activations), {args.prompt_tokens}-token "
          f"prompts, {args.decode_tokens} tokens each; bench batch-1 decode {single.decode_tok_s:.1f} tok/s")
    print(f"{'N':>4} {'bench decode':>13} {'server decode':>14} {'bench stream':>13} {'server stream':>14} "
          f"{'bench TTFT p50/p99 ms':>22} {'server TTFT p50/p99 ms':>23}")
    for b, s in zip(out["bench"], out["server"]):
        print(f"{b['concurrency']:>4} {b['decode_tok_s']:>13.1f} {s['decode_tok_s']:>14.1f} {b['stream_tok_s']:>13.1f} "
              f"{s['stream_tok_s']:>14.1f} {b['ttft_p50_s'] * 1e3:>10.0f}/{b['ttft_p99_s'] * 1e3:<11.0f} "
              f"{s['ttft_p50_s'] * 1e3:>11.0f}/{s['ttft_p99_s'] * 1e3:<11.0f}")
    print(f"server levels read by {args.clients} client processes; the busiest one's CPU share: "
          + ", ".join(f"{s['client_busy']:.0%} at {s['concurrency']}" for s in out["server"]))
    if "ttft_under_load" in out:
        t = out["ttft_under_load"]
        print(f"time to first token of a {args.prompt_tokens}-token prompt while {t['background']} streams decode "
              f"(server): median {t['ttft_median_ms']} ms of {t['ttft_ms']} ({t['still_decoding']} still decoding, "
              f"{t['background_completed']} completed)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
