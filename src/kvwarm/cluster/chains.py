"""Chained hashes of a conversation at message boundaries: what a router matches prefixes by.

Invariant: ``chain[i]`` is a digest of ``chain[i-1]`` and the i-th unit (a chat message, or a
fixed-size block of a text prompt), seeded by the model, the cache salt and the tools. So equal
``chain[i]`` means an equal conversation up to unit i under the same tenant and template
inputs: a replica that served a request with ``chain[:k]`` has that prefix's KV (or had it).
The ingress computes chains; replicas report the ones they served; ``routing`` compares them.
Hashes are routing hints, never cache keys: a collision costs a less warm replica, nothing else.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

# A text prompt has no message boundaries: it is cut into blocks of this many characters
# (chat turns are usually longer, so a block is about one turn's granularity).
TEXT_BLOCK_CHARS = 256
_DIGEST_BYTES = 12  # 96 bits: collisions among a replica's few thousand hashes are negligible


def _digest(previous: bytes, unit: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update(previous)
    h.update(len(unit).to_bytes(8, "little"))
    h.update(unit)
    return h.digest()


def _seed(model_id: str, cache_salt: str | None, extra: object) -> bytes:
    head = json.dumps([model_id, cache_salt, extra], sort_keys=True, default=str)
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
) -> tuple[str, ...]:
    """One hash per message: ``h1 = H(seed, m1)``, ``h2 = H(h1, m2)`` ... Tools render into the
    prompt's head, so they are part of the seed."""
    units = [json.dumps(m, sort_keys=True, default=str).encode() for m in messages]
    return _chain(_seed(model_id, cache_salt, list(tools or ())), units)


def text_chain(
    model_id: str,
    prompt: str | Sequence[int],
    *,
    cache_salt: str | None = None,
    block: int = TEXT_BLOCK_CHARS,
) -> tuple[str, ...]:
    """One hash per whole block of a text prompt (or of token ids, ``block // 4`` a block);
    the partial last block is left out, since the next request rarely repeats it."""
    if isinstance(prompt, str):
        data, size, kind = prompt.encode(), block, "text"
    else:
        data, size, kind = b"".join(t.to_bytes(4, "little") for t in prompt), block, "tokens"
    units = [data[i : i + size] for i in range(0, len(data) - size + 1, size)]
    return _chain(_seed(model_id, cache_salt, kind), units)
