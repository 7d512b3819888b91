"""``kvwarm serve``: the OpenAI-compatible server under uvicorn.

Invariant: the socket is bound before any model loads (loading happens in the app's background
thread), so ``/health`` answers 503 while loading instead of refusing connections. Before any
thread starts, the process's matrix kernels are decided over every model it may load
(``common.decide_kernels``). A server
none of whose models loaded stops and exits 1 with the reason; one with some models left keeps
serving them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from types import FrameType

from kvwarm.cli.common import add_settings, decide_kernels, settings_from, stop_signals
from kvwarm.errors import ModelLoadError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve the OpenAI API (/v1/completions, /v1/chat/completions, "
        "/v1/responses, /v1/embeddings, /v1/rerank, /v1/models), Anthropic's (/v1/messages), "
        "llama-server's /completion, /completions, /tokenize, /detokenize, /apply-template, "
        "/infill, /embedding, /embeddings, /props, /slots, /rerank, /reranking, /v1/reranking, "
        "/v2/rerank and /lora-adapters, /health, /metrics, /cache/* (stats, rows, slots, "
        "prewarm, keepalive, evict, gc, verify), /admin/models/load|unload and a web page at / "
        "(a chat, the models and a live cache dashboard). Defaults: the embedded model, a disk "
        "cache tier under the user cache directory.",
    )
    add_settings(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: the server extra (uvicorn, fastapi) is not needed by the other commands.
    from kvwarm.server import create_app
    from kvwarm.server.connections import Server, uvicorn_config

    class _Server(Server):
        """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, so the process dies of the
        signal; for a CLI a requested, clean shutdown is success (exit 0). A second signal
        exits at once (found by review: uvicorn forces only on a second SIGINT, and only its
        wait for open connections; the engine's shutdown, bounded by 30 s per stuck worker,
        ignored every further signal)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            with stop_signals(self.handle_exit):
                yield

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if not self.should_exit:
                self.should_exit = True  # the first: a graceful shutdown, saves flushed
                return
            # Not logging (its lock may be held by the thread this handler interrupted).
            os.write(2, b"kvwarm: second signal: exiting now; saves still pending are lost\n")
            os._exit(128 + sig)

    settings = settings_from(args)
    # Here, in the main thread before the server's threads: the kernels every model it may
    # load computes with (a speculating K-quant model needs llama.cpp's tiled kernel off).
    decide_kernels(settings)
    fatal: list[str] = []

    def on_fatal(reason: str) -> None:  # from the loader thread: nothing can be served
        fatal.append(reason)
        server.should_exit = True

    app = create_app(settings, on_fatal=on_fatal)
    # Slow clients are dropped and connections capped (server/connections.py).
    # Its shutdown ends streams still running with an error event (ServerState.drain).
    server = _Server(uvicorn_config(app, settings), drain=app.state.kvwarm.drain)
    try:
        server.run()
    except SystemExit:
        # uvicorn logs why it could not start (the port is taken, the host does not resolve)
        # and exits 3 (found by review): the CLI's failure is 1, with one line of its own.
        if server.started:
            raise
        print(
            f"kvwarm: error: cannot serve on {settings.host}:{settings.port} "
            "(the reason is logged above)",
            file=sys.stderr,
        )
        return 1
    if fatal:
        raise ModelLoadError(f"no model could be loaded: {fatal[0]}")
    return 0 if server.started else 1
