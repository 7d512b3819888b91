"""OpenAI's predicted outputs on kvwarm: a chat's ``prediction`` drafted where the model
speculates (``engine/worker/drafts.Predicted``), against the same requests without one.

    python bench/prediction.py [--model PATH.gguf] [--rounds 3] [--max-tokens 96]

One kvwarm server (``--spec-type ngram-simple``, the bench's other flags as
``bench/speculative.py``'s), greedy chat requests to ``/v1/chat/completions``, each under a
cache salt of its own so no cached row replays another's reply. Per load and round: the plain
reply (``spec_type`` none), then, alternated in a rotating order, the plain request again,
the speculating request with no prediction, with the plain reply as its prediction
(``exact``), and with that reply changed in one line (``edited``: an edit the model does not
make, as a client's guess of a file that changed more than it thought). The loads are replies
the model does not copy from its prompt (SmolLM2 writes its own code and prose), where n-gram
drafts have nothing to draft from and a prediction is all there is. Prints each variant's
median decode speed by the server's own timings (``predicted_n - 1`` tokens in
``predicted_ms``), its ratio to plain, the drafts kept, and whether every reply is the plain
reply's text (it must be). llama-server has no ``prediction`` (it ignores the field), so it is
not run. Run it alone: two processes decoding at once on 2 cores halve each other.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from multiturn import post
from speculative import Server, machine_load

LOADS = {
    "code": "Write a Python function that merges two sorted lists into one sorted list. "
    "Reply with the code only.",
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "steps": "Explain in five numbered steps how to make a cup of tea.",
}
VARIANTS = ("plain", "spec", "exact", "edited")


def edit(text: str) -> str:
    """``text`` with its middle line (or, with one line, its middle word) replaced."""
    lines = text.split("\n")
    if len(lines) >= 3:
        at = len(lines) // 2
        lines[at] = "# this line is not what the model writes"
        return "\n".join(lines)
    words = text.split(" ")
    words[len(words) // 2] = "zebra"
    return " ".join(words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import kvwarm.embedded

    print("command: " + " ".join([sys.executable, *sys.argv]), flush=True)
    model = args.model or kvwarm.embedded.default_model_path()
    print(f"model {model}; before: {machine_load()}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="kvwarm-prediction-bench-"))
    server = Server("kvwarm-spec", model, args.threads, work, model)
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    salt = 0

    def ask(content: str, **extra: object) -> tuple[str, float, int, int]:
        """(text, decode seconds, decode steps, drafts kept) of one request, cold."""
        nonlocal salt
        salt += 1
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "cache_salt": f"bench-{salt}",
            **extra,
        }
        out = post(url, body)
        timings = out["timings"]
        assert isinstance(timings, dict)
        text = str(out["choices"][0]["message"]["content"])  # type: ignore[index]
        steps = int(timings["predicted_n"]) - 1
        return text, timings["predicted_ms"] / 1e3, steps, int(timings["draft_n_accepted"])

    runs: dict[tuple[str, str], list[tuple[float, int, bool]]] = {}
    try:
        server.start()
        turn = 0
        for _ in range(args.rounds):
            for load, content in LOADS.items():
                reference = ask(content, spec_type="none")[0]
                extra: dict[str, dict[str, object]] = {
                    "plain": {"spec_type": "none"},
                    "spec": {},
                    "exact": {"prediction": {"type": "content", "content": reference}},
                    "edited": {"prediction": {"type": "content", "content": edit(reference)}},
                }
                order = VARIANTS[turn % 4 :] + VARIANTS[: turn % 4]
                turn += 1
                for variant in order:
                    text, seconds, steps, kept = ask(content, **extra[variant])
                    speed = steps / seconds if seconds > 0 else 0.0
                    runs.setdefault((load, variant), []).append((speed, kept, text == reference))
    finally:
        server.stop()
    print(f"after: {machine_load()}\n", flush=True)
    print(f"{'load':7} {'variant':8} {'tok/s':>8} {'x plain':>8} {'kept':>6}  text")
    for load in LOADS:
        plain = statistics.median(r[0] for r in runs[(load, "plain")])
        for variant in VARIANTS:
            rs = runs[(load, variant)]
            speed = statistics.median(r[0] for r in rs)
            same = "same as plain" if all(r[2] for r in rs) else "DIFFERS from plain"
            kept = sum(r[1] for r in rs)
            print(f"{load:7} {variant:8} {speed:8.1f} {speed / plain:8.2f} {kept:6}  {same}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    start = time.monotonic()
    main()
    print(f"\n{time.monotonic() - start:.0f} s in all")
