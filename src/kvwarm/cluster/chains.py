"""Chained hashes of a conversation at message boundaries: what a router matches prefixes by.

Invariant: ``chain[i]`` is a digest of ``chain[i-1]`` and the i-th unit (a chat message, or a
fixed-size block of a text prompt), seeded by the model, the cache salt, the tools and the LoRA
adapters the request runs under (none: the model's plain namespace). So equal ``chain[i]``
means an equal conversation up to unit i under the same tenant, template inputs and adapters:
a replica that served a request with ``chain[:k]`` has that prefix's KV (or had it).
The ingress computes chains; replicas report the ones they served; ``routing`` compares them.
Hashes are routing hints, never cache keys: a collision costs a less warm replica, nothing else.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence

# A request's LoRA adapters, as ``GenerationOptions.lora`` names them: (handle, scale) pairs.
Lora = Sequence[tuple[int, float]]

# A text prompt has no message boundaries: it is cut into blocks of this many characters
# (chat turns are usually longer, so a block is about one turn's granularity).
TEXT_BLOCK_CHARS = 256
_HEAD_ROLES = frozenset({"system", "developer"})
_DIGEST_BYTES = 12  # 96 bits: collisions among a replica's few thousand hashes are negligible


def _digest(previous: bytes, unit: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update(previous)
    h.update(len(unit).to_bytes(8, "little"))
    h.update(unit)
    return h.digest()


def _seed(model_id: str, cache_salt: str | None, extra: object, lora: Lora | None) -> bytes:
    # Adapters at scale 0 are no adapters (``engine/adapters.py``): with none left the seed is
    # the plain model's, as its rows' namespace is.
    adapters = sorted((int(h), float(s)) for h, s in lora or () if s != 0.0)
    fields: list[object] = [model_id, cache_salt, extra]
    if adapters:
        fields.append(adapters)
    head = json.dumps(fields, sort_keys=True, default=str)
    return _digest(b"kvwarm-chain-v1", head.encode())


def _chain(seed: bytes, units: Sequence[bytes]) -> tuple[str, ...]:
    out: list[str] = []
    current = seed
    for unit in units:
        current = _digest(current, unit)
        out.append(current.hex())
    return tuple(out)


def chat_chain(
    model_id: str,
    messages: Sequence[Mapping[str, object]],
    *,
    cache_salt: str | None = None,
    tools: Sequence[Mapping[str, object]] | None = None,
    lora: Lora | None = None,
) -> tuple[str, ...]:
    """One hash per message after the head: ``h1 = H(seed, m1)``, ``h2 = H(h1, m2)`` ...

    The head (leading system or developer messages) and the tools are the seed, not units:
    many conversations share a system prompt, and a match on it alone must not pull every new
    conversation to the replica that served it first. So ``h1`` names a conversation (its
    head and first user message) and a follow-up matches its earlier turns."""
    n_head = 0
    while n_head < len(messages) and messages[n_head].get("role") in _HEAD_ROLES:
        n_head += 1
    head = [_canonical(m) for m in messages[:n_head]]
    units = [_canonical(m).encode() for m in messages[n_head:]]
    return _chain(_seed(model_id, cache_salt, [head, list(tools or ())], lora), units)


def _canonical(message: Mapping[str, object]) -> str:
    """A message as text, fields that are absent or null left out (clients echo an assistant
    message back with or without ``"tool_calls": null``)."""
    present = {k: v for k, v in message.items() if v is not None}
    return json.dumps(present, sort_keys=True, default=str)


def text_chain(
    model_id: str,
    prompt: str | Sequence[int],
    *,
    cache_salt: str | None = None,
    block: int = TEXT_BLOCK_CHARS,
    lora: Lora | None = None,
) -> tuple[str, ...]:
    """One hash per whole block of a text prompt (or of token ids, ``block // 4`` a block);
    the partial last block is left out, since the next request rarely repeats it."""
    if isinstance(prompt, str):
        data, size, kind = prompt.encode(), block, "text"
    else:
        # Modulo 2**32: a valid id as before, and one no vocabulary has (negative, huge) is
        # hashed too, for the replica to refuse as a 400 (found by review: an OverflowError
        # here, a 500).
        ids = b"".join((t % (1 << 32)).to_bytes(4, "little") for t in prompt)
        data, size, kind = ids, block, "tokens"
    units = [data[i : i + size] for i in range(0, len(data) - size + 1, size)]
    return _chain(_seed(model_id, cache_salt, kind, lora), units)


class LastRows:
    """The finish-save key of the last request seen with each chain end (bounded, least
    recent out; thread-safe).

    A follow-up's chain contains its previous turn's whole chain, so ``parent_of`` finds that
    turn's row key, which the ingress passes as ``parent_key``: a replica that never served
    the conversation then restores the whole previous turn from a shared tier by an exact
    lookup, instead of only what prefix probing can find."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, chain: Sequence[str], key: bytes | None) -> None:
        if not chain or key is None:
            return
        with self._lock:
            self._keys[chain[-1]] = key
            self._keys.move_to_end(chain[-1])
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)

    def parent_of(self, chain: Sequence[str]) -> bytes | None:
        with self._lock:
            for h in reversed(chain):
                key = self._keys.get(h)
                if key is not None:
                    return key
        return None

    def __len__(self) -> int:
        return len(self._keys)
