"""Stored responses, for ``previous_response_id``, ``GET /v1/responses/{id}`` and its
``input_items``; and background responses still running (``background: true``).

Invariants: the store is in memory and bounded (``max_items`` responses and roughly
``max_chars`` characters of conversation and body together); past either bound a response
goes, the least recently used of the tenant (``owner``) that holds the most of what is over
(responses, or characters), of those holding more than their share, the tenant adding on a
tie. So one tenant's flood evicts its own responses once it holds as many as any other
tenant, never another's below that: each of ``t`` tenants keeps its ``1/t`` share, its most
recent responses, whatever the others send (a response larger than the bound by itself
included: it stays, alone over the bound, until the next put),
while a store one tenant uses alone (no keys: every owner is None) is one LRU, as before.
A response over the bound is one request's (the body's bound is far below the store's): a
follow-up whose conversation would outgrow the bound is refused (``routes``), so no chain
grows one response past it turn by turn.
A tenant is a key (``cache_salt_from_auth``), so this holds between keys a gateway issues;
a client free to present made-up keys is as many tenants as it likes.

A stored response holds its whole conversation (without ``instructions``, which OpenAI does
not carry over) and the key of its reply's finish row, so a follow-up re-renders the
conversation and resumes from that row (its prompt is restored, not prefilled), in the cache
namespace (salt) it ran in when a key's tenant asks (without one, in the salt the follow-up
presents). The routes show a response only to the tenant that made it (``owner``;
``server/tenancy.py``). Losing an entry loses only the ability to refer to it: the cache rows
stay.

A background response is *pending* from its ``POST`` until its generation ends: held apart
from the stored ones (``Pending``), never evicted (it is running), and bounded by what runs:
each is a request queued or active on its model, whose queue is bounded (``max_queue``; past
it the ``POST`` is a 429). When it ends it is stored as any response is (``finish``), its
status ``completed``, ``incomplete``, ``failed`` or ``cancelled``, under the bounds above.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvwarm.server.schemas import ChatMessage

Json = dict[str, object]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    model_id: str
    conversation: tuple[ChatMessage, ...]  # every input turn and this reply, no instructions
    key: bytes | None  # the reply's finish row (``CompletionStats.key``)
    body: Json  # the response object as it was returned
    cache_salt: str | None = None  # the namespace it ran in: its owner's follow-up continues there
    owner: str | None = None  # the tenant that made it (``tenancy``); no one else sees it
    # Its input, as items with ids: after previous_response_id, the earlier turns' input and
    # output items first (what OpenAI's input_items lists).
    input_items: tuple[Json, ...] = ()

    @property
    def continuable(self) -> bool:
        """Whether a follow-up may name it (``previous_response_id``): a background response
        that failed or was cancelled has no reply to continue from."""
        return self.body.get("status") in ("completed", "incomplete")

    def size(self) -> int:
        """Approximate footprint in characters (what the store's budget counts)."""
        turns = sum(len(m.model_dump_json()) for m in self.conversation)
        return turns + len(json.dumps(self.body)) + len(json.dumps(self.input_items))


@dataclass(slots=True, eq=False)
class Pending:
    """A background response whose generation still runs: the body ``GET`` shows meanwhile
    (status ``queued``, then ``in_progress``), and how to end it (``cancel``: its generation
    stops between tokens, or is taken out of its model's queue, freeing its slot)."""

    id: str
    owner: str | None
    body: Json
    input_items: tuple[Json, ...]
    cancel: Callable[[], None]
    cancelled: bool = False  # cancel() was called: it ends cancelled (unless it ended first)
    deleted: bool = False  # DELETE while it ran: it is not stored when it ends
    #: Set once it has ended and its final response is stored (or dropped, if deleted).
    ended: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True, eq=False)
class _Tenant:
    """One owner's responses, least recently used first, and their characters."""

    ids: OrderedDict[str, int]  # response id -> its size
    chars: int = 0


class ResponseStore:
    def __init__(self, max_items: int = 1024, max_chars: int = 64 << 20) -> None:
        if max_items < 1 or max_chars < 1:
            raise ValueError("a response store holds at least one item and one character")
        self.max_items = max_items
        self.max_chars = max_chars
        self._items: dict[str, StoredResponse] = {}
        self._pending: dict[str, Pending] = {}  # background responses still running
        self._tenants: dict[str | None, _Tenant] = {}
        self._chars = 0
        self._lock = threading.Lock()  # handlers run on the loop, but tests and tools may not

    def __len__(self) -> int:
        return len(self._items)

    def held(self, owner: str | None) -> tuple[int, int]:
        """The responses and characters ``owner`` holds."""
        with self._lock:
            tenant = self._tenants.get(owner)
            return (0, 0) if tenant is None else (len(tenant.ids), tenant.chars)

    def chars(self, item: StoredResponse) -> int:
        """The characters ``item`` counts for here: as counted when it was put (its ``size``
        measured again only if it is no longer held)."""
        with self._lock:
            tenant = self._tenants.get(item.owner)
            size = None if tenant is None else tenant.ids.get(item.id)
        return item.size() if size is None else size

    def put(self, item: StoredResponse) -> None:
        size = item.size()
        with self._lock:
            self._drop(item.id)
            self._items[item.id] = item
            tenant = self._tenants.get(item.owner)
            if tenant is None:
                tenant = self._tenants[item.owner] = _Tenant(OrderedDict())
            tenant.ids[item.id] = size
            tenant.chars += size
            self._chars += size
            while len(self._items) > self.max_items or self._chars > self.max_chars:
                by_chars = len(self._items) <= self.max_items
                victim = self._victim(item, by_chars)
                if victim is None:
                    # Only the entry just added holds more than its share: kept, so a
                    # follow-up to it works, and no other tenant goes below its share.
                    break
                self._drop(victim)

    def _victim(self, added: StoredResponse, by_chars: bool) -> str | None:
        """The response to evict: the least recently used of the tenant holding the most
        (characters when only ``max_chars`` is over, else responses; the adder on a tie) of
        those holding more than their share of the bound, never ``added`` itself. Found by
        review: a response larger than the whole character bound took every other tenant's
        responses with it (theirs were all that could go); it is the one over now, by itself.
        Counting responses, some tenant always holds more than its share when the store is
        over, so that bound always holds."""
        bound = self.max_chars if by_chars else self.max_items
        share = bound // len(self._tenants)
        best: tuple[int, bool] | None = None
        found: str | None = None
        for owner, tenant in self._tenants.items():
            oldest = next(iter(tenant.ids))
            if oldest == added.id:  # its only one (the entry just added is its newest)
                continue
            held = tenant.chars if by_chars else len(tenant.ids)
            if held <= share:
                continue  # within its share: another tenant's responses never take it below
            rank = (held, owner == added.owner)
            if best is None or rank > best:
                best, found = rank, oldest
        return found

    def start(self, pending: Pending) -> None:
        """A background response begins: ``GET`` shows ``pending.body`` until ``finish``."""
        with self._lock:
            self._pending[pending.id] = pending

    def running(self, response_id: str) -> Pending | None:
        """The background response ``response_id`` if it still runs."""
        with self._lock:
            return self._pending.get(response_id)

    def finish(self, pending: Pending, stored: StoredResponse) -> None:
        """A background response ended: ``stored`` (its final body) replaces it, unless it
        was deleted meanwhile; whoever waits on ``pending.ended`` wakes."""
        with self._lock:
            self._pending.pop(pending.id, None)
        if not pending.deleted:
            self.put(stored)
        pending.ended.set()

    @property
    def pending_count(self) -> int:
        with self._lock:
            return len(self._pending)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            found = self._items.get(response_id)
            if found is None:
                return None
            self._tenants[found.owner].ids.move_to_end(response_id)
            return found

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        found = self._items.pop(response_id, None)
        if found is None:
            return False
        tenant = self._tenants[found.owner]
        size = tenant.ids.pop(response_id)
        tenant.chars -= size
        self._chars -= size
        if not tenant.ids:
            del self._tenants[found.owner]
        return True
