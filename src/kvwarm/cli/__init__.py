"""The ``kvwarm`` command line: serve, cluster, complete, chat, cache, bench, models.

Invariants: exit status 0 on success, 1 on a runtime error, 2 on a usage or settings error;
error messages go to stderr as one line, never as a traceback for an expected ``KvwarmError``.
Every subcommand reads its settings through ``kvwarm.settings.load_settings`` (flags > env >
config file > defaults), the same loader the server uses.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvwarm._version import __version__
from kvwarm.errors import ConfigError, KvwarmError

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    from kvwarm.cli import cache_cmd, cluster, generate, misc, serve

    parser = argparse.ArgumentParser(
        prog="kvwarm",
        description="Local LLMs through llama.cpp with a token-exact, multi-tier KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"kvwarm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve.register(sub)
    cluster.register(sub)
    generate.register(sub)
    cache_cmd.register(sub)
    misc.register(sub)
    return parser


def _bench_argv(argv: list[str]) -> list[str]:
    """``kvwarm bench [--script PATH] ARGS...``: ARGS are the script's, its options included.
    argparse's REMAINDER takes them only after a positional, so ``kvwarm bench --lengths 128``
    was refused as an unknown option (found by review); a ``--`` is put before them."""
    rest = argv[1:]
    head: list[str] = []
    if rest[:1] == ["--script"] and len(rest) >= 2:
        head, rest = rest[:2], rest[2:]
    elif rest[:1] and rest[0].startswith("--script="):
        head, rest = rest[:1], rest[1:]
    if not rest or rest[0] in ("-h", "--help", "--"):
        return argv
    return ["bench", *head, "--", *rest]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["bench"]:
        given = _bench_argv(given)
    args = parser.parse_args(given)
    try:
        code: int = args.run(args)
    except ConfigError as exc:
        print(f"kvwarm: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KvwarmError as exc:
        print(f"kvwarm: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("kvwarm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `kvwarm cache ls | head`
        logging.shutdown()
        return EXIT_OK
    return code
