"""``kestrel serve``: an OpenAI-compatible HTTP server over the continuous-batching ``AsyncEngine``.

The modules import fastapi, uvicorn, httptools and prometheus-client (the ``serve`` extra); nothing else in kestrel
imports this package but the CLI's ``serve`` handler, so ``kestrel run`` works without them. ``command`` is
that handler, ``server`` runs uvicorn with a graceful shutdown, ``app`` holds the routes, ``generation``
runs one request (whole or streamed, aborted when its client leaves), ``bodies`` is the base of every API's
request bodies, ``protocol`` has OpenAI's requests and ``responses`` their answers' shapes, ``tools`` reads the tool
calls in an answer and ``reasoning`` its reasoning block, ``errors`` has OpenAI's error bodies, ``access`` the
per-request log line and the API key check, ``connection`` the limits on a connection that makes no progress,
``metrics`` the Prometheus metrics.
"""
