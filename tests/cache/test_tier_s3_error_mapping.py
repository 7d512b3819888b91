"""How ``S3Wire`` maps what a store answers: throttling (429 or a throttling code) is "try
again later" like a 5xx, so the tier is skipped for ``down_for_s``; a store that does not
implement a request (501, e.g. no conditional PUT) is refusing it, a ``CacheIOError`` that must
not mark the whole store down (reads still work). Errors built by hand: no network."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from kvwarm.cache.tiers.s3client import S3Wire
from kvwarm.errors import CacheIOError, CacheNetworkError


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
