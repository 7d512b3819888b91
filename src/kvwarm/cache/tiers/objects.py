"""The generic tier: the publish protocol, probes, scans, hit fields and chunk rules of every
persistent tier -- a directory of files, s3, redis -- written once over ``ObjectStore``.

Two layers: ``ObjectTier`` implements ``protocols.Tier`` and owns every rule; an
``ObjectStore`` only moves named byte strings (put-if-absent, get, list, delete, user
metadata). A new store is one module implementing ``ObjectStore`` plus one
``tiers.registry.register_scheme`` call. A store may offer more, as small protocols checked
once when the tier is built, and the tier then uses it: ``StagesPuts`` (the durable half of a
put runs before the reservation check: files' temp file and fdatasync), ``LocalReads`` (reads
are local copies: a load lands in the caller's reused buffer, a probe reads the metadata
only), ``Quarantines`` (what a scan rejects is moved aside, not only reported) and
``ReapsTemps`` (interrupted puts leave temp objects a scan removes).

Invariants:
- An object holds exactly the bytes of a ``.kvc`` file (``cache/formats/kvc.py``), so every ``load``
  verifies the payload CRC32C and that the row replays to its key; a row that fails is
  ``CacheFormatError`` (the facade drops it and deletes the object).
- Publish once (``common.publish_row``): the row is staged (``StagesPuts``; else nothing is
  staged), ``book.check``'ed, then put with put-if-absent; a store makes a put visible whole
  or not at all. "Already there" means another writer published the key first: its object
  is *adopted* if its metadata parses as this key and every chunk it names is there,
  replaced (delete, put again) if it is junk or names a chunk that is gone.
- The startup scan only reports what it cannot read, unless the store ``Quarantines`` and the
  tier repairs: an object it cannot read may be another host's row, and a store several hosts
  share refuses to set it aside. Something that vanished since the listing is skipped. Only
  an object whose bytes are bad (``CacheFormatError``) is set aside: a read that failed
  (``CacheIOError``: EIO, EMFILE, ENOMEM on our side) leaves it in place, reported; out of
  descriptors or memory (``CacheIOError.exhausted``) the scan stops there.
- A row or chunk in a format version newer than this kvwarm reads (``CacheNewerFormatError``:
  a newer kvwarm sharing the store, or one before a rollback) is nobody's damage: a scan
  leaves it where it is (not set aside, not reported as bad), a probe or load is a miss, and
  a save whose name it holds fails rather than replacing it.
- Hit counts and last-used times are user metadata outside the KVC bytes' CRCs (a file keeps
  them in its header's hit fields, an object store beside the object).
- Chunks are ``chunks/<hex>.kvk`` objects, content-addressed and put once; one already there
  is kept (and touched: its age restarts, as a sweep sees it) if its head is valid, replaced
  if not (``common.commit_chunk``); the payload CRC
  is checked on load (``chunkfmt.parse``), the head at scan where the store can set aside.
- With ``TierCapabilities.packs`` (s3, redis) a save's new chunks are one *pack*,
  ``packs/<hex id>.kvp`` (``PacksChunks``), put once like a chunk: chunk objects one after
  another, each verified alone when a ranged read fetches it (``load_packed``); a pack a
  load found bad is replaced, not kept, by the next put of its id.
- Network faults surface as ``CacheNetworkError`` from the store; nothing here retries.
See docs/architecture.md (the cache).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from kvwarm.cache.formats import chunkfmt, kvc
from kvwarm.cache.protocols import ReservationBook, RowBytes, StoredRow, TierCapabilities
from kvwarm.cache.tiers import layout
from kvwarm.cache.tiers.common import StepHook, commit_chunk, publish_row, row_info
from kvwarm.cache.tiers.layout import ROW_SUFFIX, key_of, name_for
from kvwarm.cache.types import PackLoc, SaveRequest, TierName
from kvwarm.errors import (
    CacheFormatError,
    CacheIOError,
    CacheKeyError,
    CacheNetworkError,
    CacheNewerFormatError,
    ChunkFormatError,
    ConfigError,
)

__all__ = [
    "REMOTE_CAPABILITIES",
    "Breaker",
    "Got",
    "LocalReads",
    "ObjectStore",
    "ObjectTier",
    "Quarantines",
    "ReapsTemps",
    "StagedPut",
    "StagesPuts",
    "remote_capabilities",
]

log = logging.getLogger(__name__)

# Outlives us, other processes and hosts publish into it, and every byte crosses a network:
# a save's new chunks go into one pack object (``PacksChunks``).
REMOTE_CAPABILITIES = TierCapabilities(
    persistent=True, shared=True, local=False, packs=True, pack_writes=True
)


def remote_capabilities(*, packs: bool) -> TierCapabilities:
    """A remote tier's capabilities; ``packs=False`` (the tier option ``packs=0``): its saves
    write chunk objects only, while packs others wrote are still read and swept."""
    return REMOTE_CAPABILITIES if packs else replace(REMOTE_CAPABILITIES, pack_writes=False)


CHUNK_DIR = "chunks/"  # chunk objects: chunks/<hex key>.kvk beside the <hex key>.kvc rows
PACK_DIR = "packs/"  # packs of chunk objects: packs/<hex id>.kvp
PACK_STEP = "pack_linked"  # reported to ``on_step`` once a pack is put (fault tests)
# A probe reads this much first: a miss costs nothing more, and a hit's header, TLV, tokens
# and stored logits (4 B x vocab: 196 KiB for a 49k vocab) come in one round trip for most
# models; longer metadata (a 128k vocab's logits) takes a second ranged read.
HEAD_BYTES = 256 << 10
CHUNK_HEAD_BYTES = 1 << 16  # a chunk head is ~140 B + 4 B a token: 16k tokens fit
_SCAN_PARALLEL = 16
META_HITS = "kvwarm-hits"
META_LAST_USED = "kvwarm-last-used"


class Breaker:
    """The rule every remote store follows after a network fault: it is *down* for
    ``down_for_s`` and calls fail at once with ``CacheNetworkError`` instead of waiting out
    another timeout. When the window has passed, one call (the *trial*) tries the store while
    every other still fails at once: its answer opens the store to all (``answered``), its
    fault shuts it for another window (``trip``). So a dead store costs each lookup nothing
    and the process one timeout per window, however many threads call it (found by review:
    every caller in flight as a window ended -- a wave of probes, the writer threads, a
    restore on the engine's thread -- waited out its own timeout). A trial still unanswered
    a window later (a read timeout longer than the window) lets one more caller try. An
    outage is warned once, and its end said. Thread-safe."""

    def __init__(self, label: str, down_for_s: float) -> None:
        self._label = label
        self._down_for_s = down_for_s
        self._lock = threading.Lock()
        self._down_until = 0.0  # no call goes before this; then one, the trial
        self._out_since: float | None = None  # the outage's first fault; None: the store is up
        self._trial = 0  # the thread trying the store since the window passed

    def is_down(self) -> bool:
        with self._lock:
            return self._out_since is not None and time.monotonic() < self._down_until

    def check(self) -> None:
        """``CacheNetworkError`` while the store is down, or while another call is its trial;
        else the caller goes (as the trial, when the store was down)."""
        if self._out_since is None:  # the common case: no lock
            return
        with self._lock:
            now = time.monotonic()
            if self._out_since is None:
                return
            if now >= self._down_until:
                self._down_until = now + self._down_for_s  # this caller is the trial
                self._trial = threading.get_ident()
                return
        raise CacheNetworkError(f"{self._label}: store marked down after a network fault")

    def answered(self) -> None:
        """A call got an answer (a refusal or a missing object is one): the store is up. One
        that went before the fault and answers within its window is not the trial's answer
        (a store throttling some calls answers others): the window stands."""
        if self._out_since is None:
            return
        with self._lock:
            now = time.monotonic()
            if self._trial != threading.get_ident() and now < self._down_until:
                return
            since, self._out_since = self._out_since, None
            self._down_until = 0.0
        if since is not None:
            log.warning(
                "%s: the store answers again (down %.1fs)", self._label, time.monotonic() - since
            )

    def trip(self, err: CacheNetworkError) -> None:
        """A network fault: down from now for ``down_for_s`` (warned once per outage)."""
        with self._lock:
            now = time.monotonic()
            first = self._out_since is None
            if first:
                self._out_since = now
            self._down_until = now + self._down_for_s
            self._trial = 0
        if first:
            log.warning("%s; skipping the store for %.1fs", err, self._down_for_s)


class TransferTooSlowError(CacheNetworkError):
    """A remote transfer under its store's speed floor (``Pace``): abandoned as a network
    fault, as a timeout is."""


class Pace:
    """The slowest a remote transfer may go, as curl's ``--speed-limit``/``--speed-time``: one
    that moves fewer than ``min_bytes_per_s`` bytes a second, averaged over a window of
    ``window_s`` (the store's read timeout), is abandoned (``TransferTooSlowError``). Found by
    review: botocore, urllib3 and redis-py bound each socket read or send by their timeout,
    not a whole body, so a store sending a few bytes now and then held a GET for as long as
    the body lasted (a restore on the engine's thread: the whole model worker), and one
    taking a PUT's bytes slowly held its thread and payload as long. A rate, not a deadline:
    a multi-GB pack read at a good rate takes as long as it takes. The floor is checked as
    bytes arrive (or are handed to the socket), so a transfer is abandoned at most one read
    timeout after its window ends. Once abandoned it stays so: a retry reading the same body
    again fails at once. One per transfer (or connection); not thread-safe. 0: no floor."""

    def __init__(self, min_bytes_per_s: int, window_s: float) -> None:
        self._floor = min_bytes_per_s
        self._window_s = window_s
        self._abandoned: str | None = None
        self.restart()

    def restart(self) -> None:
        """A new exchange begins (a command sent, a body read again from its start)."""
        self._since = time.monotonic()
        self._moved = 0

    def moved(self, n: int) -> None:
        """``n`` more bytes came or went; ``TransferTooSlowError`` if the window ending now moved
        too few."""
        if self._abandoned is not None:
            raise TransferTooSlowError(self._abandoned)
        if self._floor <= 0:
            return
        self._moved += n
        now = time.monotonic()
        elapsed = now - self._since
        if elapsed < self._window_s:
            return
        if self._moved < self._floor * elapsed:
            self._abandoned = (
                f"transfer abandoned: {self._moved} bytes in {elapsed:.1f}s, under the floor "
                f"of {self._floor} bytes a second (min_bytes_per_s)"
            )
            raise TransferTooSlowError(self._abandoned)
        self._since, self._moved = now, 0


@dataclass(frozen=True, slots=True)
class Got:
    """What ``ObjectStore.get`` read: ``data`` (the range asked for, or all of it), the
    object's whole ``size`` and its user metadata."""

    data: bytes
    size: int
    meta: Mapping[str, str]


class ObjectStore(Protocol):
    """Named, immutable byte strings plus a little mutable user metadata. Names are relative
    (``<hex>.kvc``, ``chunks/<hex>.kvk``); the store adds its own prefix. Thread-safe.
    Errors: a missing object is ``CacheKeyError``; a store that cannot be reached is
    ``CacheNetworkError``; anything else it refuses is ``CacheIOError``."""

    @property
    def label(self) -> str:
        """Where, for messages: e.g. ``s3://bucket/prefix``."""
        ...

    def location(self, name: str) -> str:
        """The object's address, recorded as the row's location (e.g. an ``s3://`` URL)."""
        ...

    def put_if_absent(self, name: str, body: bytes) -> bool:
        """Create ``name`` whole, atomically. False if an object of that name exists."""
        ...

    def get(self, name: str, end: int | None = None) -> Got:
        """Bytes ``[0, end)`` of ``name`` (all of it if ``end`` is None or past its end)."""
        ...

    def get_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``name``."""
        ...

    def names(self, prefix: str) -> list[str]:
        """The name of every object whose name starts with ``prefix``, nothing else read."""
        ...

    def list(self, prefix: str) -> list[tuple[str, int, float]]:
        """(name, size, age as last-modified epoch seconds; ``inf`` if unknown) of every
        object whose name starts with ``prefix``."""
        ...

    def delete(self, name: str) -> None:
        """Remove ``name`` and its metadata; missing is fine."""
        ...

    def set_meta(self, name: str, meta: Mapping[str, str]) -> None:
        """Replace ``name``'s user metadata. ``CacheKeyError`` if it is gone."""
        ...

    def touch(self, name: str) -> bool:
        """Set ``name``'s last-modified time to now (the store's clock where it stamps
        times), bytes unchanged; its user metadata may be dropped (only chunks, which have
        none, are touched). False if it is gone."""
        ...

    def age(self, name: str) -> float | None:
        """``name``'s last-modified epoch seconds (``inf`` if unknown); None if it is gone."""
        ...

    def close(self) -> None: ...


class StagedPut(Protocol):
    """A put split in two: its bytes already durable where no reader sees them, to be made
    visible under the name atomically."""

    def link(self) -> bool:
        """Make the object visible under its name; False if the name is taken."""
        ...

    def settle(self, adopted: bool) -> None:
        """After the link (or, ``adopted``, after keeping what was already there): make the
        name durable and drop what was staged."""
        ...

    def undo(self) -> None:
        """Remove what was staged, and what ``link`` made visible of a row. Idempotent."""
        ...


@runtime_checkable
class StagesPuts(Protocol):
    """A store whose put has a slow durable half that runs before the reservation check
    (files: temp file, fdatasync) and a fast atomic half after it (link(2))."""

    def stage(self, name: str, parts: Sequence[kvc.Buffer], token: int) -> StagedPut:
        """Write ``parts`` durably under a private name (``token``: the reservation, 0 for a
        chunk); cleans up after itself if it raises."""
        ...


@runtime_checkable
class LocalReads(Protocol):
    """A store whose reads are local copies, not round trips (files)."""

    def read_prefix(self, name: str) -> tuple[bytes, int]:
        """Row ``name``'s metadata prefix (``[0, kvc.meta_end)``, no payload) and its size."""
        ...

    def read_into(self, name: str, buffer: bytearray | None) -> tuple[memoryview, bytearray]:
        """All of ``name``, read into ``buffer`` if it is large enough, else a fresh one:
        (a view of exactly its bytes, the buffer behind it)."""
        ...

    def read_exact_into(self, name: str, into: memoryview) -> memoryview | None:
        """All of ``name`` read into ``into`` if it is exactly that long, else None."""
        ...


@runtime_checkable
class Quarantines(Protocol):
    """A store that can move what a scan rejects out of the way (files: ``quarantine/``)."""

    def set_aside(self, name: str) -> bool:
        """Move ``name`` aside (or delete it); False if it may only be reported (a store
        several hosts share) or could not be moved. Errors are logged, never raised."""
        ...

    def quarantined(self) -> tuple[int, int]:
        """(rows, chunks) set aside so far."""
        ...


@runtime_checkable
class ReapsTemps(Protocol):
    """A store whose interrupted puts leave temp objects behind (files)."""

    def reap_temps(self, names: Sequence[str], remove: bool) -> list[tuple[str, str]]:
        """Remove the temp objects among ``names`` (a listing) that nobody may still be
        writing (``remove=False``: keep them); (location, why) of those left in place, and
        of anything else in the way of the store's names that a scan must report (files: a
        directory named like a row or chunk file)."""
        ...


class _PutAtLink:
    """A store with no staging: nothing before the check, one put at the link."""

    def __init__(self, store: ObjectStore, name: str, parts: Sequence[kvc.Buffer]) -> None:
        self._store = store
        self._name = name
        self._body = b"".join(parts)  # the one copy a store that takes one body needs

    def link(self) -> bool:
        return self._store.put_if_absent(self._name, self._body)

    def settle(self, adopted: bool) -> None:
        """A put is visible whole and durable when it returns."""

    def undo(self) -> None:
        """Nothing was visible before the put; after it, the row is complete and the index
        (mark_linked) or a scan decides, as for a reservation lost at publish."""


class _Staged:
    """One row through ``common.publish_row``: staged by the store, linked, adopted or
    cleared here."""

    def __init__(self, tier: ObjectTier, key: bytes, request: SaveRequest, token: int) -> None:
        self._tier = tier
        self._key = key
        self._request = request
        self._fields = kvc.fields_from_request(request, now=time.time())
        prefix = kvc.build_prefix(self._fields, request.payload)
        self._prefix_len = len(prefix)
        self._put = tier._stage(row_name(key), (prefix, request.payload), token)

    def link(self) -> bool:
        return self._put.link()

    def existing(self) -> StoredRow | None:
        """The row there, unless it names a chunk that is gone (swept by another process,
        evicted by redis): such a manifest is a miss for everyone, so ours replaces it
        rather than being adopted into one -- else the key would miss for good. Only the
        chunks ours does not name are asked after (one request each): the save wrote or
        touched ours just before (``chunking.store_row``), and were one of them gone, ours
        would name it too. Replicas cutting alike name the same chunks, so adopting costs
        no request per chunk (it cost one per chunk of the row; found by review)."""
        found = self._tier._examine(row_name(self._key), self._key)
        if isinstance(found, CacheNewerFormatError):
            # A newer kvwarm's row under our key: not junk, not ours to replace (found by
            # review: an older kvwarm's save deleted it). This save fails; the row stays.
            raise found
        row = None if isinstance(found, str) else found
        if row is None:
            return None
        if self._tier._found_bad(row_name(self._key)):
            log.info("%s: the row in the way of %s failed a load: replacing it",
                     self._tier.name, self._key.hex())  # fmt: skip
            return None
        request = self._request
        ours = set(request.chunk_keys or ())
        if request.rest_chunks is not None:
            ours.update(request.rest_chunks.keys)
        locs = row.locs or (None,) * len(row.chunk_refs)
        packs: dict[bytes, bool] = {}  # each pack asked after once
        gone = next(
            (
                k
                for k, loc in zip(row.chunk_refs, locs, strict=True)
                if k not in ours
                and (
                    self._tier.chunk_age(k) is None
                    if loc is None
                    else not packs.setdefault(loc.pack, self._tier.pack_age(loc.pack) is not None)
                )
            ),
            None,
        )
        if gone is not None:
            log.info(
                "%s: the row in the way of %s names a chunk that is gone (%s): replacing it",
                self._tier.name,
                self._key.hex(),
                gone.hex(),
            )
            return None
        return row

    def clear(self) -> None:
        self._tier.delete(self._key)

    def settle(self, adopted: StoredRow | None) -> StoredRow:
        self._put.settle(adopted is not None)
        if adopted is not None:
            return adopted
        self._tier._found_bad(row_name(self._key), False)
        tier, key, request = self._tier, self._key, self._request
        n = memoryview(request.payload).nbytes
        info = row_info(key, tier.name, self._fields, n, stored_bytes=self._prefix_len + n)
        location = tier.location(key)
        return StoredRow(
            info,
            request.tokens,
            location,
            request.chunk_keys,
            request.chunk_lens,
            request.rest_chunks,
            request.chunk_locs,
        )

    def undo(self) -> None:
        self._put.undo()

    def lost(self) -> None:
        """The row stays for the index (which may have adopted it) or the scan to decide."""


class ObjectTier:
    """A ``Tier`` over an ``ObjectStore``. Thread-safe when the store is."""

    def __init__(
        self,
        store: ObjectStore,
        quota_bytes: int,
        *,
        name: TierName,
        repair: bool = True,
        capabilities: TierCapabilities = REMOTE_CAPABILITIES,
        on_step: StepHook | None = None,
    ) -> None:
        if quota_bytes < 0:
            raise ConfigError(f"{name} tier quota must be >= 0")
        self._store = store
        self._quota = quota_bytes
        self._name = name
        self._repair = repair
        self._capabilities = capabilities
        self._on_step = on_step  # publish steps, for the fault-injection tests
        self._problems: list[tuple[str, str]] = []
        self._chunk_problems: list[tuple[str, str]] = []
        # Objects a load found bad (a payload failing its CRC: the metadata or head that
        # decides whether a save adopts an object already there may still be valid). A save
        # of one replaces it rather than adopting it, then forgets it (``_found_bad``).
        self._bad: set[str] = set()
        self._bad_lock = threading.Lock()
        # What the store offers beyond the seam, asked once.
        self._stages = store if isinstance(store, StagesPuts) else None
        self._local = store if isinstance(store, LocalReads) else None
        self._aside = store if isinstance(store, Quarantines) else None
        self._temps = store if isinstance(store, ReapsTemps) else None

    @property
    def name(self) -> TierName:
        return self._name

    @property
    def quota_bytes(self) -> int:
        return self._quota

    @property
    def capabilities(self) -> TierCapabilities:
        return self._capabilities

    @property
    def objects(self) -> ObjectStore:
        """The store under this tier."""
        return self._store

    def location(self, key: bytes) -> str:
        return self._store.location(row_name(key))

    def problems(self) -> tuple[tuple[str, str], ...]:
        """(location, why) of everything the last scans could not use and left in place."""
        return tuple(self._problems) + tuple(self._chunk_problems)

    # ---- publish -------------------------------------------------------------------------

    def store(self, key: bytes, request: SaveRequest, book: ReservationBook) -> StoredRow | None:
        return publish_row(
            self._name,
            key,
            request,
            book,
            lambda token: _Staged(self, key, request, token),
            self._on_step,
        )

    def _stage(self, name: str, parts: Sequence[kvc.Buffer], token: int) -> StagedPut:
        if self._stages is not None:
            return self._stages.stage(name, parts, token)
        return _PutAtLink(self._store, name, parts)

    # ---- read side -----------------------------------------------------------------------

    def load(self, row: StoredRow, buffer: bytearray | None = None) -> RowBytes:
        """The whole row, fully verified. A store with ``LocalReads`` reads it into
        ``buffer``; another's body arrives as one immutable bytes object (``buffer`` unused),
        which a promotion may keep past the caller's lease."""
        key = row.info.key
        data: kvc.Buffer
        backing: bytearray | None = None
        if self._local is not None:
            data, backing = self._local.read_into(row_name(key), buffer)
        else:
            data = self._store.get(row_name(key)).data
        try:
            f = kvc.parse(data, expected_key=key, known_tokens=row.tokens)
        except CacheNewerFormatError:
            raise  # not bad: a newer kvwarm's, which a save must not replace
        except CacheFormatError:
            self._found_bad(row_name(key), True)
            raise
        fields = f.meta.fields
        return RowBytes(fields.tokens, f.payload, fields.logits, backing, fields)

    def load_meta(self, row: StoredRow) -> RowBytes:
        """The row's metadata alone (a prefix read, as ``probe``'s; its CRC and key checked,
        the payload neither read nor checked)."""
        meta, _ = self._checked_meta(row_name(row.info.key), row.info.key)
        fields = meta.fields
        return RowBytes(fields.tokens, memoryview(b""), fields.logits, None, fields)

    def probe(self, key: bytes) -> StoredRow | None:
        """The row under ``key`` if a valid one exists (metadata read, payload not): one
        ranged read, two if the metadata is longer than ``HEAD_BYTES`` (one local read of
        exactly the metadata with ``LocalReads``). None if missing or invalid;
        ``CacheNetworkError`` if the store cannot say."""
        found = self._examine(row_name(key), key)
        if isinstance(found, (str, CacheNewerFormatError)):
            log.info("%s: probe of %s found an unusable object: %s", self._name, key.hex(), found)
            return None
        return found

    def _examine(self, name: str, key: bytes) -> StoredRow | str | CacheNewerFormatError | None:
        """The valid row ``name`` holds, why it is unusable, the error saying it is a newer
        kvwarm's (to be left alone), or None if it is gone."""
        try:
            meta, user_meta = self._checked_meta(name, key)
        except CacheKeyError:
            return None
        except CacheNewerFormatError as exc:
            return exc
        except CacheFormatError as exc:
            return str(exc)
        return self._row(key, meta, user_meta)

    def _checked_meta(self, name: str, key: bytes) -> tuple[kvc.KvcMeta, Mapping[str, str]]:
        """``name``'s metadata, verified and replaying to ``key`` (else ``CacheFormatError``)."""
        meta, user_meta = self._read_meta(name)
        if meta.key != key:
            raise CacheFormatError(f"{name} holds another key")
        return meta, user_meta

    def _read_meta(self, name: str) -> tuple[kvc.KvcMeta, Mapping[str, str]]:
        if self._local is not None:
            prefix, size = self._local.read_prefix(name)
            return kvc.parse_meta(prefix, file_size=size), {}
        got = self._store.get(name, HEAD_BYTES)
        head, size = got.data, got.size
        offset = kvc.meta_end(head, size, name)
        if offset > len(head):
            head += self._store.get_range(name, len(head), offset)
        return kvc.parse_meta(head[:offset], file_size=size), got.meta

    def _row(self, key: bytes, meta: kvc.KvcMeta, user_meta: Mapping[str, str]) -> StoredRow:
        stored = meta.payload_offset + meta.payload_length
        info = row_info(key, self._name, meta.fields, meta.payload_length, stored_bytes=stored)
        hits, last_used = _int_meta(user_meta, META_HITS), _int_meta(user_meta, META_LAST_USED)
        if hits is not None and last_used is not None:
            info = replace(info, hits=hits, last_used=float(last_used))
        now = time.time()
        if info.last_used > now:
            # The last-used field is outside every CRC (rewritten in place on hits): one in
            # the future is damage (or another host's clock), and would keep the row from
            # LRU eviction and its TTL forever. It was used at most now.
            log.info("%s: %s was last used in the future; taking it as now", self._name, key.hex())
            info = replace(info, last_used=now)
        fields = meta.fields
        return StoredRow(
            info,
            fields.tokens,
            self.location(key),
            fields.chunks,
            fields.chunk_lens,
            fields.rest_chunks,
            # A tier without packs (a directory) reads none, as a kvwarm before packs would:
            # its chunks are files of their own, whatever a manifest there says.
            fields.chunk_locs if self.capabilities.packs else (),
        )

    def delete(self, key: bytes) -> None:
        self._store.delete(row_name(key))

    def record_hit(self, row: StoredRow, hits: int, last_used: float) -> None:
        """Best effort, no sync: the row's user metadata is replaced (its bytes are not)."""
        name = row_name(row.info.key)
        meta = {META_HITS: str(max(0, int(hits))), META_LAST_USED: str(max(0, int(last_used)))}
        try:
            self._store.set_meta(name, meta)
        except CacheKeyError:
            return  # deleted meanwhile (another process evicted it)
        except CacheIOError as exc:
            log.info("%s: cannot record hit on %s: %s", self._name, name, exc)

    def stored_keys(self) -> Iterator[bytes]:
        for name in self._store.names(""):
            key = key_of(name)
            if key is not None:
                yield key

    def scan(self) -> Iterator[StoredRow]:
        """Every valid row, its metadata read (payload CRC deferred to ``load``): in order
        with ``LocalReads``, else ``_SCAN_PARALLEL`` probes at a time (a shared store may hold
        thousands). Interrupted temp objects are reaped first (``ReapsTemps``). What cannot
        be read is set aside or reported (``_reject``); one bad object never stops the scan."""
        problems: list[tuple[str, str]] = []
        self._problems = problems
        listed = self._store.names("")
        if self._temps is not None:
            problems.extend(self._temps.reap_temps(listed, remove=self._repair))
        named: list[tuple[str, bytes]] = []
        for name in listed:
            if not name.endswith(ROW_SUFFIX):
                continue  # chunks, temp objects, or not ours
            key = key_of(name)
            if key is None:
                self._reject(name, "not a <hex key>.kvc name", problems)
            else:
                named.append((name, key))
        if self._local is not None:
            found: Iterator[StoredRow | str | CacheNewerFormatError | CacheIOError | None] = (
                self._examine_local(n, k) for n, k in named
            )
        else:
            pool = ThreadPoolExecutor(_SCAN_PARALLEL, thread_name_prefix="kvwarm-obj-scan")
            with pool:
                found = iter(list(pool.map(lambda nk: self._examine(*nk), named)))
        newer = 0
        for (name, _), row in zip(named, found, strict=True):
            if isinstance(row, str):
                self._reject(name, row, problems)
            elif isinstance(row, CacheNewerFormatError):
                newer += 1
                log.info("%s: leaving %s alone: %s", self._name, name, row)
            elif isinstance(row, CacheIOError):
                self._unreadable(name, row, problems)
            elif row is not None:
                yield row
        if newer:
            log.warning(
                "%s: left %d row(s) in a newer kvwarm's format alone (a miss here, kept for it)",
                self._name,
                newer,
            )

    def _examine_local(
        self, name: str, key: bytes
    ) -> StoredRow | str | CacheNewerFormatError | CacheIOError | None:
        """``_examine`` of a local store, with a read that failed (EIO, EACCES: a fault that
        says nothing of the bytes) returned, for the scan to leave the file and go on; a
        process out of descriptors or memory raises, stopping the scan (each other file
        would fail alike), and the files it had not reached are left as they are."""
        try:
            return self._examine(name, key)
        except CacheIOError as exc:
            if exc.exhausted:
                raise
            return exc

    def _unreadable(self, name: str, exc: CacheIOError, problems: list[tuple[str, str]]) -> None:
        """A file a scan could not read: left where it is (never set aside: nothing proves
        its bytes bad), reported, and found again by a later scan or rescan."""
        log.warning("%s: cannot read %s, leaving it: %s", self._name, name, exc)
        problems.append((self._store.location(name), f"unreadable: {exc}"))

    def _reject(self, name: str, why: str, problems: list[tuple[str, str]]) -> None:
        """Set ``name`` aside if the tier repairs and the store can, else report it."""
        if self._repair and self._aside is not None and self._aside.set_aside(name):
            log.warning("%s: set aside invalid %s: %s", self._name, name, why)
            return
        problems.append((self._store.location(name), why))
        if self._repair:
            log.warning("%s: cannot read %s, leaving it: %s", self._name, name, why)

    def _set_aside_row(self, key: bytes, why: str) -> bool:
        """``SetsAside.set_aside_row`` for a tier whose store ``Quarantines``: False, changing
        and reporting nothing, on a read-only open or where the store refuses."""
        if not self._repair or self._aside is None or not self._aside.set_aside(row_name(key)):
            return False
        log.warning("%s: set aside %s: %s", self._name, row_name(key), why)
        return True

    def _set_aside_chunk(self, key: bytes, why: str) -> bool:
        """``SetsAside.set_aside_chunk``, as ``_set_aside_row`` for a chunk object."""
        name = chunk_name(key)
        if not self._repair or self._aside is None or not self._aside.set_aside(name):
            return False
        log.warning("%s: set aside %s: %s", self._name, name, why)
        return True

    # ---- chunks: chunks/<hex>.kvk, published once like rows -------------------------------

    def store_chunk(self, key: bytes, head: bytes, payload: bytes) -> int:
        """Staged, then put once (visible whole or not at all); a chunk already there is
        kept if its head is valid for ``key``, replaced if not (``commit_chunk``)."""
        name = chunk_name(key)
        # Kept: touched, as young as one just written (another process may have orphaned it
        # long ago, and a sweep's grace protects only young chunks).
        self._put_once(name, key, (head, payload), lambda: self._chunk_head(key) is not None)
        return len(head) + memoryview(payload).nbytes

    def _put_once(
        self, name: str, key: bytes, parts: Sequence[kvc.Buffer], sound: Callable[[], bool]
    ) -> None:
        """Object ``name`` (a chunk or a pack, ``key`` its id) staged from ``parts`` and put
        once (``commit_chunk``): one already there is kept, and touched, where no read found
        it bad since and ``sound`` says it is whole; else replaced."""
        put = self._stage(name, parts, 0)
        try:
            commit_chunk(
                self._name,
                key,
                put.link,
                lambda: not self._found_bad(name) and sound() and self._store.touch(name),
                lambda: self._store.delete(name),
            )
            put.settle(False)
            self._found_bad(name, False)
        except BaseException:
            put.undo()
            raise

    def _chunk_head(self, key: bytes) -> chunkfmt.ChunkHead | None:
        """The valid head of chunk ``key`` (payload not read); None if it is gone or junk;
        ``CacheNewerFormatError`` if it is a newer kvwarm's (neither ours to use nor junk)."""
        try:
            return self._stored_chunk_head(key)
        except CacheKeyError:
            return None

    def _stored_chunk_head(self, key: bytes) -> chunkfmt.ChunkHead | None:
        """``_chunk_head``, with a chunk that is gone a ``CacheKeyError``: None is junk."""
        try:
            got = self._store.get(chunk_name(key), CHUNK_HEAD_BYTES)
            head = chunkfmt.parse_head(got.data, size=got.size)
        except CacheNewerFormatError:
            raise
        except CacheFormatError as exc:
            log.info("%s: chunk %s is unusable: %s", self._name, key.hex(), exc)
            return None
        return head if head.key == key else None

    def load_chunk(self, key: bytes, buffer: memoryview | None = None) -> memoryview:
        """The verified payload; with ``LocalReads``, read into ``buffer`` when the chunk is
        exactly that long. Bad bytes are ``ChunkFormatError``, naming the chunk."""
        name = chunk_name(key)
        try:
            if self._local is None:
                return chunkfmt.parse(self._store.get(name).data, key)
            data = self._local.read_exact_into(name, buffer) if buffer is not None else None
            if data is None:
                data, _ = self._local.read_into(name, None)
            return chunkfmt.parse(data, key)
        except CacheNewerFormatError:
            raise  # a newer kvwarm's chunk: a miss, never set aside (not a ChunkFormatError)
        except ChunkFormatError:
            self._found_bad(name, True)
            raise
        except CacheFormatError as exc:
            self._found_bad(name, True)
            raise ChunkFormatError(str(exc), key=key) from exc

    def _found_bad(self, name: str, bad: bool | None = None) -> bool:
        """Whether a load found object ``name`` bad (since a save last replaced it); with
        ``bad``, first record that it did (True) or that a save replaced it (False)."""
        with self._bad_lock:
            if bad is True:
                self._bad.add(name)
            elif bad is False:
                self._bad.discard(name)
            return name in self._bad

    def delete_chunk(self, key: bytes) -> None:
        self._store.delete(chunk_name(key))

    def scan_chunks(self) -> Iterator[tuple[bytes, int]]:
        """Listed, not read, where nothing could be set aside (a chunk's CRC is checked when a
        restore loads it); where the store ``Quarantines``, each head is checked and an
        invalid chunk set aside (or, read-only, reported)."""
        problems: list[tuple[str, str]] = []
        self._chunk_problems = problems
        if self._aside is None:
            for key, size, _ in self.chunk_ages():
                yield key, size
            return
        for name in self._store.names(CHUNK_DIR):
            chunk = layout.chunk_key_of(name[len(CHUNK_DIR) :])
            try:
                head = None if chunk is None else self._stored_chunk_head(chunk)
            except CacheKeyError:
                # Deleted since the listing (another process's eviction or sweep; found by
                # review: reported, or set aside, as an invalid chunk): nothing to scan.
                continue
            except CacheNewerFormatError as exc:  # a newer kvwarm's: left, not counted stored
                log.info("%s: leaving %s alone: %s", self._name, name, exc)
                continue
            except CacheIOError as exc:  # as ``_examine_local``: left, or the scan stops
                if exc.exhausted:
                    raise
                self._unreadable(name, exc, problems)
                continue
            if chunk is not None and head is not None:
                yield chunk, head.payload_offset + head.payload_length
            else:
                self._reject(name, "invalid chunk", problems)

    def chunk_age(self, key: bytes) -> float | None:
        return self._store.age(chunk_name(key))

    def touch_chunk(self, key: bytes) -> bool:
        return self._store.touch(chunk_name(key))

    def chunk_ages(self) -> Iterator[tuple[bytes, int, float]]:
        return self._listed(CHUNK_DIR, layout.chunk_key_of)

    def _listed(
        self, where: str, id_of: Callable[[str], bytes | None]
    ) -> Iterator[tuple[bytes, int, float]]:
        """(id, stored bytes, last-modified epoch seconds) of each object under ``where``
        whose name ``id_of`` reads as one (chunks, packs), listed."""
        for name, size, mtime in self._store.list(where):
            found = id_of(name[len(where) :])
            if found is not None:
                yield found, size, mtime

    # ---- packs: packs/<hex>.kvp, chunk objects one after another (``PacksChunks``) ------

    def store_pack(self, pack: bytes, parts: list[bytes]) -> int:
        """Put once, visible whole or not at all. A pack of the same id already there holds
        the same chunk heads at the same offsets (its id hashes them), each chunk verifiable
        alone: it is kept and touched, unless a read found it bad since (then replaced)."""
        if not self._capabilities.pack_writes:
            raise CacheIOError(f"{self._name}: this tier writes no packs")
        self._put_once(pack_name(pack), pack, parts, lambda: True)
        if self._on_step is not None:
            self._on_step(PACK_STEP)
        return sum(memoryview(p).nbytes for p in parts)

    def load_packed(self, pack: bytes, pieces: list[tuple[bytes, PackLoc]]) -> list[memoryview]:
        """One ranged read of ``pieces`` (adjacent, in offset order), each chunk verified as
        a chunk object is (``chunkfmt.parse``). A pack gone is ``CacheKeyError``; bytes short
        or bad are ``ChunkFormatError`` naming the first chunk they fail."""
        name = pack_name(pack)
        start, end = pieces[0][1].offset, pieces[-1][1].end
        try:
            data = self._store.get_range(name, start, end)
        except CacheFormatError as exc:  # s3: a range past the pack's end (416)
            self._found_bad(name, True)
            raise ChunkFormatError(f"{self._name}: pack {name}: {exc}", key=pieces[0][0]) from exc
        if not data:  # redis answers a missing key's GETRANGE with nothing
            raise CacheKeyError(f"{self._name}: no pack {name}")
        view = memoryview(data)
        out: list[memoryview] = []
        for key, loc in pieces:
            at = loc.offset - start
            try:
                if at + loc.length > len(data):
                    raise CacheFormatError(f"the pack ends at {start + len(data)}")
                out.append(chunkfmt.parse(view[at : at + loc.length], key))
            except CacheNewerFormatError:
                raise  # a newer kvwarm's chunk: a miss, the pack not bad
            except CacheFormatError as exc:
                self._found_bad(name, True)
                raise ChunkFormatError(f"{self._name}: in pack {name}: {exc}", key=key) from exc
        return out

    def touch_pack(self, pack: bytes) -> bool:
        return self._store.touch(pack_name(pack))

    def pack_ages(self) -> Iterator[tuple[bytes, int, float]]:
        return self._listed(PACK_DIR, layout.pack_id_of)

    def pack_age(self, pack: bytes) -> float | None:
        return self._store.age(pack_name(pack))

    def delete_pack(self, pack: bytes) -> None:
        self._store.delete(pack_name(pack))

    def close(self) -> None:
        self._store.close()


def row_name(key: bytes) -> str:
    return name_for(key)


def chunk_name(key: bytes) -> str:
    return CHUNK_DIR + layout.chunk_name(key)


def pack_name(pack: bytes) -> str:
    return PACK_DIR + layout.pack_name(pack)


def _int_meta(meta: Mapping[str, str], name: str) -> int | None:
    value = meta.get(name)
    # ASCII only: "²".isdigit() is True, yet int() refuses it (a foreign value, not a crash).
    return int(value) if value is not None and value.isascii() and value.isdigit() else None
