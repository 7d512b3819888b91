"""``kvwarm cache stats | ls | gc | verify``: the cache with no model loaded.

Invariant: these commands open the cache alone (pure Python, no llama.cpp), over the same tier
directories the server uses, so they work on a machine without a model. ``verify`` reports
every bad file (CRC, truncation, garbage, interrupted temp files) and exits 1 if there is one;
it moves and deletes nothing unless given ``--repair``. No command creates a directory: a
named ``cache_dir`` or ``shm_dir`` (flag, environment, config file) that does not exist (a
typo) is a one-line error, exit 2. ``stats``, ``ls`` and ``verify`` tighten no mode either; a
missing tier directory otherwise (``rows/`` under an existing one, or under the default
``cache_dir`` not created yet) is reported (stderr; ``missing_dirs`` in ``--json``) and
counts as empty, exit 0. What a server's startup scan already
set aside (``quarantine/``: damaged rows and chunks, manifests whose chunks were gone) is
reported as fixed, and alone does not make it exit 1. No command evicts a row to meet a
quota (``gc`` and ``verify --repair`` included: the quota their settings give may be smaller
than the server's) or runs the cache's background sweeps, and the two that repair register
in a file tier's ``procs/`` as maintenance, which a server writing it does not count as a
co-tenant. ``stats`` reports what the tiers hold,
never the event counters (hits, misses, saves): those count what the opening process did, and
this one served nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvwarm.cache.sizes import row_sizes, summary
from kvwarm.cache.types import DEFAULT_GRACE_S, TIER_TOTALS, TierConfig
from kvwarm.cli.common import CACHE_SETTINGS, add_settings, settings_from
from kvwarm.settings import Settings

if TYPE_CHECKING:
    from kvwarm.cache.api import CacheApi


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cache = sub.add_parser(
        "cache",
        help="inspect and maintain the KV cache (no model needed)",
        description="Inspect and maintain the KV cache tiers configured by the settings.",
    )
    actions = cache.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, help_text, run in (
        ("stats", "rows, tokens and bytes per tier and memory kind", run_stats),
        ("ls", "list rows, most recently used first", run_ls),
        ("gc", "remove expired rows and stale reservations now", run_gc),
        ("verify", "check every row; exit 1 if any file is bad", run_verify),
    ):
        parser = actions.add_parser(name, help=help_text, description=help_text)
        parser.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "ls":
            parser.add_argument(
                "--limit",
                type=_count,
                default=None,
                metavar="N",
                help="at most N rows, 1 or more (default: all)",
            )
        if name == "gc":
            parser.add_argument(
                "--shared",
                action="store_true",
                help="also mark-and-sweep the chunks of shared tiers (s3, cache_dir_shared): "
                "delete those no row in the store names, older than --grace-s",
            )
            parser.add_argument(
                "--grace-s",
                type=_grace,
                default=None,
                metavar="S",
                help="with --shared: keep unreferenced chunks younger than S seconds, 0 or "
                f"more (a save writes its chunks before its row; default {DEFAULT_GRACE_S:g})",
            )
        if name == "verify":
            parser.add_argument(
                "--repair",
                action="store_true",
                help="also quarantine or delete the bad files (default: only report them)",
            )
        add_settings(parser, CACHE_SETTINGS)
        parser.set_defaults(run=run)
    from kvwarm.cli import explain_cmd

    explain_cmd.register(actions)


def _count(text: str) -> int:
    """A flag's count, 1 or more, as ``GET /cache/rows?limit=`` takes it: a negative one was
    taken for "all" without a word, and 0, which meant "all" here and "none" there, is refused
    by both (leave the flag out for every row)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be 1 or more (leave --limit out for every row), got {value}"
        )
    return value


def _grace(text: str) -> float:
    """``--grace-s``: a finite number of seconds, 0 or more, refused before anything runs
    (found by review: ``gc`` removed expired rows first, then refused it; a negative grace
    would take the chunks of saves in flight)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more, got {text}")
    return value


@contextmanager
def open_cache(
    settings: Settings, *, repair: bool = True, missing: list[str] | None = None
) -> Iterator[CacheApi]:
    """The configured cache. A read-only open (``repair=False``) runs no sweeper and creates
    nothing: a file tier whose directory does not exist is left out, reported on stderr and
    appended to ``missing``, and the others are opened as they are."""
    from kvwarm.cache import Cache, TierConfig
    from kvwarm.errors import CacheDirMissingError

    require_dirs(settings)
    config = settings.cache_config()
    if repair:  # a repairing open would create a missing tier directory: leave it out
        for tier in config.tiers:
            if tier.root is not None and not tier.root.exists():
                print(f"kvwarm: {tier.name}: cache directory {tier.root} does not exist "
                      "(not created); nothing is cached there", file=sys.stderr)  # fmt: skip
                if missing is not None:
                    missing.append(str(tier.root))
        tiers = tuple(t for t in config.tiers if t.root is None or t.root.exists())
        config = dataclasses.replace(config, tiers=tiers or (TierConfig("ram", 1 << 30),))
    while True:
        try:
            # No quota is enforced, and no sweeper runs: a maintenance command's settings may
            # give a tier a smaller quota than the server writing it has (found by review:
            # `verify --repair`, `gc` deleted sound rows down to it without a word); and its
            # registration leaves a lone server writing the directory lone.
            cache = Cache(config, repair=repair, background=False, maintenance=True)
            break
        except CacheDirMissingError as exc:
            print(f"kvwarm: {exc}; nothing is cached there", file=sys.stderr)
            if missing is not None:
                missing.append(exc.path)
            tiers = tuple(t for t in config.tiers if t.name != exc.tier)
            config = dataclasses.replace(config, tiers=tiers or (TierConfig("ram", 1 << 30),))
    try:
        yield cache
    finally:
        cache.close()


def require_dirs(settings: Settings) -> None:
    """``ConfigError`` (exit 2) for a named cache directory that does not exist: a maintenance
    command given a typo (``--cache-dir /var/cache/kvwram``) says so, instead of creating it
    (``gc``) or reporting an empty cache (``stats``). ``serve`` creates its own. The default
    ``cache_dir`` (``~/.cache/kvwarm``), which nobody typed, is a cache not served yet: empty."""
    from kvwarm.errors import ConfigError
    from kvwarm.settings import user_cache_dir

    cache_dir = settings.cache_dir if settings.cache_dir != user_cache_dir() else None
    for name, path in (("cache_dir", cache_dir), ("shm_dir", settings.shm_dir)):
        if path is not None and not path.exists():
            raise ConfigError(
                f"{name} {path} does not exist (kvwarm cache creates nothing; kvwarm serve "
                "creates it)"
            )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# What ``stats`` reports of ``Cache.counters()``: the levels, read from the tiers. The others
# (hits, misses, saves, latencies ...) count events of the process that opened the cache, here
# this command, which serves nothing: they would read 0 beside a server that counted thousands.
_LEVEL_PREFIXES = ("tier_", "memory_")
_LEVELS = frozenset({"rows", "reservations"})
EVENTS_NOTE = (
    "kvwarm: requests, hits, misses and saves are counted by the server using this cache "
    "(GET /cache/stats, /metrics), not here"
)


def _levels(counters: Mapping[str, float], tiers: Sequence[str]) -> dict[str, float]:
    """The levels of ``counters``, less the tiers' counts of events (restores ...): this
    command's, always 0. By their exact names: a suffix also took a tier named ``restored``'s
    ``tier_restored_bytes`` for one (found by review)."""
    totals = {f"tier_{tier}_{series}" for tier in tiers for series in TIER_TOTALS}
    return {
        k: v
        for k, v in counters.items()
        if (k.startswith(_LEVEL_PREFIXES) and k not in totals) or k in _LEVELS
    }


def run_stats(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    # An inspection: creates, moves, deletes and registers nothing (a running server's
    # directory, or one that does not exist yet).
    missing: list[str] = []
    with open_cache(settings, repair=False, missing=missing) as cache:
        counters = _levels(cache.counters(), cache.tier_names())
        rows = cache.rows()
    # The same summary /cache/stats answers (kvwarm.cache.sizes): physical bytes (each chunk
    # once; a file tier's files' apparent sizes), logical bytes (what the rows restore). Over
    # the configured tiers, as the server lists them: one whose directory does not exist (left
    # out of the open) is listed empty, with its quota, not dropped.
    configured = settings.cache_config().tiers
    total = summary(counters, rows, [t.name for t in configured])
    per = total["tiers"]
    assert isinstance(per, dict)
    unopened = _missing_tiers(counters, configured)
    for tier in configured:
        if tier.name in unopened:  # its configured quota, capped by nothing known
            per[tier.name]["quota_bytes"] = per[tier.name]["effective_quota_bytes"] = (
                tier.quota_bytes
            )
    cache_dir = str(settings.cache_dir) if settings.cache_dir else None
    if args.json:
        out = {**total, "cache_dir": cache_dir, "missing_dirs": missing, "counters": counters}
        print(json.dumps(out, indent=2))
        return 0
    print(f"cache dir: {cache_dir or '(none: RAM only)'}")
    print(
        f"rows: {total['rows']}  stored: {_size(_num(total['bytes']))}  "
        f"logical: {_size(_num(total['logical_bytes']))}  "
        f"dedup: {_num(total['dedup_ratio']):.2f}x  chunks: {total['chunks']}  "
        f"tokens: {total['tokens']}"
    )
    for tier, level in per.items():
        print(
            f"  {tier:<9} {level['rows']:>6} rows {level['chunks']:>7} chunks  "
            f"{_size(level['bytes']):>10} stored  {_size(level['logical_bytes']):>10} logical  "
            f"{level['dedup_ratio']:.2f}x  quota {_quota(level)}"
        )
    kinds = total["memory_kinds"]
    assert isinstance(kinds, dict)
    for kind, level in kinds.items():
        print(
            f"  memory {kind:<9} {level['rows']:>6} rows {level['chunks']:>7} chunks  "
            f"{_size(level['bytes']):>10} stored  {_size(level['logical_bytes']):>10} logical  "
            f"{level['dedup_ratio']:.2f}x"
        )
    for key in sorted(counters):
        print(f"{key} {counters[key]:g}")
    print(EVENTS_NOTE, file=sys.stderr)
    return 0


def _missing_tiers(counters: Mapping[str, float], configured: Sequence[TierConfig]) -> set[str]:
    """The configured tiers the open left out (their directory does not exist)."""
    return {t.name for t in configured if f"tier_{t.name}_quota_bytes" not in counters}


def _quota(level: Mapping[str, object]) -> str:
    """A tier's quota as ``stats`` prints it: the effective one, and the configured one
    beside it when the room on its filesystem caps it."""
    quota, effective = _num(level["quota_bytes"]), _num(level["effective_quota_bytes"])
    if effective == quota:
        return _size(quota)
    return f"{_size(effective)} (configured {_size(quota)}, capped by the free space)"


def _num(value: object) -> float:
    assert isinstance(value, int | float)
    return float(value)


def run_ls(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    # An inspection: creates, moves, deletes and registers nothing.
    with open_cache(settings, repair=False) as cache:
        rows = sorted(cache.rows(), key=lambda r: r.last_used, reverse=True)
    if args.limit is not None:
        rows = rows[: args.limit]
    if args.json:
        items = [
            {
                "key": r.key.hex(),
                "tier": r.tier,
                **row_sizes(r),
                "n_tokens": r.n_tokens,
                "hits": r.hits,
                "last_used": r.last_used,
                "created": r.created,
                "reason": r.reason.name.lower(),
                "ttl_class": r.ttl_class.name.lower(),
                "has_logits": r.has_logits,
            }
            for r in rows
        ]
        print(json.dumps(items, indent=2))
        return 0
    print(
        f"{'KEY':<16}  {'TIER':<8} {'TOKENS':>7} {'SIZE':>10} {'ALONE':>10} {'HITS':>5}  "
        f"{'LAST USED':<19}  {'REASON':<9} TTL"
    )
    for r in rows:
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.last_used))
        print(
            f"{r.key.hex()[:16]}  {r.tier:<8} {r.n_tokens:>7} {_size(r.logical_bytes):>10} "
            f"{_size(r.exclusive_bytes):>10} {r.hits:>5}  "
            f"{used:<19}  {r.reason.name.lower():<9} {r.ttl_class.name.lower()}"
        )
    return 0


def run_gc(args: argparse.Namespace) -> int:
    from kvwarm.errors import ConfigError

    if args.grace_s is not None and not args.shared:
        # Without --shared no chunk is swept: the grace was ignored without a word.
        raise ConfigError("--grace-s applies to the sweep of --shared; give both, or neither")
    grace_s = DEFAULT_GRACE_S if args.grace_s is None else args.grace_s
    settings = settings_from(args)
    with open_cache(settings) as cache:
        # Idle time from each row's last use: this process opened the cache a moment ago, and
        # counted from then (a server's rule after a restart) no row could ever have expired
        # (found by review: "removed 0 rows", always).
        result = cache.gc(count_downtime=True)
        swept = cache.gc_shared(grace_s) if args.shared else []
    if args.json:
        out: dict[str, object] = {"rows": result.rows, "bytes": result.bytes}
        if args.shared:
            out["shared"] = [dataclasses.asdict(s) for s in swept]
        print(json.dumps(out))
    else:
        print(f"removed {result.rows} rows ({_size(result.bytes)})")
        for s in swept:
            print(
                f"{s.tier}: {s.deleted} of {s.chunks} chunks"
                + (f" and {s.packs_deleted} of {s.packs} packs" if s.packs else "")
                + f" swept ({_size(s.deleted_bytes)}), "
                f"{s.young} unreferenced but younger than the grace period, {s.manifests} rows"
                + (f"; left alone: {s.refused}" if s.refused else "")
            )
    return 1 if any(s.refused for s in swept) else 0


def run_verify(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    missing: list[str] = []
    with open_cache(settings, repair=False, missing=missing) as cache:
        report = cache.verify()
    if report.bad and args.repair:
        # A repairing open quarantines what the scan rejects; its verify drops CRC failures.
        # The report stays the read-only one: it is the only one that saw every bad file.
        with open_cache(settings) as cache:
            cache.verify(repair=True)
    fixed = {"rows": report.quarantined_rows, "chunks": report.quarantined_chunks}
    if args.json:
        bad = [{"row": where, "reason": why} for where, why in report.bad]
        out = {"checked": report.checked, "bad": bad, "quarantined": fixed}
        print(json.dumps({**out, "missing_dirs": missing}))
    else:
        print(f"checked {report.checked} rows: {len(report.bad)} bad")
        if report.quarantined_rows or report.quarantined_chunks:
            print(
                f"already fixed by startup scans (set aside in quarantine/): "
                f"{report.quarantined_rows} row files, {report.quarantined_chunks} chunk files"
            )
        for where, why in report.bad:
            print(f"bad: {where}: {why}", file=sys.stderr)
    return 1 if report.bad else 0
