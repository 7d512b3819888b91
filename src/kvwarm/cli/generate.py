"""``kvwarm complete`` (one prompt, streamed, with timings) and ``kvwarm chat`` (a REPL).

Invariant: generated text goes to stdout as it streams; timings and the per-turn cache report
go to stderr. The chat REPL keeps the conversation client-side and re-sends all of it each turn
(stateless, like an OpenAI client): the cache is what makes the repeated prefix cheap, and the
report shows how many prompt tokens it restored.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, TextIO

from kvwarm.cli.common import (
    MODEL_SETTINGS,
    add_model_id,
    add_settings,
    loaded_model,
    settings_from,
)
from kvwarm.engine.types import Completion, GenerationOptions
from kvwarm.errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from kvwarm.engine.model import Model


def _add_sampling(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        metavar="T",
        help="0 for greedy (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=None, metavar="N")
    parser.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop sequence (repeatable)"
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    complete = sub.add_parser(
        "complete",
        help="complete one prompt and print the text and its timings",
        description="Stream a completion to stdout; timings and cache use go to stderr.",
    )
    complete.add_argument("prompt", nargs="?", default="-", help="the prompt ('-': stdin)")
    _add_sampling(complete, 64)
    add_model_id(complete, "to complete with")
    add_settings(complete, MODEL_SETTINGS)
    complete.set_defaults(run=run_complete)

    chat = sub.add_parser(
        "chat",
        help="interactive multi-turn chat (reads stdin)",
        description="One user message per line. Commands: /reset, /system TEXT, /exit. "
        "After each reply, stderr shows how many prompt tokens came from the cache.",
    )
    chat.add_argument("--system", default=None, metavar="TEXT", help="system prompt")
    _add_sampling(chat, 256)
    add_model_id(chat, "to chat with")
    add_settings(chat, MODEL_SETTINGS)
    chat.set_defaults(run=run_chat)


def _options(args: argparse.Namespace) -> GenerationOptions:
    """The sampling flags; a value out of range is a usage error (exit 2), as a flag that is
    not a number is, not a failure (exit 1)."""
    opts = GenerationOptions(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    try:
        opts.validate()
    except InvalidRequestError as exc:
        flag = f"--{exc.param.replace('_', '-')}: " if exc.param else ""
        raise ConfigError(f"{flag}{exc}") from None
    return opts


def _why(done: Completion) -> str:
    """Why no more of the prompt came from the cache (``kvwarm.cache.explain``), if known."""
    r = done.stats.reuse
    return "" if r is None else f"; {r.reason.value}, found {r.found_tokens}"


def timing_line(done: Completion) -> str:
    s = done.stats
    rate = s.completion_tokens / (s.generation_ms / 1000) if s.generation_ms > 0 else 0.0
    return (
        f"prompt {s.prompt_tokens} tokens ({s.cached_tokens} from cache, {s.cache_hit}"
        f"{_why(done)}), "
        f"prefill {s.prefill_ms:.1f} ms; {s.completion_tokens} tokens in "
        f"{s.generation_ms:.1f} ms ({rate:.1f} tok/s); queue {s.queue_ms:.1f} ms; "
        f"finish {s.finish_reason}"
    )


def _stream_to(out: TextIO, fragments: Iterable[str]) -> None:
    for fragment in fragments:
        out.write(fragment)
        out.flush()


def _lenient_stdin() -> None:
    """Bytes on stdin that are not UTF-8 reach the text as lone surrogates, as they do from
    the command line (``sys.argv``): the prompt's own check then refuses them with a typed
    error naming where (``kvwarm.unicode``). Found by review: under a locale whose stdin
    decodes strictly (en_US.UTF-8, Python's default) one Latin-1 byte was a traceback, and in
    ``chat`` it ended the REPL with its conversation."""
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="surrogateescape")


def run_complete(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    opts = _options(args)
    if args.prompt == "-":
        _lenient_stdin()
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    with loaded_model(settings, args.model_id) as model:
        stream = model.stream(prompt, opts)
        try:
            _stream_to(sys.stdout, stream)
        finally:
            stream.cancel()  # a no-op once finished; frees the slot on Ctrl-C
        done = stream.result()
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(timing_line(done), file=sys.stderr)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    opts = _options(args)
    _lenient_stdin()
    interactive = sys.stdin.isatty()
    system: str | None = args.system
    history: list[dict[str, object]] = []
    refused = 0  # turns the model refused (each reported, dropped from the conversation)
    with loaded_model(settings, args.model_id) as model:
        if interactive:
            print(f"chatting with {model.id}; /reset, /system TEXT, /exit", file=sys.stderr)
        turn = 0
        while True:
            if interactive:
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history.clear()
                print("(conversation reset)", file=sys.stderr)
                continue
            command, _, rest = text.partition(" ")
            if command == "/system":
                # The word alone: a message such as "/systemd will not boot" was taken for
                # "/system d will not boot", the conversation reset (found by review).
                system = rest.strip() or None
                history.clear()
                print("(system prompt set; conversation reset)", file=sys.stderr)
                continue
            history.append({"role": "user", "content": text})
            messages = ([{"role": "system", "content": system}] if system else []) + history
            try:
                done = _turn(model, messages, opts)
            except InvalidRequestError as exc:
                # Found by review: a turn the model refuses (the conversation has outgrown
                # the context, text that is not valid Unicode) ended the chat, its
                # conversation lost. It is reported and left out; the chat goes on, and the
                # exit status says a turn failed.
                history.pop()
                refused += 1
                print(
                    f"kvwarm: error: {exc} (not sent: the conversation is as it was; "
                    "/reset starts afresh)",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            turn += 1
            sys.stdout.write("\n")
            sys.stdout.flush()
            history.append({"role": "assistant", "content": done.text})
            s = done.stats
            print(
                f"[turn {turn}: cached {s.cached_tokens}/{s.prompt_tokens} prompt tokens "
                f"({s.cache_hit}{_why(done)}), prefill {s.prefill_ms:.1f} ms, "
                f"{s.completion_tokens} tokens "
                f"in {s.generation_ms:.1f} ms]",
                file=sys.stderr,
                flush=True,
            )
    return 1 if refused else 0


def _turn(
    model: Model, messages: Sequence[Mapping[str, object]], opts: GenerationOptions
) -> Completion:
    """One reply, streamed to stdout."""
    stream = model.stream_chat(messages, options=opts)
    try:
        _stream_to(sys.stdout, stream)
    finally:
        stream.cancel()
    return stream.result()
