"""A replica's log of what its cache gains and loses, for the routers (``routing/facts.py``).

``EventLog`` is the ``RowEvents`` listener the replica hands its cache (``Cache.watch_rows``)
and is told what the replica served (``served``); it numbers each change, keeps the newest
in a bounded log and the state they add up to, and answers the two things routers read:
``report()`` (the tail of the log, in every routing-stats report) and ``snapshot()`` (the
whole state, when a router missed events).

Invariants:

- One epoch per log (a fresh random id): a restarted replica starts a new one, so no router
  mistakes its events for the old process's.
- ``seq`` grows by one per event; the state is exactly what the events ``1..seq`` add up to
  (``snapshot`` and the log are changed together under one lock), so a router that loads a
  snapshot and applies the events after it holds the replica's state.
- A report carries the events of the last ``window`` reports (at most ``max_events``, the
  newest): a router that missed a few reports (Serve relays only the latest) still sees
  every event; one that missed more sees a gap and asks for a snapshot.
- Live slots: the last ``slots`` conversations finished are taken to be live (the engine
  reuses the least recently used slot); an older one's slot is taken to be reused.
- Called from the cache under its index lock (``row_*``) and from the replica's event loop
  and Ray's stats thread: the own lock is a leaf (nothing is called while holding it).
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence

from kvwarm.cache.protocols import StoredRow
from kvwarm.cluster.routing.facts import (
    Fact,
    Link,
    Live,
    LiveGone,
    RowFact,
    RowGone,
    Scope,
    Source,
    encode,
)

__all__ = ["EventLog"]

LOG_CAPACITY = 8192  # events kept for reports
REPORT_WINDOW = 8  # reports a router may miss before it needs a snapshot
REPORT_MAX_EVENTS = 2048  # per report: the routing stats stay small
LINKS = 65536  # chain-end -> row links a replica keeps (a snapshot carries them)


class EventLog:
    def __init__(
        self,
        places: Mapping[str, tuple[Scope, Source]],
        *,
        slots: int = 1,
        epoch: str | None = None,
        capacity: int = LOG_CAPACITY,
        window: int = REPORT_WINDOW,
        max_events: int = REPORT_MAX_EVENTS,
        links: int = LINKS,
    ) -> None:
        """``places``: each tier's scope and source (``facts.place`` of its capabilities);
        ``slots``: how many conversations the replica keeps live at once."""
        self.epoch = epoch or secrets.token_hex(8)
        self.slots = max(1, slots)
        self._places = dict(places)
        self._lock = threading.Lock()
        self._seq = 0
        self._log: deque[tuple[int, tuple[object, ...]]] = deque(maxlen=capacity)
        self._marks: deque[int] = deque(maxlen=max(1, window))
        self._max_events = max_events
        self._rows: dict[bytes, RowFact] = {}
        self._live: OrderedDict[str, Live] = OrderedDict()
        self._links: OrderedDict[str, bytes] = OrderedDict()
        self._link_capacity = links

    # ---------------------------------------------------------------- the cache's listener

    def _place(self, tier: str) -> tuple[Scope, Source]:
        return self._places.get(tier, ("replica", "memory"))

    def row_stored(self, row: StoredRow) -> None:
        scope, source = self._place(row.info.tier)
        fact = RowFact(
            row.info.key,
            row.info.tier,
            scope,
            source,
            row.info.n_tokens,
            row.chunk_refs,
            row.chunk_lens[: len(row.chunks)],
        )
        with self._lock:
            self._rows[fact.key] = fact
            self._append(fact)

    def row_dropped(self, row: StoredRow, *, bytes_kept: bool) -> None:
        scope, _ = self._place(row.info.tier)
        with self._lock:
            held = self._rows.get(row.info.key)
            if held is None or held.tier != row.info.tier:
                return  # told before we listened: nothing of it was said
            del self._rows[row.info.key]
            self._append(RowGone(row.info.key, row.info.tier, scope, bytes_kept))

    # ---------------------------------------------------------------- what the replica served

    def served(self, chain: Sequence[str], key: bytes | None, n_tokens: int) -> None:
        """A request with ``chain`` finished here with ``n_tokens`` in its slot; its finish
        save (if any) is ``key``."""
        if not chain:
            return
        end = chain[-1]
        with self._lock:
            if key is not None:
                self._links[end] = key
                self._links.move_to_end(end)
                while len(self._links) > self._link_capacity:
                    self._links.popitem(last=False)
                self._append(Link(end, key))
            live = Live(end, key, n_tokens)
            self._live.pop(end, None)
            self._live[end] = live
            self._append(live)
            while len(self._live) > self.slots:
                old, _ = self._live.popitem(last=False)
                self._append(LiveGone(old))

    def _append(self, fact: Fact) -> None:
        self._seq += 1
        self._log.append((self._seq, encode(fact)))

    # ---------------------------------------------------------------- what routers read

    @property
    def seq(self) -> int:
        return self._seq

    def report(self) -> dict[str, object]:
        """The log's tail for one routing-stats report (plain values; ``facts.decode_report``)."""
        with self._lock:
            since = self._marks[0] if self._marks else 0
            self._marks.append(self._seq)
            events = [e for e in self._log if e[0] > since][-self._max_events :]
            return {"epoch": self.epoch, "seq": self._seq, "slots": self.slots, "events": events}

    def snapshot(self) -> dict[str, object]:
        """The whole state as of ``seq`` (plain values; ``facts.decode_snapshot``)."""
        with self._lock:
            return {
                "epoch": self.epoch,
                "seq": self._seq,
                "slots": self.slots,
                "rows": [encode(f) for f in self._rows.values()],
                "live": [encode(f) for f in self._live.values()],
                "links": [encode(Link(end, key)) for end, key in self._links.items()],
            }

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "rows": len(self._rows),
                "chunks": len({c for f in self._rows.values() for c in f.chunks}),
                "live": len(self._live),
            }
