"""CPU decode of a mixture-of-experts preset's first layers: its experts and attention compiled, against op by op.

    python benchmarks/cpu_moe.py                                   # qwen3-30b-a3b's shapes, 8 layers, q4
    python benchmarks/cpu_moe.py --preset qwen1.5-moe-a2.7b --layers 6 --quant q8

A random model of the preset's shapes cut to ``--layers`` layers (and a 32,000-token vocabulary, so the lm_head
does not dominate) decodes greedy steps after a 64-token prompt on the CPU backend with int8 activations; the two
settings alternate, ``--rounds`` times, each timing ``--steps`` steps on its own decoder (the two caches at the
same positions), and must give the same logits. A full
model's step is about layers / --layers times the layers' part.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

import numpy as np

from kestrel_core.dispatch import Offload
from kestrel_core.model.decoder import Decoder
from kestrel_core.model.presets import preset_config, synthetic_model
from kestrel_core.registry import Registry
from kestrel_cpu import LAYERS_ENV


def _decoder(model, compiled: bool) -> tuple[Decoder, object]:  # type: ignore[no-untyped-def]
    """A decoder on the CPU backend, its layers compiled or op by op (``KESTREL_CPU_LAYERS``), its cache after a
    64-token prompt."""
    os.environ[LAYERS_ENV] = "1" if compiled else "0"  # read as the backend opens
    cpu = Registry().cpu()
    dec = Decoder(model, Offload(cpu, cpu), activations="q8")
    cache = dec.new_cache()
    dec.forward(np.arange(64) % model.config.vocab_size, cache)
    for _ in range(2):  # compiles, packs
        dec.forward([5], cache)
    return dec, cache


def _steps(dec: Decoder, cache: object, steps: int) -> tuple[float, np.ndarray]:
    """Seconds a decode step, and the last step's logits."""
    start = time.perf_counter()
    for _ in range(steps):
        logits = dec.forward([5], cache)  # type: ignore[arg-type]
    return (time.perf_counter() - start) / steps, logits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quant", default="q4")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    config = preset_config(args.preset)
    config = replace(config, num_layers=args.layers, vocab_size=32000, max_position=4096,
                     dense_layers=tuple(i for i in config.dense_layers if i < args.layers))
    model = synthetic_model(config, args.quant, seed=0)
    decoders = {compiled: _decoder(model, compiled) for compiled in (True, False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        logits = {}
        for compiled, (dec, cache) in decoders.items():
            seconds, logits[compiled] = _steps(dec, cache, args.steps)
            times[compiled].append(seconds)
        assert np.array_equal(logits[True], logits[False]), "the two settings disagree"
    for compiled in (True, False):
        runs = ", ".join(f"{t * 1e3:.1f}" for t in times[compiled])
        print(f"{'compiled' if compiled else 'op by op'}: {statistics.median(times[compiled]) * 1e3:.1f} ms "
              f"a step (runs {runs}), {args.layers} layers of {args.preset} at {args.quant}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
