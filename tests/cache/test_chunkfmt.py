"""Chunk objects and manifests (KVC v2, v3 with a rest, v4 with a rest in chunks): round
trips, chained keys, and every bit flip, truncation or extension of a chunk or a manifest is a
``CacheFormatError`` (nothing else); old (v1) rows are read as whole blobs, never as
manifests."""

from __future__ import annotations

import struct
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.cache.test_kvc import (
    FIELDS,
    KEY,
    PAYLOAD,
    UNCOVERED,
    _file,
    _reseal,
    flips_accepted,
)

from kvwarm.cache.formats import chunkfmt, kvc
from kvwarm.cache.types import Namespace, RestChunks
from kvwarm.errors import CacheFormatError

NS = FIELDS.namespace
CHUNK_TOKENS = (9, 8, 7, 0xFFFF_FFFF)
CHUNK_PAYLOAD = bytes(range(48))
MANIFEST = replace(FIELDS, chunk_lens=(3, 1), chunks=(b"\x01" * 32, b"\x02" * 32))


def _chunk(parent: bytes = chunkfmt.ROOT_PARENT) -> tuple[bytes, bytes]:
    key, head = chunkfmt.build_head(NS, parent, CHUNK_TOKENS, CHUNK_PAYLOAD)
    return key, head + CHUNK_PAYLOAD


def test_chunk_round_trip_is_a_view() -> None:
    key, obj = _chunk()
    payload = chunkfmt.parse(obj, key)
    assert isinstance(payload, memoryview) and bytes(payload) == CHUNK_PAYLOAD
    head = chunkfmt.parse_head(obj)
    assert (head.key, head.tokens, head.namespace) == (key, CHUNK_TOKENS, NS)
    assert head.payload_offset == chunkfmt.head_size(len(CHUNK_TOKENS))


def test_chunk_keys_chain_and_stay_in_their_namespace() -> None:
    tokens = list(range(10))
    keys = chunkfmt.chunk_keys(NS, tokens, (3, 3, 3))
    assert len(keys) == 3  # a prefix of the tokens may be cut
    assert keys[0] == chunkfmt.chunk_key(NS, chunkfmt.ROOT_PARENT, tokens[:3])
    assert keys[2] == chunkfmt.chunk_key(NS, keys[1], tokens[6:9])
    assert chunkfmt.chunk_keys(NS, tokens[:9], (3, 3, 3)) == keys  # equal prefixes, equal chunks
    other = chunkfmt.chunk_keys(NS, [99, *tokens[1:]], (3, 3, 3))
    assert all(a != b for a, b in zip(keys, other, strict=True))  # a changed parent changes all
    salted = Namespace(NS.fingerprint, NS.quant, b"\x77" * 32)
    assert not set(chunkfmt.chunk_keys(salted, tokens, (3, 3, 3))) & set(keys)
    assert chunkfmt.chunk_keys(NS, tokens, (3, 7))[1] != keys[1]  # lengths are part of it
    with pytest.raises(ValueError):
        chunkfmt.chunk_keys(NS, tokens, (3, 0))
    with pytest.raises(ValueError):
        chunkfmt.chunk_keys(NS, tokens, (11,))


def test_chunks_past_plain_to_chain_apart_and_a_copy_recovers_their_parents() -> None:
    tokens = list(range(10))
    lens = (3, 3, 3)
    plain = chunkfmt.chunk_keys(NS, tokens, lens)
    own = chunkfmt.chunk_keys(NS, tokens, lens, plain_to=3, own=10)
    loose = chunkfmt.chunk_keys(NS, tokens, lens, plain_to=3, own=0)
    assert plain[0] == own[0] == loose[0]  # ends at plain_to: canonical bits, shared
    assert len({plain[1], own[1], loose[1]}) == 3 and len({plain[2], own[2], loose[2]}) == 3
    assert chunkfmt.chunk_keys(NS, tokens, lens, plain_to=9, own=10) == plain
    for keys in (plain, own, loose):
        chain = chunkfmt.recover_chain(NS, tokens, lens, keys)
        assert [key for _, key in chain] == list(keys)
        for (parent, key), start in zip(chain, (0, 3, 6), strict=True):
            # Each head rebuilt from its recovered parent replays to the key it is stored under.
            assert chunkfmt.build_head(NS, parent, tokens[start : start + 3], b"x")[0] == key
    with pytest.raises(CacheFormatError):
        chunkfmt.recover_chain(NS, tokens, lens, (plain[0], own[1], loose[2]))


def test_every_single_bit_flip_of_a_chunk_is_rejected() -> None:
    key, good = _chunk()
    for i in range(len(good)):
        for bit in range(8):
            buf = bytearray(good)
            buf[i] ^= 1 << bit
            with pytest.raises(CacheFormatError):
                chunkfmt.parse(buf, key)


def test_every_truncation_and_extension_of_a_chunk_is_rejected() -> None:
    key, good = _chunk()
    for n in range(len(good)):
        with pytest.raises(CacheFormatError):
            chunkfmt.parse(good[:n], key)
    with pytest.raises(CacheFormatError):
        chunkfmt.parse(good + b"\0", key)


def test_a_chunk_under_another_key_is_rejected() -> None:
    _, obj = _chunk()
    other, _ = _chunk(parent=b"\x09" * 32)
    with pytest.raises(CacheFormatError, match="another key"):
        chunkfmt.parse(obj, other)


@given(st.binary(max_size=400))
def test_random_bytes_only_raise_format_error(data: bytes) -> None:
    with pytest.raises(CacheFormatError):
        chunkfmt.parse(b"KVK\x01" + data, b"\0" * 32)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), min_size=1, max_size=8))
def test_mutated_chunks_only_raise_format_error(edits: list[tuple[int, int]]) -> None:
    key, good = _chunk()
    buf = bytearray(good)
    for pos, val in edits:
        if pos < len(buf):
            buf[pos] = val
    if bytes(buf) == good:
        return
    with pytest.raises(CacheFormatError):
        chunkfmt.parse(buf, key)


# ---- manifests (KVC version 2 with chunk tags)


def test_manifest_round_trip() -> None:
    f = kvc.parse(_file(MANIFEST, b""), expected_key=KEY)
    assert f.meta.fields == MANIFEST and f.payload.nbytes == 0


@pytest.mark.parametrize("rest", [b"", b"rest"], ids=["v2", "v3-with-a-rest"])
def test_every_single_bit_flip_of_a_manifest_is_rejected(rest: bytes) -> None:
    accepted = set(flips_accepted(_file(MANIFEST, rest)))
    assert accepted == UNCOVERED  # only the hit fields, rewritten in place on purpose


def test_every_truncation_of_a_manifest_is_rejected() -> None:
    good = _file(MANIFEST, b"")
    for n in range(len(good)):
        with pytest.raises(CacheFormatError):
            kvc.parse(good[:n])


K = b"\x01" * 32


@pytest.mark.parametrize(
    ("lens", "chunks", "payload"),
    [
        ((2,), (K,), b""),  # 2 of 4 tokens
        ((1, 1, 1, 2), (K,) * 4, b""),  # 5 of 4
        ((4, 0), (K, K), b""),  # an empty chunk
        ((4,), (K[:31],), b""),  # a short key
        ((2, 2), (K,), b""),  # unpaired
        ((4,), (), b""),
    ],
)
def test_manifests_whose_chunks_do_not_cover_the_tokens_are_refused(
    lens: tuple[int, ...], chunks: tuple[bytes, ...], payload: bytes
) -> None:
    with pytest.raises(ValueError):
        kvc.build_prefix(replace(FIELDS, chunk_lens=lens, chunks=chunks), payload)


def _as_version(buf: bytes, version: int) -> bytes:
    out = bytearray(buf)
    out[3] = version
    return bytes(_reseal(out))


def test_a_version_1_row_reads_as_a_whole_blob() -> None:
    f = kvc.parse(_as_version(_file(), 1), expected_key=KEY)
    assert f.meta.fields.chunk_lens == () and f.meta.fields.chunks == ()
    assert bytes(f.payload) == PAYLOAD


def test_chunk_tags_in_a_version_1_file_are_refused() -> None:
    with pytest.raises(CacheFormatError, match="version-2"):
        kvc.parse(_as_version(_file(MANIFEST, b""), 1), expected_key=KEY)


def test_an_unknown_version_is_refused_with_a_clear_message() -> None:
    with pytest.raises(CacheFormatError, match="unsupported version 5"):
        kvc.parse(_as_version(_file(), 5))


# ---- manifests with a rest (KVC version 3): an iSWA window, a hybrid's recurrent state


def test_a_manifest_with_a_rest_is_version_3_and_round_trips() -> None:
    rest = b"window state"
    good = _file(MANIFEST, rest)
    assert good[3] == 3
    assert _file(MANIFEST, b"")[3] == 2 and _file()[3] == 2  # every other row stays 2
    f = kvc.parse(good, expected_key=KEY)
    assert f.meta.fields == MANIFEST and bytes(f.payload) == rest


@pytest.mark.parametrize(
    ("fields", "payload", "version"),
    [
        (MANIFEST, b"rest", 2),  # a version-2 manifest holds its KV in its chunks alone
        (MANIFEST, b"", 3),  # a version-3 manifest without its rest
        (FIELDS, PAYLOAD, 3),  # a whole-blob row is never version 3
    ],
)
def test_a_rest_and_the_version_must_agree(
    fields: kvc.KvcFields, payload: bytes, version: int
) -> None:
    with pytest.raises(CacheFormatError, match=r"version-[23]"):
        kvc.parse(_as_version(_file(fields, payload), version), expected_key=KEY)


def test_a_lone_chunk_tag_is_refused() -> None:
    good = bytearray(_file(MANIFEST, b""))
    # Rename the chunk-keys record to an unknown tag: the lengths tag is left alone.
    at = bytes(good).find(struct.pack("<BI", kvc.TAG_CHUNKS, 64))
    assert at > 0
    good[at] = 0x7F
    with pytest.raises(CacheFormatError, match="together"):
        kvc.parse(_reseal(good), expected_key=KEY)


# ---- manifests whose rest is in chunks (KVC version 4): an iSWA window

REST = RestChunks(first=1, start=0, lens=(3, 1), keys=(b"\x03" * 32, b"\x04" * 32))
WINDOWED = replace(MANIFEST, rest_chunks=REST)


def test_a_manifest_with_its_rest_in_chunks_is_version_4_and_round_trips() -> None:
    good = _file(WINDOWED, b"")
    assert good[3] == 4
    f = kvc.parse(good, expected_key=KEY)
    assert f.meta.fields == WINDOWED and f.payload.nbytes == 0
    # Version 3 (a rest in the payload) and 2 are still read as they were.
    assert kvc.parse(_file(MANIFEST, b"w"), expected_key=KEY).meta.fields.rest_chunks is None


def test_every_single_bit_flip_of_a_version_4_manifest_is_rejected() -> None:
    assert set(flips_accepted(_file(WINDOWED, b""))) == UNCOVERED


def test_every_truncation_of_a_version_4_manifest_is_rejected() -> None:
    good = _file(WINDOWED, b"")
    for n in range(len(good)):
        with pytest.raises(CacheFormatError):
            kvc.parse(good[:n])


@pytest.mark.parametrize(
    ("fields", "payload", "version", "match"),
    [
        (WINDOWED, b"", 3, "version-3"),  # rest chunks in a version-3 file
        (WINDOWED, b"", 2, "version 4"),
        (MANIFEST, b"rest", 4, "no rest chunks"),  # a version-3 row claiming version 4
        (FIELDS, PAYLOAD, 4, "no chunks"),  # a whole blob claiming version 4
    ],
)
def test_rest_chunks_and_the_version_must_agree(
    fields: kvc.KvcFields, payload: bytes, version: int, match: str
) -> None:
    with pytest.raises(CacheFormatError, match=match):
        kvc.parse(_as_version(_file(fields, payload), version), expected_key=KEY)


@pytest.mark.parametrize(
    "rest",
    [
        RestChunks(first=3, start=0, lens=(3, 1), keys=REST.keys),  # first past chunk 0
        RestChunks(first=1, start=0, lens=(3,), keys=REST.keys[:1]),  # ends before the row
        RestChunks(first=1, start=0, lens=(3, 2), keys=REST.keys),  # ends after it
        RestChunks(first=1, start=0, lens=(3, 1), keys=REST.keys[:1]),  # unpaired
        RestChunks(first=1, start=0, lens=(), keys=()),
    ],
)
def test_rest_chunks_that_do_not_cover_the_window_are_refused(rest: RestChunks) -> None:
    with pytest.raises(ValueError):
        kvc.build_prefix(replace(MANIFEST, rest_chunks=rest), b"")


def test_a_rest_in_chunks_needs_chunks_and_no_payload() -> None:
    with pytest.raises(ValueError):
        kvc.build_prefix(replace(WINDOWED, chunk_lens=(), chunks=()), b"")
    with pytest.raises(ValueError):
        kvc.build_prefix(WINDOWED, b"rest")


def test_rest_cuts_are_the_grid_and_the_chunk_cuts_inside_the_window() -> None:
    assert chunkfmt.rest_cuts((256, 256, 100), 300, 612, 32) == [
        300, *range(320, 612, 32), 612
    ]  # fmt: skip
    cuts = chunkfmt.rest_cuts((250, 250, 112), 100, 612, 64)
    assert 250 in cuts and 500 in cuts and cuts[0] == 100 and cuts[-1] == 612
    # Two windows of one conversation cut alike past the later one's start.
    a, b = chunkfmt.rest_cuts((256, 356), 88, 612, 32), chunkfmt.rest_cuts((256, 356), 100, 612, 32)
    assert a[2:] == b[1:]


def test_rest_chunk_keys_name_the_prefix_the_start_and_the_bits_rule() -> None:
    tokens = list(range(40, 60))
    lens = (8, 8, 4)
    chain = chunkfmt.chunk_chain(NS, tokens, lens)
    keys = [k for _, k in chunkfmt.rest_chain(NS, tokens, lens, chain, [6, 8, 12, 16, 20])]
    assert len(set(keys)) == 4 and not set(keys) & {k for _, k in chain}
    # The same cells of a window starting elsewhere, or of other earlier tokens, are other keys.
    later = chunkfmt.rest_chain(NS, tokens, lens, chain, [7, 8, 12, 16, 20])
    assert later[0][1] != keys[0] and [k for _, k in later[1:]] == keys[1:]
    other = [99, *tokens[1:]]
    moved = chunkfmt.rest_chain(NS, other, lens, chunkfmt.chunk_chain(NS, other, lens), [6, 8])
    assert moved[0][1] != keys[0]
    # Past plain_to the rest's chunks chain apart as the first cache's do.
    salted = chunkfmt.chunk_chain(NS, tokens, lens, plain_to=8, own=20)
    apart = chunkfmt.rest_chain(NS, tokens, lens, salted, [6, 8, 12, 16, 20])
    assert apart[0][1] == keys[0] and not {k for _, k in apart[1:]} & set(keys)
    for parent, key in chunkfmt.rest_chain(NS, tokens, lens, chain, [6, 8, 12]):
        assert key == chunkfmt.chunk_key(NS, parent, tokens[8:12]) or key == keys[0]
    with pytest.raises(ValueError, match="crosses"):
        chunkfmt.rest_chain(NS, tokens, lens, chain, [6, 12])


def test_a_rows_memory_kind_round_trips_and_an_unknown_one_reads_as_unsaid() -> None:
    for kind in ("full", "swa", "recurrent", "hybrid", ""):
        fields = replace(WINDOWED, memory=kind)
        assert kvc.parse(_file(fields, b""), expected_key=KEY).meta.fields.memory == kind
    good = bytearray(_file(replace(MANIFEST, memory="swa"), b""))
    at = bytes(good).find(struct.pack("<BIB", kvc.TAG_MEMORY, 1, 2))
    assert at > 0
    good[at + 5] = 99  # a newer writer's kind
    assert kvc.parse(_reseal(good), expected_key=KEY).meta.fields.memory == ""
    with pytest.raises(ValueError):
        kvc.build_prefix(replace(MANIFEST, memory="quantum"), b"")
