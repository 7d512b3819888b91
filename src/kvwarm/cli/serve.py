"""``kvwarm serve``: the OpenAI-compatible server under uvicorn.

Invariant: the socket is bound before any model loads (loading happens in the app's background
thread), so ``/health`` answers 503 while loading instead of refusing connections.
"""

from __future__ import annotations

import argparse

from kvwarm.cli.common import add_settings, settings_from


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models, "
        "/health, /metrics, /tokenize, /detokenize and /cache/* (stats, rows, prewarm, evict, "
        "gc, verify). Defaults: the embedded model, a disk cache tier under the user cache "
        "directory.",
    )
    add_settings(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvwarm.server import create_app

    settings = settings_from(args)
    app = create_app(settings)
    # log_config=None keeps our logging setup; the per-request line comes from kvwarm itself.
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
    )
    return 0
