"""The CLI handlers of run, chat, embed, pull, quantize and bench (list and cache: model/inventory.py): thin
layers over the Python API.

Each takes the argparse Namespace, its values already checked by the CLI (``validate.check_cli_args``), and
returns an exit code; errors are KestrelErrors, which the CLI prints as one line. Generated text goes to
stdout; the backend line, stats and prompts go to stderr.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from rich.table import Table

from kestrel_core.console import dumps, err, out
from kestrel_core.entry import interrupt_handled
from kestrel_core.errors import InvalidRequest, KestrelError, os_error
from kestrel_core.model.engine import Engine
from kestrel_core.model.engine_load import load, load_preset
from kestrel_core.model.fim import fim_prompt_ids
from kestrel_core.model.grammar import json_schema_grammar, lark_grammar, regex_grammar
from kestrel_core.model.harmony import HarmonyStream, is_harmony
from kestrel_core.model.reasoning import ReasoningStream, opens_in_prompt, reasoning_markers, think_kwargs
from kestrel_core.model.rerank import is_reranker
from kestrel_core.model.speculate import DRAFT_MIN, DRAFT_P_MIN
from kestrel_core.model.validate import concurrency_levels, read_line_stdin, read_text_stdin


def _open_engine(args: argparse.Namespace) -> Engine:
    preset = getattr(args, "preset", None)
    if preset and getattr(args, "model", None):
        raise KestrelError("give either --model or --preset, not both")
    kv_cache_mb = getattr(args, "kv_cache_mb", None)
    if preset:
        engine = load_preset(preset, backend=args.backend, quant=args.quant, seed=getattr(args, "model_seed", 0),
                             kv_cache_mb=kv_cache_mb, activations=getattr(args, "activations", "auto"),
                             **load_options(args, preset=True))
    else:
        engine = load(args.model, backend=args.backend, quant=args.quant, kv_cache_mb=kv_cache_mb,
                      activations=getattr(args, "activations", "auto"), **load_options(args))
    if getattr(args, "no_model_sampling", False):
        engine.sampling_defaults = {}
    err.print(engine.backend_line, soft_wrap=True)
    try:
        set_speculate(engine, getattr(args, "speculate", 0), getattr(args, "draft_model", None), args.quant,
                      getattr(args, "draft_p_min", None), getattr(args, "draft_min", None))
    except BaseException:
        engine.close()
        raise
    return engine


def set_speculate(engine: Engine, tokens: int, draft_model: str | None = None, quant: str | None = None,
                  draft_p_min: float | None = None, draft_min: int | None = None) -> None:
    """``--speculate``, and ``--draft-model`` (loaded at ``quant`` where the engine guesses at all, its guesses cut
    at ``--draft-p-min``, DRAFT_P_MIN where None, its drafts of fewer than ``--draft-min`` dropped, DRAFT_MIN where
    None): set, with a note where this model and backend decode without guesses."""
    engine.speculate = tokens
    if engine.speculate and not engine.rewinds:
        why = ("its recurrent layers keep a state, which cannot take back a wrong guess"
               if engine.config.state_layers else
               f"the {engine.backend_name} backend runs whole steps on a KV cache it cannot rewind (that takes "
               "API 1.6's kestrel_forward_batch)")
        err.print(f"--speculate: this model decodes without guesses here ({why})", soft_wrap=True)
    elif engine.speculate and draft_model is not None:
        from kestrel_core.model.draft_model import attach_draft_model

        attach_draft_model(engine, draft_model, quant, DRAFT_P_MIN if draft_p_min is None else draft_p_min,
                           DRAFT_MIN if draft_min is None else draft_min)


def _note_options(engine: Engine, args: argparse.Namespace) -> None:
    """Say which of the model's recommended sampling values this command takes (those not given), when
    --speculate cannot speculate because the answer is sampled or constrained, and when --think has nothing to
    switch."""
    template = getattr(engine.tokenizer, "chat_template", None)
    if getattr(args, "think", None) is not None and not (reasoning_markers(template) or is_harmony(template)):
        err.print("--think: this model's chat template has no reasoning to switch; it is ignored", soft_wrap=True)
    taken = {k: v for k, v in engine.sampling_defaults.items() if getattr(args, k, None) is None}
    if taken:
        values = ", ".join(f"{k.replace('_', '-')} {v:g}" for k, v in taken.items())
        err.print(f"sampling as the model recommends: {values} (--no-model-sampling: greedy)", soft_wrap=True)
    params = engine.sampling_params(temperature=args.temperature, top_k=args.top_k,
                                    repetition_penalty=args.repetition_penalty)
    if engine.speculate and not params.argmax_only:
        err.print("--speculate: only greedy decoding without penalties guesses tokens; this answer is sampled "
                  "(-t 0 --repetition-penalty 1 for greedy)", soft_wrap=True)
    elif engine.speculate and any(getattr(args, k, None) is not None for k in ("json_schema", "regex", "grammar")):
        err.print("--speculate: a constrained answer decodes without guesses", soft_wrap=True)


def _open_generator(args: argparse.Namespace) -> Engine:
    """``_open_engine`` for the commands that generate text: an embedding model is refused at once."""
    engine = _open_engine(args)
    try:
        engine.check_generates()
    except KestrelError:
        engine.close()
        raise
    return engine


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        if not args.prompt:  # as an empty stdin is refused: a chat template would answer a blank turn
            raise KestrelError("the prompt given is empty (pass some text, as an argument or on stdin)")
        return args.prompt
    # a piped line ends in a newline the prompt given as an argument lacks (`echo ... | kestrel run`): the same
    # question gets the same answer either way
    text = "" if sys.stdin.isatty() else read_text_stdin(sys.stdin).removesuffix("\n").removesuffix("\r")
    if not text:
        raise KestrelError("no prompt given (pass it as an argument or on stdin)")
    return text


def _prompt(engine: Engine, messages: list[dict[str, str]], chat: bool, args: argparse.Namespace
            ) -> tuple[list[int], HarmonyStream | ReasoningStream | None]:
    """The prompt's ids (the chat template's, with --think's variables, or the last message's text alone) and how
    its answer is read: harmony's channels (gpt-oss), a reasoning block (a template that teaches one), or as text."""
    tok = engine.tokenizer
    if not chat:
        return list(tok.encode(messages[-1]["content"])), None
    text = tok.apply_chat_template(messages, True, **(think_kwargs(getattr(args, "think", None), engine.harmony) or {}))
    ids = list(tok.encode(text, add_special_tokens=False))  # the template writes any BOS itself
    markers = reasoning_markers(getattr(tok, "chat_template", None))
    if engine.harmony:
        return ids, HarmonyStream()
    return ids, ReasoningStream(opens_in_prompt(text, markers), markers) if markers is not None else None


def _check_context(engine: Engine, ids: Sequence[int]) -> None:
    if len(ids) > engine.config.max_position:
        raise KestrelError(f"the prompt has {len(ids)} tokens; the model's context is {engine.config.max_position}")
    if not ids:
        raise KestrelError("the prompt is empty")


def load_options(args: argparse.Namespace, preset: bool = False) -> dict[str, Any]:
    """load()'s ``max_model_len``, ``kv_cache_type``, ``rope_scaling`` (--rope-scaling: JSON as config.json's
    rope_scaling, or @file) and, for a model that is not a preset, ``lora`` and ``lora_scale``."""
    out: dict[str, Any] = {"max_model_len": getattr(args, "max_model_len", None), "rope_scaling": None,
                           "kv_cache_type": getattr(args, "kv_cache_type", "f16")}
    scale = getattr(args, "lora_scale", None)
    if getattr(args, "lora", None) is not None:
        if preset:
            raise KestrelError("--lora merges into a model's checkpoint; a preset has none")
        out.update(lora=args.lora, lora_scale=1.0 if scale is None else scale)
    elif scale is not None:
        raise KestrelError("--lora-scale scales a --lora adapter, and none is given")
    text = getattr(args, "rope_scaling", None)
    if text is not None:
        try:
            out["rope_scaling"] = json.loads(_option_text(text, "--rope-scaling"))
        except ValueError as exc:
            raise KestrelError(f"--rope-scaling: not JSON ({exc})") from None
        if not isinstance(out["rope_scaling"], dict):
            raise KestrelError("--rope-scaling: a JSON object, as config.json's rope_scaling")
    return out


def _option_text(value: str, option: str) -> str:
    """An option's value, or with a leading @ the text of the file it names, read as stdin is: strictly UTF-8
    and at most MAX_STDIN_BYTES (``@/dev/zero`` would fill the memory)."""
    if not value.startswith("@"):
        return value
    try:
        with open(value[1:], encoding="utf-8") as f:
            return read_text_stdin(f, f"{option}: {value[1:]}")
    except OSError as exc:
        raise os_error(exc, f"{option}: cannot read", value[1:]) from None


def _grammar(args: argparse.Namespace) -> str | None:
    """The grammar ``run``'s answer keeps to (--json-schema, --regex, --grammar), or None."""
    try:
        return _option_grammar(args)
    except InvalidRequest as exc:
        raise KestrelError(f"{exc.param}: {exc}") from None


def _option_grammar(args: argparse.Namespace) -> str | None:
    if getattr(args, "json_schema", None) is not None:
        text = _option_text(args.json_schema, "--json-schema")
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise KestrelError(f"--json-schema: not JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise KestrelError("--json-schema: a JSON Schema is a JSON object")
        return json_schema_grammar(schema, param="--json-schema")
    if getattr(args, "regex", None) is not None:
        return regex_grammar(args.regex, param="--regex")
    if getattr(args, "grammar", None) is not None:
        return lark_grammar(_option_text(args.grammar, "--grammar"), param="--grammar")
    return None


def _stream(engine: Engine, ids: list[int], args: argparse.Namespace, out: TextIO | None,
            grammar: str | None = None, stop_token_ids: tuple[int, ...] = (),
            reader: HarmonyStream | ReasoningStream | None = None) -> tuple[str, list[int], str | None, str | None]:
    """Generate, writing text to ``out`` as it arrives; returns (text, token ids, reasoning, finish reason: "stop"
    or "length"). ``reader`` (from ``_prompt``) splits the answer's reasoning (gpt-oss's analysis channel, or a
    reasoning block) from its text: the reasoning is shown dimmed on stderr as it comes where ``out`` is given; the
    special tokens' text is kept where the reader reads them (harmony's channels, Mistral's [THINK] tags)."""
    channels = None if grammar is not None else reader  # a constrained answer is what it is constrained to
    reads_special = isinstance(channels, HarmonyStream) or isinstance(channels, ReasoningStream) \
        and channels.markers.control
    params = engine.sampling_params(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                    top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                                    seed=args.seed, stop=tuple(getattr(args, "stop", None) or ()), grammar=grammar,
                                    stop_token_ids=stop_token_ids, skip_special_tokens=not reads_special)
    pieces: list[str] = []
    thoughts: list[str] = []
    tokens: list[int] = []

    def show(thought: str, text: str) -> None:
        thoughts.append(thought)
        pieces.append(text)
        if out is not None and thought:
            err.print(thought, end="", style="dim", highlight=False, soft_wrap=True)
        if out is not None and text:
            out.write(text)
            out.flush()

    finish = None
    for step in engine.stream(ids, params):
        tokens.extend(step.new_token_ids)
        finish = step.finish_reason or finish
        if step.new_text:
            show(*(channels.feed(step.new_text) if channels is not None else ("", step.new_text)))
    if channels is not None:
        thought, text = channels.finish()
        show(thought, text)
        if out is not None and "".join(thoughts):
            err.print()
    return "".join(pieces), tokens, "".join(thoughts) or None, finish


def _say_if_the_context_ended(engine: Engine, finish: str | None, tokens: list[int], args: argparse.Namespace) -> None:
    """A note on stderr where the answer stopped at the end of the model's context, short of ``--max-tokens``."""
    if finish == "length" and len(tokens) < args.max_tokens:
        err.print(f"(the answer reached the end of the model's context of {engine.config.max_position} tokens)",
                  style="dim")


def stats_line(stats: dict[str, Any]) -> str:
    guesses = f" | guesses kept {stats['accepted']}/{stats['drafted']}" if stats.get("drafted") else ""
    return (f"prompt {stats['prompt_tokens']} tok | prefill {stats['prefill_tok_s']:.1f} tok/s | "
            f"decode {stats['decode_tok_s']:.1f} tok/s ({stats['decode_tokens']} tok after the first){guesses} | "
            f"backend {stats['backend']} | offload {stats['offload_accepted']} accepted, "
            f"{stats['offload_declined']} declined")


def _offload_table(stats: dict[str, Any]) -> Table:
    table = Table(title="offload hooks")
    for col in ("hook", "offered", "accepted", "declined", "reasons"):
        table.add_column(col)
    for hook, c in stats["offload"].items():
        reasons = ", ".join(f"{r}: {n}" for r, n in c["declined_reasons"].items())
        table.add_row(hook, str(c["offered"]), str(c["accepted"]), str(c["declined"]), reasons)
    return table


def _backend_table(stats: dict[str, Any]) -> Table | None:
    """The backend's own counters (kestrel_stats: cache hits, simulated NPU time...), if it keeps any."""
    counters = stats.get("backend_stats") or {}
    if not counters:
        return None
    table = Table(title=f"backend {stats['backend']}")
    table.add_column("counter")
    table.add_column("value", justify="right")
    for name, value in counters.items():
        table.add_row(name, f"{value:.6g}" if isinstance(value, float) else str(value))
    return table


def run(args: argparse.Namespace) -> int:
    text_in = _read_prompt(args)
    grammar = _grammar(args)
    with _open_generator(args) as engine:
        engine.prefix_cache = False  # one request: nothing reads what it would keep (nor fills a device's pool)
        _note_options(engine, args)
        stops: tuple[int, ...] = ()
        if args.suffix is not None:  # the prompt is the prefix of a fill-in-the-middle prompt
            try:
                ids, stops = fim_prompt_ids(engine.tokenizer, text_in, args.suffix, engine.eos_token_ids)
            except InvalidRequest as exc:
                raise KestrelError(f"--suffix: {exc}") from None
            reader = None
        else:
            ids, reader = _prompt(engine, [{"role": "user", "content": text_in}], not args.no_chat, args)
        _check_context(engine, ids)
        if args.seed is None:  # drawn here rather than by the sampler, so --json can report it
            args.seed = secrets.randbits(63)
        text, tokens, reasoning, finish = _stream(engine, ids, args, None if args.json else sys.stdout, grammar,
                                                  stops, reader)
        stats = engine.stats
        if args.json:
            answer = {"text": text, **({"reasoning": reasoning} if reader is not None and grammar is None else {})}
            print(dumps({**answer, "tokens": tokens, "finish_reason": finish, "prompt_tokens": len(ids),
                         "seed": args.seed, "stats": stats}))
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()
        _say_if_the_context_ended(engine, finish, tokens, args)
        err.print(stats_line(stats), soft_wrap=True)
        if args.stats:
            err.print(_offload_table(stats))
            backend_table = _backend_table(stats)
            if backend_table is not None:
                err.print(backend_table)
    return 0


def chat(args: argparse.Namespace) -> int:
    """A multi-turn session: each turn re-renders the whole conversation with the chat template."""
    interactive = sys.stdin.isatty()
    with _open_generator(args) as engine:
        engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])  # no template: said before a turn
        _note_options(engine, args)
        if interactive:
            import readline  # noqa: F401  (input() then edits the line and keeps a history)
            err.print('type a message (several lines between two lines of """); /exit or Ctrl-D ends, /reset starts '
                      "over, Ctrl-C stops an answer")
        messages: list[dict[str, str]] = []
        refused = False  # a message refused: a session read from a pipe or file then ends as failed
        while True:
            line = _chat_message(interactive)
            if line is None or line in ("/exit", "/quit"):
                break
            if line == "/reset":
                messages.clear()
                continue
            if not line:
                continue
            messages.append({"role": "user", "content": line})
            try:
                ids, reader = _prompt(engine, messages, True, args)
            except KestrelError as exc:  # a template that refuses this conversation (roles must alternate...)
                messages.pop()
                err.print(f"error: {exc} (the message is dropped; /reset starts over)", soft_wrap=True)
                refused = True
                continue
            if len(ids) + 1 > engine.config.max_position:
                messages.pop()
                err.print(f"error: the conversation has {len(ids)} tokens; the model's context is "
                          f"{engine.config.max_position} (/reset to start over)", soft_wrap=True)
                refused = True
                continue
            try:
                reply, tokens, _, finish = _stream(engine, ids, args, sys.stdout, reader=reader)
            except KeyboardInterrupt:  # the answer stops, the session goes on without that turn
                if not interactive:
                    raise
                interrupt_handled()
                messages.pop()
                sys.stdout.write("\n")
                err.print("(stopped)", style="dim")
                continue
            sys.stdout.write("\n")
            sys.stdout.flush()
            _say_if_the_context_ended(engine, finish, tokens, args)
            messages.append({"role": "assistant", "content": reply.strip()})
    return 2 if refused and not interactive else 0


class _BlockDropped(Exception):
    """Ctrl-C inside a block of several lines: the block is dropped, as Ollama drops it."""


def _chat_line(interactive: bool, prompt: str, in_block: bool = False) -> str | None:
    """A line typed (edited with readline) or read from stdin, without its newline; None at the end. Ctrl-C
    gives a fresh prompt, as a shell does, or inside a block (``in_block``) drops it (_BlockDropped)."""
    if not interactive:
        line = read_line_stdin(sys.stdin)
        return line.rstrip("\r\n") if line else None
    while True:
        try:
            return input(prompt)
        except EOFError:
            sys.stdout.write("\n")
            return None
        except KeyboardInterrupt:
            interrupt_handled()
            sys.stdout.write("\n")
            if in_block:
                raise _BlockDropped from None


def _chat_message(interactive: bool) -> str | None:
    """The next message: a line, or the lines between two lines of three quotes (Ollama's way); None at the
    end."""
    while True:
        line = _chat_line(interactive, "> ")
        if line is None or not line.strip().startswith('"""'):
            return None if line is None else line.strip()
        lines = [line.strip()[3:]]
        try:
            while not lines[-1].endswith('"""'):
                more = _chat_line(interactive, "... ", in_block=True)
                if more is None:
                    break
                lines.append(more)
        except _BlockDropped:
            continue
        return "\n".join(lines).removesuffix('"""').strip()


def _embed_texts(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The texts ``embed`` takes, and each one's place ("line 3 of stdin", "argument 2"): its arguments, else
    each line of stdin, split at newlines only (as ``wc -l`` counts them), so the Nth vector is the Nth line's. An
    empty text is refused by its place, as /v1/embeddings refuses an empty input: its vector would be the special
    tokens' alone, and skipping it would shift the vectors after it."""
    texts, place = list(args.texts), "argument {}"
    if not texts and not sys.stdin.isatty():
        text = read_text_stdin(sys.stdin)  # which ends every line in "\n", whatever the line ends it read
        texts, place = (text.removesuffix("\n").split("\n") if text else []), "line {} of stdin"
    if not texts:
        raise KestrelError("no text to embed (pass texts as arguments, or one a line on stdin)")
    places = [place.format(i + 1) for i in range(len(texts))]
    empty = next((i for i, text in enumerate(texts) if not text), None)
    if empty is not None:
        raise KestrelError(f"{places[empty]} is empty: every text to embed needs at least one character")
    return texts, places


def embed(args: argparse.Namespace) -> int:
    """Each text's embedding as a JSON array on a line of its own, in the order given."""
    from kestrel_core.model.embed import check_input

    texts, places = _embed_texts(args)
    with _open_engine(args) as engine:
        if is_reranker(engine.config):
            raise KestrelError("this is a reranker: it scores query-document pairs (kestrel serve: /v1/rerank), "
                               "its hidden states are no embeddings")
        # each text's own limits first, so that a refusal names the text as an empty one is named
        ids = [check_input(engine, engine.tokenizer.encode(text), f"text of {where}")
               for text, where in zip(texts, places)]
        vectors = engine.embed(ids, pooling=args.pooling, dimensions=args.dimensions)
        for v in vectors:
            sys.stdout.write(json.dumps(v.tolist()) + "\n")
        sys.stdout.flush()
        s = engine.last
        err.print(f"{len(texts)} texts | {s.prompt_tokens} tok | {s.prefill_tok_s:.1f} tok/s | "
                  f"{vectors.shape[1]} dimensions", soft_wrap=True)
    return 0


def pull(args: argparse.Namespace) -> int:
    from kestrel_core.model.hub import fetch, parse_hub_spec
    from kestrel_core.model.pull import pull_default_model

    if args.model is None:
        if args.force:  # its pull hashes the file and replaces a damaged one
            raise KestrelError("--force downloads a Hub model again; the default model is checked against its "
                               "sha256 on every kestrel pull")
        print(pull_default_model(progress=True, rehash=True))
        return 0
    spec = parse_hub_spec(args.model)
    if Path(args.model).expanduser().exists():  # what --model loads as it is, whatever Hub name it also reads as
        raise KestrelError(f"{args.model} is a local path, which -m loads as it is; kestrel pull fetches a Hugging "
                           "Face Hub name" + (f" (that repository: kestrel pull hf.co/{spec})" if spec else ""))
    if spec is None:
        raise KestrelError(f"{args.model!r} is not a Hugging Face Hub name (owner/name[@revision][:TAG])")
    print(fetch(spec, force=args.force))
    return 0


def quantize(args: argparse.Namespace) -> int:
    from kestrel_core.artifact import read_meta
    from kestrel_core.artifact_write import check_output
    from kestrel_core.model.loader import load_model, write_artifact
    from kestrel_core.model.quantize import parse_quant

    out = Path(args.output)
    if out.suffix != ".kst":  # kestrel knows its artifacts by their suffix: another would not load as one
        raise KestrelError(f"{out}: an artifact's file name ends in .kst (for example {out.with_suffix('.kst')})")
    check_output(out, args.force)  # before the (slow) load
    source = Path(args.model)
    try:
        inside = source.exists() and (out.exists() and out.samefile(source)
                                      or source.is_dir() and out.resolve().is_relative_to(source.resolve()))
    except OSError as exc:  # a name too long, a directory it may not search
        raise os_error(exc, "cannot read the model", source) from None
    if inside:
        raise KestrelError(f"{out} is the model being quantized, or inside it: write the artifact elsewhere")
    if args.quant is not None:
        wanted = parse_quant(args.quant).name
        if source.is_file() and source.suffix == ".kst" and (held := read_meta(source).quant) != wanted:
            raise KestrelError(f"{source} holds {held} weights and an artifact is not re-quantized: quantize the "
                               f"model it was built from with --quant {wanted}")
    loaded = load_model(args.model, quant=args.quant, cache="read")  # a cached build is reused, not copied
    try:
        path = write_artifact(loaded, out, force=args.force)
    except OSError as exc:  # a full disk's error names no file
        raise os_error(exc, "cannot write", out) from exc
    err.print(f"wrote {path} ({loaded.quant}, {path.stat().st_size / 1e6:.1f} MB) from {loaded.source}",
              soft_wrap=True)
    return 0


def bench(args: argparse.Namespace) -> int:
    from kestrel_core.model.quantize import model_quant

    if args.concurrency:
        return _bench_concurrency(args)
    from kestrel_core.model.bench import run_bench

    with _open_engine(args) as engine:
        result = run_bench(engine, prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
                           runs=args.runs, warmup=args.warmup,
                           quant=args.quant or model_quant(engine.model))
    if args.json:
        print(dumps(result.as_dict(), indent=2))
        return 0
    table = Table(title=f"kestrel bench: {result.model}")
    table.add_column("")
    table.add_column("value", justify="right")
    rows = [
        ("backend", f"{result.backend} ({result.device})"), ("quant", result.quant),
        ("weights", f"{result.weights_mb:.1f} MB"), ("model load", f"{result.load_s:.2f} s"),
        ("preload", f"{result.preload_s:.2f} s"),
        (f"prefill ({result.prompt_tokens} tok)", f"{result.prefill_tok_s:.1f} tok/s"),
        (f"decode ({result.decode_tokens} tok)", f"{result.decode_tok_s:.1f} tok/s"),
        ("runs (median of)", str(result.runs)),
    ]
    if result.upload_mb_per_token:
        rows.append(("weights uploaded",
                     f"{result.upload_mb_per_token:.1f} MB a token at {result.upload_gb_s:.1f} GB/s"))
    if result.bus_gb_s:
        rows.append(("bus (pinned copy)", f"{result.bus_gb_s:.1f} GB/s: a token in {result.bus_ratio:.2f}x "
                                          "its uploads' time at it"))
    for name, value in rows:
        table.add_row(name, value)
    out.print(table)
    return 0


def _bench_concurrency(args: argparse.Namespace) -> int:
    from kestrel_core.model.bench import run_concurrency_bench
    from kestrel_core.model.quantize import model_quant

    levels = concurrency_levels(args.concurrency)
    with _open_engine(args) as engine:
        result = run_concurrency_bench(engine, levels, prompt_tokens=args.prompt_tokens,
                                       decode_tokens=args.decode_tokens,
                                       quant=args.quant or model_quant(engine.model),
                                       warn=lambda text: err.print(text, style="yellow", soft_wrap=True))
    if args.json:
        print(dumps(result.as_dict(), indent=2))
        return 0
    table = Table(title=f"kestrel bench: {result.model}, {result.backend} {result.quant}, "
                        f"{result.prompt_tokens}-token prompts, {result.decode_tokens} tokens each")
    table.caption = "decode: tok/s while every stream decodes; output: all tokens over the run; stream: median"
    for col in ("streams", "decode", "output", "stream", "TTFT p50", "TTFT p99", "steps", "preempted"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in result.levels:
        table.add_row(str(r.concurrency), f"{r.decode_tok_s:.1f}", f"{r.output_tok_s:.1f}", f"{r.stream_tok_s:.1f}",
                      f"{r.ttft_p50_s * 1e3:.0f} ms", f"{r.ttft_p99_s * 1e3:.0f} ms", str(r.steps),
                      str(r.preemptions))
    out.print(table)
    return 0
