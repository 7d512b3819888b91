"""Chunked rows vs single blobs: bytes written and stored, restore time, save-path CPU.

Runs each scenario twice, with whole-blob rows (``chunk_tokens=0``, what kvwarm stored before
issue 9) and with chunked rows (``chunk_tokens=256``):

1. **One 4,000-token generation with continued saves** (real model, real KV): the embedded
   model prefills 4,000 tokens 512 at a time and, like continued saves every 512 tokens, packs
   and saves its sequence after each step (sync, disk tier). Reports bytes written, bytes
   stored, the distinct KV (the last blob) and save-path CPU per token (``kv_pack`` plus the
   cache's ``save``, process CPU time).
2. **20 conversations x 4 turns over a shared 1,000-token system prompt**, through the engine
   with the server's save policy, on the stub backend with the real model's KV bytes per token
   (so the byte counts are real bytes of the same size, without 80 real decodes). Reports
   bytes stored on disk and the distinct tokens' KV.
3. **Restore of a 2,048-token prefix**, per tier (ram, ram_file on /dev/shm, disk, s3 on a
   local moto server when moto is installed; run with ``PYTHONPATH=src:.``): ``open_row`` +
   the restore into the real context, median of ``--reps``, variants interleaved: the whole
   blob (``kv_unpack``), chunks restored in place (``kv_unpack_chunks``, what the engine does)
   and, with ``--variants``, chunks joined into the reused ``JoinBuffer`` or a fresh buffer
   first (the paths before in-place restores).
4. **KV cell types** f16, q8_0, q4_0: KV bytes a token, and split + join byte-identical.
5. **A sliding-window row** (``--window-model``, e.g. Gemma 3 270M, n_swa 512; run alone with
   ``--only window``): a 1,000-token state saved per tier as a version-3 row (its 512-cell
   window kept whole in the row: what kvwarm stored before issue 38) and as a version-4 row
   (the window in chunks), each restored the engine's way (``open_row``, both caches joined
   into the reused ``JoinBuffer``, ``kv_unpack``), median ms, interleaved; and the bytes a
   second checkpoint 40 tokens later adds to the tier in each format.

Usage::

    PYTHONPATH=src:. .venv/bin/python bench/chunks.py [--reps 7] [--root /tmp/kvwarm-bench]
        [--only restore|window] [--variants chunks,joined,fresh] [--window-model GGUF]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvwarm.backends.base import ContextParams
from kvwarm.backends.llama import LlamaBackend, LlamaContext
from kvwarm.backends.stub import StubBackend
from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.protocols import RowBytes, StoredRow, Tier
from kvwarm.cache.types import Namespace, SaveReason, SaveRequest
from kvwarm.embedded import default_model_path
from kvwarm.engine.api import Engine, EngineConfig, ModelConfig
from kvwarm.engine.types import GenerationOptions
from kvwarm.engine.worker.joinbuf import JoinBuffer
from kvwarm.settings import SERVER_POLICY

TEXT = (
    "The history of the lighthouse begins with fires lit on hills to guide ships home. "
    "Keepers trimmed wicks, polished lenses and logged every passing vessel in ledgers. "
)
NS = Namespace(fingerprint=b"\x42" * 32, quant=3, ctx_hash=b"\x24" * 32)
MODES = {"blob": 0, "chunks": 256}
#: Restore variants, timed interleaved against "blob" (the baseline): "chunks" is what the
#: engine does; "fresh" and "joined" (``--variants``) are the join paths it no longer takes.
VARIANTS = ("blob", "fresh", "joined", "chunks")


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def request(tokens: Sequence[int], blob: bytes, ctx: LlamaContext, tier: str) -> SaveRequest:
    return SaveRequest(
        NS, tuple(tokens), blob, SaveReason.CONTINUED, tier, split=ctx.kv_codec.split
    )


def generation(ctx: LlamaContext, tokens: list[int], root: Path) -> dict[str, dict[str, float]]:
    """Scenario 1. Returns per mode: written, stored, distinct, cpu_per_token_us."""
    blobs: list[tuple[int, bytes, float]] = []
    ctx.seq_rm(0)
    for start in range(0, len(tokens), 512):
        end = min(start + 512, len(tokens))
        ctx.prefill(0, tokens[start:end], start)
        c0 = time.process_time()
        blob = ctx.kv_pack(0)
        blobs.append((end, blob, time.process_time() - c0))
    out: dict[str, dict[str, float]] = {}
    for mode, chunk in MODES.items():
        where = root / f"gen-{mode}"
        cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 34, where),), chunk_tokens=chunk)
        written = 0
        cpu = 0.0
        with Cache(cfg, background=False) as cache:
            for end, blob, pack_cpu in blobs:
                before = dir_bytes(where)
                c0 = time.process_time()
                assert cache.save(request(tokens[:end], blob, ctx, "disk"), sync=True)
                cpu += time.process_time() - c0 + pack_cpu
                written += dir_bytes(where) - before
        out[mode] = {
            "written": written,
            "stored": dir_bytes(where),
            "distinct": len(blobs[-1][1]),
            "cpu_per_token_us": cpu / len(tokens) * 1e6,
        }
    return out


def _distinct(rows: Sequence[Sequence[int]]) -> int:
    trie: dict[int, dict[int, object]] = {}
    count = 0
    for tokens in rows:
        node = trie
        for t in tokens:
            if t not in node:
                node[t] = {}
                count += 1
            node = node[t]  # type: ignore[assignment]
    return count


def conversations(cell_bytes: int, root: Path) -> dict[str, dict[str, float]]:
    """Scenario 2 (stub backend with the real model's KV bytes per token)."""
    system = "".join(f"Rule {i}: answer briefly and cite the manual. " for i in range(25))[:999]
    opts = GenerationOptions(max_tokens=48, temperature=0.0)
    out: dict[str, dict[str, float]] = {}
    for mode, chunk in MODES.items():
        where = root / f"conv-{mode}"
        cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 34, where),), chunk_tokens=chunk)
        seen: list[tuple[int, ...]] = []
        with Engine(EngineConfig(cache=cfg, policy=SERVER_POLICY)) as engine:
            backend = StubBackend(cell_bytes=min(cell_bytes, 0xFFFF))
            context = ContextParams(n_ctx=2048, n_batch=512, n_ubatch=512)
            model = engine.load_model(config=ModelConfig(backend=backend, context=context))
            for conv in range(20):
                messages: list[dict[str, object]] = [{"role": "system", "content": system}]
                for turn in range(4):
                    ask = f"Conversation {conv}, question {turn}: what does rule {turn} say?"
                    messages.append({"role": "user", "content": ask})
                    reply = model.chat(messages, options=opts)
                    seen.append(tuple(reply.tokens))
                    messages.append({"role": "assistant", "content": reply.text})
                    engine.cache.flush()
                model.evict()
            engine.cache.flush()
            snap = engine.cache.counters()
        per_token = min(cell_bytes, 0xFFFF)
        out[mode] = {
            "stored": dir_bytes(where),
            "distinct": _distinct(seen) * per_token,
            "rows": snap["tier_disk_rows"],
        }
    return out


TierMaker = Callable[[], Tier]


@contextmanager
def tier_configs(root: Path) -> Iterator[list[tuple[str, TierConfig | None, TierMaker | None]]]:
    """(name, config, or a maker of a fresh tier: s3 gets a bucket per mode)."""
    shm = Path(tempfile.mkdtemp(prefix="kvwarm-bench-", dir="/dev/shm"))
    made: list[tuple[str, TierConfig | None, TierMaker | None]] = [
        ("ram", TierConfig("ram", 1 << 34), None),
        ("ram_file", TierConfig("ram_file", 1 << 34, shm / "rows"), None),
        ("disk", TierConfig("disk", 1 << 34, root / "restore"), None),
    ]
    server = None
    try:
        from tests.s3kit import MotoServer, aws_env

        from kvwarm.cache.tiers.s3 import S3Tier

        with aws_env():
            # In its own process: a remote store's work must not take the restoring
            # process's GIL (a real one answers on other machines, concurrently).
            server = MotoServer(own_process=True)
            moto = server

            def s3_tier() -> Tier:
                return S3Tier(moto.config(moto.new_bucket()), 1 << 34)

            made.append(("s3", None, s3_tier))
            if S3_RTT_S > 0:
                made.append((f"s3+{S3_RTT_S * 1e3:.0f}ms", None, _delayed_s3(moto)))
            yield made
    except ImportError:
        yield made
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(shm, ignore_errors=True)


#: ``--s3-rtt-ms``: a round trip added to each GET of the "s3+rtt" tier. The moto server
#: answers a GET with ~1-3 ms of Python on this machine's own cores, so several GETs cost
#: about their sum; a real object store answers in tens of ms, concurrently (the cache's
#: remote pool), so there a row costs about its round trips, not its GETs.
S3_RTT_S = 0.0


def _delayed_s3(moto: Any) -> TierMaker:
    from kvwarm.cache.tiers.s3 import S3Tier

    class DelayedS3(S3Tier):
        """An s3 tier whose every read waits one round trip first (sleeping, so concurrent
        reads overlap as they do against a remote store)."""

        def load(self, row: StoredRow, buffer: bytearray | None = None) -> RowBytes:
            time.sleep(S3_RTT_S)
            return super().load(row, buffer)

        def load_meta(self, row: StoredRow) -> RowBytes:
            time.sleep(S3_RTT_S)
            return super().load_meta(row)

        def load_chunk(self, key: bytes, buffer: memoryview | None = None) -> memoryview:
            time.sleep(S3_RTT_S)
            return super().load_chunk(key, buffer)

    def make() -> Tier:
        return DelayedS3(moto.config(moto.new_bucket()), 1 << 34)

    return make


def restores(
    ctx: LlamaContext,
    tokens: list[int],
    blob: bytes,
    reps: int,
    root: Path,
    variants: Sequence[str] = ("blob", "chunks"),
) -> dict[str, dict[str, float]]:
    """Scenario 3: median ms to restore the 2,048-token row, per tier and mode."""
    out: dict[str, dict[str, float]] = {}
    with tier_configs(root) as tiers:
        for name, tier_cfg, tier in tiers:
            caches: dict[str, tuple[Cache, bytes]] = {}
            for mode, chunk in MODES.items():
                base = tier_cfg if tier_cfg is not None else TierConfig("ram", 1)
                if base.root is not None:
                    base = replace(base, root=base.root.with_name(f"{base.root.name}-{mode}"))
                cfg = CacheConfig(tiers=(base,), chunk_tokens=chunk)
                cache = Cache(cfg, tiers=None if tier is None else [tier()], background=False)
                key = cache.save(request(tokens, blob, ctx, cache.tier_names()[0]), sync=True)
                assert key is not None
                caches[mode] = (cache, key)
            out[name] = _time_restores(ctx, caches, len(tokens), reps, variants)
            for cache, _ in caches.values():
                cache.close()
    return out


def _time_restores(
    ctx: LlamaContext,
    caches: dict[str, tuple[Cache, bytes]],
    n: int,
    reps: int,
    names: Sequence[str],
) -> dict[str, float]:
    """Median ms per variant: the blob row; the chunked row joined into a fresh buffer (as
    before the engine kept one); joined into the worker's reused ``JoinBuffer`` (as now)."""
    join_buf = JoinBuffer()
    variants = {v: "blob" if v == "blob" else "chunks" for v in names}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(reps):  # interleaved, so machine noise hits all alike
        for variant, mode in variants.items():
            cache, key = caches[mode]
            ctx.seq_rm(0)
            t0 = time.perf_counter()
            with cache.open_row(key) as row:
                if not row.chunks:
                    got = ctx.kv_unpack(0, row.payload)
                elif variant == "fresh":
                    got = ctx.kv_unpack(0, ctx.kv_join(row.chunks))
                elif variant == "joined":
                    got = ctx.kv_unpack(0, join_buf.join(ctx, row.chunks))
                else:
                    restored = ctx.kv_unpack_chunks(0, row.chunks)
                    assert restored is not None, "chunks of the first format"
                    got = restored
                assert got == n
            times[variant].append(time.perf_counter() - t0)
    join_buf.release()
    return {v: statistics.median(t) * 1e3 for v, t in times.items()}


def window_restores(
    path: str, reps: int, root: Path, threads: int | None, flash_attn: str = "auto"
) -> tuple[dict[str, dict[str, float]], dict[str, int], int]:
    """Scenario 5: per tier, median ms to restore a 1,000-token sliding-window state stored
    as version 3 (window whole) and version 4 (window in chunks); the tier bytes a second
    checkpoint 40 tokens later adds in each format; the blob's size."""
    model = LlamaBackend().load_model(path)
    params = model.context_params(
        ContextParams(
            n_ctx=2048,
            n_batch=512,
            n_ubatch=512,
            n_threads=threads,
            flash_attn=flash_attn,  # type: ignore[arg-type]
        ),
        deterministic=False,
    )
    ctx = model.new_context(params)
    tokens = model.tokenize(TEXT * 40)[:1040]
    codec = ctx.kv_codec
    blobs = {}
    for n in (1000, 1040):
        ctx.seq_rm(0)
        ctx.prefill(0, tokens[:n], 0)
        blobs[n] = ctx.kv_pack(0)

    def save(cache: Cache, n: int, windowed: bool) -> bytes:
        tier = cache.tier_names()[0]
        req = SaveRequest(
            NS, tuple(tokens[:n]), blobs[n], SaveReason.CONTINUED, tier,
            split=codec.split, rest=codec.rest,
            rest_span=codec.rest_span if windowed else None,
            split_rest=codec.split_rest if windowed else None,
        )  # fmt: skip
        key = cache.save(req, sync=True)
        assert key is not None
        return key

    times: dict[str, dict[str, float]] = {}
    added: dict[str, int] = {}
    join_buf = JoinBuffer()
    with tier_configs(root) as tiers:
        for name, tier_cfg, tier in tiers:
            caches: dict[str, tuple[Cache, bytes]] = {}
            for mode in ("v3", "v4"):
                base = tier_cfg if tier_cfg is not None else TierConfig("ram", 1)
                if base.root is not None:
                    base = replace(base, root=base.root.with_name(f"{base.root.name}-w{mode}"))
                cfg = CacheConfig(tiers=(base,), chunk_tokens=256)
                cache = Cache(cfg, tiers=None if tier is None else [tier()], background=False)
                caches[mode] = (cache, save(cache, 1000, mode == "v4"))
            runs: dict[str, list[float]] = {"v3": [], "v4": []}
            cpus: dict[str, list[float]] = {"v3": [], "v4": []}
            for _ in range(reps):
                for mode, (cache, key) in caches.items():
                    ctx.seq_rm(0)
                    c0 = time.process_time()
                    t0 = time.perf_counter()
                    with cache.open_row(key) as row:  # as Admission._restore_whole does
                        if row.rest_chunks:
                            got = join_buf.restore(ctx, 0, row.chunks, rest_chunks=row.rest_chunks,
                                                   rest_from=row.rest_from)  # fmt: skip
                        else:
                            got = join_buf.restore(ctx, 0, row.chunks, row.payload)
                        assert got == 1000
                    runs[mode].append(time.perf_counter() - t0)
                    cpus[mode].append(time.process_time() - c0)
            times[name] = {m: statistics.median(t) * 1e3 for m, t in runs.items()}
            times[name].update({f"{m} cpu": statistics.median(t) * 1e3 for m, t in cpus.items()})
            for mode, (cache, _) in caches.items():
                before = cache.counters()[f"tier_{cache.tier_names()[0]}_bytes"]
                save(cache, 1040, mode == "v4")
                added[f"{name} {mode}"] = int(
                    cache.counters()[f"tier_{cache.tier_names()[0]}_bytes"] - before
                )
                cache.close()
    join_buf.release()
    size = len(blobs[1000])
    ctx.close()
    model.close()
    return times, added, size


def cell_types(tokens: list[int], threads: int | None) -> dict[str, tuple[float, bool]]:
    """Section 4: KV bytes a token and whether split + join gives the blob back, per type."""
    model = LlamaBackend().load_model(str(default_model_path()))
    out: dict[str, tuple[float, bool]] = {}
    for kv_type in ("f16", "q8_0", "q4_0"):
        params = ContextParams(
            n_ctx=1024,
            n_batch=512,
            n_ubatch=512,
            n_threads=threads,
            type_k=kv_type,  # type: ignore[arg-type]
            type_v=kv_type,  # type: ignore[arg-type]
        )
        ctx = model.new_context(params)
        ctx.prefill(0, tokens[:768], 0)
        blob = ctx.kv_pack(0)
        joined = ctx.kv_join(ctx.kv_split(blob, [0, 256, 512, 700, 768]))
        out[kv_type] = (len(blob) / 768, bytes(joined) == blob)
        ctx.close()
    model.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--root", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--only", choices=("restore", "window"), default=None, help="run scenario 3 or 5 alone"
    )
    parser.add_argument(
        "--window-model", default=None, help="a sliding-window GGUF for scenario 5 (Gemma 3)"
    )
    parser.add_argument(
        "--flash-attn",
        choices=("auto", "on", "off"),
        default="auto",
        help="scenario 5's context (auto: off on a CPU, so V is stored transposed; on: by cell)",
    )
    parser.add_argument(
        "--variants",
        default="chunks",
        help="restore variants to time against the blob, comma-separated: chunks (the "
        "engine's in-place restore), joined (into the reused JoinBuffer), fresh",
    )
    parser.add_argument(
        "--s3-rtt-ms",
        type=float,
        default=20.0,
        help="also time an s3 tier whose GETs each wait this long first (0: not)",
    )
    args = parser.parse_args()
    global S3_RTT_S
    S3_RTT_S = args.s3_rtt_ms / 1e3
    root = args.root or Path(tempfile.mkdtemp(prefix="kvwarm-bench-chunks-"))
    if args.window_model is not None and args.only in (None, "window"):
        times, added, size = window_restores(
            args.window_model, args.reps, root, args.threads, args.flash_attn
        )
        print(f"5. a 1,000-token sliding-window row ({size / 2**20:.1f} MiB), median ms to "
              "restore (and the restoring process's CPU ms, all threads, median;\n"
              "   the s3 tiers' moto server runs in its own process); bytes a checkpoint "
              "40 tokens later adds")  # fmt: skip
        for name, t in times.items():
            print(
                f"   {name:8s}  window whole (v3) {t['v3']:6.2f} (cpu {t['v3 cpu']:5.2f})  "
                f"in chunks (v4) {t['v4']:6.2f} (cpu {t['v4 cpu']:5.2f}) "
                f"({t['v4'] / t['v3']:.2f}x)   +{added[f'{name} v3'] / 2**20:5.2f} MiB (v3) "
                f"+{added[f'{name} v4'] / 2**20:5.2f} MiB (v4)"
            )
    if args.only == "window":
        shutil.rmtree(root, ignore_errors=True)
        return
    model = LlamaBackend().load_model(str(default_model_path()))
    params = ContextParams(n_ctx=4608, n_batch=512, n_ubatch=512, n_threads=args.threads)
    ctx = model.new_context(params)
    tokens = model.tokenize(TEXT * 160)[:4000]
    assert len(tokens) == 4000
    if args.only is None:
        _report_bytes(ctx, tokens, root)
    ctx.seq_rm(0)
    ctx.prefill(0, tokens[:2048], 0)
    blob = ctx.kv_pack(0)
    variants = ["blob", *(v for v in VARIANTS[1:] if v in args.variants.split(","))]
    res = restores(ctx, tokens[:2048], blob, args.reps, root, variants)
    print(f"3. restore of a 2,048-token prefix ({len(blob) / 2**20:.1f} MiB), median ms")
    print(
        "   (fresh: chunks joined into a new buffer each time; joined: into the reused "
        "JoinBuffer;\n    chunks: each restored in place from its buffer, what the engine does)"
    )
    for name, r in res.items():
        print(
            f"   {name:8s}  blob {r['blob']:6.2f}  "
            + "  ".join(f"{v} {r[v]:6.2f} ({r[v] / r['blob']:.2f}x)" for v in variants[1:])
        )
    if args.only is None:
        print("4. KV cell types (768 tokens): bytes a token, split + join == blob")
        for kv_type, (per_token, same) in cell_types(tokens, args.threads).items():
            print(
                f"   {kv_type:5s}  {per_token:9.0f} B/token  "
                f"round trip {'exact' if same else 'DIFFERS'}"
            )
    shutil.rmtree(root, ignore_errors=True)


def _report_bytes(ctx: LlamaContext, tokens: list[int], root: Path) -> None:
    """Scenarios 1 and 2."""
    gen = generation(ctx, tokens, root)
    print("1. one 4,000-token generation, continued saves every 512 tokens (real KV, disk)")
    for mode, r in gen.items():
        print(
            f"   {mode:6s}  written {r['written'] / 2**20:8.1f} MiB  stored "
            f"{r['stored'] / 2**20:8.1f} MiB  = {r['stored'] / r['distinct']:.2f}x distinct "
            f"({r['distinct'] / 2**20:.1f} MiB)  save CPU {r['cpu_per_token_us']:.1f} us/token"
        )
    cell_bytes = round(gen["blob"]["distinct"] / len(tokens))
    conv = conversations(cell_bytes, root)
    print(f"2. 20 conversations x 4 turns, 1,000-token system prompt ({cell_bytes} B/token)")
    for mode, r in conv.items():
        print(
            f"   {mode:6s}  stored {r['stored'] / 2**20:8.1f} MiB  = "
            f"{r['stored'] / r['distinct']:.2f}x distinct ({r['distinct'] / 2**20:.1f} MiB), "
            f"{r['rows']:.0f} rows"
        )


if __name__ == "__main__":
    main()
