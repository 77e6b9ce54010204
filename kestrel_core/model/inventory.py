"""The CLI handlers of list and cache: what this machine holds (models, quantized builds), read without
loading a model; ``cache --prune`` and ``--clear`` also remove entries."""

from __future__ import annotations

import argparse
import json
import stat

from rich.table import Table

from kestrel_core.console import err, out, print_uncut


def list_models(args: argparse.Namespace) -> int:
    """The models kestrel can load without a download: the default one once pulled, and what the Hugging Face
    cache holds (``hub.cached_models``), by the name ``--model`` takes."""
    import datetime

    from kestrel_core.model.hub import CachedModel, cached_models
    from kestrel_core.model.pull import DEFAULT_MODEL, default_model_path, home_error

    models = []
    default = default_model_path()
    try:
        st = default.stat()
    except FileNotFoundError:
        st = None
    except OSError as exc:  # KESTREL_HOME a file, or a directory it may not read: not "no local models"
        raise home_error(exc, "cannot read the directory", default.parent) from None
    if st is not None and stat.S_ISREG(st.st_mode):
        name = f"{DEFAULT_MODEL.filename.split('.')[0]} (the default: no -m)"  # what `kestrel run` loads without -m
        models.append(CachedModel(name, "gguf", default, st.st_size, st.st_mtime))
    models += cached_models()
    if args.json:
        for m in models:
            print(json.dumps({"name": m.name, "format": m.kind, "path": str(m.path), "size": m.size,
                              "modified": m.modified}))
        return 0
    table = Table(title="local models (kestrel run -m NAME; the default one without -m)")
    for column in ("name", "format", "size", "modified"):
        table.add_column(column, justify="right" if column == "size" else "left", no_wrap=True)
    for m in models:
        when = datetime.datetime.fromtimestamp(m.modified).strftime("%Y-%m-%d %H:%M")
        table.add_row(m.name, m.kind, f"{m.size / 1e6:,.0f} MB", when)
    if models:
        print_uncut(table)
    else:
        out.print("no local models: kestrel pull, or kestrel run -m owner/name, fetches one")
    return 0


def cache(args: argparse.Namespace) -> int:
    """The quantized models cached in ``$KESTREL_HOME/cache`` (cache.cache_entries); ``--prune`` removes those
    whose model is gone, ``--clear`` all of them."""
    import datetime

    from kestrel_core.model.cache import cache_dir, cache_entries, cache_temps, prune_cache

    if args.prune or args.clear:
        removed, temps = prune_cache(everything=args.clear)
        err.print(f"removed {len(removed)} cache entries ({sum(e.size for e in removed) / 1e6:,.0f} MB) and "
                  f"{len(temps)} temp files of writers that died ({sum(t.size for t in temps) / 1e6:,.0f} MB) "
                  f"from {cache_dir()}", soft_wrap=True)
        return 0
    entries = cache_entries()
    if args.json:
        for e in entries:
            print(json.dumps({"path": str(e.path), "sources": list(e.sources), "quant": e.quant, "size": e.size,
                              "used": e.used, "orphaned": e.orphaned}))
        return 0
    table = Table(title=f"quantized models cached in {cache_dir()} (kestrel cache --prune removes the orphaned)")
    for column in ("built from", "quant", "size", "last used", "state"):
        table.add_column(column, justify="right" if column == "size" else "left", overflow="fold")
    for e in entries:
        when = datetime.datetime.fromtimestamp(e.used).strftime("%Y-%m-%d %H:%M")
        table.add_row(" + ".join(e.sources) or e.path.name, e.quant, f"{e.size / 1e6:,.0f} MB", when,
                      "orphaned" if e.orphaned else "ok")
    out.print(table if entries else f"the cache {cache_dir()} holds no entries")
    if entries:
        out.print(f"{sum(e.size for e in entries) / 1e6:,.0f} MB in {len(entries)} entries", highlight=False)
    if dead := [t for t in cache_temps() if t.dead]:
        out.print(f"{sum(t.size for t in dead) / 1e6:,.0f} MB in {len(dead)} temp files of writers that died "
                  "(kestrel cache --prune removes them)", highlight=False)
    return 0
