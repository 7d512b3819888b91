"""A seeded soak of speculative decoding against plain decoding on the real embedded model
(SmolLM2), one speculating ``Model``, one request at a time (``tests/engine/speckit.py`` says
what each seed asks and checks):

    PYTHONPATH=src python bench/spec_fuzz.py [--start 0] [--count 100] [--minutes 30]
                                             [--seeds 3,17,42] [--verbose]
                                             [--model GGUF] [--n-ctx-slot 512] [--swa-full]

Each seed's request is asked twice, plainly and with a random speculative setting, under two
cache salts (each reusing its own earlier rows, so later seeds draft from the cache too); the
replies (text, tokens, finish reason, usage, logprobs) must be equal bit for bit, the context
must hold exactly the cells its slots say after each, and both must have saved rows of the same
tokens. Seeds run in order on one model, so a seed's cache holds the earlier seeds' rows: to
replay a mismatch run the same ``--start`` up to it (the command is printed), or ``--seeds S``
alone from a cold cache. Prints a line a seed, each mismatch, and a summary. Run it alone on
2 cores: it is the whole machine's work.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.engine.speckit import (
    Outcome,
    dump_case,
    fuzz_config,
    fuzz_engine,
    make_case,
    replay_command,
    run_case,
    traced,
)

from kvwarm.engine.api import untile_at_start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--count", type=int, default=100, help="seeds to run")
    ap.add_argument("--seeds", default="", help="these seeds (comma-separated), in order")
    ap.add_argument("--minutes", type=float, default=0.0, help="stop after this long (0: never)")
    ap.add_argument("--ngram-n", type=int, default=3, help="the model's spec_ngram_n")
    ap.add_argument("--verbose", action="store_true", help="print each case as JSON")
    ap.add_argument(
        "--model",
        default=None,
        help="a GGUF to soak instead (e.g. $KVWARM_GEMMA: a sliding window)",
    )
    ap.add_argument("--n-ctx-slot", type=int, default=512, help="each slot's window")
    ap.add_argument(
        "--swa-full", action="store_true", help="a full-size sliding-window cache (llama.cpp's)"
    )
    args = ap.parse_args()
    seeds = (
        [int(s) for s in args.seeds.split(",") if s]
        if args.seeds
        else list(range(args.start, args.start + args.count))
    )
    command = " ".join([sys.executable, *sys.argv])
    print(f"# {command}", flush=True)
    began = time.monotonic()
    outcomes: list[Outcome] = []
    config = fuzz_config(args.n_ctx_slot, spec_ngram_n=args.ngram_n)
    if args.swa_full:
        config = replace(config, context=replace(config.context, swa_full=True))
    # As ``kvwarm serve`` does before any thread starts: a K-quant model (Gemma 3) verifies
    # drafts exactly only with llama.cpp's tiled kernel off.
    untile_at_start([(args.model, config)])
    with fuzz_engine() as engine, traced() as paths:
        model = engine.load_model(args.model, config=config)
        info = model.info()
        print(
            f"# model {info.id}: speculation {info.speculation}, exact {info.speculation_exact}, "
            f"cells {info.type_k}/{info.type_v}",
            flush=True,
        )
        for seed in seeds:
            if args.minutes and time.monotonic() - began > args.minutes * 60:
                print("# time is up", flush=True)
                break
            case = make_case(seed, model)
            if args.verbose:
                print(f"#   {dump_case(case)}", flush=True)
            started = time.monotonic()
            try:
                out = run_case(engine, model, case)
            except Exception as exc:  # a request that failed is a finding too
                out = Outcome(case, mismatches=[f"raised {exc!r}"])
            outcomes.append(out)
            print(f"{out.line()} [{time.monotonic() - started:.1f}s]", flush=True)
            for line in out.mismatches:
                print(f"    {line}", flush=True)
            for line in out.notes:
                print(f"    note: {line}", flush=True)
        filler = model.status().filler_rows
    bad = [o.case.seed for o in outcomes if o.mismatches]
    drafted = sum(o.drafted for o in outcomes)
    accepted = sum(o.accepted for o in outcomes)
    print(
        f"# {len(outcomes)} seeds in {time.monotonic() - began:.0f}s: drafted {drafted}, "
        f"accepted {accepted}, seeds that drafted "
        f"{sum(1 for o in outcomes if o.drafted)}, with a rejection "
        f"{sum(1 for o in outcomes if o.drafted > o.accepted)}, with notes "
        f"{sum(1 for o in outcomes if o.notes)}; mismatches {len(bad)} {bad}"
    )
    print(
        f"# draft sources: cached rows matched {paths.row_matches} times, rows replayed a "
        f"request {paths.replays} times, predictions matched {paths.predicted} times; "
        f"filler rows {filler}"
    )
    if bad:
        print(f"# replay in order: {replay_command(seeds[: seeds.index(bad[0]) + 1])}")
        print(f"# or alone, cold: {replay_command([bad[0]])}")
    print(f"# {command}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
