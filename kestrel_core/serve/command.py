"""The ``kestrel serve`` handler: load the engine, serve until SIGTERM/SIGINT.

fastapi, uvicorn, httptools and prometheus-client are the ``serve`` extra: they are imported here, only when serving,
and a missing one is a one-line error that says how to install them.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os

from kestrel_core.console import timed_log_handler
from kestrel_core.env import env_str
from kestrel_core.errors import KestrelError

API_KEY_ENV = "KESTREL_API_KEY"
_NEEDED = {"fastapi": "fastapi", "uvicorn": "uvicorn", "httptools": "httptools",
           "prometheus_client": "prometheus-client"}


def _check_installed() -> None:
    missing = [pip for module, pip in _NEEDED.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise KestrelError(f"kestrel serve needs {', '.join(missing)}: pip install \"kestrel[serve]\"")


def _setup_logging(verbose: bool) -> None:
    """Request lines and the startup line go to stderr as plain lines, whatever the CLI's root logging."""
    logger = logging.getLogger("kestrel.serve")
    if not any(getattr(h, "_kestrel_serve", False) for h in logger.handlers):
        handler = timed_log_handler()
        handler._kestrel_serve = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    logger.propagate = False


def _api_key(option: str | None) -> str | None:
    """--api-key, else $KESTREL_API_KEY, else None; refused before the model loads where it is not valid UTF-8
    (lone surrogates to Python) or is blank: a blank variable, often a deployment's unset one substituted empty,
    would serve without a key, so it fails closed."""
    from kestrel_core.model.validate import strict_text

    if option is not None:  # the command line refused a blank one
        return strict_text(option.strip(), "--api-key")  # a header's value is read stripped
    if API_KEY_ENV in os.environ and not env_str(API_KEY_ENV):
        raise KestrelError(f"{API_KEY_ENV} is set but empty: give it a key, or unset it to serve without one")
    return strict_text(env_str(API_KEY_ENV), API_KEY_ENV) or None


def serve_command(args: argparse.Namespace) -> int:
    _check_installed()  # the option values were checked by the CLI, as every command's are
    from kestrel_core.model.commands import load_options, set_speculate
    from kestrel_core.model.engine_load import load, load_preset
    from kestrel_core.model.loader import finish_cache_writes
    from kestrel_core.model.scheduler import DEFAULT_MAX_BATCH, DEFAULT_MAX_WAITING
    from kestrel_core.serve.access import DEFAULT_MAX_REQUEST_BYTES, check_origins
    from kestrel_core.serve.server import bind_socket, serve

    _setup_logging(bool(getattr(args, "verbose", False)))
    api_key = _api_key(args.api_key)
    origins = check_origins(args.allowed_origins or ())
    names = args.served_model_name or []
    if len(names) > max(1, len(args.model or ())):
        raise KestrelError(f"{len(names)} --served-model-name for {len(args.model or ()) or 1} model(s)")
    preset = getattr(args, "preset", None)
    if preset and args.model:
        raise KestrelError("give either --model or --preset, not both")
    if args.lora is not None and len(args.model or ()) > 1:
        raise KestrelError("--lora merges into one model; serve one --model with it")
    if args.draft_model is not None and len(args.model or ()) > 1:
        raise KestrelError("--draft-model drafts for one model; serve one --model with it")
    if args.rerank and (preset or len(args.model or ()) != 1):
        raise KestrelError("--rerank makes one checkpoint a reranker; serve one --model with it (a reranker GGUF "
                           "needs no --rerank)")
    loading = load_options(args, preset=bool(preset))  # a bad option is its error, not a busy port's
    sock = bind_socket(args.host, args.port)  # a busy port fails now, not after the model has loaded
    engines = []
    try:
        options = dict(backend=args.backend, quant=args.quant, kv_cache_mb=args.kv_cache_mb,
                       activations=getattr(args, "activations", "auto"))
        if preset:
            engines.append(load_preset(preset, **options, **loading))
        else:
            for model in args.model or [None]:
                engines.append(load(model, **options, **loading, rerank=args.rerank))
        for engine in engines:
            set_speculate(engine, args.speculate, args.draft_model, args.quant, args.draft_p_min, args.draft_min)
            if args.no_model_sampling:
                engine.sampling_defaults = {}
        status = serve(engines, host=args.host, port=args.port, api_key=api_key, sock=sock,
                       max_batch=args.max_batch if args.max_batch is not None else DEFAULT_MAX_BATCH,
                       max_waiting=args.max_waiting if args.max_waiting is not None else DEFAULT_MAX_WAITING,
                       token_budget=args.token_budget, model_names=names, shutdown_grace_s=args.shutdown_grace,
                       pooling=args.pooling, max_request_bytes=DEFAULT_MAX_REQUEST_BYTES
                       if args.max_request_mb is None else int(args.max_request_mb * 1e6),
                       allowed_origins=origins, scheduling_policy=args.scheduling_policy)
    finally:
        for engine in engines:
            engine.close()
        sock.close()
        finish_cache_writes(cancel=True)  # a stopping server does not wait for its model's cache entry
    return status
