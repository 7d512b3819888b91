"""Stored responses, for ``previous_response_id``, ``GET /v1/responses/{id}`` and its
``input_items``.

Invariants: the store is in memory and bounded (``max_items`` responses and roughly
``max_chars`` characters of conversation and body together); past either bound the least
recently used response goes first. A stored response holds its whole conversation (without
``instructions``, which OpenAI does not carry over) and the key of its reply's finish row, so a
follow-up re-renders the conversation and resumes from that row (its prompt is restored, not
prefilled), in the cache namespace (salt) it ran in when a key's tenant asks (without one, in
the salt the follow-up presents). The routes show a response only to the
tenant that made it (``owner``; ``server/tenancy.py``). Losing an entry loses only the ability
to refer to it: the cache rows stay.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

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

    def size(self) -> int:
        """Approximate footprint in characters (what the store's budget counts)."""
        turns = sum(len(m.model_dump_json()) for m in self.conversation)
        return turns + len(json.dumps(self.body)) + len(json.dumps(self.input_items))


class ResponseStore:
    def __init__(self, max_items: int = 1024, max_chars: int = 64 << 20) -> None:
        if max_items < 1 or max_chars < 1:
            raise ValueError("a response store holds at least one item and one character")
        self.max_items = max_items
        self.max_chars = max_chars
        self._items: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # handlers run on the loop, but tests and tools may not

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: StoredResponse) -> None:
        size = item.size()
        with self._lock:
            self._drop(item.id)
            self._items[item.id] = (item, size)
            self._chars += size
            # Never evict the entry just added: a follow-up to it must work.
            while len(self._items) > 1 and (
                len(self._items) > self.max_items or self._chars > self.max_chars
            ):
                oldest = next(iter(self._items))
                self._drop(oldest)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            found = self._items.get(response_id)
            if found is None:
                return None
            self._items.move_to_end(response_id)
            return found[0]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        found = self._items.pop(response_id, None)
        if found is None:
            return False
        self._chars -= found[1]
        return True
