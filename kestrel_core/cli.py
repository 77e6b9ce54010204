"""The ``kestrel`` command: a thin layer over the Python API.

User errors print one line on stderr and exit non-zero; ``-v`` shows the traceback.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    # ``python -m kestrel_core.cli`` is the ``kestrel`` command: its entry point installs the Ctrl-C guard, then
    # imports this module again as ``kestrel_core.cli``, so that a Ctrl-C while the CLI's modules load is its
    # "interrupted" instead of a traceback
    from kestrel_core.entry import main as kestrel

    sys.exit(kestrel())

import argparse
import json
import logging
import os
import signal
import warnings
from collections.abc import Sequence
from typing import NoReturn

from rich.table import Table
from rich.text import Text

import kestrel_core
from kestrel_core.console import err, log_handler, out
from kestrel_core.entry import INTERRUPTED_EXIT, interrupted
from kestrel_core.errors import KestrelError, os_error
from kestrel_core.model.config import KV_TYPES, POOLINGS
from kestrel_core.model.reasoning import THINK_LEVELS
from kestrel_core.model.request_queue import POLICIES
from kestrel_core.model.speculate import DRAFT_MIN, DRAFT_P_MIN

# -- backends / selftest ------------------------------------------------------------------------------


def cmd_backends(args: argparse.Namespace) -> int:
    from kestrel_core.registry import Registry

    registry = Registry()
    try:
        rows = [b.as_dict() for b in registry.bind_all()]
    finally:
        registry.close()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="kestrel backends")
    for col in ("name", "version", "kind", "device", "status", "offload", "probe", "source", "reason"):
        table.add_column(col, overflow="fold")
    for r in rows:
        status = Text("bound", style="green") if r["status"] == "bound" else Text("not bound", style="red")
        # plugin-supplied text is shown as it is: a "[...]" in a reason is not rich markup
        table.add_row(*(Text(str(r[c])) for c in ("name", "version", "kind", "device")), status,
                      *(Text(str(r[c])) for c in ("offload", "probe", "source", "reason")))
    out.print(table)
    return 0


def cmd_selftest(args: argparse.Namespace) -> int:
    from kestrel_core.guard import plugin_output
    from kestrel_core.registry import Registry
    from kestrel_core.selftest import run_selftest

    registry = Registry()
    try:
        with plugin_output():  # the suite calls the backend's hooks itself
            report = run_selftest(args.backend, seeds=args.seeds, registry=registry)
    finally:
        registry.close()
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        table = Table(title=f"kestrel selftest: {report.backend}")
        for col in ("case", "max abs err", "tolerance", "result"):
            table.add_column(col)
        for c in report.cases:
            verdict = (Text("declined (the CPU's result)", "yellow") if c.declined else Text("pass", "green")
                       if c.passed else Text.assemble(("FAIL", "red"), f" {c.detail}"))
            table.add_row(c.name, f"{c.max_err:.3g}", f"{c.tolerance:.3g}", verdict)
        out.print(table)
        declined = sum(c.declined for c in report.cases)
        out.print(f"{report.passed} passed{f' ({declined} declined)' if declined else ''}, {report.failed} failed")
    return 0 if report.ok else 1


# -- the model engine ---------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from kestrel_core.model.commands import run

    return run(args)


def cmd_chat(args: argparse.Namespace) -> int:
    from kestrel_core.model.commands import chat

    return chat(args)


def cmd_embed(args: argparse.Namespace) -> int:
    from kestrel_core.model.commands import embed

    return embed(args)


def cmd_pull(args: argparse.Namespace) -> int:
    from kestrel_core.model.commands import pull

    return pull(args)


def cmd_list(args: argparse.Namespace) -> int:
    from kestrel_core.model.inventory import list_models

    return list_models(args)


def cmd_cache(args: argparse.Namespace) -> int:
    from kestrel_core.model.inventory import cache

    return cache(args)


def cmd_quantize(args: argparse.Namespace) -> int:
    from kestrel_core.model.commands import quantize

    return quantize(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from kestrel_core.model.commands import bench

    return bench(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from kestrel_core.serve.command import serve_command  # fastapi and uvicorn only when serving

    return serve_command(args)


MODEL_HELP = ("HF model dir, Hugging Face Hub name (owner/name[:TAG]), .gguf, or .kst artifact "
              "(default: SmolLM2)")


def _model_args(p: argparse.ArgumentParser, several: bool = False, kv_cache_mb: bool = False) -> None:
    """The options of every command that loads a model; ``kv_cache_mb``: also --kv-cache-mb, the KV cache's budget
    (serve and bench), which --kv-cache-type's help then speaks of."""
    if several:
        p.add_argument("--model", "-m", action="append", default=None,
                       help=f"{MODEL_HELP}; repeat it to serve several (the first answers requests that name no "
                            "model)")
    else:
        p.add_argument("--model", "-m", default=None, help=MODEL_HELP)
    p.add_argument("--backend", "-b", default="auto", help="backend name, or auto (default)")
    p.add_argument("--quant", "-q", default=None,
                   help="q8 (default; a symmetric 4-bit checkpoint without --lora: q4, its own codes), q4, q8-g256, "
                        "q4-g256; a .kst artifact keeps its own")
    p.add_argument("--activations", default="auto", choices=("auto", "q8", "f32", "mixed"),
                   help="projection inputs: int8, float32, or mixed (the prompt at float32); auto (default): "
                        "mixed, or q8 on a backend that runs whole steps on its device")
    p.add_argument("--backend-option", action="append", default=None, metavar="KEY=VALUE",
                   help="passed to every backend's kestrel_open as options[KEY] = VALUE (a string); repeatable")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="the context in tokens, at most the model's (default: the model's); a smaller one sizes "
                        "the KV cache down and, for a longrope model within its pretraining context, takes its "
                        "short RoPE factors")
    p.add_argument("--kv-cache-type", default="f16", choices=KV_TYPES,
                   help="what the host's KV cache holds: float16 keys and values (default), or q8: int8 with a scale "
                        "every 32 dims (Q8_0's), 9/16 of the bytes a position"
                        + (", so 1.78x the context in the same --kv-cache-mb" if kv_cache_mb else ""))
    if kv_cache_mb:
        p.add_argument("--kv-cache-mb", type=float, default=None, help="host KV cache budget (default: 2048)")
    p.add_argument("--lora", action="append", default=None, metavar="PATH",
                   help="a LoRA adapter merged into the model's weights as they load (a Hugging Face directory "
                        "or a GGUF file): PEFT's directory (adapter_config.json, adapter_model.safetensors) or "
                        "llama.cpp's GGUF adapter; repeatable: the adapters stack, W + s1*B1@A1 + s2*B2@A2")
    p.add_argument("--lora-scale", action="append", type=float, default=None, metavar="S",
                   help="times the adapter's own scale, lora_alpha / r (default: 1); once for every --lora, or "
                        "once per --lora, in their order")
    p.add_argument("--rope-scaling", default=None, metavar="JSON",
                   help="RoPE scaling in place of the model's, as config.json's rope_scaling (or @file), e.g. "
                        "'{\"rope_type\":\"yarn\",\"factor\":4.0,\"original_max_position_embeddings\":32768}' "
                        "for Qwen3 at 131072 tokens (the context becomes original x factor)")


def _speculate_arg(p: argparse.ArgumentParser) -> None:
    """Prompt lookup or a draft model, for the commands that generate (not ``embed``)."""
    p.add_argument("--speculate", type=int, default=0, metavar="N",
                   help="greedy decoding guesses up to N tokens a step from the context (prompt lookup) and keeps "
                        "what the model confirms: its greedy answer in fewer steps (default: 0, off)")
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="a smaller model of the same vocabulary guesses the --speculate N tokens instead (what --model "
                        "takes: a Hugging Face directory or Hub name, a .gguf, a .kst), on the same backend")
    p.add_argument("--draft-p-min", type=float, default=None, metavar="P",
                   help="the --draft-model's guesses stop at the first it gives a probability below P (the softmax "
                        f"of its logits; llama.cpp's --draft-p-min; default: {DRAFT_P_MIN}; 0: up to N every step)")
    p.add_argument("--draft-min", type=int, default=None, metavar="M",
                   help="a --draft-model's draft of fewer than M guesses is not checked: the step decodes without it "
                        f"(llama.cpp's --draft-min; default: {DRAFT_MIN}; at most --speculate N)")


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """How ``run`` and ``chat`` sample: a value not given is the model's recommendation (its
    generation_config.json or GGUF metadata), else greedy with no filters."""
    p.add_argument("--max-tokens", "-n", type=int, default=max_tokens)
    p.add_argument("--temperature", "-t", type=float, default=None,
                   help="0: greedy (default: the model's recommendation, else 0)")
    p.add_argument("--top-k", type=int, default=None, help="0: off (default: the model's, else 0)")
    p.add_argument("--top-p", type=float, default=None, help="(default: the model's, else 1)")
    p.add_argument("--min-p", type=float, default=None, help="(default: the model's, else 0)")
    p.add_argument("--repetition-penalty", type=float, default=None, help="1: off (default: the model's, else 1)")
    p.add_argument("--seed", type=int, default=None,
                   help="a sampled answer's seed: the same seed, the same answer (default: a random one; run --json "
                        "reports it)")
    p.add_argument("--think", type=_think_arg, default=None, metavar="true|false|low|medium|high|max",
                   help="reasoning, as Ollama's --think: false turns Qwen3's thinking off (its template's "
                        "enable_thinking), and Cohere's (an empty thinking block, as llama.cpp writes it); a level "
                        "is the template's reasoning effort, gpt-oss's (max: its high) (default: the template's)")
    _model_sampling_arg(p)


def _think_arg(value: str) -> bool | str:
    """--think's value: true, false, or a reasoning effort (THINK_LEVELS)."""
    words = {"true": True, "false": False, **{level: level for level in THINK_LEVELS}}
    if value.lower() not in words:
        raise argparse.ArgumentTypeError(f"expected true, false or one of {', '.join(THINK_LEVELS)}, got {value!r}")
    return words[value.lower()]


def _model_sampling_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-model-sampling", action="store_true",
                   help="ignore the sampling the model recommends: what is not given takes kestrel's defaults "
                        "(run, chat: greedy) or each API's (serve)")


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too), whose usage error is one line, as every other error is: the usage
    it would print first (a screenful for ``run``) is what ``--help`` shows."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kestrel", description=kestrel_core.__doc__.splitlines()[0],
                     epilog="kestrel COMMAND --help: that command's options")
    parser.add_argument("--version", action="version", version=f"kestrel {kestrel_core.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list every backend, bound or not, and why")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("selftest", help="check a backend's hooks against the CPU reference")
    p.add_argument("--backend", "-b", default="cpu")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_selftest)

    p = sub.add_parser("run", help="generate text from a prompt")
    p.add_argument("prompt", nargs="?", default=None)
    _model_args(p)
    _speculate_arg(p)
    _sampling_args(p, max_tokens=128)
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--suffix", default=None,
                   help="fill in the middle: the prompt is the code before, this the code after (code models)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object: text, tokens, finish_reason (stop, or length: --max-tokens or the "
                        "context's end), prompt_tokens, seed, stats")
    p.add_argument("--stats", action="store_true", help="also print the per-hook offload counters")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", default=None, metavar="SCHEMA",
                       help="answer with JSON this JSON Schema accepts (its text, or @file)")
    shape.add_argument("--regex", default=None, help="answer with text this regular expression matches")
    shape.add_argument("--grammar", default=None, metavar="LARK",
                       help="answer with text this Lark grammar accepts (its text, or @file; llguidance's dialect)")
    p.add_argument("--preset", default=None, help="synthetic model preset (random weights) instead of --model")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="interactive multi-turn chat")
    _model_args(p)
    _speculate_arg(p)
    _sampling_args(p, max_tokens=256)
    p.add_argument("--preset", default=None, help="synthetic model preset (random weights) instead of --model")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/serving.md)")
    _model_args(p, several=True, kv_cache_mb=True)
    _speculate_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000; 0: any free port)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (or x-api-key) on /v1/*, /v2/*, /api/*, /tokenize, "
                        "/detokenize and /infill (default: $KESTREL_API_KEY, else none)")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="the model's name in the API (default: from the model); one a --model, in order")
    p.add_argument("--max-batch", type=int, default=None, help="sequences in the running batch (default: 64)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="requests queued beyond the batch before 429s (default: 256)")
    p.add_argument("--token-budget", type=int, default=None,
                   help="tokens per batched step (default: 512 + --max-batch)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=POLICIES,
                   help="fcfs: requests in arrival order; priority: by each request's priority (lower first), "
                        "then arrival, preempting requests of worse priority (default: fcfs)")
    p.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN",
                   help="a web page (https://app.example) whose browser requests are answered; '*': any (default: "
                        "the loopback's pages only)")
    p.add_argument("--max-request-mb", type=float, default=None,
                   help="the largest request body taken, in MB (default: 32); a larger one is a 413")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds running requests get to finish on SIGTERM/SIGINT (default: 30)")
    p.add_argument("--pooling", default=None, choices=POOLINGS,
                   help="how /v1/embeddings pools a text's hidden states (default: the model's, else last)")
    p.add_argument("--rerank", action="store_true",
                   help="serve the model (a Qwen3-Reranker checkpoint) as the reranker it is: /v1/rerank and "
                        "/v1/score score a document by the probability of \"yes\" against \"no\" after its prompt "
                        "(a GGUF converted from one, rank pooling, is one without it)")
    _model_sampling_arg(p)
    p.add_argument("--preset", default=None, help="synthetic model preset (random weights) instead of --model")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("embed", help="embedding vectors of texts (one JSON array per line)")
    p.add_argument("texts", nargs="*", help="texts to embed (default: one per line of stdin)")
    _model_args(p)
    p.add_argument("--pooling", default=None, choices=POOLINGS,
                   help="last, mean or cls (first) token's final hidden state (default: the model's, else last)")
    p.add_argument("--dimensions", type=int, default=None, help="keep the first N components (Matryoshka)")
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser("pull", help="fetch a model from the Hugging Face Hub (default: SmolLM2 into KESTREL_HOME)")
    p.add_argument("model", nargs="?", default=None,
                   help="a Hub name, owner/name[@revision][:TAG] (TAG: a GGUF repository's quantization)")
    p.add_argument("--force", action="store_true",
                   help="download the model's files again, whatever the cache holds (a damaged download)")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("list", help="the models on this machine: the default one, the Hugging Face cache's")
    p.add_argument("--json", action="store_true", help="one JSON object a model (name, format, path, size, modified)")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("cache", help="the quantized models kestrel cached, what each was built from, its size")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--prune", action="store_true", help="remove the entries whose model (or adapter) is gone")
    action.add_argument("--clear", action="store_true", help="remove every entry (models are quantized again)")
    p.add_argument("--json", action="store_true", help="one JSON object an entry")
    p.set_defaults(func=cmd_cache)

    p = sub.add_parser("quantize", help="quantize a model into a .kst strip-cache artifact")
    p.add_argument("model")
    p.add_argument("--output", "-o", required=True)
    p.add_argument("--quant", "-q", default=None,
                   help="q8 (default; a symmetric 4-bit checkpoint: q4, its own codes), q4, q8-g256, q4-g256")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("bench", help="prefill and decode tok/s")
    _model_args(p, kv_cache_mb=True)
    _speculate_arg(p)
    p.add_argument("--preset", default=None, help="synthetic model preset instead of --model")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3, help="timed runs at batch 1, their medians reported (default: 3; "
                   "--concurrency runs each level once)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (kernel compiles, caches; --concurrency "
                   "warms up with two short requests of its own)")
    p.add_argument("--concurrency", default=None, metavar="N,N,...",
                   help="continuous batching at these concurrency levels (e.g. 1,8,32,64; each at most 4096) "
                   "instead of batch 1")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)
    for command in sub.choices.values():  # -v after the command too (kestrel serve -v), not only before it
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="show tracebacks and debug logs")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; Ctrl-C at any moment of it (argument parsing and logging setup too) is "interrupted", exit 130."""
    try:
        code = _main(argv)
        _finish_cache_writes()  # what the command left writing, failed or not
        return code
    except KeyboardInterrupt:
        _finish_cache_writes(cancel=True)
        print("interrupted", file=sys.stderr)
        return 130


def _finish_cache_writes(cancel: bool = False) -> None:
    """A command's model cache entry still being written on a thread (a large new checkpoint): waited for at
    the command's end, with a progress bar, or cancelled on Ctrl-C. Nothing to do where no loader ran."""
    loader = sys.modules.get("kestrel_core.model.loader")
    if loader is not None:
        loader.finish_cache_writes(cancel=cancel)


def _interrupted() -> int:
    _finish_cache_writes(cancel=True)
    err.print("interrupted")
    return INTERRUPTED_EXIT


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(message)s",
                        handlers=[log_handler()])
    # huggingface_hub prints its warnings with a handler of its own, which a root handler would print again
    logging.getLogger("huggingface_hub").propagate = False
    if not args.verbose:  # numpy's overflow and invalid-value notes: what they lead to is checked and reported
        warnings.simplefilter("ignore", RuntimeWarning)
    try:
        from kestrel_core.model.validate import check_cli_args
        from kestrel_core.registry import default_options, parse_backend_options

        check_cli_args(args)  # every command's values, before anything slow
        args.backend_options = parse_backend_options(getattr(args, "backend_option", None))
        with default_options(args.backend_options):  # every Registry this command builds opens with them
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return _interrupted()
    except BrokenPipeError:  # the reader left (``kestrel run ... | head``): stop quietly, as a killed writer does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 128 + signal.SIGPIPE
    except (KestrelError, OSError, MemoryError) as exc:
        if args.verbose:
            err.print_exception()
        if interrupted():  # the error is what an interrupt dropped in a callback left (numba's cache save)
            return _interrupted()
        # numpy's MemoryError says how much; an OSError that reaches here is its words and path, not "[Errno N]"
        said = (f" not enough memory: {exc}" if isinstance(exc, MemoryError)
                else f" {os_error(exc)}" if isinstance(exc, OSError) else f" {exc}")
        err.print(Text.assemble(("error:", "red"), said), soft_wrap=True)
        return 2
    except BaseException as exc:  # an unexpected bug (a Rust extension's panic too): still one line unless -v
        if isinstance(exc, SystemExit):
            raise
        if args.verbose:
            err.print_exception()
        if interrupted():
            return _interrupted()
        err.print(Text.assemble(("error:", "red"), f" {type(exc).__name__}: {exc} (run with -v for the traceback)"),
                  soft_wrap=True)
        return 1
