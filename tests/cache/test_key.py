"""Cache keys: exact byte layout, prefix keys, namespace sensitivity, adapter folding."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwarm.cache.formats.key import (
    PrefixKeyer,
    cache_key,
    effective_fingerprint,
    encode_tokens,
)
from kvwarm.cache.types import Namespace

NS = Namespace(fingerprint=bytes(range(32)), quant=7, ctx_hash=bytes(range(32, 64)))
tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=200)


def test_key_is_the_documented_sha256() -> None:
    toks = [0, 1, 0xFFFF_FFFF, 258]
    expected = hashlib.sha256(
        NS.fingerprint + bytes([7]) + NS.ctx_hash + struct.pack("<4I", *toks)
    ).digest()
    assert cache_key(NS, toks) == expected
    assert cache_key(NS, tuple(toks)) == expected
    assert cache_key(NS, np.array(toks, dtype=np.int64)) == expected
    assert cache_key(NS, np.array(toks, dtype=np.uint32)) == expected


def test_encode_tokens_is_little_endian_u32() -> None:
    assert encode_tokens([1, 0x01020304]) == b"\x01\x00\x00\x00\x04\x03\x02\x01"
    assert encode_tokens([]) == b""


@pytest.mark.parametrize(
    "bad",
    [
        [-1],
        [2**32],
        [1.5],
        ["a"],
        b"\x01\x02",
        np.array([-1]),
        np.array([2**32]),
        np.array([1.0]),
        np.zeros((2, 2), dtype=np.int32),
    ],
)
def test_encode_tokens_rejects_out_of_range(bad: object) -> None:
    with pytest.raises(ValueError):
        encode_tokens(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "ns",
    [
        Namespace(b"x" * 31, 0, bytes(32)),
        Namespace(bytes(32), 256, bytes(32)),
        Namespace(bytes(32), -1, bytes(32)),
        Namespace(bytes(32), 0, b"y" * 33),
    ],
)
def test_bad_namespace_rejected(ns: Namespace) -> None:
    with pytest.raises(ValueError):
        cache_key(ns, [1])
    with pytest.raises(ValueError):
        PrefixKeyer(ns, [1])


@pytest.mark.parametrize(
    "other",
    [
        Namespace(bytes([1]) + NS.fingerprint[1:], NS.quant, NS.ctx_hash),
        Namespace(NS.fingerprint, NS.quant + 1, NS.ctx_hash),
        Namespace(NS.fingerprint, NS.quant, NS.ctx_hash[:-1] + b"\xff"),
    ],
)
def test_every_namespace_field_changes_the_key(other: Namespace) -> None:
    assert cache_key(other, [1, 2, 3]) != cache_key(NS, [1, 2, 3])


def test_token_order_and_length_change_the_key() -> None:
    keys = {cache_key(NS, t) for t in ([], [0], [0, 0], [1, 2], [2, 1])}
    assert len(keys) == 5


@given(tokens_st, st.lists(st.integers(0, 200), max_size=30))
def test_prefix_keys_equal_direct_keys(tokens: list[int], lengths: list[int]) -> None:
    keyer = PrefixKeyer(NS, tokens)
    assert len(keyer) == len(tokens)
    # Any order: increasing lengths take the running path, decreasing ones the direct path.
    for n in [min(x, len(tokens)) for x in lengths] + list(range(len(tokens) + 1)):
        assert keyer.key(n) == cache_key(NS, tokens[:n])


def test_prefix_keyer_rejects_bad_length() -> None:
    keyer = PrefixKeyer(NS, [1, 2])
    for n in (-1, 3):
        with pytest.raises(ValueError):
            keyer.key(n)


def test_effective_fingerprint_no_adapters_is_identity() -> None:
    assert effective_fingerprint(NS.fingerprint, []) == NS.fingerprint


def test_effective_fingerprint_is_order_independent_multiset() -> None:
    a, b = (b"a" * 32, 1.0), (b"b" * 32, 0.5)
    fp = NS.fingerprint
    ab = effective_fingerprint(fp, [a, b])
    assert ab == effective_fingerprint(fp, [b, a])
    assert ab != fp
    assert ab != effective_fingerprint(fp, [a])
    assert ab != effective_fingerprint(fp, [a, b, b])
    assert ab != effective_fingerprint(fp, [a, (b"b" * 32, 0.25)])
    assert ab != effective_fingerprint(b"z" * 32, [a, b])
    # Scales are folded as the float32 llama.cpp uses; -0.0 acts like 0.0.
    assert effective_fingerprint(fp, [(b"a" * 32, 0.1)]) == effective_fingerprint(
        fp, [(b"a" * 32, float(np.float32(0.1)))]
    )
    assert effective_fingerprint(fp, [(b"a" * 32, -0.0)]) == effective_fingerprint(
        fp, [(b"a" * 32, 0.0)]
    )


@pytest.mark.parametrize(
    "adapters",
    [
        [(b"a" * 31, 1.0)],
        [(b"a" * 32, float("nan"))],
        [(b"a" * 32, float("inf"))],
        [(b"a" * 32, 1e300)],
    ],
)
def test_effective_fingerprint_rejects_bad_adapters(adapters: list[tuple[bytes, float]]) -> None:
    with pytest.raises(ValueError):
        effective_fingerprint(NS.fingerprint, adapters)
    with pytest.raises(ValueError):
        effective_fingerprint(b"short", [])


def test_salt_folds_into_ctx_hash_and_no_salt_changes_nothing() -> None:
    from kvwarm.cache.formats.key import salted_namespace

    assert salted_namespace(NS, None) is NS
    a, b = salted_namespace(NS, b"alice"), salted_namespace(NS, b"bob")
    assert len({NS.ctx_hash, a.ctx_hash, b.ctx_hash}) == 3
    assert a.fingerprint == NS.fingerprint and a.quant == NS.quant  # the model is still named
    assert salted_namespace(NS, b"alice") == a  # stable across calls (and processes)
    expected = hashlib.sha256(b"kvwarm-salt-v1\x00" + NS.ctx_hash + b"alice").digest()
    assert a.ctx_hash == expected
    assert salted_namespace(NS, b"") != NS  # an empty salt is still a salt
    assert cache_key(a, [1, 2, 3]) != cache_key(NS, [1, 2, 3]) != cache_key(b, [1, 2, 3])
    with pytest.raises(ValueError):
        salted_namespace(NS, "alice")  # type: ignore[arg-type]
