"""How ``S3Wire`` maps what a store answers: throttling (429 or a throttling code) is "try
again later" like a 5xx, so the tier is skipped for ``down_for_s``; a store that does not
implement a request (501, e.g. no conditional PUT) is refusing it, a ``CacheIOError`` that must
not mark the whole store down (reads still work). Errors built by hand: no network."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from kvwarm.cache.tiers.s3client import S3Wire, list_aged
from kvwarm.errors import CacheFormatError, CacheIOError, CacheNetworkError


class _NoClient:
    """Never called: the failure is raised by the function the wire runs."""


def _answer(status: int, code: str) -> ClientError:
    response = {
        "Error": {"Code": code, "Message": code},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, "PutObject")  # type: ignore[arg-type]


def _call(wire: S3Wire, exc: Exception) -> None:
    def fail() -> None:
        raise exc

    wire.call("put x", fail)


@pytest.mark.parametrize(
    ("status", "code"), [(429, "TooManyRequests"), (400, "Throttling"), (503, "SlowDown")]
)
def test_throttling_marks_the_store_down(status: int, code: str) -> None:
    wire = S3Wire(_NoClient(), label="s3", down_for_s=60.0)  # type: ignore[arg-type]
    with pytest.raises(CacheNetworkError):
        _call(wire, _answer(status, code))
    assert wire.is_down()


def test_a_request_the_store_does_not_implement_is_refused_not_down() -> None:
    wire = S3Wire(_NoClient(), label="s3", down_for_s=60.0)  # type: ignore[arg-type]
    with pytest.raises(CacheIOError) as info:
        _call(wire, _answer(501, "NotImplemented"))
    assert not isinstance(info.value, CacheNetworkError)
    assert not wire.is_down()


class _Pages:
    """A store whose listing answers ``pages`` in turn (the last one again after them)."""

    def __init__(self, *pages: dict[str, object]) -> None:
        self.pages = list(pages)
        self.calls = 0

    def list_objects_v2(self, **kwargs: object) -> dict[str, object]:
        self.calls += 1
        assert self.calls <= 4, "listed on and on"
        return self.pages[min(self.calls, len(self.pages)) - 1]


_ENTRY = {"Key": "p/a.kvc", "Size": 3}


@pytest.mark.parametrize(
    "pages",
    [
        ({"Contents": [_ENTRY], "IsTruncated": True},),  # said to go on, no token
        ({"Contents": [_ENTRY], "IsTruncated": True, "NextContinuationToken": "t"},),  # again
        ({"Contents": [{"Size": 3}]},),  # an entry without a name
        ({"Contents": "junk"},),
    ],
)
def test_a_listing_not_shaped_as_s3s_is_a_format_error_not_a_crash_or_a_loop(
    pages: tuple[dict[str, object], ...],
) -> None:
    """Found by review: a truncated page without a continuation token raised ``KeyError``,
    which the startup scan (it takes cache errors) let through, stopping the process; a store
    handing back the token it was given was listed for ever."""
    client = _Pages(*pages)
    wire = S3Wire(client, label="s3", down_for_s=60.0)  # type: ignore[arg-type]
    with pytest.raises(CacheFormatError):
        wire.call("list", lambda: list(list_aged(client, "bucket", "p/")))  # type: ignore[arg-type]
    assert not wire.is_down()  # the store answered


def test_a_listing_of_several_pages_is_read_whole() -> None:
    client = _Pages(
        {"Contents": [_ENTRY], "IsTruncated": True, "NextContinuationToken": "t1"},
        {"Contents": [{"Key": "p/b.kvc", "Size": 5}], "IsTruncated": False},
    )
    names = [(n, s) for n, s, _ in list_aged(client, "bucket", "p/")]  # type: ignore[arg-type]
    assert names == [("p/a.kvc", 3), ("p/b.kvc", 5)]
