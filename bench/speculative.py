"""Speculative decoding, kvwarm vs llama-server (the peer built from the same pinned llama.cpp by
``bench/peer.py``), side by side in one run, same model, same threads, servers alternated.

    python bench/speculative.py [--model PATH.gguf] [--draft-model PATH.gguf] [--rounds 2]
                                [--max-tokens 160] [--servers kvwarm,kvwarm-spec,llama,...]

Loads (issue 39), greedy, each a chat rendered once with the GGUF's template and sent as the same
text to every server's ``/v1/completions``: three that copy (return a function with one rename;
answer a question by quoting a passage; rewrite a JSON document with one key changed) and a plain
chat that copies nothing. ``rename-base`` and ``json-base`` are the rename and the JSON rewrite
as raw completions (the start of a document that goes on with the renamed function, the
rewritten JSON), for a base model such as Gemma 3 270M, which answers the chat turns with a loop
of its fallback template's tags. Servers:
kvwarm plain (its defaults: flash attention off on the CPU, f16 KV), ``kvwarm-fa``: kvwarm plain as
a speculating kvwarm runs (its server is ``kvwarm-spec``'s, each request ``spec_type`` none: flash
attention on, and the KV cells a speculating model's ``auto`` gives, q8_0 on the CPU), kvwarm
``--spec-type ngram-simple``, ``ngram-map-k``, ``ngram-mod``, ``ngram-map-k4v`` and ``ngram-cache``
and with ``--draft-model``, llama-server plain, with each n-gram ``--spec-type`` (its defaults: n
12, m 48; ``ngram-mod`` n 24; ``ngram-cache`` 8 tokens a draft, no lookup cache files, so its
context counts alone) and with ``--model-draft`` (the draft model: ``--draft-model``, by default
the model itself, which tests the path but cannot be faster on a CPU). Each request goes to every
server in turn (the order rotating per request), so a drift in the machine's speed falls on all
alike; each load runs ``--rounds`` times, each round's prompt beginning with its own "Request N."
(so no prompt is one a server saw before, though kvwarm's cached rows and llama-server's
``ngram-mod`` pool hold the earlier rounds' replies; ``--repeat`` sends the same prompts every
round). ``--base-tree DIR`` adds ``kvwarm-spec-base``: ``kvwarm-spec`` run from another source tree
(an A/B in one run). ``--kv-type T`` runs every server with K and V cells of type ``T`` (f16:
kvwarm then does not speculate where it is not exact, so ``--spec-exact false`` with it speculates
anyway). ``--gpu-layers N`` offloads N layers on every server (llama-server's ``-ngl``, whose
own default is not 0, is then always given); on a GPU kvwarm does not speculate unless
``--spec-exact false`` (a verify pass's exactness is measured on the CPU only).

Prints per load and server the median decode speed by the server's own timings (and each
round's, in order: a server drafting from its earlier replies is faster from the second on), on
one clock:
``predicted_n - 1`` tokens in ``predicted_ms`` (from the first token's sampling to the last one's;
the first token comes from the prompt's pass), llama-server's own ``predicted_per_second``
(measured 2026-11-29: kvwarm's ``generation_ms`` is within 0.3 ms of its ``predicted_ms``, so the
earlier ``completion_tokens / generation_ms`` against ``predicted_n / predicted_ms`` counted the
free first token on both sides alike; each speed is now 95/96 of what it was), the ratio to
kvwarm plain (of the medians, and the median of each round's ratio: ``paired``), the drafts
accepted/drafted, and whether the text is the plain text of the same numerics (greedy: it
must be, everywhere): a speculating kvwarm's is kvwarm-fa's (flash attention on, as
speculation runs it), llama-server's types' is llama-server plain's. Run it alone: two
processes decoding at once on 2 cores halve each other; it prints the machine's load average
before and after, which says what else ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from multiturn import free_port, post, stop_server, wait_ready
from peer import llama_server

FUNCTION = '''def merge_sorted(left, right):
    """Merge two sorted lists into one sorted list."""
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result
'''
PASSAGE = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
    "individual reefs and 900 islands stretching for over 2,300 kilometres over an area of "
    "approximately 344,400 square kilometres. The reef is located in the Coral Sea, off the "
    "coast of Queensland, Australia. It can be seen from outer space and is the world's "
    "biggest single structure made by living organisms."
)
DOCUMENT = {
    "name": "Alice Smith",
    "age": 34,
    "city": "Paris",
    "email": "alice.smith@example.com",
    "tags": ["admin", "editor", "viewer"],
    "address": {"street": "12 Rue de Rivoli", "zip": "75001", "country": "France"},
    "active": True,
}
LOADS: dict[str, str] = {
    "rename": "Here is a Python function:\n\n```python\n"
    + FUNCTION
    + "```\n\nRepeat this function with only its name changed from merge_sorted to "
    "merge_lists. Reply with the code only.",
    "quote": f"Passage: {PASSAGE}\n\nQuote the passage's sentences about where the reef is "
    "and how big it is, word for word.",
    "json": 'Rewrite this JSON document with the key "city" renamed to "town". Output only '
    "the JSON.\n\n" + json.dumps(DOCUMENT, indent=2),
    "chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
#: Loads sent as raw completions, for a base model (no chat turn): the prompt is the start of
#: a document whose natural continuation copies. Gemma 3 270M on PyPI is a base model; it
#: copies the function with its new name this way, where a chat-tuned 135M model would not.
RAW_LOADS: dict[str, str] = {
    "rename-base": "Original:\n\n```python\n"
    + FUNCTION
    + "```\n\nThe same function, renamed from merge_sorted to merge_lists:\n\n```python\n"
    "def merge_lists(",
    # The JSON load as a document: a base model given it as a chat turn (Gemma 3 270M has no
    # chat template: chatml) answers with a loop of the template's own tags, where as the
    # start of a document it goes on copying the document. (The quote as a document: Gemma
    # 3 270M repeats one sentence of the passage, in a loop, rather than quoting it.)
    "json-base": "Original:\n\n"
    + json.dumps(DOCUMENT, indent=2)
    + '\n\nThe same document with the key "city" renamed to "town":\n\n'
    + '{\n  "name": "Alice Smith",\n',
}
SERVERS = (
    "kvwarm",
    "kvwarm-fa",
    "kvwarm-spec",
    "kvwarm-spec-map-k",
    "kvwarm-spec-mod",
    "kvwarm-spec-map-k4v",
    "kvwarm-spec-cache",
    "kvwarm-draft",
    "llama",
    "llama-ngram-simple",
    "llama-ngram-map-k",
    "llama-ngram-mod",
    "llama-ngram-map-k4v",
    "llama-ngram-cache",
    "llama-draft",
)
#: kvwarm's server name -> its --spec-type
KVWARM_SPEC = {
    "kvwarm-spec": "ngram-simple",
    "kvwarm-spec-base": "ngram-simple",
    "kvwarm-spec-map-k": "ngram-map-k",
    "kvwarm-spec-mod": "ngram-mod",
    "kvwarm-spec-map-k4v": "ngram-map-k4v",
    "kvwarm-spec-cache": "ngram-cache",
}


@dataclass
class Server:
    name: str
    model: Path
    threads: int
    work: Path
    draft: Path
    #: Another kvwarm source tree to run (``--base-tree``: the ``kvwarm-spec-base`` server).
    tree: Path | None = None
    #: Every server's K and V cell type (``--kv-type``; None: each server's default, f16).
    kv_type: str | None = None
    #: kvwarm's ``--spec-exact`` (``--spec-exact``; None: its default, true).
    spec_exact: str | None = None
    #: Layers offloaded to a GPU, every server alike (``--gpu-layers``).
    gpu_layers: int = 0
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def kvwarm(self) -> bool:
        return self.name.startswith("kvwarm")

    def command(self) -> list[str]:
        if self.kvwarm:
            extra = ["--spec-type", KVWARM_SPEC[self.name]] if self.name in KVWARM_SPEC else []
            if self.name == "kvwarm-fa":
                # kvwarm-spec's server with each request's spec_type none (below): the same
                # flash attention and the same KV cells (a speculating model's ``auto`` cells
                # are q8_0 on the CPU), so its replies are the plain replies of the same
                # numerics.
                extra = ["--spec-type", "ngram-simple"]
            if self.name == "kvwarm-draft":
                extra = ["--draft-model", str(self.draft)]
            if self.kv_type is not None:
                extra += ["--cache-type-k", self.kv_type, "--cache-type-v", self.kv_type]
            if self.spec_exact is not None:
                extra += ["--spec-exact", self.spec_exact]
            return [
                sys.executable, "-m", "kvwarm", "serve", "--host", "127.0.0.1",
                "--port", str(self.port), "--model", f"m={self.model}", "--n-ctx", "4096",
                "--n-threads", str(self.threads), "--n-threads-batch", str(self.threads),
                "--cache-dir", str(self.work / self.name), "--n-parallel", "1",
                "--n-gpu-layers", str(self.gpu_layers), *extra,
            ]  # fmt: skip
        extra = ["--spec-type", self.name.removeprefix("llama-")] if self.name != "llama" else []
        if self.name == "llama-draft":
            extra = ["--model-draft", str(self.draft), "--spec-type", "draft-simple"]
        if self.kv_type is not None:
            extra += ["-ctk", self.kv_type, "-ctv", self.kv_type]
        return [
            str(llama_server()), "--host", "127.0.0.1", "--port", str(self.port),
            "-m", str(self.model), "-c", "4096", "-t", str(self.threads),
            "-tb", str(self.threads), "-np", "1", "--no-webui", "-ngl", str(self.gpu_layers),
            *extra,
        ]  # fmt: skip

    def start(self) -> None:
        print(f"{self.name}: {' '.join(self.command())}", flush=True)
        log = open(self.work / f"{self.name}.log", "wb")  # noqa: SIM115 (the child owns it)
        env = None if self.tree is None else {**os.environ, "PYTHONPATH": str(self.tree / "src")}
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env)
        wait_ready(f"http://127.0.0.1:{self.port}/health", self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            stop_server(self.proc, 30)

    def complete(self, prompt: str, max_tokens: int) -> tuple[str, float, int, int, int, int]:
        """(text, decode seconds, decode steps, drafted, accepted, completion tokens), by the
        server's own timings (``predicted_ms``, ``predicted_n``: the same clock on both):
        kvwarm's ``/v1/completions``, llama-server's native ``/completion``."""
        url = f"http://127.0.0.1:{self.port}"
        if self.kvwarm:
            body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            if self.name == "kvwarm-fa":
                body["spec_type"] = "none"
            out = post(f"{url}/v1/completions", body)
            timings, usage = out["timings"], out["usage"]
            assert isinstance(timings, dict) and isinstance(usage, dict)
            text = str(out["choices"][0]["text"])  # type: ignore[index]
            tokens = int(usage["completion_tokens"])
        else:
            body = {
                "prompt": prompt, "n_predict": max_tokens, "temperature": 0,
                "cache_prompt": True,
            }  # fmt: skip
            out = post(f"{url}/completion", body)
            timings = out["timings"]
            assert isinstance(timings, dict)
            text = str(out["content"])
            tokens = int(timings["predicted_n"])
        if "predicted_ms" not in timings:  # a kvwarm from before 2026-11-29 (--base-tree)
            timings = {**timings, "predicted_ms": timings["generation_ms"], "predicted_n": tokens}
        seconds, steps = timings["predicted_ms"] / 1e3, int(timings["predicted_n"]) - 1
        drafted = int(timings.get("draft_n", 0))
        accepted = int(timings.get("draft_n_accepted", 0))
        return text, float(seconds), steps, drafted, accepted, tokens


def render(model: Path, content: str) -> str:
    """The chat as the GGUF's own template renders it (one user turn), as text."""
    from kvwarm.cache.types import CacheConfig, TierConfig
    from kvwarm.engine.api import Engine, EngineConfig

    with Engine(EngineConfig(CacheConfig(tiers=(TierConfig("ram", 1 << 20),)))) as engine:
        m = engine.load_model(str(model), n_ctx=512)
        return m.apply_chat_template([{"role": "user", "content": content}])


def machine_load() -> str:
    one, five, _ = os.getloadavg()
    top = subprocess.run(
        ["ps", "-eo", "pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True, check=False
    ).stdout.splitlines()[1:6]
    return f"load average {one:.2f} (1 min) {five:.2f} (5 min); top: " + "; ".join(
        " ".join(line.split()) for line in top
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded)")
    parser.add_argument(
        "--draft-model", type=Path, default=None, help="draft model GGUF (default: the model)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--base-tree",
        type=Path,
        default=None,
        help="the kvwarm-spec-base server's source tree (kvwarm-spec from another commit, "
        "for an A/B in one run)",
    )
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--gpu-layers",
        type=int,
        default=0,
        help="layers offloaded, every server (kvwarm on a GPU speculates only with "
        "--spec-exact false: its verify passes are not measured exact there)",
    )
    parser.add_argument(
        "--kv-type",
        default=None,
        help="every server's K and V cell type (q8_0, bf16 ...; kvwarm's speculation is exact "
        "at any length with a type other than f16/f32)",
    )
    parser.add_argument(
        "--spec-exact",
        default=None,
        choices=("true", "false"),
        help="kvwarm's --spec-exact (false: speculate where a verify pass is not exact, e.g. "
        "with --kv-type f16)",
    )
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument(
        "--loads",
        default=",".join(LOADS),
        help=f"comma-separated, of {', '.join(LOADS)} (chat turns) and {', '.join(RAW_LOADS)} "
        "(a raw completion, for a base model such as Gemma 3 270M)",
    )
    parser.add_argument(
        "--repeat",
        action="store_true",
        help="send each round the same prompts (a server may then draft from its earlier "
        "replies: kvwarm from its cached rows, llama-server's ngram-mod from its pool); "
        "by default each round's prompts begin with their own 'Request N.'",
    )
    args = parser.parse_args()
    import kvwarm.embedded

    print("command: " + " ".join([sys.executable, *sys.argv]), flush=True)
    model = args.model or kvwarm.embedded.default_model_path()
    draft = args.draft_model or model
    names = [n for n in args.servers.split(",") if n]
    unknown = set(names) - {*SERVERS, "kvwarm-spec-base"}
    if unknown:
        raise SystemExit(f"unknown servers {sorted(unknown)}; known: {', '.join(SERVERS)}")
    if "kvwarm-spec-base" in names and args.base_tree is None:
        raise SystemExit("the kvwarm-spec-base server needs --base-tree")
    chosen = [name for name in args.loads.split(",") if name]
    unknown = set(chosen) - set(LOADS) - set(RAW_LOADS)
    if unknown:
        raise SystemExit(
            f"unknown loads {sorted(unknown)}; known: {', '.join([*LOADS, *RAW_LOADS])}"
        )

    def prompt_of(name: str, r: int) -> str:
        if name in RAW_LOADS:
            return RAW_LOADS[name] if args.repeat else f"# Request {r + 1}.\n{RAW_LOADS[name]}"
        return render(model, LOADS[name] if args.repeat else f"Request {r + 1}. {LOADS[name]}")

    rounds = [{name: prompt_of(name, r) for name in chosen} for r in range(args.rounds)]
    loads = rounds[0]
    print(f"model {model}; before: {machine_load()}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="kvwarm-spec-bench-"))
    servers = [
        Server(
            name, model, args.threads, work, draft,
            tree=args.base_tree if name == "kvwarm-spec-base" else None,
            kv_type=args.kv_type,
            spec_exact=args.spec_exact,
            gpu_layers=args.gpu_layers,
        )
        for name in names
    ]  # fmt: skip
    # (load, server) -> per round: (text, decode s, tokens, drafted, accepted)
    runs: dict[tuple[str, str], list[tuple[str, float, int, int, int, int]]] = {}
    try:
        for server in servers:
            server.start()
        turn = 0
        for prompts in rounds:
            for load, prompt in prompts.items():
                order = servers[turn % len(servers) :] + servers[: turn % len(servers)]
                turn += 1
                for server in order:
                    result = server.complete(prompt, args.max_tokens)
                    runs.setdefault((load, server.name), []).append(result)
    finally:
        for server in servers:
            server.stop()
    print(f"after: {machine_load()}\n", flush=True)
    # Speeds against the first server (kvwarm's defaults); texts against the plain server
    # whose numerics each one shares: flash attention changes the last bits of every logit,
    # so kvwarm with it off and everything with it on may greedily pick differently at a near
    # tie. kvwarm-fa is kvwarm-spec with spec_type none; llama-server runs llama.cpp's auto.
    base_name = names[0]
    spec_names = ("kvwarm-spec", "kvwarm-draft")
    same_as = {n: "kvwarm-fa" if n.startswith(spec_names) else n for n in names}
    same_as.update({n: "llama" for n in names if n.startswith("llama")})
    same_as = {n: ref if ref in names else base_name for n, ref in same_as.items()}
    # Two ratios: to kvwarm's defaults (the "plain decode speed"), and to the plain
    # server of the same numerics (kvwarm-fa for kvwarm's speculation: the chat goal's
    # "no slower than plain" at the same flash-attention setting; llama for llama-server's).
    # And the median of each round's ratio to kvwarm's defaults ("paired"): the two requests of
    # a round ran back to back, so a drift of the host's speed between rounds (±15% seen on
    # a shared host) mostly cancels there, where it does not in a ratio of medians.
    print(
        f"{'load':11} {'server':20} {'tok/s':>8} {'x ' + base_name:>10} {'paired':>7} "
        f"{'x plain':>8} {'acc/draft':>11}  text"
    )

    def speed_of(load: str, name: str) -> float:
        return statistics.median(r[2] / r[1] for r in runs[(load, name)] if r[1] > 0)

    def paired(load: str, name: str) -> float:
        pairs = zip(runs[(load, name)], runs[(load, base_name)], strict=True)
        return statistics.median(
            (r[2] / r[1]) / (b[2] / b[1]) for r, b in pairs if r[1] > 0 and b[1] > 0
        )

    for load in loads:
        base_speed = speed_of(load, base_name)
        for name in names:
            rs = runs[(load, name)]
            speed = speed_of(load, name)
            plain = speed_of(load, same_as[name])
            refs = [r[0] for r in runs[(load, same_as[name])]]
            same = all(r[0] == ref for r, ref in zip(rs, refs, strict=True))
            drafted = sum(r[3] for r in rs)
            accepted = sum(r[4] for r in rs)
            per_round = "/".join(f"{r[2] / r[1]:.0f}" for r in rs if r[1] > 0)
            print(
                f"{load:11} {name:20} {speed:8.1f} {speed / base_speed:10.2f} "
                f"{paired(load, name):7.2f} {speed / plain:8.2f} "
                f"{accepted:5}/{drafted:<5}  {'same as' if same else 'DIFFERS from'}"
                f" {same_as[name]} ({rs[0][5]} tokens; rounds {per_round} tok/s)"
            )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    start = time.monotonic()
    main()
    print(f"\n{time.monotonic() - start:.0f} s in all")
