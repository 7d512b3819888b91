"""Saving and reading rows as manifests over content-addressed chunks (tier I/O; no lock).

A save of ``n`` tokens is cut into chunks of at most ``C`` tokens (``plan_lens``) that line
up with the row sharing its longest prefix: that row's chunks are reused as far as the shared
prefix reaches, one chunk ends exactly where the two diverge, and fixed ``C``-token chunks
follow, the last one shorter; a cut that would fall inside a media span is dropped, the chunk
holding the span's start then holding all of it (``off_spans``). Every chunk's key chains
its parent's (``chunkfmt``), so a conversation's next turn reuses all of the previous turn's
chunks and the second conversation over a system prompt cuts a chunk at the prompt's end
that every later one reuses. The cache pins the chunks in the index, asks the backend's
codec (``SaveRequest.split``) for only those the tier lacks, writes them, then publishes the
manifest through the tier's row protocol.

Invariants:

- No manifest is published before every chunk it names is durable in its tier: chunks are
  stored (each through the tier's crash-safe ``store_chunk``) before ``tier.store`` of the
  manifest begins, and stay pinned until it ends, so no eviction frees them in between.
- A chunk the index knows is stored in the tier is never written again; in a tier other
  processes sweep, it is touched before the manifest (``_refresh``) and written again (or the
  save dropped) if it is gone: the index's knowledge of a shared tier may be stale.
- Cut points only decide how much is shared, never what a row holds: keys are content
  addresses, so any plan restores the same bytes.
- A row shorter than one chunk is stored whole (no split, no copy), and so is a blob the
  codec refuses to cut (``KvwarmError`` from ``split`` or ``rest``: e.g. a model with several
  KV streams).
- A memory of two parts (``SaveRequest.rest``: an iSWA window, a hybrid's recurrent state)
  is chunked in its first KV cache only; the manifest carries the rest as its payload, taken
  before any chunk is written, so every manifest holds exactly the blob it was cut from.
- In a tier with packs (``TierCapabilities.packs``: s3, redis) the chunks a save writes are
  one pack object, put (durable) before the manifest; the manifest names each chunk's place
  as the index knows it (a reused chunk keeps its pack, offset and length; one of its own
  object has none), and a restore reads each run of adjacent chunks in one ranged GET
  (``chunk_reads``), each chunk verified as a chunk object is.
See docs/architecture.md ("Chunks") and docs/internals.md ("Chunks in detail", "Chunk packs").
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace

from kvwarm.cache.counters import Counters
from kvwarm.cache.formats.chunkfmt import (
    build_head,
    chunk_chain,
    recover_chain,
    rest_chain,
    rest_cuts,
)
from kvwarm.cache.index.index import Index, RoomHold
from kvwarm.cache.protocols import ChunkAges, PacksChunks, StoredRow, Tier
from kvwarm.cache.types import Namespace, PackLoc, RestChunks, SaveRequest
from kvwarm.errors import CacheError, CacheFormatError, CacheIOError, KvwarmError
from kvwarm.tokens import common_prefix, is_span_id

#: Room for bytes about to enter a tier: raises to refuse, returns the room held (the bytes
#: leave it as they land: ``Index.chunk_stored``, ``Index.held``; ``Index.give_room`` ends it).
HoldRoom = Callable[[int], RoomHold]

__all__ = [
    "ChunkRead",
    "Freshness",
    "NoRoomError",
    "PlanBook",
    "RowTooLargeError",
    "chunk_reads",
    "gather_reads",
    "held_lead",
    "load_chunks",
    "pack_request",
    "pin_lead",
    "plan_lens",
    "row_size",
    "store_row",
]

log = logging.getLogger(__name__)


def plan_lens(
    n: int, size: int, base: Sequence[int], shared: int, tokens: Sequence[int] = ()
) -> tuple[int, ...]:
    """Chunk lengths for ``n`` tokens: ``base``'s chunks (the chunk lengths of a row sharing
    ``shared`` tokens; () for fixed cuts) while they end within the shared prefix, one chunk
    up to the shared length, then chunks of ``size`` tokens; with the row's ``tokens``, no
    cut inside a run of span ids (``off_spans``)."""
    return off_spans(_plan_lens(n, size, base, shared), tokens)


def off_spans(lens: Sequence[int], tokens: Sequence[int]) -> tuple[int, ...]:
    """``lens`` with every cut that falls inside a run of span ids (``kvwarm.tokens``: an
    image's or a clip's positions) dropped, the chunks on either side joined: a chunk holding
    any of a span holds the rest of it. Its KV depends on the whole span (Gemma 3's images
    attend both ways), but a chunk's key names only the ids up to its end, and a span's
    first id is 31 bits of its content's digest: cut one position in, a chunk named a
    picture by 31 bits, and a picture crafted to share that id (2^31 tries) put its KV under
    the key every save of the other's prompt then reused (found by review)."""
    out: list[int] = []
    end = held = 0
    for length in lens:
        end += length
        held += length
        if _inside_span(tokens, end):
            continue
        out.append(held)
        held = 0
    if held:
        out.append(held)
    return tuple(out)


def _inside_span(tokens: Sequence[int], at: int) -> bool:
    """Whether a cut at ``at`` falls inside a run of span ids of ``tokens``."""
    return 0 < at < len(tokens) and is_span_id(tokens[at - 1]) and is_span_id(tokens[at])


def _plan_lens(n: int, size: int, base: Sequence[int], shared: int) -> tuple[int, ...]:
    shared = min(shared, n)
    if not base:
        base = (size,) * (shared // size)
    lens: list[int] = []
    end = 0
    for length in base:
        if end + length > shared:
            break
        lens.append(length)
        end += length
    if end < shared:
        lens.append(shared - end)
        end = shared
    while end < n:
        lens.append(min(size, n - end))
        end += lens[-1]
    return tuple(lens)


class PlanBook:
    """The cuts of saves accepted but not yet published, so a save planned meanwhile lines
    up with them too (a finish save queued behind its own cold save shares its chunks even
    when both run at once). Thread-safe; a handful of entries (the writer queue's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: dict[bytes, tuple[Namespace, tuple[int, ...], tuple[int, ...]]] = {}

    def plan(
        self, key: bytes, request: SaveRequest, index: Index, size: int
    ) -> tuple[int, ...] | None:
        """Chunk lengths for ``request`` (None: store it whole), registered until ``done``."""
        ns, tokens = request.namespace, request.tokens
        if request.split is None or size <= 0 or len(tokens) < size:
            return None
        base, shared = index.chunk_base(ns, tokens)
        with self._lock:
            pending = [(t, lens) for n, t, lens in self._plans.values() if n == ns]
        for other, lens in pending:
            common = common_prefix(other, tokens)
            if common > shared:
                base, shared = lens, common
        lens = plan_lens(len(tokens), size, base, shared, tokens)
        with self._lock:
            self._plans[key] = (ns, tokens, lens)
        return lens

    def done(self, key: bytes) -> None:
        with self._lock:
            self._plans.pop(key, None)


def held_lead(
    request: SaveRequest, tier: Tier, index: Index, lens: tuple[int, ...] | None
) -> list[tuple[int, int]]:
    """(end position, stored bytes) of each of the leading planned chunks (``lens``) that
    ``tier`` already holds, in order; [] when the row is stored whole (``lens`` None)."""
    held: list[tuple[int, int]] = []
    if lens:
        keys = [key for _, key in chain_of(request, lens)]
        end = 0
        for length, size in zip(lens, index.chunk_sizes(tier.name, keys), strict=True):
            if size is None:
                break
            end += length
            held.append((end, size))
    return held


def pin_lead(
    request: SaveRequest, tier: Tier, index: Index, lens: tuple[int, ...] | None
) -> tuple[list[tuple[int, int]], list[bytes]]:
    """``held_lead``, and its chunks' keys, pinned in ``tier`` (``Index.pin_chunks``): a tail
    packed after them is stored later, on a writer, and none of them may leave the tier
    before (an eviction for another save's room, an evict: the save failed, and an evict or
    shutdown save kept its KV live only). The caller unpins the keys. A chunk freed between
    the look and the pin ends the lead before it; one being deleted right now, the lead."""
    held = held_lead(request, tier, index, lens)
    if not held or not lens:
        return [], []
    keys = [key for _, key in chain_of(request, lens)][: len(held)]
    write = index.pin_chunks(tier.name, keys, 0.0)
    if write is None:  # a chunk is being deleted right now: nothing was pinned
        return [], []
    gone = set(write)
    kept = next((i for i, key in enumerate(keys) if key in gone), len(keys))
    index.unpin_chunks(tier.name, keys[kept:])
    return held[:kept], keys[:kept]


def pack_request(
    request: SaveRequest,
    tier: Tier,
    index: Index,
    lens: tuple[int, ...] | None,
    held: Sequence[tuple[int, int]] | None = None,
) -> SaveRequest:
    """``request`` with its payload packed (``request.pack``): from the end of the leading
    planned chunks (``lens``) the tier already holds (``held``: ``held_lead``'s answer, when
    the caller has it), so only what it lacks leaves the context; from 0 when the row is
    stored whole (``lens`` None)."""
    assert request.pack is not None
    if held is None:
        held = held_lead(request, tier, index, lens)
    start = held[-1][0] if held else 0
    if start >= len(request.tokens) and request.rest is None:
        # Every chunk is there: only the manifest is written.
        payload, first = b"", start
    else:
        payload, first = request.pack(start)
    return replace(request, payload=payload, payload_from=first, pack=None)


def row_size(request: SaveRequest, held: Sequence[tuple[int, int]] = ()) -> int:
    """The bytes a packed ``request`` would occupy in a tier holding ``held`` (its
    ``held_lead``): the chunks before its payload as stored there, its payload, tokens and
    logits. An estimate, before the payload is cut: its chunks may add a few bytes each
    (``store_row``'s check of the cut row is exact: ``RowTooLargeError``)."""
    stored = sum(size for end, size in held if end <= request.payload_from)
    return stored + memoryview(request.payload).nbytes + _row_extra(request)


def _row_extra(request: SaveRequest) -> int:
    """What a row holds besides its KV: its tokens and logits."""
    return 4 * len(request.tokens) + len(request.logits or b"")


class RowTooLargeError(CacheError):
    """A row would occupy more than its tier's quota (``size`` bytes): nothing was written,
    as no eviction could make room for it. Its save may go to another tier
    (``saves.Saves``)."""

    def __init__(self, message: str, *, size: int) -> None:
        super().__init__(message)
        self.size = size


class NoRoomError(CacheError):
    """A row within its tier's quota for which the tier cannot make room now: what it holds
    besides is checked out, or held for saves in flight (``CacheCore`` of a ram tier's
    ``hold``). Nothing was written. Its save may go to another tier (``saves.Saves``)."""


def store_row(
    key: bytes,
    request: SaveRequest,
    tier: Tier,
    index: Index,
    chunk_tokens: int,
    *,
    counters: Counters | None = None,
    wait_s: float = 30.0,
    hold: HoldRoom | None = None,
    fresh: Freshness | None = None,
    limit: int | None = None,
) -> StoredRow | None:
    """Store ``request`` in ``tier`` as a manifest over chunks when it comes with a splitter
    and holds at least one full chunk, else whole. Returns the published row, or None.
    ``hold``: called with the bytes about to enter the tier (the chunks it lacks and the
    manifest, or the whole row) before any is written; it raises to refuse them and returns
    what gives the room back once the row is stored or failed. ``fresh``: given where other
    processes sweep the tier's chunks (``sharedgc.py``): before the manifest, every chunk it
    names that this process has not written or touched in the last ``REFRESH_AFTER_S`` is
    touched (``_refresh``). ``limit``: the tier's quota; a row that would occupy more (its
    chunks, stored or new, and its manifest) is refused before anything is written, as no
    eviction could make room for it (``RowTooLargeError``)."""
    split, ns, tokens = request.split, request.namespace, request.tokens
    lens = request.chunk_lens
    lead = request.payload_from  # the payload is a tail: chunks before it must be stored
    if request.pack is not None:
        raise ValueError("store_row needs the payload packed (chunking.pack_request)")
    if split is None or (not lens and (chunk_tokens <= 0 or len(tokens) < chunk_tokens)):
        if lead:
            raise CacheError(f"{tier.name}: {key.hex()} holds positions from {lead} only")
        return _store_whole(key, request, tier, index, hold, limit)
    if not lens:
        lens = plan_lens(len(tokens), chunk_tokens, *index.chunk_base(ns, tokens), tokens)
    chain = chain_of(request, lens)
    keys = tuple(key for _, key in chain)
    bounds = [0]
    for length in lens:
        bounds.append(bounds[-1] + length)
    rest = _plan_rest(request, lens, chain, tier, index, chunk_tokens)
    pinned = keys + (rest.keys if rest is not None else ())
    write = index.pin_chunks(tier.name, pinned, wait_s)
    if write is not None and rest is not None and rest.start < rest.first and rest.keys[0] in write:
        # The wider chunk the window was to start in left the tier since it was found: the
        # window's own first cells are stored instead.
        index.unpin_chunks(tier.name, pinned)
        rest = _plan_rest(request, lens, chain, tier, index, chunk_tokens, wide=False)
        assert rest is not None
        pinned = keys + rest.keys
        write = index.pin_chunks(tier.name, pinned, wait_s)
    if write is None:
        raise CacheIOError(f"{tier.name}: chunks of {key.hex()} are still being deleted")
    try:
        need = set(write)
        first = next((i for i, k in enumerate(keys) if k in need), len(keys))
        if first < len(keys) and bounds[first] < lead:
            # A chunk the tail was packed without left the tier since (evicted, deleted):
            # this row cannot be stored; a later save packs it whole.
            raise CacheError(
                f"{tier.name}: chunk {keys[first].hex()} of {key.hex()} went while its tail "
                f"(positions from {lead}) was being saved"
            )
        try:
            # A copy: a view would keep the whole blob alive in the ram tier.
            whole_rest = (
                bytes(request.rest(request.payload))
                if request.rest is not None and rest is None
                else b""
            )
            parts = split(request.payload, bounds[first:]) if first < len(keys) else []
        except KvwarmError as exc:
            if lead:
                raise CacheError(f"{tier.name}: tail of {key.hex()} not cut: {exc}") from exc
            # A blob the codec cannot cut (several KV streams, a sliding-window cache): the
            # row is stored whole, as before chunks existed.
            log.info("%s: storing %s whole: %s", tier.name, key.hex(), exc)
            return _store_whole(key, request, tier, index, hold, limit)
        if len(parts) != len(keys) - first:
            raise ValueError(f"splitter returned {len(parts)} parts for {len(keys) - first}")
        rest_parts = _cut_rest(request, rest, tier, need) if rest is not None else []
        size = len(whole_rest) + sum(
            len(part) for i, part in enumerate(parts, start=first) if keys[i] in need
        )
        size += sum(len(part) for _, part in rest_parts)
        if limit is not None:
            stored = index.chunk_sizes(tier.name, [k for k in pinned if k not in need])
            _check_fits(tier, key, request, size + sum(s or 0 for s in stored), limit)
        room = hold(size) if hold is not None else None
        try:
            writes = _Writes(tier, index, counters, ns, fresh, room)
            for i, part in enumerate(parts, start=first):
                if keys[i] in need:
                    writes.add(keys[i], chain[i][0], tokens[bounds[i] : bounds[i + 1]], part)
            if rest is not None:
                rest_bounds = rest.bounds()
                for i, part in rest_parts:
                    span = tokens[rest_bounds[i] : rest_bounds[i + 1]]
                    writes.add(rest.keys[i], rest.parents[i], span, part)
            writes.flush()  # one pack, where the tier packs; else one object each
            if fresh is not None and isinstance(tier, ChunkAges):
                packed = index if tier.capabilities.packs else None
                lost = _refresh(tier, tier.name, pinned, fresh, packed)
                for i, k in enumerate(keys):
                    if k in lost and bounds[i] >= lead:  # swept elsewhere; its bytes are here
                        index.chunk_lost(tier.name, k)
                        [part] = split(request.payload, bounds[i : i + 2])
                        writes.add(k, chain[i][0], tokens[bounds[i] : bounds[i + 1]], part)
                        lost.discard(k)
                writes.flush()
                if lost:
                    for gone in lost:
                        index.chunk_lost(tier.name, gone)
                    raise CacheError(
                        f"{tier.name}: {len(lost)} chunk(s) of {key.hex()} (e.g. "
                        f"{next(iter(lost)).hex()}) left the tier (another process swept "
                        "them) and this save holds no bytes of theirs: dropped; the next "
                        "save writes them"
                    )
            if counters is not None:
                counters.incr("chunks_reused", len(pinned) - len(need))
            manifest = replace(
                request,
                payload=whole_rest,
                split=None,
                rest=None,
                rest_span=None,
                split_rest=None,
                chunk_lens=lens,
                chunk_keys=keys,
                rest_chunks=None if rest is None else rest.chunks,
                chunk_locs=_locs(tier, index, pinned),
            )
            return tier.store(key, manifest, index if room is None else index.held(room))
        finally:
            if room is not None:
                index.give_room(room)
    finally:
        index.unpin_chunks(tier.name, pinned)


#: A window is cut every ``chunk_tokens // REST_GRID_PARTS`` positions (and at its first
#: cache's cuts), so a checkpoint's window costs its new cells plus at most that many before
#: the next grid point, where no lower window's chunk reached. Finer cuts waste less there
#: but make more chunks a restore reads (Gemma 3 270M, a 1,000-token row on disk: 17 window
#: chunks at 32 tokens restored in 1.25x the time of its window stored whole).
REST_GRID_PARTS = 4


@dataclass(frozen=True, slots=True)
class _RestPlan:
    """A rest's chunks as a save plans them: what the manifest records, and each chunk's
    parent (for its object's head)."""

    chunks: RestChunks
    parents: tuple[bytes, ...]

    @property
    def keys(self) -> tuple[bytes, ...]:
        return self.chunks.keys

    @property
    def first(self) -> int:
        return self.chunks.first

    @property
    def start(self) -> int:
        return self.chunks.start

    def bounds(self) -> list[int]:
        out = [self.chunks.start]
        for length in self.chunks.lens:
            out.append(out[-1] + length)
        return out


def _plan_rest(
    request: SaveRequest,
    lens: tuple[int, ...],
    chain: Sequence[tuple[bytes, bytes]],
    tier: Tier,
    index: Index,
    chunk_tokens: int,
    *,
    wide: bool = True,
) -> _RestPlan | None:
    """The chunks of ``request``'s rest, when it is a KV cache the codec cuts (an iSWA
    window) and the payload holds it: cut at fixed points (``chunkfmt.rest_cuts``), its first
    chunk a wider one the tier already holds when it does (``wide``), so only the window's
    new cells are written. None: the rest stays in the row (a recurrent state, a copy of a
    row whose rest is whole, or a blob the codec does not cut)."""
    ns, tokens = request.namespace, request.tokens
    if request.rest_chunks is not None:  # a copy: its keys as they are
        given = request.rest_chunks
        plan = _RestPlan(given, ())
        parents = _rest_parents(ns, tokens, lens, chain, plan.bounds(), given.keys)
        return _RestPlan(given, parents)
    if (
        request.split_rest is None
        or request.rest_span is None
        or request.rest is None
        or request.payload_from
        or chunk_tokens <= 0
    ):
        return None
    try:
        first, end = request.rest_span(request.payload)
    except KvwarmError as exc:
        log.debug("rest of %d tokens kept whole: %s", len(tokens), exc)
        return None
    if not 0 <= first < end == len(tokens):
        return None
    grid = max(1, chunk_tokens // REST_GRID_PARTS)
    # No window chunk ends inside a span either (``off_spans``): a grid point may fall there
    # (the first cache's cuts stay: a window chunk lies within one of its chunks).
    cuts = rest_cuts(lens, first, end, grid)
    kept = {end, *itertools.accumulate(lens)}
    cuts = [cuts[0], *(c for c in cuts[1:] if c in kept or not _inside_span(tokens, c))]
    if wide:
        # A chunk from below the window's first position to the next cut, stored by a lower
        # window, holds these cells too: one from the grid point or chunk cut at or below it,
        # or from where the window of a row this one extends began (its first chunk).
        floor = max(first // grid * grid, *(b for b in _starts(lens) if b <= first))
        starts = index.rest_starts(tier.name, ns, tokens) if floor < first else set()
        for at in sorted({floor, *(s for s in starts if floor <= s < first)}):
            if at >= first:
                break
            widened = [at, *cuts[1:]]
            key = rest_chain(request.namespace, tokens, lens, chain, widened[:2])[0][1]
            if index.chunk_sizes(tier.name, [key])[0] is not None:
                cuts = widened
                break
    links = rest_chain(ns, tokens, lens, chain, cuts)
    chunks = RestChunks(
        first=first,
        start=cuts[0],
        lens=tuple(b - a for a, b in itertools.pairwise(cuts)),
        keys=tuple(k for _, k in links),
    )
    return _RestPlan(chunks, tuple(p for p, _ in links))


def _starts(lens: Sequence[int]) -> list[int]:
    out = [0]
    for n in lens[:-1]:
        out.append(out[-1] + n)
    return out


def _rest_parents(
    ns: Namespace,
    tokens: Sequence[int],
    lens: Sequence[int],
    chain: Sequence[tuple[bytes, bytes]],
    bounds: Sequence[int],
    keys: Sequence[bytes],
) -> tuple[bytes, ...]:
    """The parents of a copied manifest's rest chunks; ``CacheFormatError`` unless its keys
    are the chain of its tokens."""
    try:
        links = rest_chain(ns, tokens, lens, chain, bounds)
    except ValueError as exc:
        raise CacheFormatError(f"a manifest's rest chunks do not fit its chunks: {exc}") from None
    if [k for _, k in links] != list(keys):
        raise CacheFormatError("a manifest's rest chunk keys are not the chain of its tokens")
    return tuple(p for p, _ in links)


def _cut_rest(
    request: SaveRequest, rest: _RestPlan, tier: Tier, need: set[bytes]
) -> list[tuple[int, bytes]]:
    """The rest chunks the tier lacks, cut (from the first of them on), by their index."""
    assert request.split_rest is not None
    bounds = rest.bounds()
    keys = rest.keys
    first = next((i for i, k in enumerate(keys) if k in need), len(keys))
    if first == len(keys):
        return []
    if bounds[first] < rest.first and request.rest_chunks is None:
        # Only a copy (promotion) holds a wider chunk's cells before the window: a packed
        # blob does not, and the plan named that chunk only because the tier held it.
        raise CacheError("a rest chunk wider than the window is not in the tier")
    try:
        parts = request.split_rest(request.payload, bounds[first:])
    except KvwarmError as exc:  # the codec spanned this window a moment ago: a bug, not a row
        n = len(request.tokens)
        raise CacheError(f"{tier.name}: window of {n} tokens not cut: {exc}") from exc
    if len(parts) != len(keys) - first:
        raise ValueError(f"rest splitter returned {len(parts)} parts for {len(keys) - first}")
    return [(i, part) for i, part in enumerate(parts, start=first) if keys[i] in need]


#: A chunk this process wrote or touched (a chunk found already there when written is
#: touched) longer ago than this is touched again before a manifest naming it: a sweep's
#: grace period (``gc_shared``, default an hour) must exceed it plus one chunk's upload plus
#: the clock skew between the sweeping host and the store.
REFRESH_AFTER_S = 300.0


class Freshness:
    """When (monotonic) this process last wrote or touched each chunk of the tiers others
    sweep, so a conversation's saves a turn apart touch its chunks once per
    ``REFRESH_AFTER_S``, not once per save. Thread-safe; pruned of stale entries as it
    grows, so it holds at most twice the chunks noted within ``REFRESH_AFTER_S`` (or
    ``PRUNE_AT``), and a prune comes only after the table has doubled since the last one:
    a process noting more than ``PRUNE_AT`` chunks within ``REFRESH_AFTER_S`` rebuilt the
    whole table at every note (found by review)."""

    PRUNE_AT = 1 << 16

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at: dict[tuple[str, bytes], float] = {}
        self._prune_at = self.PRUNE_AT

    def note(self, tier: str, key: bytes) -> None:
        now = time.monotonic()
        with self._lock:
            self._at[(tier, key)] = now
            if len(self._at) > self._prune_at:
                self._at = {k: t for k, t in self._at.items() if now - t < REFRESH_AFTER_S}
                self._prune_at = max(self.PRUNE_AT, 2 * len(self._at))

    def forget(self, tier: str, keys: Iterable[bytes]) -> None:
        """A row naming ``keys`` failed to read (a chunk may be gone: evicted by redis, or
        deleted by hand): the next save naming them touches them, so finds out."""
        with self._lock:
            for key in keys:
                self._at.pop((tier, key), None)

    def recent(self, tier: str, key: bytes) -> bool:
        with self._lock:
            at = self._at.get((tier, key))
        return at is not None and time.monotonic() - at < REFRESH_AFTER_S


def _refresh(
    tier: ChunkAges,
    name: str,
    keys: Sequence[bytes],
    fresh: Freshness,
    index: Index | None = None,
) -> set[bytes]:
    """Touch each chunk of ``keys`` this process has not written or touched within
    ``REFRESH_AFTER_S``: one another process published, or this process's index knows from
    an earlier row, may be old and unreferenced in the store right now (its manifests
    evicted elsewhere), and a sweep deletes old unreferenced chunks (and packs). Touched, it
    is young until the manifest names it. A chunk in a pack is touched by touching its pack,
    once however many of the due chunks it holds. The chunks found gone (every due chunk of
    a pack found gone). ``index``: where the chunks lie, for a tier with packs."""
    due = [key for key in dict.fromkeys(keys) if not fresh.recent(name, key)]
    by_pack: dict[bytes, list[bytes]] = {}
    alone: list[bytes] = []
    packs = tier if index is not None and isinstance(tier, PacksChunks) else None
    locs = index.chunk_locs(name, due) if index is not None else [None] * len(due)
    for key, loc in zip(due, locs, strict=True):
        if loc is None:
            alone.append(key)
        else:
            by_pack.setdefault(loc.pack, []).append(key)
    touches: list[tuple[Callable[[bytes], bool], bytes, list[bytes]]] = [
        (tier.touch_chunk, key, [key]) for key in alone
    ]
    if packs is not None:
        touches += [(packs.touch_pack, pack, held) for pack, held in by_pack.items()]
    # A remote touch is a round trip (s3: a CopyObject): a long conversation saved after a
    # pause has a hundred due, which one after another held the writer thread for seconds
    # and filled its queue (found by review). Several go to a pool of their own (not the
    # read pools: restores must not wait behind them); the first failure still raises.
    found = (
        list(_touch_pool().map(lambda t: t[0](t[1]), touches))
        if len(touches) > TOUCH_ALONE
        else [touch(what) for touch, what, _ in touches]
    )
    lost: set[bytes] = set()
    for (_, _, held), there in zip(touches, found, strict=True):
        for key in held:
            if there:
                fresh.note(name, key)
            else:
                lost.add(key)
    return lost


#: Touches due at one save up to which they are made one after another on the saving thread
#: (a local tier's are syscalls; a chat's next turn within ``REFRESH_AFTER_S`` has none).
TOUCH_ALONE = 2
_TOUCH_WORKERS = 8
_touch_lock = threading.Lock()
_touch_executor: ThreadPoolExecutor | None = None


def _touch_pool() -> ThreadPoolExecutor:
    global _touch_executor
    with _touch_lock:
        if _touch_executor is None:
            _touch_executor = ThreadPoolExecutor(_TOUCH_WORKERS, thread_name_prefix="kvwarm-touch")
        return _touch_executor


class _Writes:
    """The chunks a save writes: gathered (``add``), then written by ``flush`` -- in a tier
    with packs as ONE pack object (its id the sha256 of their heads, which name each chunk's
    key, length and payload CRC32C: the same id is the same layout), else one object each
    through the tier's publish. Each is noted in the index where it lies, and in ``fresh``
    (a tier others sweep) as written now."""

    def __init__(
        self,
        tier: Tier,
        index: Index,
        counters: Counters | None,
        ns: Namespace,
        fresh: Freshness | None,
        room: RoomHold | None = None,
    ) -> None:
        self._tier = tier
        self._index = index
        self._room = room  # what the chunks land in leaves (``Index.chunk_stored``)
        self._counters = counters
        self._ns = ns
        self._fresh = fresh
        self._packs = (
            tier if isinstance(tier, PacksChunks) and tier.capabilities.pack_writes else None
        )
        self._pending: list[tuple[bytes, bytes, bytes]] = []

    def add(self, key: bytes, parent: bytes, tokens: Sequence[int], part: bytes) -> None:
        """Chunk ``key``: ``tokens`` after ``parent``, its payload ``part``."""
        made, head = build_head(self._ns, parent, tokens, part)
        if made != key:  # the plan and the head disagree: a bug, never a mislabelled chunk
            raise ValueError(f"chunk {key.hex()} would be stored under {made.hex()}")
        self._pending.append((key, head, part))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        tier = self._tier
        if self._packs is not None:
            for group in _pack_groups(pending):
                self._store_pack(self._packs, group)
            return
        for key, head, part in pending:
            self._done(key, tier.store_chunk(key, head, part), None)

    def _store_pack(self, packs: PacksChunks, group: list[tuple[bytes, bytes, bytes]]) -> None:
        pack = hashlib.sha256(b"".join(head for _, head, _ in group)).digest()
        packs.store_pack(pack, [b for _, head, part in group for b in (head, part)])
        offset = 0
        for key, head, part in group:
            size = len(head) + memoryview(part).nbytes
            self._done(key, size, PackLoc(pack, offset, size))
            offset += size
        if self._counters is not None:
            self._counters.incr("packs_written")

    def _done(self, key: bytes, size: int, loc: PackLoc | None) -> None:
        self._index.chunk_stored(self._tier.name, key, size, loc, self._room)
        if self._fresh is not None:
            self._fresh.note(self._tier.name, key)
        if self._counters is not None:
            self._counters.incr("chunks_written")
            self._counters.incr("chunk_bytes_written", size)


#: The most bytes one pack holds: a save's new chunks past it go into further packs, cut at a
#: chunk boundary (a chunk larger than it is a pack of its own). A pack is one PUT, and its
#: body is joined in memory for it: a long row of a large model (a 70B model's 128k tokens
#: are ~40 GB of f16 KV) as one pack would hold a second copy of the row and pass S3's 5 GB
#: limit on one PUT, where chunk objects were each a few MB. Four ranged GETs of
#: ``MAX_RUN_BYTES`` read a full pack, at once.
MAX_PACK_BYTES = 64 << 20


def _pack_groups(
    pending: Sequence[tuple[bytes, bytes, bytes]], limit: int | None = None
) -> list[list[tuple[bytes, bytes, bytes]]]:
    """``pending`` chunks (key, head, payload), in order, cut into packs of at most ``limit``
    bytes (``MAX_PACK_BYTES``) each."""
    limit = MAX_PACK_BYTES if limit is None else limit
    groups: list[list[tuple[bytes, bytes, bytes]]] = []
    size = 0
    for chunk in pending:
        n = len(chunk[1]) + memoryview(chunk[2]).nbytes
        if not groups or size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(chunk)
        size += n
    return groups


def _locs(tier: Tier, index: Index, refs: Sequence[bytes]) -> tuple[PackLoc | None, ...]:
    """A manifest's pack locations (``SaveRequest.chunk_locs``): () unless the tier packs
    and one of ``refs`` lies in a pack."""
    if not tier.capabilities.packs:
        return ()
    locs = tuple(index.chunk_locs(tier.name, refs))
    return locs if any(loc is not None for loc in locs) else ()


def _store_whole(
    key: bytes,
    request: SaveRequest,
    tier: Tier,
    index: Index,
    hold: HoldRoom | None,
    limit: int | None = None,
) -> StoredRow | None:
    if limit is not None:
        _check_fits(tier, key, request, memoryview(request.payload).nbytes, limit)
    if hold is None:
        return tier.store(key, _whole(request), index)
    room = hold(memoryview(request.payload).nbytes + len(request.logits or b""))
    try:
        return tier.store(key, _whole(request), index.held(room))
    finally:
        index.give_room(room)


def _check_fits(tier: Tier, key: bytes, request: SaveRequest, n_bytes: int, limit: int) -> None:
    """``RowTooLargeError`` when a row of ``n_bytes`` (its KV; its tokens and logits added here)
    exceeds ``limit``, its tier's quota: found by review, such a save was stored (or its
    room held) first, evicting every other row of the tier, then itself: nothing kept."""
    total = n_bytes + _row_extra(request)
    if total > limit:
        raise RowTooLargeError(
            f"{tier.name}: {key.hex()} ({total} bytes) is larger than the tier's quota "
            f"({limit} bytes): not saved",
            size=total,
        )


def chain_of(request: SaveRequest, lens: Sequence[int]) -> list[tuple[bytes, bytes]]:
    """(parent, key) of each chunk of ``request`` cut at ``lens``: a copied manifest's own
    keys, else the chain of its tokens, apart past ``plain_to`` (``chunkfmt.chunk_chain``;
    a row whose every token is canonical keeps its non-plain chunks to its own length)."""
    ns, tokens = request.namespace, request.tokens
    if request.chunk_keys:
        return recover_chain(ns, tokens, lens, request.chunk_keys)
    own = len(tokens) if request.canonical_tokens is None else 0
    return chunk_chain(ns, tokens, lens, plain_to=request.plain_to, own=own)


def _whole(request: SaveRequest) -> SaveRequest:
    return replace(
        request,
        split=None,
        rest=None,
        rest_span=None,
        split_rest=None,
        chunk_lens=(),
        chunk_keys=(),
        rest_chunks=None,
        chunk_locs=(),
    )


def load_chunks(
    tier: Tier,
    keys: Sequence[bytes],
    arena: bytearray | None = None,
    sizes: Sequence[int | None] = (),
    helper: Executor | None = None,
    helpers: int = 1,
) -> list[memoryview]:
    """The verified payloads of ``keys``, in order (``CacheKeyError``/``CacheFormatError``
    from the first that is missing or bad). With ``arena`` and every chunk's stored size,
    chunk ``i`` is read into its own slice of the arena (the tier may decline).

    With ``helper`` (a local tier's read threads), the chunks are shared out between the
    caller and up to ``helpers`` tasks on it, each taking the next unread chunk: a file read
    and its CRC32C release the GIL, so on two free cores a 13-chunk row reads in about half
    the time. The caller never waits for a task that has not started (a busy pool: it reads
    every chunk itself), only for the one chunk each started task is reading."""
    if arena is None or len(sizes) != len(keys) or None in sizes:
        into: list[memoryview | None] = [None] * len(keys)
    else:
        whole = memoryview(arena)
        into, at = [], 0
        for size in sizes:
            assert size is not None
            into.append(whole[at : at + size])
            at += size
        whole.release()
    if helper is None or len(keys) < 2:
        return [tier.load_chunk(k, b) for k, b in zip(keys, into, strict=True)]
    return _load_shared(tier, keys, into, helper, helpers)


#: The most bytes one ranged GET of a pack reads: a longer run of adjacent chunks is cut at a
#: chunk boundary into GETs issued together. One connection's throughput bounds a single GET
#: (AWS advises ranged GETs of 8-16 MB to read a large object at several connections' speed),
#: so a 45 MiB row reads as three GETs at once, not one; a 1,000-token Gemma 3 270M row
#: (10.4 MiB) is still one. Not measured against real S3 here (moto and redis only).
MAX_RUN_BYTES = 16 << 20

#: One read of a remote row's chunks: (index among the row's chunks, verified payload) of
#: each chunk it fetched.
ChunkRead = Callable[[], list[tuple[int, memoryview]]]


def chunk_reads(
    tier: Tier, refs: Sequence[bytes], locs: Sequence[PackLoc | None] = ()
) -> list[ChunkRead]:
    """The reads that fetch the chunks ``refs`` of a row of a remote tier, to be issued
    together: one GET per chunk stored as its own object, one ranged GET per run of chunks
    adjacent in a pack (``locs``: the row's ``StoredRow.locs``), a run cut where it would
    pass ``MAX_RUN_BYTES``. Each read verifies every
    chunk it fetched exactly as ``Tier.load_chunk`` does, and raises as it does."""
    packs = tier if locs and isinstance(tier, PacksChunks) else None
    reads: list[ChunkRead] = []
    runs: dict[bytes, list[tuple[int, bytes, PackLoc]]] = {}
    for i, key in enumerate(refs):
        loc = locs[i] if packs is not None else None
        if loc is None:
            reads.append(functools.partial(_read_own, tier, i, key))
        else:
            runs.setdefault(loc.pack, []).append((i, key, loc))
    assert packs is not None or not runs
    for pack, pieces in runs.items():
        pieces.sort(key=lambda piece: piece[2].offset)
        run = [pieces[0]]
        for piece in pieces[1:]:
            loc = piece[2]
            if loc.offset != run[-1][2].end or loc.end - run[0][2].offset > MAX_RUN_BYTES:
                reads.append(functools.partial(_read_run, packs, pack, run))
                run = []
            run.append(piece)
        reads.append(functools.partial(_read_run, packs, pack, run))
    return reads


def _read_own(tier: Tier, i: int, key: bytes) -> list[tuple[int, memoryview]]:
    return [(i, tier.load_chunk(key))]


def _read_run(
    packs: PacksChunks | None, pack: bytes, run: list[tuple[int, bytes, PackLoc]]
) -> list[tuple[int, memoryview]]:
    assert packs is not None
    views = packs.load_packed(pack, [(key, loc) for _, key, loc in run])
    return [(i, view) for (i, _, _), view in zip(run, views, strict=True)]


def gather_reads(done: Iterable[list[tuple[int, memoryview]]], n: int) -> list[memoryview]:
    """The payloads of ``n`` chunks in their row's order, from the results of its
    ``chunk_reads`` (the first read that raised raises here)."""
    out: list[memoryview | None] = [None] * n
    for got in done:
        for i, view in got:
            out[i] = view
    views = [view for view in out if view is not None]
    if len(views) != n:
        raise AssertionError("a chunk no read fetched")
    return views


def _load_shared(
    tier: Tier,
    keys: Sequence[bytes],
    into: Sequence[memoryview | None],
    helper: Executor,
    helpers: int,
) -> list[memoryview]:
    """``load_chunks`` by the caller and up to ``helpers`` tasks, each taking the next
    chunk."""
    out: list[memoryview | None] = [None] * len(keys)
    errors: dict[int, BaseException] = {}
    lock = threading.Lock()
    taken = 0

    def work() -> None:
        nonlocal taken
        while True:
            with lock:
                i = taken
                if i >= len(keys) or errors:
                    return
                taken += 1
            try:
                out[i] = tier.load_chunk(keys[i], into[i])
            except BaseException as exc:  # re-raised by the caller below, in key order
                with lock:
                    errors[i] = exc
                return

    futures = []
    for _ in range(min(helpers, len(keys) - 1)):
        try:
            futures.append(helper.submit(work))
        except RuntimeError:  # the pool is shut down (the cache is closing): read alone
            break
    try:
        work()
    finally:
        for future in futures:
            if not future.cancel():  # started: it holds at most one chunk, wait for it
                future.result()
    if errors:
        raise errors[min(errors)]
    views = [view for view in out if view is not None]
    assert len(views) == len(keys), "every chunk read or an error raised"
    return views
