"""Cache keys: ``sha256(fingerprint ‖ quant byte ‖ ctx_hash ‖ tokens as u32 little-endian)``.

Invariant: the key is a pure function of (namespace, tokens) and its byte encoding is fixed
(little-endian u32 tokens, whatever the host byte order), so two processes -- or two machines
sharing a cache directory -- derive the same key for the same KV state, and nothing else ever
maps to it. Invalid inputs raise ``ValueError``; they are programming errors, not bad files.
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from array import array
from collections.abc import Sequence

import numpy as np

from kvwarm.cache.types import Namespace

__all__ = [
    "KEY_BYTES",
    "PrefixKeyer",
    "cache_key",
    "effective_fingerprint",
    "encode_tokens",
    "namespace_prefix",
    "salted_namespace",
    "validate_namespace",
]

KEY_BYTES = 32
_DIGEST_BYTES = 32
_MAX_TOKEN = 0xFFFF_FFFF
_LORA_DOMAIN = b"kvwarm-lora-v1\x00"
_SALT_DOMAIN = b"kvwarm-salt-v1\x00"

# array('I') is the fastest pure-stdlib u32 encoder, but its item size is platform-defined.
_ARRAY_CODE = next((c for c in ("I", "L") if array(c).itemsize == 4), None)
_BIG_ENDIAN_HOST = sys.byteorder == "big"


def validate_namespace(ns: Namespace) -> None:
    """Raise ``ValueError`` unless ``ns`` has 32-byte digests and a quant byte in 0..255."""
    if not isinstance(ns.fingerprint, bytes) or len(ns.fingerprint) != _DIGEST_BYTES:
        raise ValueError("namespace fingerprint must be 32 bytes")
    if not isinstance(ns.ctx_hash, bytes) or len(ns.ctx_hash) != _DIGEST_BYTES:
        raise ValueError("namespace ctx_hash must be 32 bytes")
    if isinstance(ns.quant, bool) or not isinstance(ns.quant, int) or not 0 <= ns.quant <= 255:
        raise ValueError("namespace quant must be an int in 0..255")


def namespace_prefix(ns: Namespace) -> bytes:
    """The 65 bytes hashed before the tokens."""
    validate_namespace(ns)
    return ns.fingerprint + bytes((ns.quant,)) + ns.ctx_hash


def encode_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Tokens as consecutive u32 little-endian. ``ValueError`` for anything outside 0..2^32-1."""
    if isinstance(tokens, np.ndarray):
        return _encode_ndarray(tokens)
    if isinstance(tokens, (bytes, bytearray, memoryview, str)):
        # bytes would silently encode as a list of small ints; refuse the ambiguity.
        raise ValueError("tokens must be a sequence of ints, not bytes/str")
    if _ARRAY_CODE is None:  # pragma: no cover - no such CPython platform today
        try:
            return struct.pack(f"<{len(tokens)}I", *tokens)
        except struct.error as exc:
            raise ValueError(f"token out of range 0..2^32-1: {exc}") from None
    try:
        arr = array(_ARRAY_CODE, tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"tokens must be ints in 0..2^32-1: {exc}") from None
    if _BIG_ENDIAN_HOST:  # pragma: no cover - exercised only on big-endian hosts
        arr.byteswap()
    return arr.tobytes()


def _encode_ndarray(tokens: np.ndarray) -> bytes:
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ValueError("token array must be 1-D with an integer dtype")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > _MAX_TOKEN):
        raise ValueError("token out of range 0..2^32-1")
    return tokens.astype("<u4", copy=False).tobytes()


def cache_key(ns: Namespace, tokens: Sequence[int] | np.ndarray) -> bytes:
    """The 32-byte key of the KV state produced by ``tokens`` under ``ns``."""
    h = hashlib.sha256(namespace_prefix(ns))
    h.update(encode_tokens(tokens))
    return h.digest()


class PrefixKeyer:
    """Keys of many prefixes of one token list, encoding the tokens once.

    Increasing lengths extend one running hash (total cost O(len(tokens)) for a whole walk);
    a length below the last one asked hashes that prefix directly from the shared encoding
    (a memoryview slice, no copy). Not thread-safe: one keyer per lookup.
    """

    __slots__ = ("_base", "_encoded", "_n", "_running")

    def __init__(self, ns: Namespace, tokens: Sequence[int] | np.ndarray) -> None:
        self._encoded = memoryview(encode_tokens(tokens))
        self._base = hashlib.sha256(namespace_prefix(ns))
        self._running = self._base.copy()
        self._n = 0

    def __len__(self) -> int:
        return len(self._encoded) // 4

    def key(self, n: int) -> bytes:
        """Key of the first ``n`` tokens (0 <= n <= len)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(self):
            raise ValueError(f"prefix length {n!r} outside 0..{len(self)}")
        if n >= self._n:
            self._running.update(self._encoded[self._n * 4 : n * 4])
            self._n = n
            return self._running.copy().digest()
        h = self._base.copy()
        h.update(self._encoded[: n * 4])
        return h.digest()


def effective_fingerprint(model_fp: bytes, adapters: Sequence[tuple[bytes, float]]) -> bytes:
    """Fold LoRA adapters (file sha256, scale) into the model fingerprint.

    No adapters: ``model_fp`` unchanged, so plain-model rows keep their keys. Otherwise the
    result is order-independent (adapters are sorted): llama.cpp keeps attached adapters in an
    unordered map, so attach order does not define the computation and must not split the
    cache. It is a multiset: attaching one adapter twice differs from once. Scales are folded as
    the float32 llama.cpp actually uses, so 0.1 and float32(0.1) give the same key.
    """
    if not isinstance(model_fp, bytes) or len(model_fp) != _DIGEST_BYTES:
        raise ValueError("model fingerprint must be 32 bytes")
    if not adapters:
        return model_fp
    parts: list[bytes] = []
    for digest, scale in adapters:
        if not isinstance(digest, bytes) or len(digest) != _DIGEST_BYTES:
            raise ValueError("adapter sha256 must be 32 bytes")
        if not math.isfinite(scale):
            raise ValueError("adapter scale must be finite")
        try:
            packed = struct.pack("<f", scale)
        except (OverflowError, struct.error) as exc:
            raise ValueError(f"adapter scale not representable as float32: {exc}") from None
        if packed == b"\x00\x00\x00\x80":  # -0.0 scales exactly like 0.0
            packed = bytes(4)
        parts.append(digest + packed)
    parts.sort()
    h = hashlib.sha256(_LORA_DOMAIN)
    h.update(model_fp)
    h.update(struct.pack("<I", len(parts)))
    for p in parts:
        h.update(p)
    return h.digest()


def salted_namespace(ns: Namespace, salt: bytes | None) -> Namespace:
    """``ns`` with a cache salt (a tenant's secret, UTF-8) folded into its ``ctx_hash``.

    No salt: ``ns`` unchanged, so unsalted rows keep their keys. A salt gives a namespace no
    other salt (and no unsalted request) shares, so its rows and prefix lookups stay apart
    (``docs/architecture.md``, "Tenants"). Folded into ``ctx_hash`` rather than a new field:
    the key formula and the KVC format stay as they are, a salted row survives a restart and
    is found again by the same salt, and the file records only a one-way digest, never the
    salt. The fingerprint is left alone: it names the model, and listings show it.
    """
    if salt is None:
        return ns
    if not isinstance(salt, bytes):
        raise ValueError("cache salt must be bytes")
    validate_namespace(ns)
    h = hashlib.sha256(_SALT_DOMAIN)
    h.update(ns.ctx_hash)
    h.update(salt)
    return Namespace(ns.fingerprint, ns.quant, h.digest())
