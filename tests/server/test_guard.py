"""Browser defence and keys (server/guard.py), through the ASGI app and a live server."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from kvwarm.server import create_app

from .conftest import LiveServer, stub_settings, wait_ready

EVICT = {"bytes": 10**12}


def _client(**overrides: object) -> TestClient:
    return TestClient(create_app(stub_settings(**overrides)))


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with _client(allowed_origins=("http://app.example:3000",)) as test_client:
        wait_ready(test_client.get)
        yield test_client


def _code(response: httpx.Response) -> str | None:
    code = response.json()["error"]["code"]
    assert code is None or isinstance(code, str)
    return code


def test_cross_site_text_plain_evict_is_refused(client: TestClient) -> None:
    # The tester's reproducer: a page elsewhere posting a "simple" (no preflight) request.
    response = client.post(
        "/cache/evict",
        content=b'{"bytes":1e12}',
        headers={
            "Host": "attacker.example",
            "Content-Type": "text/plain",
            "Origin": "http://attacker.example",
        },
    )
    assert response.status_code == 421
    assert _code(response) == "host_not_allowed"


def test_foreign_origin_refused_even_with_a_good_host(client: TestClient) -> None:
    response = client.post("/cache/gc", headers={"Origin": "http://evil.example"})
    assert response.status_code == 403
    assert _code(response) == "origin_not_allowed"
    null = client.post("/cache/gc", headers={"Origin": "null"})
    assert null.status_code == 403


def test_text_plain_body_refused_without_origin(client: TestClient) -> None:
    response = client.post(
        "/cache/evict", content=b'{"bytes":0}', headers={"Content-Type": "text/plain"}
    )
    assert response.status_code == 415
    assert _code(response) == "unsupported_media_type"


def test_curl_style_form_content_type_and_no_content_type_still_work(client: TestClient) -> None:
    form = client.post(
        "/cache/evict",
        content=b'{"bytes":0}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert form.status_code == 200, form.json()
    bare = client.post("/cache/evict", content=b'{"bytes":0}')
    assert bare.status_code == 200, bare.json()


def test_own_origin_and_configured_origin_allowed(client: TestClient) -> None:
    own = client.post("/cache/gc", headers={"Origin": "http://testserver"})
    assert own.status_code == 200
    other = client.post("/cache/gc", headers={"Origin": "http://app.example:3000"})
    assert other.status_code == 200
    assert other.headers["access-control-allow-origin"] == "http://app.example:3000"
    preflight = client.options(
        "/v1/completions",
        headers={
            "Origin": "http://app.example:3000",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://app.example:3000"


def test_a_websocket_route_is_guarded_too() -> None:
    """The guard saw HTTP requests only: a WebSocket handshake (which any page may open to any
    address, naming its own origin) reached the app untouched (found by review). The server
    has no socket route; one added gets the Host and Origin checks as every route does."""
    app = create_app(stub_settings())

    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text("open")
        await websocket.close()

    app.add_api_websocket_route("/ws-probe", echo)
    with TestClient(app) as test_client:
        with test_client.websocket_connect("/ws-probe") as socket:  # this origin: served
            assert socket.receive_text() == "open"
        refusals = (
            {"Origin": "http://evil.example"},
            {"Origin": "null"},
            {"Host": "rebound.attacker.example"},
        )
        for headers in refusals:
            with (
                pytest.raises(WebSocketDisconnect) as refused,
                test_client.websocket_connect("/ws-probe", headers=headers) as socket,
            ):
                socket.receive_text()
            assert refused.value.code == 1008, headers


def test_under_a_root_path_admin_paths_still_need_the_admin_key() -> None:
    """Served under a prefix (an ASGI mount, uvicorn's ``root_path``), ``scope["path"]`` holds
    the prefix and the router strips it: the guard saw ``/kv/cache/evict``, no admin path,
    and the admin endpoints answered with no key at all (found by review)."""
    app = create_app(stub_settings(admin_key="root", api_key="k"))
    with TestClient(app, root_path="/kv") as mounted:
        admin, api = {"Authorization": "Bearer root"}, {"Authorization": "Bearer k"}
        wait_ready(lambda path: mounted.get("/kv" + path, headers=api))
        for headers in ({}, api):
            evict = mounted.post("/kv/cache/evict", json={"bytes": 1}, headers=headers)
            assert evict.status_code == 401 and _code(evict) == "invalid_admin_key", evict.json()
            unload = mounted.post("/kv/admin/models/unload", json={"model": "b"}, headers=headers)
            assert unload.status_code == 401, unload.json()
            lora = mounted.post("/kv/lora-adapters", json=[], headers=headers)
            assert lora.status_code == 401, lora.json()
        assert mounted.post("/kv/cache/evict", json={"bytes": 1}, headers=admin).status_code == 200
        # The open paths stay open and the API keyed, as without the prefix.
        assert mounted.get("/kv/health").status_code == 200
        assert mounted.get("/kv/").status_code == 200
        assert mounted.get("/kv/v1/models").status_code == 401
        assert mounted.get("/kv/v1/models", headers=api).status_code == 200
        # Anthropic's paths keep their error shape under the prefix too.
        refused = mounted.post("/kv/v1/messages", json={})
        assert refused.status_code == 401 and refused.json()["type"] == "error"


def test_route_path_strips_the_root_path_as_the_router_does() -> None:
    from starlette._utils import get_route_path

    from kvwarm.server.guard import route_path

    cases = [
        ("/cache/evict", ""),
        ("/kv/cache/evict", "/kv"),
        ("/kv", "/kv"),
        ("/kvx/cache/evict", "/kv"),
        ("/other/cache/evict", "/kv"),
        ("/kv/", "/kv"),
    ]
    for path, root in cases:
        scope = {"type": "http", "path": path, "root_path": root}
        assert route_path(scope) == get_route_path(scope), (path, root)


def test_host_rules() -> None:
    from kvwarm.server.guard import Guard

    loopback = Guard(stub_settings(allowed_hosts=("kv.lan",)))
    for host in ("localhost:8000", "127.0.0.1", "[::1]:80", "app.localhost", "KV.LAN:1"):
        assert loopback.host_ok(host), host
    # Not a host and a port: nothing after an IPv6 literal but a port, a port of digits.
    malformed = ("[::1]evil.com", "[::1]:80evil", "localhost:evil", "[::1", "[]:80")
    for host in ("attacker.example", "192.168.1.5", "", "localhost.attacker.example", *malformed):
        assert not loopback.host_ok(host), host
    wildcard = Guard(stub_settings(host="0.0.0.0"))
    assert wildcard.host_ok("192.168.1.5:8000") and wildcard.host_ok("[fe80::1]:8000")
    assert not wildcard.host_ok("attacker.example:8000")
    assert not wildcard.host_ok("[fe80::1]evil.com") and not wildcard.host_ok("10.0.0.1:x")
    assert Guard(stub_settings(allowed_hosts=("*",))).host_ok("anything.example")


def test_admin_key_guards_admin_paths_only() -> None:
    with _client(admin_key="root", api_key="user") as secured:
        wait_ready(secured.get)
        user = {"Authorization": "Bearer user"}
        admin = {"Authorization": "Bearer root"}
        assert secured.post("/cache/gc", headers=user).status_code == 401
        assert _code(secured.post("/cache/gc", headers=user)) == "invalid_admin_key"
        assert secured.post("/cache/gc").status_code == 401
        assert secured.post("/cache/gc", headers=admin).status_code == 200
        assert secured.get("/v1/models", headers=user).status_code == 200
        assert secured.get("/v1/models", headers=admin).status_code == 200
        assert secured.get("/v1/models").status_code == 401
    with _client(admin_key="root") as admin_only:
        wait_ready(admin_only.get)
        assert admin_only.get("/v1/models").status_code == 200
        assert admin_only.get("/cache/stats").status_code == 401


def test_a_non_ascii_key_is_read_as_utf8_like_the_setting_that_names_it() -> None:
    # Header bytes reach the app as latin-1; a key is UTF-8 text in the settings and in a
    # JSON body, so "café" sent as UTF-8 must be "café", and other bytes no key at all.
    utf8 = {"Authorization": "Bearer café".encode()}
    with _client(api_key="café", admin_key="rööt") as secured:
        wait_ready(secured.get)
        assert secured.get("/v1/models", headers=utf8).status_code == 200
        assert secured.get("/v1/models", headers={"x-api-key": "café".encode()}).status_code == 200
        assert secured.post("/cache/gc", headers={"x-api-key": "rööt".encode()}).status_code == 200
        assert _code(secured.post("/cache/gc", headers=utf8)) == "invalid_admin_key"
    # Bytes that are not UTF-8 (TestClient re-encodes headers as UTF-8: the guard directly)
    # are no key's, and refused rather than failing.
    from kvwarm.server.guard import Guard

    guard = Guard(stub_settings(api_key="café"))
    for raw in ("café".encode("latin-1"), b"caf\xed\xb3\xa9", "café".encode()):
        headers = [(b"host", b"localhost"), (b"x-api-key", raw)]
        scope = {"method": "GET", "path": "/v1/models", "headers": headers}
        refused = guard.refusal(scope)
        assert (refused is None) == (raw == "café".encode()), raw


def test_live_server_refuses_rebinding_host_and_cross_site_post() -> None:
    live = LiveServer(stub_settings(allowed_hosts=())).start()
    try:
        with httpx.Client(base_url=live.base_url, timeout=30) as http:
            rebound = http.post(
                "/cache/evict",
                content=b'{"bytes":1e12}',
                headers={"Host": "attacker.example", "Content-Type": "text/plain"},
            )
            assert rebound.status_code == 421
            cross = http.post(
                "/cache/evict", json=EVICT, headers={"Origin": "https://attacker.example"}
            )
            assert cross.status_code == 403
            plain = http.post("/cache/evict", json={"bytes": 0})
            assert plain.status_code == 200, plain.json()
            own = http.post("/cache/gc", headers={"Origin": live.base_url})
            assert own.status_code == 200
    finally:
        live.stop()


def test_two_host_headers_are_a_400_whatever_the_parser() -> None:
    """Issue 41: with httptools the first Host won (127.0.0.1, then evil.example: a 200);
    RFC 9112 requires a 400 (h11 refuses it itself)."""
    from kvwarm.server.guard import Guard

    guard = Guard(stub_settings(allowed_hosts=()))
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/health",
        "headers": [(b"host", b"127.0.0.1"), (b"Host", b"evil.example")],
    }
    assert guard.refusal(scope) == (
        400,
        "the request has more than one Host header",
        "duplicate_host",
    )
    scope["headers"] = scope["headers"][:1]
    assert guard.refusal(scope) is None


#: The warning each needle below is from, where it is not the no-api_key one.
_WARNING_OF = {
    "DNS-rebinding defence is off": "hosts",
    "allowed_origins '*'": "origins",
    "no api_key to stop it": "origins",
    "lets every web page": "origins",
    "every tenant may call the admin endpoints": "tenants",
}


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        ({}, []),
        ({"host": "::1"}, []),
        ({"host": "localhost"}, []),
        ({"allowed_hosts": ("*",)}, ["DNS-rebinding defence is off"]),
        ({"host": "0.0.0.0"}, ["listening on 0.0.0.0", "with no api_key", "admin endpoints"]),
        ({"host": "192.168.1.5", "admin_key": "a"}, ["listening on 192.168.1.5"]),
        ({"host": "0.0.0.0", "api_key": "k"}, []),
        (
            {"host": "::", "allowed_hosts": ("*",)},
            ["DNS-rebinding defence is off", "listening on ::"],
        ),
        ({"allowed_origins": ("*",)}, ["allowed_origins '*'", "no api_key to stop it"]),
        ({"allowed_origins": ("*",), "api_key": "k"}, ["lets every web page"]),
        ({"allowed_origins": ("http://app.example:3000",)}, []),
        ({"cache_salt_from_auth": True}, ["every tenant may call the admin endpoints"]),
        ({"cache_salt_from_auth": True, "admin_key": "a"}, []),
    ],
)
def test_startup_warns_of_defences_switched_off(
    overrides: dict[str, object], needles: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """``--allowed-host '*'`` (no DNS-rebinding defence), ``--allowed-origin '*'`` (any page
    may call the server), tenants without ``--admin-key`` (each may act on the others' rows)
    and a non-loopback address without ``--api-key`` (anyone on the network may use the
    server) were silent (found by review)."""
    with caplog.at_level(logging.WARNING, logger="kvwarm.server"):
        create_app(stub_settings(**{"allowed_hosts": (), **overrides}))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # One warning per setting: needles from the same warning count once.
    assert len(warnings) == len({_WARNING_OF.get(n, "key") for n in needles})
    for needle in needles:
        assert any(needle in w for w in warnings), (needle, warnings)
