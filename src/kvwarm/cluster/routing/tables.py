"""What the router knows of where chains are: each replica's report and its own record.

Invariants: both are bounded (least recent out), so a long-running cluster holds a fixed
amount; the table forgets a replica's entries when the replica leaves. ``WarmSet`` is what a
replica reports through its routing stats (``EngineReplica.record_routing_stats``);
``AffinityTable`` is the router's memory of where it sent each chain hash, so a follow-up that
arrives before the next report still finds its replica. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence


class WarmSet:
    """The chain hashes a replica served, most recent first, at most ``capacity`` of them
    (what it reports through routing stats)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, None] = OrderedDict()

    def add(self, chain: Iterable[str]) -> None:
        for h in chain:
            self._items[h] = None
            self._items.move_to_end(h)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def recent(self, limit: int | None = None) -> list[str]:
        out = list(reversed(self._items))
        return out if limit is None else out[:limit]

    def __len__(self) -> int:
        return len(self._items)


class AffinityTable:
    """The router's own memory of where it sent each chain hash (bounded, least recent out).

    Replicas report what they hold every stats period; a follow-up often arrives sooner, so the
    router also remembers its own decisions. Forgetting a replica drops its entries."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[str, str] = OrderedDict()
        self._counts: dict[str, int] = {}
        #: A routed prompt's token count (0: not tokenized), under its chain's last hash:
        #: its follow-up extends that prompt, so its replica holds at least that many of the
        #: follow-up's tokens before any report says so. Its keys are the chain ends sent.
        self._tokens: dict[str, int] = {}

    def _drop(self, h: str) -> None:
        owner = self._owner.pop(h)
        self._counts[owner] -= 1
        self._tokens.pop(h, None)

    def record(self, chain: Sequence[str], replica_id: str, tokens: int = 0) -> None:
        """``chain`` was sent to ``replica_id``; ``tokens``: its prompt's token count (0: not
        known)."""
        for h in chain:
            if h in self._owner:
                self._drop(h)
            self._owner[h] = replica_id
            self._counts[replica_id] = self._counts.get(replica_id, 0) + 1
        if chain:
            self._tokens[chain[-1]] = tokens
        while len(self._owner) > self.capacity:
            self._drop(next(iter(self._owner)))

    def forget(self, live: Iterable[str]) -> None:
        keep = set(live)
        for h in [h for h, r in self._owner.items() if r not in keep]:
            self._drop(h)
        self._counts = {r: n for r, n in self._counts.items() if r in keep}

    def count(self, replica_id: str) -> int:
        return self._counts.get(replica_id, 0)

    def warm_of(self, chain: Sequence[str]) -> Mapping[str, set[str]]:
        """For each replica, the hashes of ``chain`` this table places there."""
        out: dict[str, set[str]] = {}
        for h in chain:
            owner = self._owner.get(h)
            if owner is not None:
                out.setdefault(owner, set()).add(h)
        return out

    def tokens_of(self, chain: Sequence[str], held: Iterable[str]) -> int:
        """The token count of the longest prompt this table sent whose chain's last hash is
        among ``held`` (a replica's hashes of ``chain``); 0 when none was counted."""
        known = [self._tokens.get(h, 0) for h in held]
        return max(known, default=0)

    def ends_in(self, held: Iterable[str]) -> set[str]:
        """Which of ``held`` (a replica's hashes of a chain) end a chain this table sent."""
        return {h for h in held if h in self._tokens}

    def __len__(self) -> int:
        return len(self._owner)
