"""A zero-length object in the s3 tier (left by a tool, a lifecycle or a copy that wrote
nothing) is junk like any other: a ranged GET of an empty object is answered 416
InvalidRange by S3 (and moto), and that must read as "unusable", not as a store error that
stops the startup scan, fails every publish of that key and every probe."""

from __future__ import annotations

from tests.cache.fakebook import FakeBook
from tests.cache.tierkit import NS, request
from tests.s3kit import MotoServer

from kvwarm.cache.formats.chunkfmt import ROOT_PARENT, build_head
from kvwarm.cache.tiers.objects import chunk_name
from kvwarm.cache.tiers.s3 import S3Tier


def _tier(server: MotoServer, bucket: str, **kw: object) -> S3Tier:
    return S3Tier(server.config(bucket), 1 << 30, **kw)  # type: ignore[arg-type]


def test_an_empty_row_object_does_not_stop_the_scan(moto_server: MotoServer) -> None:
    bucket = moto_server.new_bucket()
    tier = _tier(moto_server, bucket)
    good, req = request((1, 2, 3))
    assert tier.store(good, req, FakeBook()) is not None
    empty, _ = request((4, 5))
    tier.wire.client.put_object(Bucket=bucket, Key=tier.object_name(empty), Body=b"")
    viewer = _tier(moto_server, bucket, repair=False)
    # The good row is found, the empty one reported (like the 10-byte junk in test_tier_s3).
    assert [r.info.key for r in viewer.scan()] == [good]
    assert [where for where, _ in viewer.problems()] == [viewer.location(empty)]


def test_an_empty_chunk_object_in_the_way_is_replaced(moto_server: MotoServer) -> None:
    tier = _tier(moto_server, moto_server.new_bucket())
    payload = bytes(range(256)) * 4
    key, head = build_head(NS, ROOT_PARENT, tuple(range(40, 72)), payload)
    assert tier.objects.put_if_absent(chunk_name(key), b"")
    size = tier.store_chunk(key, head, payload)  # the junk is cleared, the chunk put
    assert bytes(tier.load_chunk(key)) == payload
    assert dict(tier.scan_chunks()) == {key: size}
