"""CPU decode of a preset's first layers: its layers (and a mixture of experts' experts) compiled, against op by op.

    python benchmarks/cpu_layers.py                                   # qwen3-30b-a3b's shapes, 8 layers, q4
    python benchmarks/cpu_layers.py --preset qwen1.5-moe-a2.7b --layers 6 --quant q8
    python benchmarks/cpu_layers.py --preset command-r7b --layers 4 --quant q8   # Cohere's layers
    python benchmarks/cpu_layers.py --model tests/fixtures/models/tiny-cohere2 --quant q8   # a checkpoint's, whole

A random model of the preset's shapes cut to ``--layers`` layers (and a 32,000-token vocabulary, so the lm_head
does not dominate) decodes greedy steps after a 64-token prompt on the CPU backend with int8 activations; the two
settings alternate, ``--rounds`` times, each timing ``--steps`` steps on its own decoder (the two caches at the
same positions), and must give the same logits. A full
model's step is about layers / --layers times the layers' part. ``--model``: a checkpoint's own layers and weights
instead, all of them (its context taken to 4096 positions, as a preset's).
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
from kestrel_core.model.loader import load_model
from kestrel_core.model.presets import preset_model
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
    ap.add_argument("--model", help="a checkpoint (a directory or .gguf) in place of the preset")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quant", default="q4")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.model:
        model = load_model(args.model, quant=args.quant, cache="off").model
        model = replace(model, config=replace(model.config, max_position=4096))  # room for the steps
        args.layers, args.preset = model.config.num_layers, args.model
    else:
        model = preset_model(args.preset, args.quant, num_layers=args.layers, vocab_size=32000, max_position=4096)
    decoders = {compiled: _decoder(model, compiled) for compiled in (True, False)}
    ran = sum(layer is not None for layer in decoders[True][0].dense.values())
    print(f"{ran} of {args.layers} layers compiled whole or their attention alone")
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        logits = {}
        for compiled, (dec, cache) in decoders.items():
            seconds, logits[compiled] = _steps(dec, cache, args.steps)
            times[compiled].append(seconds)
        assert np.array_equal(logits[True], logits[False]), "the two settings disagree"
    for compiled in (True, False):
        runs = ", ".join(f"{t * 1e3:.4g}" for t in times[compiled])
        print(f"{'compiled' if compiled else 'op by op'}: {statistics.median(times[compiled]) * 1e3:.4g} ms "
              f"a step (runs {runs}), {args.layers} layers of {args.preset} at {args.quant}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
