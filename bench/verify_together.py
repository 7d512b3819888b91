"""Several slots speculating at once: their verify passes in one call each (``spec_exact``
true: cell order kept, so replies stay plain decoding's) against one shared call
(``spec_exact`` false: ``WorkerConfig.verify_together``), side by side in one run.

    python bench/verify_together.py [--model PATH.gguf] [--rounds 3] [--max-tokens 96]
                                    [--draft-cost 0.05]

Two models of the same GGUF in one engine, each ``n_parallel`` = 3 with q8_0 K and V cells
(what a speculating model's ``auto`` gives on the CPU, so the two differ only in how their
verify passes are grouped), ``spec_type`` ngram-simple, the CPU's own draft pricing or
``--draft-cost``'s. A round
sends the three copy loads of ``bench/speculative.py`` (rename, quote, json) at once to one
model, then to the other (the order alternating by round), each request under a salt of its
own (a cold prefill, no row drafted from an earlier round). Prints per round and model: the
wall time until all three replies are in, ``llama_decode`` calls and those verifying two
drafts or more, the decode speed (completion tokens over the summed ``generation_ms`` divided
by three, i.e. per request while all three run), drafts accepted/drafted, and how many
replies differ from the other model's (cell order may flip a near tie). Run it alone: two
processes decoding at once on 2 cores halve each other.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from kvwarm.backends.base import BatchToken, ContextParams
from kvwarm.embedded import default_model_path
from kvwarm.engine.api import Engine, EngineConfig, ModelConfig
from kvwarm.engine.model import Model
from kvwarm.engine.types import Completion, GenerationOptions
from kvwarm.engine.worker.drafts import Cost, PassCost
from speculative import LOADS

COPIES = ("rename", "quote", "json")


class Calls:
    """Counts a worker context's ``llama_decode`` calls, and those verifying ≥ 2 drafts."""

    def __init__(self, model: Model) -> None:
        ctx = model._worker.rt.ctx
        self.total = self.together = 0
        inner = ctx.decode

        def decode(batch: list[BatchToken]) -> None:
            rows: dict[int, int] = {}
            for t in batch:
                rows[t.seq] = rows.get(t.seq, 0) + t.logits
            self.total += 1
            self.together += sum(n > 1 for n in rows.values()) > 1
            inner(batch)

        ctx.decode = decode  # type: ignore[method-assign]


def one_round(
    model: Model, calls: Calls, opts: GenerationOptions, salt: str
) -> tuple[float, int, int, list[Completion]]:
    before = (calls.total, calls.together)
    gate = threading.Event()
    held = model._worker.call(gate.wait)  # all three admitted in one tick
    started = time.perf_counter()
    streams = [
        model.stream_chat(
            [{"role": "user", "content": LOADS[load]}], options=opts, cache_salt=f"{salt}{load}"
        )
        for load in COPIES
    ]
    gate.set()
    held.result()
    done = [stream.result() for stream in streams]
    wall = time.perf_counter() - started
    return wall, calls.total - before[0], calls.together - before[1], done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--draft-cost",
        type=float,
        default=None,
        help="price a drafted token at this fraction of a pass (a GPU's trade-off, e.g. "
        "0.05, so every slot drafts each tick) instead of the CPU's measured cost",
    )
    args = ap.parse_args()
    if args.draft_cost is not None:
        cost = Cost(0.0, args.draft_cost)
        PassCost.cost = property(lambda self: cost)  # type: ignore[method-assign,assignment]
    print("command: " + " ".join([sys.executable, *sys.argv]), flush=True)
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    path = str(args.model or default_model_path())
    context = ContextParams(
        n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=args.threads, type_k="q8_0", type_v="q8_0"
    )
    opts = GenerationOptions(max_tokens=args.max_tokens, temperature=0.0)
    with Engine(EngineConfig()) as engine:
        models: dict[str, tuple[Model, Calls]] = {}
        for name, exact in (("apart", True), ("together", False)):
            config = ModelConfig(
                context=context, spec_type="ngram-simple", n_parallel=3, spec_exact=exact
            )
            model = engine.load_model(path, model_id=name, config=config)
            assert model._worker.rt.cfg.verify_together is not exact
            models[name] = (model, Calls(model))
        speeds: dict[str, list[float]] = {name: [] for name in models}
        walls: dict[str, list[float]] = {name: [] for name in models}
        for r in range(args.rounds):
            order = list(models) if r % 2 == 0 else list(reversed(models))
            texts: dict[str, list[str]] = {}
            for name in order:
                model, calls = models[name]
                wall, n_calls, together, done = one_round(model, calls, opts, f"r{r}{name}")
                tokens = sum(len(d.completion_tokens) for d in done)
                gen_s = sum(d.stats.generation_ms for d in done) / 1000 / len(done)
                speed = tokens / len(done) / gen_s
                drafted = sum(d.stats.drafted_tokens for d in done)
                accepted = sum(d.stats.accepted_tokens for d in done)
                speeds[name].append(speed)
                walls[name].append(wall)
                texts[name] = [d.text for d in done]
                print(
                    f"round {r + 1} {name:9s} wall {wall:6.2f} s  calls {n_calls:4d} "
                    f"(verifying >=2 drafts: {together:3d})  {speed:6.1f} tok/s a request  "
                    f"drafts {accepted}/{drafted}  tokens {tokens}",
                    flush=True,
                )
            differ = sum(a != b for a, b in zip(texts["apart"], texts["together"], strict=True))
            print(f"round {r + 1}: {differ} of {len(COPIES)} replies differ between the two")
        for name in models:
            print(
                f"{name:9s} median wall {statistics.median(walls[name]):.2f} s, "
                f"median {statistics.median(speeds[name]):.1f} tok/s a request"
            )
    print(f"load average after: {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
