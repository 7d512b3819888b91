"""KVC codec: round trip, and every kind of damage is a CacheFormatError (nothing else)."""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
import tracemalloc
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwarm.cache.formats import kvc
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.types import FingerprintMode, Namespace, PackLoc, SaveReason, TtlClass
from kvwarm.errors import CacheFormatError

NS = Namespace(fingerprint=b"\x11" * 32, quant=2, ctx_hash=b"\x22" * 32)
TOKENS = (1, 2, 300, 0xFFFF_FFFF)
FIELDS = kvc.KvcFields(
    namespace=NS,
    tokens=TOKENS,
    reason=SaveReason.FINISH,
    created=1_700_000_000,
    last_used=1_700_000_100,
    hits=3,
    quant_bits=4,
    context_size=2048,
    fingerprint_mode=FingerprintMode.GGUF_CHUNKED,
    ttl_class=TtlClass.LONG,
    logits=struct.pack("<3f", 0.5, -1.0, 2.0),
    prompt_text="héllo",
    reason_detail="test",
    hostname="box",
    canonical_tokens=3,
)
PAYLOAD = bytes(range(40))
KEY = cache_key(NS, TOKENS)
# The only bytes outside both CRCs: rewritten in place on every hit.
UNCOVERED = set(range(kvc.HIT_COUNT_OFFSET, kvc.HIT_COUNT_OFFSET + 4)) | set(
    range(kvc.LAST_USED_OFFSET, kvc.LAST_USED_OFFSET + 8)
)


def _file(fields: kvc.KvcFields = FIELDS, payload: bytes = PAYLOAD) -> bytes:
    return kvc.build_prefix(fields, payload) + payload


def _reseal(buf: bytearray) -> bytearray:
    """Recompute the meta CRC so structural checks (not the CRC) must catch the damage."""
    off = struct.unpack_from("<Q", buf, 48)[0]
    off = min(off, len(buf))
    crc = kvc._meta_crc(buf[:48], buf[48:68], buf[72:off])
    struct.pack_into("<I", buf, 68, crc)
    return buf


def test_round_trip_and_zero_copy_payload() -> None:
    buf = bytearray(_file())
    f = kvc.parse(buf, expected_key=KEY)
    assert f.meta.fields == FIELDS
    assert f.meta.key == KEY
    assert f.payload.obj is buf  # a view of the read buffer, not a copy
    assert bytes(f.payload) == PAYLOAD
    meta = kvc.parse_meta(buf[: f.meta.payload_offset], file_size=len(buf))
    assert meta == f.meta


def test_header_layout_offsets() -> None:
    buf = _file()
    assert buf[:3] == b"KVC" and buf[3] == 2 and buf[4] == 4 and buf[5] == SaveReason.FINISH
    assert struct.unpack_from("<I", buf, 8)[0] == len(TOKENS)
    assert struct.unpack_from("<I", buf, kvc.HIT_COUNT_OFFSET)[0] == 3
    assert struct.unpack_from("<Q", buf, kvc.LAST_USED_OFFSET)[0] == FIELDS.last_used
    off, length = struct.unpack_from("<QQ", buf, 48)
    assert struct.unpack_from("<Q", buf, 40)[0] == length == len(PAYLOAD)
    assert off + length == len(buf)


def test_hit_fields_rewrite_in_place_keeps_file_valid() -> None:
    buf = bytearray(_file())
    hits, last = kvc.pack_hit_fields(99, 1_800_000_000.7)
    buf[kvc.HIT_COUNT_OFFSET : kvc.HIT_COUNT_OFFSET + 4] = hits
    buf[kvc.LAST_USED_OFFSET : kvc.LAST_USED_OFFSET + 8] = last
    f = kvc.parse(buf, expected_key=KEY)
    assert (f.meta.fields.hits, f.meta.fields.last_used) == (99, 1_800_000_000)


def flips_accepted(good: bytes) -> list[int]:
    """The offsets of every single-bit flip of ``good`` that ``kvc.parse`` still accepts (one
    entry per accepted bit)."""
    accepted = []
    for i in range(len(good)):
        for bit in range(8):
            buf = bytearray(good)
            buf[i] ^= 1 << bit
            try:
                kvc.parse(buf, expected_key=KEY)
            except CacheFormatError:
                continue
            accepted.append(i)
    return accepted


def test_every_single_bit_flip_outside_hit_fields_is_rejected() -> None:
    accepted = flips_accepted(_file())
    assert set(accepted) == UNCOVERED
    assert len(accepted) == 8 * len(UNCOVERED)


def test_every_truncation_and_extension_is_rejected() -> None:
    good = _file()
    for n in range(len(good)):
        with pytest.raises(CacheFormatError):
            kvc.parse(good[:n])
    with pytest.raises(CacheFormatError):
        kvc.parse(good + b"\0")


def test_wrong_expected_key_rejected() -> None:
    with pytest.raises(CacheFormatError, match="another key"):
        kvc.parse(_file(), expected_key=cache_key(NS, TOKENS[:-1]))


def _tlv_start(buf: bytes) -> int:
    plen = struct.unpack_from("<I", buf, 72)[0]
    return 72 + 4 + plen + 4


@pytest.mark.parametrize(
    "damage",
    [
        "payload_offset_huge",
        "payload_len_huge",
        "prompt_len_huge",
        "tlv_len_huge",
        "tlv_value_huge",
        "token_count_huge",
        "bad_magic",
        "bad_version",
        "reserved",
    ],
)
def test_huge_declared_lengths_rejected_without_allocation(damage: str) -> None:
    buf = bytearray(_file())
    t = _tlv_start(buf)
    if damage == "payload_offset_huge":
        struct.pack_into("<Q", buf, 48, 2**63)
    elif damage == "payload_len_huge":
        struct.pack_into("<Q", buf, 56, 2**63)
        struct.pack_into("<Q", buf, 40, 2**63)
    elif damage == "prompt_len_huge":
        struct.pack_into("<I", buf, 72, 0xFFFF_FFF0)
    elif damage == "tlv_len_huge":
        struct.pack_into("<I", buf, t - 4, 0xFFFF_FFF0)
    elif damage == "tlv_value_huge":
        struct.pack_into("<I", buf, t + 1, 0xFFFF_FFF0)  # first record's length
    elif damage == "token_count_huge":
        struct.pack_into("<I", buf, 8, 0x4000_0000)
    elif damage == "bad_magic":
        buf[0:3] = b"KVD"
    elif damage == "bad_version":
        buf[3] = 3
    elif damage == "reserved":
        buf[6] = 1
    _reseal(buf)
    tracemalloc.start()
    try:
        with pytest.raises(CacheFormatError):
            kvc.parse(buf)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


def _records(buf: bytes) -> list[tuple[int, bytes]]:
    t = _tlv_start(buf)
    end = t + struct.unpack_from("<I", buf, t - 4)[0]
    out, pos = [], t
    while pos < end:
        tag, n = struct.unpack_from("<BI", buf, pos)
        out.append((tag, bytes(buf[pos + 5 : pos + 5 + n])))
        pos += 5 + n
    return out


def _with_records(
    records: list[tuple[int, bytes]], payload: bytes = PAYLOAD, good: bytes | None = None
) -> bytearray:
    """A file whose TLV section is exactly ``records`` (lengths and CRCs made consistent),
    its header ``good``'s (default ``_file()``'s, whose payload is ``PAYLOAD``)."""
    good = _file() if good is None else good
    t = _tlv_start(good)
    tlv = b"".join(struct.pack("<BI", tag, len(v)) + v for tag, v in records)
    buf = bytearray(good[: t - 4]) + struct.pack("<I", len(tlv)) + tlv
    struct.pack_into("<Q", buf, 48, len(buf))
    return _reseal(buf + payload)


def test_reconstructed_file_parses() -> None:
    kvc.parse(_with_records(_records(_file())), expected_key=KEY)


def test_unknown_tags_are_skipped() -> None:
    recs = _records(_file())
    buf = _with_records([(0xEE, b"future"), *recs, (0xEE, b"again"), (0x7F, b"")])
    assert kvc.parse(buf, expected_key=KEY).meta.fields == FIELDS


@pytest.mark.parametrize("tag", [0x01, 0x02, 0x03, 0x04, 0x08, 0x09])
def test_missing_required_tag_rejected(tag: int) -> None:
    recs = [r for r in _records(_file()) if r[0] != tag]
    with pytest.raises(CacheFormatError, match="missing"):
        kvc.parse(_with_records(recs))


@pytest.mark.parametrize("tag", [0x01, 0x05, 0x09, 0x0A, 0x0B, 0x0C])
def test_duplicate_tag_rejected(tag: int) -> None:
    recs = _records(_file())
    dup = next(r for r in recs if r[0] == tag)
    with pytest.raises(CacheFormatError, match="duplicate"):
        kvc.parse(_with_records([*recs, dup]))


@pytest.mark.parametrize(
    ("tag", "value"),
    [
        (0x01, b"x" * 31),
        (0x02, b"\x09"),
        (0x03, b""),
        (0x04, b"x" * 33),
        (0x08, b"\x05\0\0\0"),
        (0x09, b"\0" * 12),
        (0x0A, b"\0" * 5),
        (0x0B, b"\x07"),
        (0x05, b"\xff\xfe"),
        (0x0C, b"\x05\0\0\0"),
        (0x0C, b"\x01\0"),
    ],
)
def test_bad_tag_values_rejected(tag: int, value: bytes) -> None:
    recs = [(t, value if t == tag else v) for t, v in _records(_file())]
    with pytest.raises(CacheFormatError):
        kvc.parse(_with_records(recs))


def test_optional_tags_default() -> None:
    required = {0x01, 0x02, 0x03, 0x04, 0x08, 0x09}
    recs = [r for r in _records(_file()) if r[0] in required]
    f = kvc.parse(_with_records(recs), expected_key=KEY).meta.fields
    assert f.ttl_class is TtlClass.SHORT and f.logits is None and f.hostname == ""
    assert f.canonical_tokens is None


fields_st = st.builds(
    kvc.KvcFields,
    namespace=st.builds(
        Namespace,
        st.binary(min_size=32, max_size=32),
        st.integers(0, 255),
        st.binary(min_size=32, max_size=32),
    ),
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=64).map(tuple),
    reason=st.sampled_from(SaveReason),
    created=st.integers(0, 2**64 - 1),
    last_used=st.integers(0, 2**64 - 1),
    hits=st.integers(0, 2**32 - 1),
    quant_bits=st.integers(0, 255),
    context_size=st.integers(0, 2**32 - 1),
    fingerprint_mode=st.sampled_from(FingerprintMode),
    ttl_class=st.sampled_from(TtlClass),
    logits=st.none() | st.binary(max_size=64).map(lambda b: b[: len(b) // 4 * 4]),
    prompt_text=st.text(st.characters(exclude_categories=("Cs",)), max_size=40),
    reason_detail=st.text(st.characters(exclude_categories=("Cs",)), max_size=10),
    hostname=st.text(st.characters(exclude_categories=("Cs",)), max_size=10),
    version=st.text(st.characters(exclude_categories=("Cs",)), max_size=10),
    canonical_tokens=st.none() | st.just(0),
)


@given(fields_st, st.binary(max_size=300))
def test_round_trip_property(fields: kvc.KvcFields, payload: bytes) -> None:
    f = kvc.parse(_file(fields, payload), expected_key=cache_key(fields.namespace, fields.tokens))
    assert f.meta.fields == fields
    assert bytes(f.payload) == payload


@given(st.binary(max_size=400))
def test_random_bytes_only_raise_format_error(data: bytes) -> None:
    with pytest.raises(CacheFormatError):
        kvc.parse(b"KVC\x01" + data)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 255)), min_size=1, max_size=8))
def test_resealed_mutations_only_raise_format_error(edits: list[tuple[int, int]]) -> None:
    """Damage that the meta CRC no longer catches must still be caught structurally."""
    buf = bytearray(_file())
    for pos, val in edits:
        if pos < len(buf) and pos not in UNCOVERED and not 68 <= pos < 72:
            buf[pos] = val
    with contextlib.suppress(CacheFormatError):
        kvc.parse(_reseal(buf))


def test_builder_rejects_unencodable_fields() -> None:
    for bad in (
        replace(FIELDS, canonical_tokens=len(TOKENS) + 1),
        replace(FIELDS, logits=b"\0" * 3),
        replace(FIELDS, quant_bits=256),
        replace(FIELDS, hits=-1),
        replace(FIELDS, tokens=(-1,)),
    ):
        with pytest.raises(ValueError):
            kvc.build_prefix(bad, PAYLOAD)


def test_known_tokens_skip_decoding_only_when_the_key_replays() -> None:
    buf = _file()
    mine = tuple(TOKENS)
    f = kvc.parse(buf, expected_key=KEY, known_tokens=mine)
    assert f.meta.fields.tokens is mine
    wrong = (9, 9, 9, 9)
    with pytest.raises(CacheFormatError, match="another key"):
        kvc.parse(buf, expected_key=cache_key(NS, wrong), known_tokens=wrong)
    assert kvc.parse(buf, known_tokens=wrong).meta.fields.tokens == TOKENS  # no key: decoded


@pytest.mark.parametrize(("mode", "warns"), [("force", True), ("auto", False)])
def test_software_crc_fallback_is_announced(mode: str, warns: bool) -> None:
    """The crc32c package silently falls back to a ~10x slower table; we log it at import."""
    code = "import logging; logging.basicConfig(); import kvwarm.cache.formats.kvc"
    env = {**os.environ, "CRC32C_SW_MODE": mode}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert ("hardware acceleration unavailable" in proc.stderr) == warns


# --- pack locations (TAG_PACKS): a manifest of a tier with packs.

_KEYS = tuple(bytes([i]) * 32 for i in range(1, 5))
_P, _Q = b"\xaa" * 32, b"\xbb" * 32
_LOCS = (PackLoc(_P, 0, 900), PackLoc(_P, 900, 700), None, PackLoc(_Q, 5, 80))
PACKED = replace(
    FIELDS, chunk_lens=(1, 1, 1, 1), chunks=_KEYS, chunk_locs=_LOCS, canonical_tokens=None
)


def test_pack_locations_round_trip() -> None:
    f = kvc.parse(_file(PACKED, b""), expected_key=KEY).meta.fields
    assert f == PACKED and f.chunk_locs == _LOCS


def test_a_reader_without_the_pack_tag_reads_the_same_chunks_with_no_places(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An older kvwarm skips the tag (unknown tags are a newer writer's business): the same
    chunks, looked for as objects of their own -- a miss where they are not, never other
    bytes (a chunk verifies against its key)."""
    monkeypatch.setattr(kvc, "_KNOWN", kvc._KNOWN - {kvc.TAG_PACKS})
    f = kvc.parse(_file(PACKED, b""), expected_key=KEY).meta.fields
    assert f == replace(PACKED, chunk_locs=())


def _packs_value(n_packs: int, ids: bytes, entries: list[tuple[int, int, int]]) -> bytes:
    return struct.pack("<I", n_packs) + ids + b"".join(struct.pack("<IIQ", *e) for e in entries)


_OWN = 0xFFFF_FFFF


@pytest.mark.parametrize(
    "value",
    [
        b"",  # too short
        _packs_value(1, _P, [(0, 9, 0)] * 3),  # one entry short
        _packs_value(1, _P, [(0, 9, 0)] * 5),  # one entry too many
        _packs_value(1, _P, [(1, 9, 0)] * 4),  # a pack index out of range
        _packs_value(1, _P, [(0, 0, 0)] * 4),  # an empty chunk
        _packs_value(1, _P, [(_OWN, 9, 0)] * 4),  # its own object, with a length
        _packs_value(2, _P + _Q, [(0, 9, 0)] * 4),  # a pack no chunk lies in
        _packs_value(2, _P + _P, [(0, 9, 0), (1, 9, 9), (0, 9, 18), (1, 9, 27)]),  # twice
        _packs_value(0, b"", [(_OWN, 0, 0)] * 4),  # none packed
        _packs_value(1, _P, [(0, 9, 1 << 62)] * 4),  # an offset out of range
    ],
)
def test_bad_pack_locations_rejected(value: bytes) -> None:
    with pytest.raises(CacheFormatError, match="pack"):
        kvc.parse(_packed_with(value), expected_key=KEY)


def _packed_with(value: bytes) -> bytearray:
    """``PACKED``'s file with ``value`` as its ``TAG_PACKS``."""
    base = _file(PACKED, b"")
    recs = [(t, v) for t, v in _records(base) if t != kvc.TAG_PACKS]
    return _with_records([*recs, (kvc.TAG_PACKS, value)], payload=b"", good=base)


def test_pack_locations_rebuilt_by_hand_parse() -> None:
    """The control of ``test_bad_pack_locations_rejected``: the same construction, valid."""
    value = _packs_value(2, _P + _Q, [(0, 900, 0), (0, 700, 900), (_OWN, 0, 0), (1, 80, 5)])
    assert kvc.parse(_packed_with(value), expected_key=KEY).meta.fields.chunk_locs == _LOCS


def test_pack_locations_name_each_chunk_and_only_in_a_manifest() -> None:
    with pytest.raises(ValueError):
        _file(replace(PACKED, chunk_locs=_LOCS[:3]), b"")
    assert kvc.parse(_file(replace(PACKED, chunk_locs=(None,) * 4), b"")).meta.fields == (
        replace(PACKED, chunk_locs=())  # nothing packed: no tag
    )
    blob_row = _records(_file())
    value = _packs_value(1, _P, [(0, 9, 0)])
    with pytest.raises(CacheFormatError, match="names no chunk"):
        kvc.parse(_with_records([*blob_row, (kvc.TAG_PACKS, value)]), expected_key=KEY)
