"""The s3 tier's lean GETs (``s3client.LeanGets``): a tier-built client's GETs after a bucket's
first are signed by the client's signer and sent through its HTTP session, not its whole
pipeline. Against moto: a hit's bytes, ranges and metadata, a miss, a missing bucket, a key
that needs quoting, a hostname endpoint (path-style). Against a scripted store on 127.0.0.1
(it answers what a test says and records what it was sent): error statuses typed as the
client's are, retries as botocore's standard mode makes them, a body cut short, a session
token and credentials refreshed between GETs signed in."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import pytest
from botocore.credentials import RefreshableCredentials
from tests.s3kit import MotoServer

from kvwarm.cache.tiers.objects import Pace
from kvwarm.cache.tiers.s3 import S3Tier
from kvwarm.cache.tiers.s3client import LeanGets
from kvwarm.cache.types import S3Config
from kvwarm.errors import CacheFormatError, CacheIOError, CacheKeyError, CacheNetworkError


def _client_gets(tier: S3Tier) -> list[str]:
    """The URL of every GetObject the tier's boto3 client itself sends from now on."""
    sent: list[str] = []

    def seen(request: object, **_: object) -> None:
        sent.append(str(request.url))  # type: ignore[attr-defined]

    tier.wire.client.meta.events.register("before-send.s3.GetObject", seen)  # type: ignore[attr-defined]
    return sent


def _lean(tier: S3Tier) -> LeanGets:
    lean = tier.wire.lean
    assert lean is not None, "a tier-built client must GET the lean way"
    return lean


# ---- against moto ---------------------------------------------------------------------------


def test_a_hit_after_the_first_get_skips_the_client(moto_server: MotoServer) -> None:
    tier = S3Tier(moto_server.config(moto_server.new_bucket()), 1 << 30)
    store = tier._s3
    body = bytes(range(256)) * 1000
    assert store.put_if_absent("chunks/a.kvk", body)
    assert store.put_if_absent("chunks/b.kvk", body[::-1])
    sent = _client_gets(tier)
    assert store.get("chunks/a.kvk").data == body  # the client's: it finds the route
    assert len(sent) == 1 and _lean(tier).routed(tier.config.bucket)
    got = store.get("chunks/b.kvk")
    assert (got.data, got.size) == (body[::-1], len(body))
    head = store.get("chunks/a.kvk", 100)
    assert (head.data, head.size) == (body[:100], len(body))  # Content-Range's total
    assert store.get_range("chunks/a.kvk", 1000, 3000) == body[1000:3000]
    store.set_meta("chunks/a.kvk", {"hits": "7"})
    assert dict(store.get("chunks/a.kvk").meta) == {"hits": "7"}
    assert len(sent) == 1, "later GETs went through the client's pipeline"


def test_a_miss_and_a_missing_bucket_are_typed_as_the_clients(moto_server: MotoServer) -> None:
    bucket = moto_server.new_bucket()
    tier = S3Tier(moto_server.config(bucket), 1 << 30)
    store = tier._s3
    assert store.put_if_absent("x.kvc", b"row")
    store.get("x.kvc")
    sent = _client_gets(tier)
    with pytest.raises(CacheKeyError):
        store.get("gone.kvc")
    with pytest.raises(CacheFormatError):  # a range past the end: 416 InvalidRange
        store.get_range("x.kvc", 10, 20)
    store.delete("x.kvc")
    moto_server.client().delete_bucket(Bucket=bucket)  # type: ignore[attr-defined]
    with pytest.raises(CacheIOError, match="no such bucket") as info:
        store.get("x.kvc")
    assert not isinstance(info.value, (CacheKeyError, CacheNetworkError))
    assert sent == []
    assert not tier.wire.is_down()


def test_a_key_that_needs_quoting_and_a_hostname_endpoint(moto_server: MotoServer) -> None:
    """``localhost`` is a name, not an address: botocore's rules pick the addressing style
    (path-style for a custom endpoint), and the lean GETs follow what the client chose."""
    host = moto_server.endpoint.replace("127.0.0.1", "localhost")
    cfg = replace(moto_server.config(moto_server.new_bucket()), endpoint_url=host)
    tier = S3Tier(replace(cfg, prefix="rows +~%é/"), 1 << 30)
    store = tier._s3
    assert store.put_if_absent("chunks/q.kvk", b"first")
    assert store.put_if_absent("chunks/r.kvk", b"second")
    sent = _client_gets(tier)
    assert store.get("chunks/q.kvk").data == b"first"
    assert sent[0].startswith(f"{host}/{cfg.bucket}/rows%20%2B~%25%C3%A9/")
    assert store.get("chunks/r.kvk").data == b"second"
    assert len(sent) == 1 and _lean(tier).routed(cfg.bucket)


def test_a_given_client_is_called_as_it_is(moto_server: MotoServer) -> None:
    """Tests wrap a client to inject faults: a tier given one never goes around it."""
    tier = S3Tier(
        moto_server.config(moto_server.new_bucket()), 1 << 30, client=moto_server.client()
    )
    assert tier.wire.lean is None


# ---- against a scripted store -----------------------------------------------------------------


@dataclass
class _Answer:
    status: int = 200
    body: bytes = b"payload"
    headers: dict[str, str] = field(default_factory=dict)
    cut_after: int | None = None  # send this many body bytes of a longer Content-Length
    drop: bool = False  # close the connection without answering


def _error(status: int, code: str) -> _Answer:
    xml = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>m</Message></Error>"
    return _Answer(status, xml.encode(), {"Content-Type": "application/xml"})


class _Scripted:
    """An HTTP store on 127.0.0.1 that answers GETs from a script (then 200 ``payload``)."""

    def __init__(self) -> None:
        self.script: list[_Answer] = []
        self.seen: list[tuple[str, dict[str, str]]] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                owner.seen.append((self.path, dict(self.headers.items())))
                answer = owner.script.pop(0) if owner.script else _Answer()
                if answer.drop:
                    self.close_connection = True
                    return
                self.send_response(answer.status)
                for name, value in answer.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                if answer.cut_after is not None:
                    self.wfile.write(answer.body[: answer.cut_after])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(answer.body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Scripted]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDLEAN")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "lean-secret")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "lean-session-token")
    server = _Scripted()
    try:
        yield server
    finally:
        server.stop()


def _tier_at(store: _Scripted, max_attempts: int = 1) -> S3Tier:
    """A tier routed to the scripted store (its first GET answered 200 by the client)."""
    cfg = S3Config(
        bucket="b",
        prefix="rows/",
        endpoint_url=store.endpoint,
        region="eu-west-3",
        connect_timeout_s=1.0,
        read_timeout_s=2.0,
        max_attempts=max_attempts,
        down_for_s=30.0,
    )
    tier = S3Tier(cfg, 1 << 30)
    assert tier._s3.get("first.kvc").data == b"payload"
    assert _lean(tier).routed("b")
    store.seen.clear()
    return tier


def test_lean_gets_are_signed_with_the_session_token_and_region(scripted: _Scripted) -> None:
    tier = _tier_at(scripted)
    assert tier._s3.get("k.kvc", 8).data == b"payload"
    [(path, headers)] = scripted.seen
    assert path == "/b/rows/k.kvc"
    assert headers["Range"] == "bytes=0-7"
    assert headers["X-Amz-Security-Token"] == "lean-session-token"
    assert "Credential=AKIDLEAN/" in headers["Authorization"]
    assert "/eu-west-3/s3/aws4_request" in headers["Authorization"]
    assert "x-amz-security-token" in headers["Authorization"]  # signed, not only sent


def test_lean_gets_sign_with_credentials_refreshed_meanwhile(scripted: _Scripted) -> None:
    tier = _tier_at(scripted)

    def keys(name: str, minutes: int) -> dict[str, str]:
        expiry = datetime.now(UTC) + timedelta(minutes=minutes)
        return {
            "access_key": name,
            "secret_key": "s",
            "token": "t",
            "expiry_time": expiry.isoformat(),
        }

    # The first keys expire within botocore's mandatory refresh window: the next signing
    # fetches the second.
    creds = RefreshableCredentials.create_from_metadata(
        keys("AKIDONE", 5), lambda: keys("AKIDTWO", 60), "test"
    )
    tier.wire.client._request_signer._credentials = creds  # type: ignore[attr-defined]
    tier._s3.get("k.kvc")
    [(_, headers)] = scripted.seen
    assert "Credential=AKIDTWO/" in headers["Authorization"]


@pytest.mark.parametrize(
    ("answer", "typed"),
    [
        (_error(403, "AccessDenied"), CacheIOError),
        (_error(404, "NoSuchKey"), CacheKeyError),
        (_Answer(404, b""), CacheKeyError),
        (_error(501, "NotImplemented"), CacheIOError),
        (_error(500, "InternalError"), CacheNetworkError),
        (_error(503, "SlowDown"), CacheNetworkError),
        (_Answer(body=b"x" * 100, cut_after=40), CacheNetworkError),
    ],
    ids=["403", "404-NoSuchKey", "404-empty", "501", "500", "503-SlowDown", "cut-body"],
)
def test_an_answer_is_typed_as_the_clients_would_be(
    scripted: _Scripted, answer: _Answer, typed: type[Exception]
) -> None:
    tier = _tier_at(scripted)  # max_attempts=1: botocore makes 2 attempts
    scripted.script = [answer, answer]
    with pytest.raises(typed) as info:
        tier._s3.get("k.kvc")
    if typed is not CacheNetworkError:
        assert not isinstance(info.value, CacheNetworkError)
    retried = typed is CacheNetworkError and answer.cut_after is None
    assert len(scripted.seen) == (2 if retried else 1)  # standard mode retries only those
    assert tier.wire.is_down() == (typed is CacheNetworkError)


def test_a_transient_failure_is_retried_and_the_get_succeeds(scripted: _Scripted) -> None:
    tier = _tier_at(scripted, max_attempts=2)  # 3 attempts
    scripted.script = [_error(500, "InternalError"), _Answer(drop=True)]
    assert tier._s3.get("k.kvc").data == b"payload"
    assert len(scripted.seen) == 3
    assert not tier.wire.is_down()


def test_an_error_whose_body_is_cut_is_retried(scripted: _Scripted) -> None:
    """The client reads an error's body before answering, and a connection lost there is
    one it retries."""
    tier = _tier_at(scripted)
    cut = replace(_error(503, "SlowDown"), cut_after=10)
    scripted.script = [cut]
    assert tier._s3.get("k.kvc").data == b"payload"
    assert len(scripted.seen) == 2
    scripted.seen.clear()
    scripted.script = [cut, cut]
    with pytest.raises(CacheNetworkError):
        tier._s3.get("k.kvc")
    assert len(scripted.seen) == 2


def test_a_redirect_goes_through_the_client(scripted: _Scripted) -> None:
    """A 400 or 3xx (a region mismatch answers one) is the client's to follow; the lean way
    finds its route again from what the client sends."""
    tier = _tier_at(scripted)
    scripted.script = [_error(400, "BadRequest")]  # the lean GET's; the client's gets 200
    assert tier._s3.get("k.kvc").data == b"payload"
    assert [path for path, _ in scripted.seen] == ["/b/rows/k.kvc", "/b/rows/k.kvc"]
    assert _lean(tier).routed("b")


def test_a_client_lean_gets_cannot_follow_stays_whole(scripted: _Scripted) -> None:
    """Unsigned requests (another signature than SigV4) never take the lean way; a client in
    another retry mode gets none (its retries would not be mirrored)."""
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    def client(**config: object) -> object:
        return boto3.client(
            "s3", endpoint_url=scripted.endpoint, region_name="us-east-1", config=Config(**config)
        )

    unsigned = client(signature_version=UNSIGNED)
    lean = LeanGets.of(unsigned)
    assert lean is not None
    for _ in range(2):
        got = lean.get_object(unsigned, "b", "k", None, Pace(0, 1.0))  # type: ignore[arg-type]
        assert got["Body"].read() == b"payload"  # type: ignore[attr-defined]
        assert not lean.routed("b")
    assert all("Authorization" not in headers for _, headers in scripted.seen)
    assert LeanGets.of(client(retries={"mode": "legacy"})) is None
    assert LeanGets.of(object()) is None


def test_a_store_that_ignores_a_range_gives_the_bytes_asked_for(scripted: _Scripted) -> None:
    """A store may answer a ranged GET 200 with the whole object (HTTP allows it; the client
    hands that on as it came): the tier must still give bytes ``[start, end)``, not the
    object from its first byte."""
    tier = _tier_at(scripted)
    assert tier._s3.get_range("k.kvc", 2, 5) == b"ylo"
    head = tier._s3.get("k.kvc", 4)
    assert (head.data, head.size) == (b"payl", len(b"payload"))
    assert [h["Range"] for _, h in scripted.seen] == ["bytes=2-4", "bytes=0-3"]


def test_a_range_answered_from_elsewhere_is_refused(scripted: _Scripted) -> None:
    """A 206 whose Content-Range is not the range asked for is not those bytes."""
    tier = _tier_at(scripted)
    wrong = {"Content-Range": "bytes 0-2/7"}
    scripted.script = [_Answer(206, b"pay", wrong)]
    with pytest.raises(CacheIOError, match="'bytes 0-2/7'") as info:
        tier._s3.get_range("k.kvc", 2, 5)
    assert not isinstance(info.value, CacheNetworkError)


def test_a_success_status_lean_gets_do_not_know_goes_through_the_client(
    scripted: _Scripted,
) -> None:
    """botocore takes any status under 300 as the answer: the lean way must not make one it
    does not read (a proxy's 203) into an error."""
    tier = _tier_at(scripted)
    scripted.script = [_Answer(203, b"payload")]
    assert tier._s3.get("k.kvc").data == b"payload"
    assert len(scripted.seen) == 2  # the lean GET's, then the client's


def test_a_botocore_without_the_parts_lean_gets_use_keeps_its_client(
    scripted: _Scripted, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A botocore without a name the lean way imports: its client GETs, nothing fails."""
    from kvwarm.cache.tiers.s3client import make_client

    client = make_client(S3Config(bucket="b", endpoint_url=scripted.endpoint), 4)
    monkeypatch.delattr("botocore.parsers.create_parser")  # ImportError in a "from" import
    assert LeanGets.of(client) is None


def test_an_endpoint_with_a_path_keeps_it_and_the_clients_user_agent(
    scripted: _Scripted,
) -> None:
    """A gateway under a path (``http://host/gw``): lean GETs go where the client's went,
    with the User-Agent it sent."""
    cfg = S3Config(bucket="b", prefix="rows/", endpoint_url=f"{scripted.endpoint}/gw")
    tier = S3Tier(replace(cfg, region="us-east-1"), 1 << 30)
    assert tier._s3.get("first.kvc").data == b"payload"
    assert _lean(tier).routed("b")
    assert tier._s3.get("k.kvc").data == b"payload"
    (client_path, client_headers), (lean_path, lean_headers) = scripted.seen
    assert (client_path, lean_path) == ("/gw/b/rows/first.kvc", "/gw/b/rows/k.kvc")
    assert lean_headers["User-Agent"] == client_headers["User-Agent"]
