"""``/docs`` (server/apidocs.py): Swagger UI under a Content-Security-Policy that lets it run
only its own CDN files and bootstrap, and ``api_docs = false`` to serve no page at all."""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import warnings
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests.server.conftest import stub_settings, wait_ready

from kvwarm.server import apidocs, create_app
from kvwarm.settings import add_settings_arguments, load_settings, settings_flags


def _directives(policy: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for part in policy.split(";"):
        name, *values = part.split()
        out[name] = values
    return out


def test_the_docs_page_runs_only_its_cdn_files_and_its_own_bootstrap() -> None:
    """/docs loaded Swagger UI's script from a CDN under no CSP, on the page where users type
    their keys (found by review)."""
    with TestClient(create_app(stub_settings())) as client:
        page = client.get("/docs")
    assert page.status_code == 200 and "swagger-ui" in page.text
    csp = _directives(page.headers["content-security-policy"])
    assert csp["default-src"] == ["'none'"]
    assert csp["frame-ancestors"] == ["'none'"] and csp["connect-src"] == ["'self'"]
    assert page.headers["x-frame-options"] == "DENY"
    scripts = csp["script-src"]
    assert "'unsafe-inline'" not in scripts and "'unsafe-eval'" not in scripts
    # Every script the page loads is named whole, every inline one by its hash, and no more.
    sources = re.findall(r'<script src="([^"]+)"', page.text)
    inline = re.findall(r"<script>(.*?)</script>", page.text, re.DOTALL)
    assert sources == [apidocs.SCRIPT_URL] and len(inline) == 1
    digest = base64.b64encode(hashlib.sha256(inline[0].encode()).digest()).decode()
    assert sorted(scripts) == sorted(["'self'", apidocs.SCRIPT_URL, f"'sha256-{digest}'"])
    styles = re.findall(r'rel="stylesheet" href="([^"]+)"', page.text)
    assert styles == [apidocs.STYLE_URL] and apidocs.STYLE_URL in csp["style-src"]
    assert "validatorUrl" in inline[0] and "null" in inline[0]  # no schema URL to swagger.io
    assert client.get("/openapi.json").status_code == 200


def test_the_cdn_files_are_pinned_to_one_release_and_its_bytes() -> None:
    """The CDN's script runs with this server's origin (it could call every endpoint), and
    the page named ``swagger-ui-dist@5``: whatever 5.x release came next ran, unchecked
    (found by review). Now one release, and the browser checks each file's digest."""
    with TestClient(create_app(stub_settings())) as client:
        page = client.get("/docs").text
    version = re.escape(apidocs.SWAGGER_UI_VERSION)
    assert re.fullmatch(r"\d+\.\d+\.\d+", apidocs.SWAGGER_UI_VERSION)
    for url in (apidocs.SCRIPT_URL, apidocs.STYLE_URL):
        assert re.search(rf"/swagger-ui-dist@{version}/", url), url
    tags = re.findall(r"<(?:script|link)\b[^>]*cdn\.jsdelivr\.net[^>]*>", page)
    assert len(tags) == 2, tags
    for tag, digest in zip(tags, (apidocs.STYLE_SRI, apidocs.SCRIPT_SRI), strict=True):
        assert f'integrity="{digest}"' in tag and 'crossorigin="anonymous"' in tag, tag
        assert re.fullmatch(r"sha384-[A-Za-z0-9+/]{64}", digest)


def test_a_page_without_the_tags_to_pin_is_refused() -> None:
    with pytest.raises(RuntimeError, match="to pin"):
        apidocs.with_integrity("<html><script src='elsewhere.js'></script></html>")


def test_api_docs_off_serves_no_page_but_keeps_the_schema() -> None:
    with TestClient(create_app(stub_settings(api_docs=False))) as client:
        assert client.get("/docs").status_code == 404
        assert client.get("/docs/oauth2-redirect").status_code == 404
        assert client.get("/openapi.json").status_code == 200


@pytest.mark.parametrize(
    ("argv", "expected"),
    [((), True), (("--no-api-docs",), False), (("--api-docs", "false"), False)],
)
def test_no_api_docs_flag(tmp_path: Path, argv: tuple[str, ...], expected: bool) -> None:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    flags = settings_flags(parser.parse_args(list(argv)))
    # No config file: the user's is under an empty directory.
    assert load_settings(flags, {"XDG_CONFIG_HOME": str(tmp_path)}).api_docs is expected


def test_every_operation_id_in_the_schema_is_its_own() -> None:
    """``/health`` answered GET and HEAD from one route, and FastAPI gave both methods one
    operation id: the schema held it twice (a client generator's clash, and a warning at
    every schema build)."""
    app = create_app(stub_settings())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schema = app.openapi()
    # Only the schema's own warnings: the record is the process's, and another thread's may land
    # in it (a stray warning of an earlier test's thread made this flaky).
    assert [str(w.message) for w in caught if "Operation ID" in str(w.message)] == []
    ids = [op["operationId"] for path in schema["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids))
    assert "head" not in schema["paths"]["/health"]
    with TestClient(app) as client:  # a load balancer's HEAD still answers
        wait_ready(client.get)
        assert client.head("/health").status_code == 200
