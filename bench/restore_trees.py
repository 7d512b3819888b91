"""A sliding-window row's restore time per tier, this tree against another (``--base-tree``).

Issue 38's goal "restore time no worse than today" compares kvwarm after the change with
kvwarm before it. ``bench/chunks.py --only window`` compares the two row formats under
today's code (the window whole, as version 3, against the window in chunks, version 4),
which is stricter: today's code also restores version-3 rows faster than the code before.
This script measures the goal as written: the same 1,000-token Gemma 3 270M state saved and
restored by each tree's own code, each storing it as that tree does (before issue 38: the
window whole in the row; after: in shared chunks), per tier.

Each measurement runs in a child process whose ``PYTHONPATH`` is one tree's ``src``: it
loads the model, prefills the tokens, saves the row to every tier (ram, ram_file on
/dev/shm, disk, s3 on one moto server in its own process that both trees share, s3 with
``--s3-rtt-ms`` slept before every GET, as a remote store's round trip, and redis on one
Debian redis-server both trees share: an object store whose own cost a request is C's, where
moto's is Python's) and
restores it ``--reps`` times the engine's way (``open_row``, the chunks and the window or
payload joined into a reused ``JoinBuffer`` and restored: ``JoinBuffer.restore`` where the tree
has it, else ``join`` then ``kv_unpack``; what ``Admission._restore_whole`` does in each
tree), printing per tier the median wall ms and the restoring process's CPU
ms (and, for s3, the moto process's CPU a restore: the store's share, which a client cannot
shrink). The trees' children alternate ``--rounds`` times (base, this, base, this...), so a
drift of the machine's speed falls on both; the figures printed are the medians over rounds.

Usage (the base tree is a ``git archive`` of the commit before the change)::

    mkdir -p /tmp/base && git archive b03a9ee | tar -x -C /tmp/base
    PYTHONPATH=src:. .venv/bin/python bench/restore_trees.py --base-tree /tmp/base \\
        [--model GGUF] [--reps 40] [--rounds 3] [--flash-attn off|on] [--tiers ram,disk]

Run it alone: a second process decoding or copying beside it moves every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
TEXT = (
    "The history of the lighthouse begins with fires lit on hills to guide ships home. "
    "Keepers trimmed wicks, polished lenses and logged every passing vessel in ledgers. "
)
TIERS = ("ram", "ram_file", "disk", "s3", "s3+rtt", "redis")


def child(args: argparse.Namespace) -> None:
    """Save and restore in this process, with whatever ``kvwarm`` the path gives."""
    import dataclasses

    import boto3

    import kvwarm
    from kvwarm.backends.base import ContextParams
    from kvwarm.backends.llama import LlamaBackend
    from kvwarm.cache import Cache, CacheConfig, TierConfig
    from kvwarm.cache.tiers.s3 import S3Tier
    from kvwarm.cache.types import Namespace, S3Config, SaveReason, SaveRequest
    from kvwarm.engine.worker.joinbuf import JoinBuffer

    model = LlamaBackend().load_model(args.model)
    params = model.context_params(
        ContextParams(
            n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=args.threads,
            flash_attn=args.flash_attn,
        ),
        deterministic=False,
    )  # fmt: skip
    ctx = model.new_context(params)
    tokens = model.tokenize(TEXT * 40)[: args.tokens]
    ctx.prefill(0, tokens, 0)
    blob = ctx.kv_pack(0)
    codec = ctx.kv_codec
    ns = Namespace(fingerprint=b"\x42" * 32, quant=3, ctx_hash=b"\x24" * 32)
    fields = {f.name for f in dataclasses.fields(SaveRequest)}
    windowed = "split_rest" in fields  # a tree that stores the window in chunks
    extra: dict[str, Any] = {}
    if windowed:
        extra = {"rest_span": codec.rest_span, "split_rest": codec.split_rest}
    root = Path(args.root)
    s3 = boto3.client("s3", endpoint_url=args.s3_endpoint, region_name="us-east-1")
    out: dict[str, Any] = {"tree": kvwarm.__file__, "window_in_chunks": windowed}
    join_buf = JoinBuffer()
    for name in args.tiers:
        tier_obj = None
        if name.startswith("s3"):
            bucket = f"kvwarm-bench-{os.getpid()}-{time.monotonic_ns()}"
            s3.create_bucket(Bucket=bucket)
            cfg_s3 = S3Config(
                bucket=bucket, prefix="rows/", endpoint_url=args.s3_endpoint,
                region="us-east-1", connect_timeout_s=1.0, read_timeout_s=5.0,
                max_attempts=1, down_for_s=30.0,
            )  # fmt: skip
            tier_obj = S3Tier(cfg_s3, 1 << 34)
            if name == "s3+rtt":
                _delay(tier_obj._s3, args.s3_rtt_ms / 1e3)
            base = TierConfig("ram", 1 << 34)
        elif name == "redis":
            # A real store's own cost a request (redis-server, C), where moto's is Python's.
            url = f"{args.redis_url}?prefix=bench-{os.getpid()}-{time.monotonic_ns()}/"
            base = TierConfig("redis", 1 << 34, url=url)
        elif name == "ram":
            base = TierConfig("ram", 1 << 34)
        elif name == "ram_file":
            base = TierConfig("ram_file", 1 << 34, Path(args.shm) / f"rows-{os.getpid()}")
        else:
            base = TierConfig("disk", 1 << 34, root / f"disk-{os.getpid()}")
        cache = Cache(
            CacheConfig(tiers=(base,), chunk_tokens=256),
            tiers=None if tier_obj is None else [tier_obj],
            background=False,
        )
        req = SaveRequest(
            ns, tuple(tokens), blob, SaveReason.CONTINUED, cache.tier_names()[0],
            split=codec.split, rest=codec.rest, **extra,
        )  # fmt: skip
        store = getattr(cache._tiers[cache.tier_names()[0]], "_store", None)
        requests = _count_requests(store) if name in ("s3", "s3+rtt", "redis") else None
        key = cache.save(req, sync=True)
        assert key is not None, f"{name}: the save failed"
        puts = dict(requests) if requests is not None else {}
        if requests is not None:
            requests.clear()
        walls: list[float] = []
        cpus: list[float] = []
        store0 = _store_cpu(args.s3_pid) if name.startswith("s3") else None
        for _ in range(args.reps):
            ctx.seq_rm(0)
            c0 = time.process_time()
            t0 = time.perf_counter()
            with cache.open_row(key) as row:
                rest_chunks = getattr(row, "rest_chunks", ())
                pieces = len(row.chunks) + len(rest_chunks)
                if hasattr(join_buf, "restore"):  # the join and the restore in one call
                    if rest_chunks:
                        restored = join_buf.restore(
                            ctx, 0, row.chunks, rest_chunks=rest_chunks, rest_from=row.rest_from
                        )
                    else:
                        restored = join_buf.restore(ctx, 0, row.chunks, row.payload)
                else:
                    if rest_chunks:
                        joined = join_buf.join(
                            ctx, row.chunks, rest_chunks=rest_chunks, rest_from=row.rest_from
                        )
                    else:
                        joined = join_buf.join(ctx, row.chunks, row.payload)
                    restored = ctx.kv_unpack(0, joined)
                    joined.release()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            assert restored == len(tokens), f"{name}: restored {restored} of {len(tokens)}"
        store1 = _store_cpu(args.s3_pid) if store0 is not None else None
        gets = (
            None
            if requests is None
            else (requests.get("get", 0) + requests.get("get_range", 0)) / args.reps
        )
        out[name] = {
            # requests to the store: PUTs of the save, GETs (whole and ranged) a restore
            "puts": puts.get("put_if_absent"),
            "gets": gets,
            "ms": statistics.median(walls) * 1e3,
            "cpu_ms": statistics.median(cpus) * 1e3,
            "chunks": pieces,
            # moto's CPU a restore (its process's, mean over the reps; clock ticks)
            "store_cpu_ms": None
            if store0 is None or store1 is None
            else (store1 - store0) / args.reps * 1e3,
        }
        cache.close()
    join_buf.release()
    out["blob_bytes"] = len(blob)
    ctx.close()
    model.close()
    print("RESULT " + json.dumps(out), flush=True)


def _tiers(text: str) -> tuple[str, ...]:
    names = tuple(t for t in text.split(",") if t)
    unknown = [t for t in names if t not in TIERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"tiers are among {','.join(TIERS)}; got {text!r}")
    return names


def _count_requests(store: Any) -> dict[str, int]:
    """Count the calls of ``store``'s (an ``ObjectStore``'s) puts and GETs, by name."""
    counts: dict[str, int] = {}
    for method in ("put_if_absent", "get", "get_range"):
        real = getattr(store, method)

        def counted(*a: Any, _real: Any = real, _name: str = method, **k: Any) -> Any:
            counts[_name] = counts.get(_name, 0) + 1
            return _real(*a, **k)

        setattr(store, method, counted)
    return counts


def _store_cpu(pid: int) -> float | None:
    """The CPU seconds process ``pid`` (the moto server) has used, or None where /proc
    cannot say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _delay(store: Any, rtt_s: float) -> None:
    """Every read of ``store`` (an ``S3Store``, alike in both trees) waits one round trip
    first, sleeping, so concurrent reads overlap as they do against a remote store: moto
    answers in ~1-3 ms of its own Python, a real store in tens of ms, concurrently."""
    get, get_range = store.get, store.get_range

    def delayed_get(*a: Any, **k: Any) -> Any:
        time.sleep(rtt_s)
        return get(*a, **k)

    def delayed_range(*a: Any, **k: Any) -> Any:
        time.sleep(rtt_s)
        return get_range(*a, **k)

    store.get, store.get_range = delayed_get, delayed_range


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--base-tree", required=True, help="the tree before the change")
    ap.add_argument("--model", default=os.environ.get("KVWARM_GEMMA", ""))
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--flash-attn", default="off", choices=("off", "on"))
    ap.add_argument("--s3-rtt-ms", type=float, default=20.0, help="the s3+rtt tier's round trip")
    ap.add_argument(
        "--tiers",
        type=_tiers,
        default=TIERS,
        help=f"comma-separated, of {','.join(TIERS)} (default: all)",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", default="", help=argparse.SUPPRESS)
    ap.add_argument("--shm", default="", help=argparse.SUPPRESS)
    ap.add_argument("--s3-endpoint", default="", help=argparse.SUPPRESS)
    ap.add_argument("--s3-pid", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--redis-url", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if not args.model:
        ap.error("--model (or KVWARM_GEMMA): a sliding-window GGUF, e.g. Gemma 3 270M")
    sys.path.insert(0, str(HERE))
    from tests.rediskit import RedisServer
    from tests.s3kit import MotoServer, aws_env

    trees = {"base": Path(args.base_tree).resolve(), "this": HERE}
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "this": []}
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with aws_env(), tempfile.TemporaryDirectory(prefix="kvwarm-trees-") as tmp:
        shm = tempfile.mkdtemp(prefix="kvwarm-trees-", dir="/dev/shm")
        server = MotoServer(own_process=True)
        redis_server = RedisServer()
        try:
            for r in range(args.rounds):
                for label, tree in trees.items():
                    cmd = [
                        sys.executable, __file__, "--child", "--base-tree", args.base_tree,
                        "--model", args.model, "--reps", str(args.reps),
                        "--tokens", str(args.tokens), "--flash-attn", args.flash_attn,
                        "--root", tmp, "--shm", shm, "--s3-endpoint", server.endpoint,
                        "--s3-rtt-ms", str(args.s3_rtt_ms), "--s3-pid", str(server.pid),
                        "--redis-url", f"redis://127.0.0.1:{redis_server.port}/0",
                        "--tiers", ",".join(args.tiers),
                    ]  # fmt: skip
                    if args.threads is not None:
                        cmd += ["--threads", str(args.threads)]
                    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
                    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
                    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                    if proc.returncode or not lines:
                        sys.exit(
                            f"{label} child failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
                        )
                    result = json.loads(lines[-1][len("RESULT ") :])
                    runs[label].append(result)
                    print(f"round {r} {label:4s} " + "  ".join(
                        f"{t} {result[t]['ms']:.2f}" for t in args.tiers), flush=True)  # fmt: skip
        finally:
            server.stop()
            redis_server.stop()
            subprocess.run(["rm", "-rf", shm], check=False)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    base, this = runs["base"][0], runs["this"][0]
    print(
        f"\n{args.tokens}-token row ({this['blob_bytes'] / 2**20:.1f} MiB), flash attention "
        f"{args.flash_attn}; base {trees['base']} (window in chunks: "
        f"{base['window_in_chunks']}), this {trees['this']} (window in chunks: "
        f"{this['window_in_chunks']}); median over {args.rounds} rounds of each child's median "
        f"of {args.reps} restores (wall ms, CPU ms of the restoring process)"
    )
    print(f"  (s3+rtt: s3 with {args.s3_rtt_ms:g} ms slept before every GET)")
    for t in args.tiers:
        if t.startswith("s3"):
            store = [
                statistics.median(x[t].get("store_cpu_ms") or 0.0 for x in runs[label])
                for label in ("base", "this")
            ]
            print(f"  {t:8s} moto's CPU a restore: base {store[0]:6.2f}   this {store[1]:6.2f}")
        b = statistics.median(x[t]["ms"] for x in runs["base"])
        n = statistics.median(x[t]["ms"] for x in runs["this"])
        bc = statistics.median(x[t]["cpu_ms"] for x in runs["base"])
        nc = statistics.median(x[t]["cpu_ms"] for x in runs["this"])
        print(
            f"  {t:8s} base {b:6.2f} (cpu {bc:5.2f}, {base[t]['chunks']:2d} pieces)   "
            f"this {n:6.2f} (cpu {nc:5.2f}, {this[t]['chunks']:2d} pieces)   {n / b:.2f}x"
        )
        # Each round's children ran one after the other: their ratio, paired.
        paired = [y[t]["ms"] / x[t]["ms"] for x, y in zip(runs["base"], runs["this"], strict=True)]
        print(
            f"  {t:8s} paired rounds: this/base median {statistics.median(paired):.3f}, "
            f"this faster in {sum(r < 1 for r in paired)} of {len(paired)}"
        )
        if base[t].get("gets") is not None:
            print(
                f"  {t:8s} requests: a save's PUTs base {base[t]['puts']}, this "
                f"{this[t]['puts']}; a restore's GETs base {base[t]['gets']:.1f}, this "
                f"{this[t]['gets']:.1f}"
            )
    print("command: " + shlex.join([sys.executable, *sys.argv]))


if __name__ == "__main__":
    main()
