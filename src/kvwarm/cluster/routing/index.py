"""The router's one index of what every replica's cache holds, fed by their events
(``facts.py``), and what each replica could serve of a request (``reach``).

What it keeps:

- *Copies*: a row (by key) in a *store*: a replica's own tier (scope ``replica``), a tier
  the replicas of one node share (``node``: the store is that node's), or one every replica
  reads (``cluster``). Each copy counts the replicas whose index holds it (*vouchers*) and
  references its chunk keys, counted per store.
- *Live slots*: per replica, the chain ends of the conversations its slots hold.
- *Served conversations*: per replica, the chain ends its slots held lately (the most recent
  ``SERVED_KEPT``), each with its finish row's key, whether the replica reported that row
  since, and whether its slot was reused: what ``let_go`` reads (a router's own record of
  sending a conversation there ends once the replica holds nothing of it).
- *Links*: chain end -> the row key its request saved (content facts, bounded).
- *Chunk steps*, per store: after a chunk key (or the root), the lengths of the chunks that
  follow it in the store's rows, counted. With the request's tokens and namespace, ``reach``
  walks them (``_ChunkWalk``): from the root, the longest next chunk whose key, computed
  from the prompt's tokens as the cache computes it (``cache/formats/chunkfmt.py``), the
  store holds, and so on: the prefix of the prompt the store could serve in whole chunks,
  whatever row or conversation saved them (another conversation over the same system
  prompt, a row no chain links).

Invariants:

- Per replica, events are applied in sequence order from the epoch's start or from a
  snapshot; a report whose events do not continue the last one applied (a gap: reports
  missed, a router restart) applies nothing and marks the replica *wanted*: the router
  fetches its snapshot (``load_snapshot``), which replaces everything the replica vouched
  for, in batches (the lock released between them; what a reader may see meanwhile: there).
  A new epoch (a restarted replica) drops the old epoch's facts first. So lost or replayed
  events converge: replaying an applied event changes nothing, a missed one ends in a
  snapshot.
- A copy whose bytes were deleted (``RowGone`` without ``bytes_kept``) leaves its store for
  every replica. A copy in a shared store that no replica vouches for any more (forgotten on
  a TTL, its replica dead) stays, since its bytes do, until deleted or pushed out by newer
  ones (``unvouched`` bounds them); a replica's own copies go with it.
- Thread-safe (one lock): the router applies reports and reads ``reach`` on its loop while
  the ingress notes what replicas served on its own threads. Pure otherwise: no clock, no
  I/O (callers pass ``now``).
- A replica first known as running (told by the router, or its first report) is announced
  once to the ``on_joined`` listeners, after the lock is released (the ingress prewarms the
  kept prefixes there); a listener must not block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvwarm.cache.formats.chunkfmt import ROOT_PARENT, chunk_hasher, own_parent
from kvwarm.cache.formats.key import encode_tokens
from kvwarm.cache.types import Namespace
from kvwarm.cluster.routing.facts import (
    Fact,
    Link,
    Live,
    LiveGone,
    RowFact,
    RowGone,
    Scope,
    Source,
    decode_report,
    decode_snapshot,
)

__all__ = ["ClusterIndex", "Reach", "forget_indexes", "index_for", "index_name"]

log = logging.getLogger("kvwarm.cluster.index")

Store = tuple[Scope, str, str]  # (scope, owner: replica id | node id | "", tier)
Reach = dict[str, int]  # tokens a replica could serve of a request, per source (Source)
LINKS = 262144
UNVOUCHED = 65536
DEAD_KEPT = 16  # dead replicas listed by ``describe``
SERVED_KEPT = 4096  # per replica: conversations ``let_go`` follows (``_Served``)
# How long after a replica reported a conversation's slot (its reply's end, when its finish
# save was handed to the cache's writers) a finish row it never reported is taken to be
# dropped (a full writer queue, a failed save): a save is a pack and one copy into a tier
# behind at most ``writer_queue`` (8) others on ``writer_threads`` (2), seconds even for a
# long context; replicas report every 0.5 s (``deploy.STATS_PERIOD_S``).
ROW_REPORT_S = 60.0
# Report fields ``describe`` leaves out: events are applied, the rest is the router's
# (``warm``: chain hashes; ``namespaces``: bytes, read off the report where it routes).
_NOT_DESCRIBED = ("events", "warm", "namespaces")
STEP_TRIES = 8  # chunk lengths tried after one chunk (the longest that fit first)
# A snapshot is applied in batches of about this many chunk references (a row counts its
# chunks plus one), the lock released in between: a few ms each (``load_snapshot``).
LOAD_BATCH = 4096

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True, eq=False)
class _Load:
    """A snapshot being applied (``load_snapshot``): compared by identity."""

    epoch: str


def _let_others_in() -> None:
    """Between a snapshot's batches, the lock released: the threads waiting for it run
    (a bare release and take again would mostly keep it, with the GIL)."""
    time.sleep(0)


def _batches(items: Sequence[_T], cost: Callable[[_T], int]) -> Iterator[Sequence[_T]]:
    start, spent = 0, 0
    for i, item in enumerate(items):
        spent += cost(item)
        if spent >= LOAD_BATCH:
            yield items[start : i + 1]
            start, spent = i + 1, 0
    if start < len(items):
        yield items[start:]


@dataclass(slots=True)
class _Copy:
    n_tokens: int
    source: Source
    chunks: tuple[bytes, ...]
    lens: tuple[int, ...] = ()
    vouchers: set[str] = field(default_factory=set)


class _ChunkWalk:
    """The keys of one prompt's chunks as a walk asks for them: the key of the ``n`` tokens
    at ``start`` after chunk ``prev``, chained plainly or (past a row's canonical bits, where
    its chain is salted: ``chunkfmt.own_parent``) from ``prev`` salted; each computed once
    per request, whatever store asks."""

    def __init__(self, namespace: Namespace, tokens: Sequence[int]) -> None:
        self._base = chunk_hasher(namespace)
        self._encoded = memoryview(encode_tokens(tokens))
        self.n_tokens = len(tokens)
        self._keys: dict[tuple[bytes, int, int, bool], bytes] = {}

    def key(self, prev: bytes, start: int, n: int, salted: bool) -> bytes:
        memo = (prev, start, n, salted)
        key = self._keys.get(memo)
        if key is None:
            parent = own_parent(prev, 0) if salted else prev
            h = self._base.copy()
            h.update(parent)
            h.update(self._encoded[4 * start : 4 * (start + n)])
            key = self._keys[memo] = h.digest()
        return key

    def served(self, steps: Mapping[bytes, Mapping[int, int]], chunks: Mapping[bytes, int]) -> int:
        """Tokens of the prompt a store with ``steps`` and ``chunks`` holds, in whole chunks
        from the start (greedy: the longest next chunk held)."""
        pos, prev = 0, ROOT_PARENT
        while True:
            after = steps.get(prev)
            if not after:
                return pos
            fits = sorted((n for n in after if pos + n <= self.n_tokens), reverse=True)
            for n in fits[:STEP_TRIES]:
                key = self.key(prev, pos, n, False)
                if key not in chunks:
                    key = self.key(prev, pos, n, True)
                    if key not in chunks:
                        continue
                pos, prev = pos + n, key
                break
            else:
                return pos


def _chunk_walk(namespace: Namespace, tokens: Sequence[int]) -> _ChunkWalk | None:
    """The walk of ``tokens``, or None when an id is outside 0..2^32-1: a text prompt's ids
    come as the client sent them (the replica refuses one its vocabulary lacks), and no
    store holds a chunk of them."""
    try:
        return _ChunkWalk(namespace, tokens)
    except ValueError:
        return None


@dataclass(slots=True)
class _Served:
    """A conversation a replica's slot held (its ``Live``): the key of its finish row (None:
    no finish save), whether the replica reported that row in a tier since (or held it
    then), when (its report's time) and whether its slot was since reported reused."""

    key: bytes | None
    row_seen: bool
    live_at: float | None
    slot_gone: bool = False


@dataclass(slots=True)
class _Replica:
    epoch: str | None = None
    seq: int = 0
    node: str | None = None
    slots: int = 1
    vouches: set[tuple[bytes, Store]] = field(default_factory=set)
    live: OrderedDict[str, tuple[bytes | None, int]] = field(default_factory=OrderedDict)
    served: OrderedDict[str, _Served] = field(default_factory=OrderedDict)
    served_rows: dict[bytes, set[str]] = field(default_factory=dict)  # key -> ``served`` ends
    stats: Mapping[str, object] = field(default_factory=dict)
    reported_at: float | None = None
    resyncs: int = 0
    gaps: int = 0


class ClusterIndex:
    def __init__(self, *, links: int = LINKS, unvouched: int = UNVOUCHED) -> None:
        self._lock = threading.Lock()
        self._replicas_changed = threading.Condition(self._lock)
        self._replicas: dict[str, _Replica] = {}
        self._dead: OrderedDict[str, _Replica] = OrderedDict()
        self._copies: dict[bytes, dict[Store, _Copy]] = {}
        self._chunks: dict[Store, dict[bytes, int]] = {}
        self._steps: dict[Store, dict[bytes, dict[int, int]]] = {}
        self._sources: dict[Store, Source] = {}
        self._live: dict[str, dict[str, int]] = {}  # chain end -> replica -> tokens
        self._links: OrderedDict[str, bytes] = OrderedDict()
        self._unvouched: OrderedDict[tuple[bytes, Store], None] = OrderedDict()
        self._wanted: set[str] = set()
        self._loading: dict[str, _Load] = {}  # replicas whose snapshot is being applied
        self._link_capacity = links
        self._unvouched_capacity = unvouched
        self._joined: list[str] = []  # replicas first known, not yet announced
        self._listeners: list[Callable[[str], None]] = []

    def on_joined(self, listener: Callable[[str], None]) -> Callable[[], None]:
        """Call ``listener(replica)`` (on the caller's thread, outside the lock; it must not
        block) for each replica this index learns runs from now on, once per replica (again
        only if it was known dead meanwhile). Returns what stops it."""
        with self._lock:
            self._listeners.append(listener)

        def stop() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return stop

    def _announce(self) -> None:
        """Tell the listeners of the replicas ``_replica`` first knew (call unlocked)."""
        if not self._joined:  # the common case, without the lock (a list's truth is atomic)
            return
        with self._lock:
            joined, self._joined = self._joined, []
            listeners = list(self._listeners)
        for replica in joined:
            for listener in listeners:
                try:
                    listener(replica)
                except Exception:  # a listener's bug never stops the router
                    log.exception("a listener of replica %s joining failed", replica)

    # ---------------------------------------------------------------- feeding

    def observe(
        self,
        replica: str,
        node: str | None,
        stats: Mapping[str, object] | None,
        now: float | None = None,
    ) -> bool:
        """Apply the events of ``stats["events"]`` (a routing-stats report) from ``replica``
        on ``node``. True if the replica's snapshot is wanted (a gap, or a bad report)."""
        try:
            return self._observe(replica, node, stats or {}, now)
        finally:
            self._announce()

    def _observe(
        self, replica: str, node: str | None, stats: Mapping[str, object], now: float | None
    ) -> bool:
        raw = stats.get("events")
        with self._lock:
            state = self._replica(replica, node)
            state.stats = {k: v for k, v in stats.items() if k not in _NOT_DESCRIBED}
            state.reported_at = now
            if raw is None:
                return False
            try:
                report = decode_report(raw)
            except ValueError as exc:
                log.warning("replica %s: unreadable cache events (%s): resync", replica, exc)
                return self._want(replica, state)
            load = self._loading.get(replica)
            if load is not None:
                if report.epoch == load.epoch:
                    return False  # applied after its snapshot: the next report has them again
                del self._loading[replica]  # restarted meanwhile: the snapshot is of the past
            state.slots = report.slots
            if report.epoch != state.epoch:
                if state.epoch is not None:
                    log.info("replica %s restarted (new epoch): its facts start over", replica)
                self._drop_facts(replica, state)
                state.epoch, state.seq = report.epoch, 0
            events = [e for e in report.events if e[0] > state.seq]
            if report.seq > state.seq and (not events or events[0][0] != state.seq + 1):
                return self._want(replica, state)
            for seq, fact in events:
                if seq != state.seq + 1:
                    return self._want(replica, state)
                self._apply(replica, state, fact)
                state.seq = seq
            return replica in self._wanted

    def load_snapshot(self, replica: str, raw: object) -> bool:
        """Replace what ``replica`` vouches for with its snapshot. False if it is unreadable,
        of another epoch than its reports now are, older than what was applied, or overtaken
        while it loaded (the replica died or restarted, another snapshot came).

        Applied in batches of about ``LOAD_BATCH`` chunk references, the lock released in
        between, so a large snapshot never holds up the router's reads or the ingress's
        served notes for long (at 20k rows x 16 chunks the whole load held it ~0.3 s).
        Meanwhile a reader sees the replica's old facts, less those the snapshot no longer
        holds, plus a growing part of the snapshot's rows: facts the replica held before the
        load or holds now, never one from neither, so it can only under-rate the replica
        (route a prefix it holds elsewhere), as it did while the gap was unresolved; its
        links come after its rows (links are facts about a row wherever it is); its live
        slots and sequence number change last, in one batch. Its events are not
        applied while it loads (the next report's window carries them again after the
        snapshot's ``seq``); a report of a new epoch ends the load."""
        try:
            snap = decode_snapshot(raw)
        except ValueError as exc:
            log.warning("replica %s: unreadable snapshot: %s", replica, exc)
            return False
        with self._lock:
            state = self._replicas.get(replica)
            if state is None:
                return False  # gone meanwhile
            if state.epoch is not None and snap.epoch != state.epoch:
                return False  # its reports speak of another process now: ask again
            if snap.epoch == state.epoch and snap.seq < state.seq and replica not in self._wanted:
                return False  # older than what the events already told
            # Only what the snapshot no longer holds is dropped: a copy it still vouches for
            # never passes through the bounded unvouched set, where it would push out a copy
            # no replica vouches for (a dead one's, its bytes still there).
            held = {(r.key, self._store(replica, state, r.scope, r.tier)) for r in snap.rows}
            stale = [vouch for vouch in state.vouches if vouch not in held]
            old_live = list(state.live)
            load = self._loading[replica] = _Load(snap.epoch)
        for batch in _batches(stale, lambda _vouch: 1):
            with self._lock:
                if not self._still_loading(replica, state, load):
                    return False
                for key, store in batch:
                    self._drop_copy(replica, state, key, store, bytes_kept=True)
            _let_others_in()
        for rows in _batches(snap.rows, lambda row: 1 + len(row.chunks)):
            with self._lock:
                if not self._still_loading(replica, state, load):
                    return False
                for row in rows:
                    self._add_copy(replica, state, row)
            _let_others_in()
        for links in _batches(snap.links, lambda _link: 1):  # facts of rows wherever they are
            with self._lock:
                if not self._still_loading(replica, state, load):
                    return False
                for link in links:
                    self._link(link.chain_end, link.key)
            _let_others_in()
        with self._lock:
            if not self._still_loading(replica, state, load):
                return False
            del self._loading[replica]
            # Slots the ingress noted while it loaded are newer than the snapshot's.
            noted = [(end, state.live[end]) for end in state.live if end not in old_live]
            for end in old_live:
                self._unset_live(replica, state, end)
            state.epoch, state.seq, state.slots = snap.epoch, snap.seq, snap.slots
            for live in snap.live:
                self._set_live(replica, state, live)
            for end, (row_key, n_tokens) in noted:
                self._set_live(replica, state, Live(end, row_key, n_tokens))
            self._wanted.discard(replica)
            state.resyncs += 1
            return True

    def _still_loading(self, replica: str, state: _Replica, load: _Load) -> bool:
        return self._replicas.get(replica) is state and self._loading.get(replica) is load

    def note_served(
        self, replica: str, chain: Sequence[str], key: bytes | None, n_tokens: int
    ) -> None:
        """The ingress saw ``replica`` finish a request with ``chain`` (before the replica's
        events say so): its slot holds the conversation, its finish row is ``key``. A
        replica already known dead (the reply's end read after Ray said so) holds no slot:
        only the link, a fact about the row wherever it is, is kept."""
        if not chain:
            return
        with self._lock:
            if key is not None:
                self._link(chain[-1], key)
            if replica in self._dead:
                return
            state = self._replica(replica, None)
            self._set_live(replica, state, Live(chain[-1], key, n_tokens))
        self._announce()

    def retain(self, running: Mapping[str, str | None]) -> None:
        """Ray's running replicas (id -> node): the others are dead; their own copies and
        live slots go, their vouches for shared copies go (the copies stay)."""
        with self._lock:
            for replica in [r for r in self._replicas if r not in running]:
                self._bury(replica)
            for replica, node in running.items():
                self._replica(replica, node)
            self._replicas_changed.notify_all()
        self._announce()

    def died(self, replica: str) -> None:
        with self._lock:
            if replica in self._replicas:
                self._bury(replica)

    def running(self) -> list[str]:
        """The replicas Ray runs now, as the router last told (sorted ids)."""
        with self._lock:
            return sorted(self._replicas)

    def wait_running(self, n: int, timeout_s: float | None) -> list[str]:
        """``running()`` once it names ``n`` replicas, or when ``timeout_s`` passed."""
        with self._replicas_changed:
            self._replicas_changed.wait_for(lambda: len(self._replicas) >= n, timeout_s)
            return sorted(self._replicas)

    def wanted(self) -> list[str]:
        """Replicas whose snapshot is wanted (a gap in their events)."""
        with self._lock:
            return sorted(self._wanted)

    # ---------------------------------------------------------------- reading

    def reach(
        self,
        chain: Sequence[str],
        parent_key: bytes | None,
        running: Mapping[str, str | None],
        *,
        tokens: Sequence[int] = (),
        namespace: Namespace | None = None,
    ) -> dict[str, Reach]:
        """For each running replica (id -> node), the most tokens of this request it could
        serve from each source: a live slot holding a prefix of ``chain``, a row linked to
        one of ``chain``'s prefixes (or ``parent_key``) in a store it can read, or (given the
        prompt's ``tokens`` and ``namespace``) the run of the prompt's chunk keys from its
        start that such a store holds. Replicas with nothing are left out. Cost: one lookup
        per chain unit, then per copy found; with tokens, a walk per store of at most
        ``STEP_TRIES`` x 2 hashes per chunk, each key hashed once per request."""
        out: dict[str, Reach] = {}

        def give(replica: str, source: str, n: int) -> None:
            best = out.setdefault(replica, {})
            if n > best.get(source, 0):
                best[source] = n

        def give_store(store: Store, source: str, n: int) -> None:
            scope, owner, _ = store
            if scope == "replica":
                if owner in running:
                    give(owner, source, n)
            elif scope == "node":
                for replica, node in running.items():
                    if node == owner:
                        give(replica, source, n)
            else:
                for replica in running:
                    give(replica, source, n)

        # Only where some store reported chunk steps (checked again under the lock): the walk
        # encodes the whole prompt, once per routing decision.
        walk = None
        if self._steps and tokens and namespace is not None:
            walk = _chunk_walk(namespace, tokens)
        with self._lock:
            if walk is not None and self._steps:
                for store, steps in self._steps.items():
                    n = walk.served(steps, self._chunks.get(store, {}))
                    if n:
                        give_store(store, self._sources[store], n)
            keys: list[bytes] = [] if parent_key is None else [parent_key]
            for end in chain:
                holders = self._live.get(end)
                if holders:
                    for replica, n in holders.items():
                        if replica in running:
                            give(replica, "live", n)
                key = self._links.get(end)
                if key is not None:
                    keys.append(key)
            for key in dict.fromkeys(keys):
                for store, copy in self._copies.get(key, {}).items():
                    give_store(store, copy.source, copy.n_tokens)
        return out

    def let_go(self, replica: str, ends: Iterable[str], now: float) -> set[str]:
        """Of ``ends`` (chain ends a router sent to ``replica``), those of which the replica
        demonstrably holds nothing: it reported their slot reused, and their finish row is in
        none of its tiers, having been reported there since the slot held it (then dropped),
        or never reported ``ROW_REPORT_S`` after the slot was (a save dropped), or never made
        (no finish save). A row reported after its slot's reuse (the save still on its way
        when the next conversation took the slot) keeps the end held. An end this index knows
        nothing of (not served yet, or past ``SERVED_KEPT``) is never let go."""
        out: set[str] = set()
        with self._lock:
            state = self._replicas.get(replica)
            if state is None:
                return out
            for end in ends:
                served = state.served.get(end)
                if served is None or not served.slot_gone:
                    continue
                if served.key is not None:
                    if self._vouched(state, served.key):
                        continue
                    if not served.row_seen:
                        if served.live_at is None:  # reports without a time: from now on
                            served.live_at = now
                        if now - served.live_at < ROW_REPORT_S:
                            continue
                out.add(end)
        return out

    def held(self, replica: str) -> int:
        """Facts a replica vouches for (rows and live slots): how much it holds."""
        with self._lock:
            state = self._replicas.get(replica)
            return 0 if state is None else len(state.vouches) + len(state.live)

    def facts_of(
        self, replica: str
    ) -> tuple[frozenset[tuple[bytes, str]], frozenset[str], int] | None:
        """What ``replica`` vouches for: (row key, tier) pairs, live chain ends, and the
        last event applied (None for a replica not known). Tests compare it with the
        replica's own snapshot."""
        with self._lock:
            state = self._replicas.get(replica)
            if state is None:
                return None
            rows = frozenset((key, store[2]) for key, store in state.vouches)
            return rows, frozenset(state.live), state.seq

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {
                "rows": len(self._copies),
                "copies": sum(len(c) for c in self._copies.values()),
                "chunks": sum(len(c) for c in self._chunks.values()),
                "chunk_steps": sum(len(s) for s in self._steps.values()),
                "links": len(self._links),
                "unvouched": len(self._unvouched),
            }

    def describe(self) -> dict[str, object]:
        """Every replica known (running first, then the recently dead) with what it last
        reported and what this index holds of it; then the index's sizes."""
        with self._lock:
            replicas = [
                self._describe(rid, state, "running") for rid, state in self._replicas.items()
            ]
            replicas += [self._describe(rid, state, "dead") for rid, state in self._dead.items()]
        return {"replicas": replicas, "index": self.sizes()}

    def _describe(self, rid: str, state: _Replica, health: str) -> dict[str, object]:
        by_store: dict[str, dict[str, int]] = {}
        for key, store in state.vouches:
            scope, _, tier = store
            entry = by_store.setdefault(tier, {"rows": 0, "tokens": 0, "chunks": 0})
            copy = self._copies.get(key, {}).get(store)
            entry["rows"] += 1
            entry["tokens"] += copy.n_tokens if copy is not None else 0
        for store, chunks in self._chunks.items():
            scope, owner, tier = store
            mine = owner == rid or (scope == "node" and owner == state.node) or scope == "cluster"
            if mine and tier in by_store:
                by_store[tier]["chunks"] = len(chunks)
        return {
            "id": rid,
            "health": health,
            "node": state.node,
            "epoch": state.epoch,
            "seq": state.seq,
            "resyncs": state.resyncs,
            "gaps": state.gaps,
            "resync_wanted": rid in self._wanted,
            "reported_at": state.reported_at,
            "stats": dict(state.stats),
            "indexed": {"live": len(state.live), "tiers": by_store},
        }

    # ---------------------------------------------------------------- internals (locked)

    def _replica(self, replica: str, node: str | None) -> _Replica:
        state = self._replicas.get(replica)
        if state is None:
            state = self._replicas[replica] = _Replica(node=node)
            self._dead.pop(replica, None)
            self._joined.append(replica)
        elif node is not None and state.node != node:
            if state.node is not None:  # a replica does not move: drop what it said before
                self._drop_facts(replica, state)
                state.epoch, state.seq = None, 0
            state.node = node
        return state

    def _want(self, replica: str, state: _Replica) -> bool:
        if replica not in self._wanted:
            state.gaps += 1
            self._wanted.add(replica)
        return True

    def _store(self, replica: str, state: _Replica, scope: Scope, tier: str) -> Store:
        if scope == "replica":
            return ("replica", replica, tier)
        if scope == "node":
            return ("node", state.node or f"?{replica}", tier)
        return ("cluster", "", tier)

    def _apply(self, replica: str, state: _Replica, fact: Fact) -> None:
        if isinstance(fact, RowFact):
            self._add_copy(replica, state, fact)
        elif isinstance(fact, RowGone):
            store = self._store(replica, state, fact.scope, fact.tier)
            self._drop_copy(replica, state, fact.key, store, fact.bytes_kept)
        elif isinstance(fact, Live):
            self._set_live(replica, state, fact)
        elif isinstance(fact, LiveGone):
            self._unset_live(replica, state, fact.chain_end)
        elif isinstance(fact, Link):
            self._link(fact.chain_end, fact.key)

    def _add_copy(self, replica: str, state: _Replica, fact: RowFact) -> None:
        store = self._store(replica, state, fact.scope, fact.tier)
        copies = self._copies.setdefault(fact.key, {})
        copy = copies.get(store)
        if copy is None:
            copy = copies[store] = _Copy(fact.n_tokens, fact.source, fact.chunks, fact.lens)
            refs = self._chunks.setdefault(store, {})
            for chunk in fact.chunks:
                refs[chunk] = refs.get(chunk, 0) + 1
            if fact.lens:
                self._sources[store] = fact.source
                steps = self._steps.setdefault(store, {})
                for prev, n in zip((ROOT_PARENT, *fact.chunks), fact.lens, strict=False):
                    after = steps.setdefault(prev, {})
                    after[n] = after.get(n, 0) + 1
        copy.vouchers.add(replica)
        self._unvouched.pop((fact.key, store), None)
        state.vouches.add((fact.key, store))
        for end in state.served_rows.get(fact.key, ()):
            state.served[end].row_seen = True

    def _vouched(self, state: _Replica, key: bytes) -> bool:
        """Whether the replica of ``state`` vouches for a copy of ``key`` in any store."""
        return any((key, store) in state.vouches for store in self._copies.get(key, {}))

    def _drop_copy(
        self, replica: str, state: _Replica, key: bytes, store: Store, bytes_kept: bool
    ) -> None:
        state.vouches.discard((key, store))
        copy = self._copies.get(key, {}).get(store)
        if copy is None:
            return
        copy.vouchers.discard(replica)
        if not bytes_kept or store[0] == "replica":
            self._delete_copy(key, store)
        elif not copy.vouchers:
            self._unvouched[(key, store)] = None
            while len(self._unvouched) > self._unvouched_capacity:
                (old_key, old_store), _ = self._unvouched.popitem(last=False)
                self._delete_copy(old_key, old_store)

    def _delete_copy(self, key: bytes, store: Store) -> None:
        copies = self._copies.get(key)
        if copies is None or store not in copies:
            return
        copy = copies.pop(store)
        if not copies:
            del self._copies[key]
        for other in copy.vouchers:  # the bytes are gone for everyone sharing the store
            other_state = self._replicas.get(other)
            if other_state is not None:
                other_state.vouches.discard((key, store))
        self._unvouched.pop((key, store), None)
        refs = self._chunks.get(store)
        if refs is not None:
            for chunk in copy.chunks:
                n = refs.get(chunk, 0) - 1
                if n > 0:
                    refs[chunk] = n
                else:
                    refs.pop(chunk, None)
            if not refs:
                del self._chunks[store]
        steps = self._steps.get(store)
        if steps is not None:
            for prev, n in zip((ROOT_PARENT, *copy.chunks), copy.lens, strict=False):
                after = steps.get(prev)
                if after is None:
                    continue
                left = after.get(n, 0) - 1
                if left > 0:
                    after[n] = left
                else:
                    after.pop(n, None)
                    if not after:
                        del steps[prev]
            if not steps:
                del self._steps[store]
                self._sources.pop(store, None)

    def _set_live(self, replica: str, state: _Replica, fact: Live) -> None:
        state.live.pop(fact.chain_end, None)
        state.live[fact.chain_end] = (fact.key, fact.n_tokens)
        self._serve(state, fact)
        self._live.setdefault(fact.chain_end, {})[replica] = fact.n_tokens
        while len(state.live) > max(1, state.slots):
            oldest = next(iter(state.live))
            self._unset_live(replica, state, oldest)

    def _unset_live(self, replica: str, state: _Replica, end: str) -> None:
        state.live.pop(end, None)
        served = state.served.get(end)
        if served is not None:
            served.slot_gone = True
        holders = self._live.get(end)
        if holders is not None:
            holders.pop(replica, None)
            if not holders:
                del self._live[end]

    def _serve(self, state: _Replica, fact: Live) -> None:
        """Note (in ``served``) that a slot holds ``fact``'s conversation; the oldest past
        ``SERVED_KEPT`` go."""
        end, key = fact.chain_end, fact.key
        served = state.served.pop(end, None)
        if served is None or served.key != key:
            if served is not None and served.key is not None:
                self._unserve_row(state, served.key, end)
            served = _Served(key, key is not None and self._vouched(state, key), None)
            if key is not None:
                state.served_rows.setdefault(key, set()).add(end)
        served.live_at, served.slot_gone = state.reported_at, False
        state.served[end] = served
        while len(state.served) > SERVED_KEPT:
            old_end, old = state.served.popitem(last=False)
            if old.key is not None:
                self._unserve_row(state, old.key, old_end)

    @staticmethod
    def _unserve_row(state: _Replica, key: bytes, end: str) -> None:
        ends = state.served_rows.get(key)
        if ends is not None:
            ends.discard(end)
            if not ends:
                del state.served_rows[key]

    def _link(self, end: str, key: bytes) -> None:
        self._links[end] = key
        self._links.move_to_end(end)
        while len(self._links) > self._link_capacity:
            self._links.popitem(last=False)

    def _drop_facts(self, replica: str, state: _Replica) -> None:
        for key, store in list(state.vouches):
            # Its own copies die with it; shared ones keep their bytes.
            self._drop_copy(replica, state, key, store, bytes_kept=True)
        for end in list(state.live):
            self._unset_live(replica, state, end)
        state.vouches.clear()

    def _bury(self, replica: str) -> None:
        state = self._replicas.pop(replica)
        self._drop_facts(replica, state)
        self._wanted.discard(replica)
        self._loading.pop(replica, None)
        self._dead[replica] = state
        while len(self._dead) > DEAD_KEPT:
            self._dead.popitem(last=False)


def index_name(app_name: str, deployment: str) -> str:
    """The key of a deployment's ``ClusterIndex`` in its process (``index_for``)."""
    return f"{app_name}#{deployment}"


_indexes: dict[str, ClusterIndex] = {}
_indexes_lock = threading.Lock()


def index_for(deployment: str) -> ClusterIndex:
    """The one ``ClusterIndex`` of this process for ``deployment`` (e.g. ``kvwarm#engine``).

    Ray builds a deployment's router inside the process that calls its handle (the ingress)
    and the ingress's app separately; neither can hand the other an object. Both find the
    index here, so the router's events and the ingress's served notes meet in one place."""
    with _indexes_lock:
        index = _indexes.get(deployment)
        if index is None:
            index = _indexes[deployment] = ClusterIndex()
        return index


def forget_indexes(names: Iterable[str] | None = None) -> None:
    """Drop this process's indexes (all, or ``names``): a test's fresh start."""
    with _indexes_lock:
        for name in list(_indexes) if names is None else list(names):
            _indexes.pop(name, None)
